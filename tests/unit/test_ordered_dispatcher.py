"""The fast path's lanes with the in-memory broker and a table in memory: a key's
messages reach the broker one at a time, in seq order; a failing key holds only itself."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from outbox.broker import PublishResult, permanent, retry
from outbox.events import Failed, Path, Reason, RelayListener, Sent
from outbox.message import Message, build_message
from outbox.settings import Settings
from relay.fastpath.dispatcher import Dispatcher
from relay.store import Head
from relay.testing.memory import MemoryBroker
from tests.helpers import DispatcherWithLoop, wait_until

FAST = Settings(retry_delays_ms=(0, 5, 10, 20), ack_flush_ms=2)
Start = Callable[..., Dispatcher]
PATIENT = Settings(retry_delays_ms=(0, *[10] * 300), ack_flush_ms=2)  # waits up to 3 s


@dataclass
class Row:
    topic: str
    key: str | None
    seq: int | None
    status: str


class Table:
    """The outbox table as the fast path reads and marks it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rows: dict[str, Row] = {}
        self.head_looks = 0  # heads checked

    def write(self, messages: Sequence[Message], status: str = "pending") -> None:
        with self.lock:
            for m in messages:
                self.rows[m.msg_id] = Row(m.topic, m.key, m.seq, status)

    def mark(self, message: Message, status: str) -> None:
        with self.lock:
            self.rows[message.msg_id].status = status

    def finish(self, acks: Sequence[tuple[str, str]]) -> int:
        with self.lock:
            pending = [self.rows[m] for m, _ in acks if self.rows[m].status == "pending"]
            for row in pending:
                row.status = "sent"
            return len(pending)

    def verify(self, msg_ids: Sequence[str]) -> set[str]:
        with self.lock:
            return {m for m in msg_ids if m in self.rows and self.rows[m].status == "pending"}

    def heads(self, heads: Sequence[Head]) -> set[tuple[str, str]]:
        """store.blocked_keys: an earlier row of the key pending or dead."""
        with self.lock:
            self.head_looks += len(heads)
            unsettled = {
                (r.topic, r.key, r.seq)
                for r in self.rows.values()
                if r.status in ("pending", "dead") and r.seq is not None
            }
        return {
            (topic, key)
            for topic, key, seq in heads
            if any(t == topic and k == key and s < seq for t, k, s in unsettled)
        }


class Ends(RelayListener):
    """Each message's one end on the fast path, by reason."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ends: dict[str, list[str]] = defaultdict(list)

    def published(self, sent: Sequence[Sent], path: Path) -> None:
        self._add("published", [s.msg_id for s in sent])

    def rejected(self, failed: Sequence[Failed]) -> None:
        self._add("rejected", [f.msg_id for f in failed])

    def left_for_sweeper(self, msg_ids: Sequence[str], reason: Reason) -> None:
        self._add(reason, list(msg_ids))

    def _add(self, end: str, msg_ids: list[str]) -> None:
        with self.lock:
            self.ends[end] += msg_ids

    def count(self, *ends: str) -> int:
        with self.lock:
            return sum(len(ids) for end, ids in self.ends.items() if not ends or end in ends)


def ordered(key: str, seqs: Sequence[int], topic: str = "t.x") -> list[Message]:
    return [
        replace(
            build_message(topic, f"{key}{s}", key=key, ordered=True, max_payload_bytes=1000),
            seq=s,
        )
        for s in seqs
    ]


def unordered(n: int) -> list[Message]:
    return [build_message("t.x", f"u{i}", max_payload_bytes=1000) for i in range(n)]


def seqs_at(broker: MemoryBroker, key: str) -> list[int | None]:
    return [m.seq for m in broker.published if m.key == key and m.seq is not None]


@pytest.fixture
def table() -> Table:
    return Table()


@pytest.fixture
def ends() -> Ends:
    return Ends()


@pytest.fixture
def running(table: Table, ends: Ends) -> Iterator[Start]:
    started: list[Dispatcher] = []

    def start(broker: MemoryBroker, settings: Settings = FAST) -> Dispatcher:
        d = DispatcherWithLoop(
            broker, table.finish, settings, verify=table.verify, listener=ends, heads=table.heads
        )
        d.start()
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop(2)


def drained(d: Dispatcher, ends: Ends, total: int) -> None:
    """Every one of ``total`` messages ended once, and every slot is free again."""
    wait_until(lambda: ends.count() == total, 30, f"{total} ends")
    wait_until(lambda: d.held() == 0, 30, "every slot freed")
    assert ends.count() == total, dict(ends.ends)


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    keys=st.integers(1, 30),
    per_key=st.integers(1, 12),
    failure=st.sampled_from([0.0, 0.2, 0.5]),
    handed_in_order=st.booleans(),
    seed=st.integers(0, 2**32),
)
def test_each_key_reaches_the_broker_in_seq_order_under_random_failures(
    keys: int, per_key: int, failure: float, handed_in_order: bool, seed: int
) -> None:
    """Publishes failing at random: what a key has at the broker is a prefix of its
    seqs, in order; the rest were left to the sweeper. Handed over in each key's order,
    the lanes alone keep it (no table: ``heads`` None); handed over shuffled, the head
    check makes a head wait until a lower seq arrives and goes first."""
    rng = random.Random(seed)
    table, ends = Table(), Ends()
    lock = threading.Lock()

    def flaky(message: Message) -> PublishResult | None:
        with lock:
            return retry("flaky") if rng.random() < failure else None

    broker = MemoryBroker(policy=flaky)
    by_key = {f"k{k}": ordered(f"k{k}", range(1, per_key + 1)) for k in range(keys)}
    loose = unordered(keys)
    everything = [m for ms in by_key.values() for m in ms] + loose
    table.write(everything)  # committed before they are handed over, as send() does
    rng.shuffle(everything)
    if handed_in_order:  # keys interleaved at random, each key's seqs in order
        everything.sort(key=lambda m: m.seq or 0)
    heads = None if handed_in_order else table.heads
    d = DispatcherWithLoop(
        broker, table.finish, FAST, verify=table.verify, listener=ends, heads=heads
    )
    d.start()
    try:
        for start in range(0, len(everything), 7):
            assert d.submit(everything[start : start + 7]) == len(everything[start : start + 7])
        drained(d, ends, len(everything))
    finally:
        d.stop(2)
    for key, messages in by_key.items():
        at_broker = seqs_at(broker, key)
        assert at_broker == list(range(1, len(at_broker) + 1)), (key, at_broker)
        left = {m.msg_id for m in messages[len(at_broker) :]}
        assert left.isdisjoint(ends.ends["published"])
    if failure == 0.0:  # nothing fails: all published, and a head only waits for a lower one
        assert ends.count("published") == len(everything)


def test_a_failing_key_holds_only_itself(running: Start, ends: Ends, table: Table) -> None:
    """Key "bad"'s head keeps failing: its followers wait in its lane, while another key's
    messages and unordered ones flow; when its schedule is spent, all of it is left."""
    bad, good, loose = ordered("bad", range(1, 11)), ordered("good", range(1, 51)), unordered(50)
    gate = threading.Event()
    attempts: Counter[str] = Counter()

    def policy(message: Message) -> PublishResult | None:
        if message.key != "bad":
            return None
        attempts[message.msg_id] += 1
        return None if gate.is_set() else retry("down for this key")

    broker = MemoryBroker(policy=policy)
    table.write([*bad, *good, *loose])
    d = running(broker, PATIENT)
    d.submit(bad)
    d.submit([*good, *loose])
    wait_until(lambda: ends.count("published") == 100, what="good key and unordered marked")
    assert seqs_at(broker, "good") == list(range(1, 51))
    assert seqs_at(broker, "bad") == []
    assert set(attempts) == {bad[0].msg_id}, "only the head of the failing key is tried"
    assert d.held() == 10 and d.depths()[0] == 9  # the head in the wheel, 9 behind it
    gate.set()
    drained(d, ends, 110)
    assert seqs_at(broker, "bad") == list(range(1, 11))
    assert d.stats.key_waits == 0


def test_a_key_whose_head_is_spent_is_left_to_the_sweeper_whole(
    running: Start, ends: Ends, table: Table
) -> None:
    bad = ordered("bad", range(1, 6))
    broker = MemoryBroker(policy=lambda m: retry("down") if m.key == "bad" else None)
    table.write(bad)
    d = running(broker)
    d.submit(bad)
    drained(d, ends, 5)
    assert ends.ends["exhausted"] == [bad[0].msg_id]
    assert ends.ends["behind_head"] == [m.msg_id for m in bad[1:]]
    assert d.stats.behind_head == 4 and d.stats.exhausted == 1


def test_a_head_whose_predecessor_is_another_process_s_waits_until_it_is_sent(
    running: Start, ends: Ends, table: Table
) -> None:
    """Seq 1 of the key is pending in the table, written and held by "another process":
    2 and 3 wait (key waits, not failed attempts) and go once 1 is marked sent."""
    first, *rest = ordered("a", [1, 2, 3])
    broker = MemoryBroker()
    table.write([first, *rest])
    d = running(broker, PATIENT)
    d.submit(rest)
    wait_until(lambda: d.stats.key_waits >= 3, what="the head waiting for seq 1")
    assert broker.published == [] and d.stats.retried == 0
    table.mark(first, "sent")
    drained(d, ends, 2)
    assert seqs_at(broker, "a") == [2, 3]
    assert table.head_looks == d.stats.key_waits + 1, "3 follows 2's ack: no look for it"


@pytest.mark.parametrize("status", ["dead", "skipped"])
def test_a_dead_predecessor_holds_the_key_and_a_skipped_one_does_not(
    running: Start, ends: Ends, table: Table, status: str
) -> None:
    first, second = ordered("a", [1, 2])
    table.write([first], status)
    table.write([second])
    broker = MemoryBroker()
    d = running(broker)
    d.submit([second])
    drained(d, ends, 1)
    if status == "dead":
        assert ends.ends["exhausted"] == [second.msg_id] and broker.published == []
        assert d.stats.key_waits == len(FAST.retry_delays_ms)
    else:
        assert seqs_at(broker, "a") == [2]


def test_a_rejected_head_takes_its_followers_and_the_key_is_forgotten(
    running: Start, ends: Ends, table: Table
) -> None:
    messages = ordered("a", [1, 2, 3, 4])
    broker = MemoryBroker(policy=lambda m: permanent("too large") if m.seq == 2 else None)
    table.write(messages)
    d = running(broker)
    d.submit(messages)
    drained(d, ends, 4)
    assert seqs_at(broker, "a") == [1]
    assert ends.ends["rejected"] == [messages[1].msg_id]
    assert ends.ends["behind_head"] == [messages[2].msg_id, messages[3].msg_id]
    assert d._lanes.last_acked("t.x", "a") is None and len(d._lanes) == 0
    # A later one of the key needs the table: seq 2 is still pending there.
    later = ordered("a", [5])
    table.write(later)
    d.submit(later)
    drained(d, ends, 5)
    assert ends.ends["exhausted"] == [later[0].msg_id]


def test_a_head_too_old_takes_its_followers(running: Start, ends: Ends, table: Table) -> None:
    old = replace(ordered("a", [1])[0], born=time.monotonic() - 60)
    young = ordered("a", [2, 3])
    table.write([old, *young])
    broker = MemoryBroker(delay=0.05)
    d = running(broker)
    d.submit([*unordered(1), old, *young])
    drained(d, ends, 4)
    assert ends.ends["too_old"] == [old.msg_id]
    assert ends.ends["behind_head"] == [m.msg_id for m in young]
    assert seqs_at(broker, "a") == []


def test_stop_leaves_a_waiting_lane_to_the_sweeper(
    running: Start, ends: Ends, table: Table
) -> None:
    messages = ordered("a", range(1, 6))
    table.write(messages)
    d = running(MemoryBroker(policy=lambda m: retry("down")), PATIENT)
    d.submit(messages)
    wait_until(lambda: d.stats.retried >= 2, what="the head retrying")
    d.stop(2)
    drained(d, ends, 5)
    assert sorted(ends.ends["stopped"]) == sorted(m.msg_id for m in messages)


def test_the_memory_of_acked_keys_is_bounded(table: Table, ends: Ends) -> None:
    """Past ``acked_keys`` keys the oldest acked is forgotten: its next message needs a
    look at the table, a remembered key's does not."""

    class Small(DispatcherWithLoop):
        acked_keys = 10

    firsts = [m for k in range(30) for m in ordered(f"k{k}", [1])]
    table.write(firsts)
    broker = MemoryBroker()
    d = Small(broker, table.finish, FAST, verify=table.verify, listener=ends, heads=table.heads)
    d.start()
    try:
        for m in firsts:  # one at a time: acked in this order
            d.submit([m])
            wait_until(lambda: d.held() == 0, what="its ack marked")
        assert d._lanes.remembered_keys() == 10
        forgotten, remembered = ordered("k0", [2]), ordered("k29", [2])
        table.write([*forgotten, *remembered])
        d.submit(forgotten)
        drained(d, ends, 31)
        assert table.head_looks == 1
        d.submit(remembered)
        drained(d, ends, 32)
        assert table.head_looks == 1
    finally:
        d.stop(2)


def test_a_failing_key_takes_no_more_into_memory(running: Start, ends: Ends, table: Table) -> None:
    """Key "a"'s head keeps failing: its later messages are left in the table at once
    (behind_head), so the key never takes the slots every other message shares."""
    hot, loose = ordered("a", range(1, 31)), unordered(15)
    table.write([*hot, *loose])
    small = Settings(queue_size=20, retry_delays_ms=(0, *[5] * 20), ack_flush_ms=2)
    d = running(MemoryBroker(policy=lambda m: retry("down") if m.key == "a" else None), small)
    assert d.submit(hot[:1]) == 1
    wait_until(lambda: d.stats.retried >= 1, what="the head's first failure")
    for m in hot[1:]:  # each one's slot is given back as soon as the loop takes it
        assert d.submit([m]) == 1
        wait_until(lambda: d.held() == 1, what="the slot given back")
    assert len(ends.ends["behind_head"]) == 29
    assert d.submit(loose) == 15 and d.stats.queue_full == 0
    drained(d, ends, 45)  # 15 published, the head exhausted, 29 behind it
    assert len(ends.ends["exhausted"]) == 1 and len(ends.ends["published"]) == 15


def test_a_lane_holds_at_most_lane_limit(running: Start, ends: Ends, table: Table) -> None:
    """A head waits for another process's row: its key keeps lane_limit messages behind
    it in memory, the rest wait in the table; once the row is sent the lane goes. (A
    head that moves takes what comes: a hot healthy key is not sent to the sweeper.)"""
    first, *rest = ordered("a", range(1, 13))
    table.write([first, *rest])
    d = running(MemoryBroker(), PATIENT)
    d.lane_limit = 5
    assert d.submit(rest[:1]) == 1
    wait_until(lambda: d.stats.key_waits >= 1, what="the head waiting for seq 1")
    assert d.submit(rest[1:]) == 10  # 5 join the lane, 5 are left in the table
    wait_until(lambda: d.held() == 6, what="the slots of those left given back")
    assert len(ends.ends["behind_head"]) == 5
    table.mark(first, "sent")
    wait_until(lambda: len(ends.ends["published"]) == 6, what="the lane published")
    assert seqs_at(d.broker, "a") == [2, 3, 4, 5, 6, 7]  # type: ignore[arg-type]
    wait_until(lambda: d.held() == 0, what="every slot freed")


def test_without_verify_commit_the_head_check_still_runs(ends: Ends, table: Table) -> None:
    first, second = ordered("a", [1, 2])
    table.write([first, second])
    broker = MemoryBroker()
    d = DispatcherWithLoop(broker, table.finish, PATIENT, listener=ends, heads=table.heads)
    d.start()
    try:
        d.submit([second], check=False)
        wait_until(lambda: d.stats.key_waits >= 2, what="the head waiting")
        table.mark(first, "sent")
        drained(d, ends, 1)
        assert seqs_at(broker, "a") == [2]
    finally:
        d.stop(2)


def test_a_head_skipped_while_it_retries_is_not_published(
    running: Start, ends: Ends, table: Table
) -> None:
    """`outbox skip` of a failing ordered head: its retries look at the row first, so it
    never reaches the broker after the key's next message was released."""
    [head] = ordered("a", [1])
    table.write([head])
    gate = threading.Event()
    d = running(MemoryBroker(policy=lambda m: None if gate.is_set() else retry("down")))
    d.submit([head])
    wait_until(lambda: d.stats.retried >= 1, what="the head's first failure")
    table.mark(head, "skipped")
    gate.set()
    drained(d, ends, 1)
    assert seqs_at(d.broker, "a") == []  # type: ignore[arg-type]
    assert len(ends.ends["exhausted"]) == 1
