"""The fast path's logic with the in-memory broker: retries, hand-off, batching, stop."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

import pytest
from sqlalchemy.exc import OperationalError

from outbox.broker import Outcome, PublishResult, permanent, retry
from outbox.events import Failed, Path, Reason, RelayListener, Sent
from outbox.message import Message, build_message
from outbox.settings import Settings
from relay.brokers import Broker
from relay.brokers.base import publish_isolated
from relay.fastpath.dispatcher import Dispatcher
from relay.testing.faults import FaultyBroker
from relay.testing.memory import MemoryBroker
from tests.helpers import DispatcherWithLoop, wait_until

FAST = Settings(retry_delays_ms=(0, 5, 10, 20), ack_flush_ms=2)


class Finisher:
    """Stands in for the DB: records each batch the AckBatcher writes."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.lock = threading.Lock()

    def __call__(self, acks: Sequence[tuple[str, str]]) -> int:
        with self.lock:
            self.batches.append([msg_id for msg_id, _ in acks])
        return len(acks)

    @property
    def marked(self) -> list[str]:
        with self.lock:
            return [m for batch in self.batches for m in batch]


def messages(n: int) -> list[Message]:
    return [build_message("t.x", f"m{i}", max_payload_bytes=1000) for i in range(n)]


@pytest.fixture
def finisher() -> Finisher:
    return Finisher()


Run = Callable[..., Dispatcher]


@pytest.fixture
def running(finisher: Finisher) -> Iterator[Run]:
    """Starts dispatchers writing to ``finisher``; stops every one at the end."""
    started: list[Dispatcher] = []

    def start(broker: Broker, settings: Settings = FAST) -> Dispatcher:
        dispatcher = DispatcherWithLoop(broker, finisher, settings)
        dispatcher.start()
        started.append(dispatcher)
        return dispatcher

    yield start
    for dispatcher in started:
        dispatcher.stop(2)  # a no-op for one the test stopped itself


def test_an_unexpected_error_marking_one_batch_leaves_the_next_marked(
    finisher: Finisher, running: Run
) -> None:
    """A listener's or driver's bug fails that batch alone: the acks thread goes on."""
    failures = iter([ValueError("a before_cursor_execute hook raised")])

    def finish(acks: Sequence[tuple[str, str]]) -> int:
        if (error := next(failures, None)) is not None:
            raise error
        return finisher(acks)

    d = DispatcherWithLoop(MemoryBroker(), finish, FAST)
    d.start()
    try:
        first, second = messages(1), messages(3)
        d.submit(first)
        wait_until(lambda: d.stats.mark_failed == 1, what="the first batch given up")
        d.submit(second)
        wait_until(lambda: len(finisher.marked) == 3, what="the next batch marked")
        assert finisher.marked == [m.msg_id for m in second]
    finally:
        d.stop(2)


def test_a_stop_the_blocked_loop_never_answered_leaves_the_inbox_for_the_sweeper(
    running: Run,
) -> None:
    """Commits waiting for the loop's wake-up are told "stopped" by stop() itself."""
    stalled = FaultyBroker(MemoryBroker(), {}, stall_s=2.5)  # blocks the loop: time.sleep
    d = running(stalled)
    d.submit(messages(1))
    wait_until(lambda: stalled.stalls == 1, what="the loop blocked")
    d.submit(messages(2))  # in the inbox, their wake-up queued behind the stall
    d.stop(0.1)
    assert d.stats.dropped_at_stop == 2


def test_every_message_published_once_and_marked_in_batches(
    finisher: Finisher, running: Run
) -> None:
    broker = MemoryBroker()
    d = running(broker)
    batch = messages(1000)
    assert d.submit(batch) == 1000
    wait_until(lambda: len(finisher.marked) == 1000, what="1000 marks")
    assert sorted(finisher.marked) == sorted(m.msg_id for m in batch)
    assert len(broker.published) == 1000
    assert d.stats.first_attempt == 1000
    assert len(finisher.batches) <= 10, "acks must be grouped, not marked one by one"
    assert max(len(b) for b in finisher.batches) <= FAST.ack_batch_size


def test_retryable_failures_follow_the_schedule(finisher: Finisher, running: Run) -> None:
    attempts: Counter[str] = Counter()

    def fail_twice(message: Message) -> PublishResult | None:
        attempts[message.msg_id] += 1
        return retry("broker busy") if attempts[message.msg_id] <= 2 else None

    broker = MemoryBroker(policy=fail_twice)
    d = running(broker)
    batch = messages(50)
    d.submit(batch)
    wait_until(lambda: len(finisher.marked) == 50, what="50 marks")
    assert set(attempts.values()) == {3}
    assert (d.stats.retried, d.stats.first_attempt, d.stats.published) == (100, 0, 50)


def test_spent_schedule_leaves_messages_for_the_sweeper(finisher: Finisher, running: Run) -> None:
    """A bug would mark a row sent without an ack, or retry forever."""
    attempts: Counter[str] = Counter()

    def always_down(message: Message) -> PublishResult:
        attempts[message.msg_id] += 1
        return retry("down")

    d = running(MemoryBroker(policy=always_down))
    d.submit(messages(20))
    wait_until(lambda: d.stats.exhausted == 20, what="schedule spent")
    assert set(attempts.values()) == {len(FAST.retry_delays_ms)}
    assert finisher.marked == []


def test_permanent_error_is_not_retried(finisher: Finisher, running: Run) -> None:
    bad = messages(1)[0]
    broker = MemoryBroker(policy=lambda m: permanent("unroutable") if m is bad else None)
    d = running(broker)
    good = messages(5)
    d.submit([bad, *good])
    wait_until(lambda: len(finisher.marked) == 5, what="healthy ones marked")
    assert d.stats.rejected == 1 and d.stats.retried == 0
    assert bad.msg_id not in finisher.marked


def test_full_queue_never_blocks_and_is_counted(finisher: Finisher, running: Run) -> None:
    d = running(MemoryBroker(), Settings(queue_size=10))
    started = time.monotonic()
    assert d.submit(messages(11)) == 0
    assert time.monotonic() - started < 0.5
    assert d.stats.queue_full == 11
    assert d.submit(messages(10)) == 10


def test_messages_past_the_handoff_limit_are_left_to_the_sweeper(
    finisher: Finisher, running: Run
) -> None:
    broker = MemoryBroker()
    d = running(broker)
    old = Message("0190c2a0-0000-7000-8000-000000000000", "t.x", b"x", born=time.monotonic() - 9)
    d.submit([old, *messages(1)])
    wait_until(lambda: len(finisher.marked) == 1, what="the young one")
    assert d.stats.too_old == 1
    assert old.msg_id not in {m.msg_id for m in broker.published}


def test_submit_before_start_or_after_stop_takes_nothing(finisher: Finisher) -> None:
    d = DispatcherWithLoop(MemoryBroker(), finisher, FAST)
    assert d.submit(messages(3)) == 0
    d.start()
    d.stop(2)
    assert d.submit(messages(3)) == 0
    assert d.stats.queue_full == 0


def test_stop_finishes_in_flight_publishes_and_acks(finisher: Finisher, running: Run) -> None:
    broker = MemoryBroker(delay=0.3)
    d = running(broker)
    batch = messages(10)
    d.submit(batch)
    wait_until(lambda: broker.batches >= 1, what="a publish in flight")
    d.stop(timeout=5)
    assert sorted(finisher.marked) == sorted(m.msg_id for m in batch)
    assert not broker.connected
    assert not [t for t in threading.enumerate() if t.name.startswith("outbox-")]


def test_stop_drops_waiting_retries_within_its_deadline(finisher: Finisher, running: Run) -> None:
    d = running(MemoryBroker(policy=lambda m: retry("down")), Settings())
    d.submit(messages(5))
    wait_until(lambda: d.stats.retried >= 5, what="retries scheduled")
    started = time.monotonic()
    d.stop(timeout=2)
    assert time.monotonic() - started < 2.5
    assert d.stats.dropped_at_stop == 5 and finisher.marked == []


POISONS = [
    TypeError("a client library's bug"),
    UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed"),
    permanent("MaxPayloadError: too large"),
]


@pytest.mark.parametrize("fault", POISONS, ids=lambda f: type(f).__name__)
def test_a_poison_message_never_fails_or_repeats_its_batch(
    finisher: Finisher, running: Run, fault: Exception | PublishResult
) -> None:
    """The adapter raises (or refuses) for one message of a batch: each healthy message
    is published and marked exactly once; the poison is rejected, not retried."""
    memory = MemoryBroker()
    good = messages(10)
    bad = messages(1)[0]
    broker = FaultyBroker(memory, {bad.msg_id: fault})
    d = running(broker, Settings(retry_delays_ms=(0, 5, 10, 20), ack_flush_ms=2, publish_batch=64))
    d.submit([*good[:5], bad, *good[5:]])
    wait_until(lambda: len(finisher.marked) == 10, what="healthy ones marked")
    wait_until(lambda: d.stats.rejected == 1, what="the poison rejected")
    assert Counter(m.msg_id for m in memory.published) == Counter(m.msg_id for m in good)
    assert sorted(finisher.marked) == sorted(m.msg_id for m in good)
    assert d.stats.retried == 0 and bad.msg_id not in finisher.marked
    # An exception: the batch call raised, then the poison's publish alone raised.
    assert broker.raised == (0 if isinstance(fault, PublishResult) else 2)


def test_a_connection_failure_fails_the_whole_batch_as_retry() -> None:
    good = messages(3)
    broker = FaultyBroker(MemoryBroker(), {good[1].msg_id: ConnectionResetError("reset")})
    results = asyncio.run(publish_isolated(broker, good))
    assert [r.outcome for r in results] == [Outcome.RETRY] * 3
    assert not broker.forwarded, "nothing is published one by one after a connection failure"


def test_an_adapter_answering_the_wrong_count_is_asked_one_by_one() -> None:
    class Short(MemoryBroker):
        async def publish(self, messages: Sequence[Message]) -> list[PublishResult]:
            answers = await super().publish(messages)
            return answers[:1] if len(messages) > 1 else answers

    broker = Short()
    good = messages(4)
    results = asyncio.run(publish_isolated(broker, good))
    assert all(r.ok for r in results) and len(results) == 4
    assert len({m.msg_id for m in broker.published}) == 4


# -- queue_size bounds every message the fast path holds ---------------------------------


class Ends(RelayListener):
    """Counts each message's one end on the fast path: published, rejected or left."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ends: Counter[str] = Counter()

    def published(self, sent: Sequence[Sent], path: Path) -> None:
        with self.lock:
            self.ends["published"] += len(sent)

    def rejected(self, failed: Sequence[Failed]) -> None:
        with self.lock:
            self.ends["rejected"] += len(failed)

    def left_for_sweeper(self, msg_ids: Sequence[str], reason: Reason) -> None:
        with self.lock:
            self.ends[reason] += len(msg_ids)

    def total(self, *but: str) -> int:
        with self.lock:
            return sum(n for end, n in self.ends.items() if end not in but)


def bounded(
    broker: Broker,
    finish: Callable[[Sequence[tuple[str, str]]], int],
    settings: Settings,
    verify: Callable[[Sequence[str]], set[str]] | None = None,
) -> tuple[Dispatcher, Ends]:
    ends = Ends()
    d = DispatcherWithLoop(broker, finish, settings, verify=verify, listener=ends)
    d.start()
    return d, ends


def all_freed(d: Dispatcher, ends: Ends, taken: int, end: str, timeout: float = 30) -> None:
    """Every message taken ended once, by ``end``, and its slot is free again."""
    wait_until(lambda: ends.total("queue_full") == taken, timeout, f"{taken} ends")
    wait_until(lambda: d.held() == 0, timeout, "every slot freed")
    assert ends.ends[end] == taken, ends.ends
    assert ends.total("queue_full") == taken, ends.ends


def test_queue_size_counts_the_time_wheel_not_only_the_inbox(finisher: Finisher) -> None:
    """Broker down, one commit at a time: retries waiting in the wheel hold their slots,
    so after ``queue_size`` messages every further commit stays in the table."""
    slow = Settings(queue_size=10, retry_delays_ms=(0, 60_000), handoff_limit_s=9)
    d, ends = bounded(MemoryBroker(policy=lambda m: retry("down")), finisher, slow)
    try:
        taken = 0
        for message in messages(100):
            taken += d.submit([message])
            assert d.held() <= 10
            wait_until(lambda: d.depths() == (0, d.held()), what="the retry in the wheel")
        assert taken == 10 and d.stats.queue_full == 90 and d.stats.held_peak == 10
        assert ends.ends["queue_full"] == 90
    finally:
        d.stop(2)
    all_freed(d, ends, 10, "stopped")


def test_acks_waiting_to_be_marked_hold_their_slots(finisher: Finisher) -> None:
    """The database is slow: published messages still hold slots until marked."""
    gate = threading.Event()

    def slow_finish(acks: Sequence[tuple[str, str]]) -> int:
        gate.wait(30)
        return finisher(acks)

    d, ends = bounded(MemoryBroker(), slow_finish, Settings(queue_size=20, ack_flush_ms=2))
    try:
        assert d.submit(messages(20)) == 20
        wait_until(lambda: d.stats.published == 20, what="20 acks")
        assert d.held() == 20 and d.submit(messages(1)) == 0
        gate.set()
        all_freed(d, ends, 20, "published")
        assert d.submit(messages(5)) == 5
        all_freed(d, ends, 25, "published")
    finally:
        gate.set()
        d.stop(2)


def test_a_slot_is_freed_when_rejected(finisher: Finisher) -> None:
    d, ends = bounded(MemoryBroker(policy=lambda m: permanent("unroutable")), finisher, FAST)
    try:
        assert d.submit(messages(7)) == 7
        all_freed(d, ends, 7, "rejected")
    finally:
        d.stop(2)


def test_a_slot_is_freed_when_the_schedule_is_spent(finisher: Finisher) -> None:
    d, ends = bounded(MemoryBroker(policy=lambda m: retry("down")), finisher, FAST)
    try:
        assert d.submit(messages(7)) == 7
        all_freed(d, ends, 7, "exhausted")
    finally:
        d.stop(2)


def test_a_slot_is_freed_when_the_batch_call_raises_until_spent(finisher: Finisher) -> None:
    """A connection failure fails every attempt: retried, then exhausted.

    Every message raises, not one of the batch: the retries may come back in other
    batches (the wheel's ticks on a loaded machine), which would publish the others.
    """
    batch = messages(4)
    broker = FaultyBroker(MemoryBroker(), lambda m: ConnectionResetError("reset"))
    d, ends = bounded(broker, finisher, FAST)
    try:
        assert d.submit(batch) == 4
        all_freed(d, ends, 4, "exhausted")
    finally:
        d.stop(2)


def test_a_slot_is_freed_when_the_row_never_becomes_visible(finisher: Finisher) -> None:
    d, ends = bounded(MemoryBroker(), finisher, FAST, verify=lambda ids: set())
    try:
        assert d.submit(messages(3)) == 3
        all_freed(d, ends, 3, "exhausted")
        assert d.stats.not_visible == 3 * len(FAST.retry_delays_ms)
    finally:
        d.stop(2)


def test_a_slot_is_freed_when_too_old(finisher: Finisher) -> None:
    d, ends = bounded(MemoryBroker(), finisher, FAST)
    try:
        old = Message(
            "0190c2a0-0000-7000-8000-000000000001", "t.x", b"x", born=time.monotonic() - 9
        )
        assert d.submit([old]) == 1
        all_freed(d, ends, 1, "too_old")
    finally:
        d.stop(2)


@pytest.mark.parametrize(
    "error", [OperationalError("UPDATE", {}, Exception("gone")), KeyError("bug")]
)
def test_a_slot_is_freed_when_marking_fails(error: Exception) -> None:
    def finish(acks: Sequence[tuple[str, str]]) -> int:
        raise error

    d, ends = bounded(MemoryBroker(), finish, FAST)
    try:
        assert d.submit(messages(5)) == 5
        all_freed(d, ends, 5, "mark_failed")
    finally:
        d.stop(2)


def test_slots_of_queued_and_waiting_retries_are_freed_at_stop(finisher: Finisher) -> None:
    d, ends = bounded(MemoryBroker(policy=lambda m: retry("down")), finisher, Settings())
    assert d.submit(messages(6)) == 6
    wait_until(lambda: d.stats.retried >= 6, what="retries waiting")
    d.stop(2)
    all_freed(d, ends, 6, "stopped")


def test_slots_of_publishes_cut_by_the_stop_deadline_are_freed(finisher: Finisher) -> None:
    broker = MemoryBroker(delay=60)
    d, ends = bounded(broker, finisher, FAST)
    assert d.submit(messages(4)) == 4
    wait_until(lambda: broker.batches >= 1, what="a publish in flight")
    d.stop(0.2)
    all_freed(d, ends, 4, "stopped")


def test_slots_of_acks_unmarked_at_stop_are_freed_when_the_write_ends(
    finisher: Finisher,
) -> None:
    gate, writing = threading.Event(), threading.Event()

    def slow_finish(acks: Sequence[tuple[str, str]]) -> int:
        writing.set()
        gate.wait(30)
        return finisher(acks)

    settings = Settings(ack_flush_ms=2, ack_batch_size=1)
    d, ends = bounded(MemoryBroker(), slow_finish, settings)
    assert d.submit(messages(3)) == 3
    wait_until(writing.is_set, what="the first mark running")
    wait_until(lambda: d.stats.published == 3, what="3 acks")
    d.stop(0.2)  # the write goes on past the deadline, on the acks thread
    assert d.held() == 3
    gate.set()
    wait_until(lambda: d.held() == 0, what="every slot freed")
    # The first was marked (its "published" would be told on the loop, closed by now);
    # the two behind it were never written: left for the sweeper.
    assert len(finisher.marked) == 1 and ends.ends["stopped"] == 2


def test_slots_of_the_inbox_a_blocked_loop_never_took_are_freed_at_stop(
    finisher: Finisher,
) -> None:
    stalled = FaultyBroker(MemoryBroker(), {}, stall_s=2.5)
    d, ends = bounded(stalled, finisher, FAST)
    assert d.submit(messages(1)) == 1
    wait_until(lambda: stalled.stalls == 1, what="the loop blocked")
    assert d.submit(messages(2)) == 2
    d.stop(0.1)
    wait_until(lambda: d.held() == 0, what="every slot freed")
    assert d.stats.held_peak == 3 and ends.ends["stopped"] >= 2
