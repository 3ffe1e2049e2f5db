"""The relay listener seam: each hook heard once per batch, a raising listener harmless.

The fast path runs with the in-memory broker (behind FaultyBroker for per-message
faults) and a recording finisher; the sweeper on SQLite.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine
from sqlalchemy.exc import OperationalError

from outbox import migrate
from outbox.broker import permanent, retry
from outbox.events import Failed, Path, Reason, RelayListener, Sent, SweepResult
from outbox.message import Message, build_message
from outbox.settings import Settings
from outbox.table import DEAD, SENT
from relay.brokers import Broker
from relay.fastpath.dispatcher import Dispatcher
from relay.listener import Listeners
from relay.loop import BrokerLoop
from relay.sweep.sweeper import Sweeper
from relay.testing.faults import FaultyBroker
from relay.testing.memory import MemoryBroker
from tests.helpers import DispatcherWithLoop, wait_until
from tests.planting import plant, row_of

FAST = Settings(retry_delays_ms=(0, 5, 10, 20), ack_flush_ms=2)


class Recorder(RelayListener):
    """Every hook call, in order; ``heard`` is set each time one arrives."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, Any]] = []
        self.threads: set[str] = set()
        self.lock = threading.Lock()
        self.heard = threading.Condition()

    def _note(self, hook: str, items: Any, detail: Any = None) -> None:
        with self.lock:
            self.calls.append((hook, list(items) if hook != "swept" else items, detail))
            self.threads.add(threading.current_thread().name)
        with self.heard:
            self.heard.notify_all()

    def published(self, sent: Sequence[Sent], path: Path) -> None:
        self._note("published", sent, path)

    def retried(self, failed: Sequence[Failed], path: Path) -> None:
        self._note("retried", failed, path)

    def rejected(self, failed: Sequence[Failed]) -> None:
        self._note("rejected", failed)

    def left_for_sweeper(self, msg_ids: Sequence[str], reason: Reason) -> None:
        self._note("left_for_sweeper", msg_ids, reason)

    def dead(self, failed: Sequence[Failed]) -> None:
        self._note("dead", failed)

    def swept(self, result: SweepResult, seconds: float) -> None:
        self._note("swept", result, seconds)

    def items(self, hook: str, detail: object = None) -> list[Any]:
        with self.lock:
            return [
                item
                for name, items, seen in self.calls
                if name == hook and (detail is None or seen == detail)
                for item in items
            ]

    def ids(self, hook: str, detail: object = None) -> list[str]:
        return [i if isinstance(i, str) else i.msg_id for i in self.items(hook, detail)]

    def count(self, hook: str) -> int:
        with self.lock:
            return sum(1 for name, _, _ in self.calls if name == hook)

    def wait(self, ready: Callable[[], bool], timeout: float = 10.0) -> None:
        """Wait until a hook call makes ``ready()`` true: woken by the hooks, no polling."""
        deadline = time.monotonic() + timeout
        with self.heard:
            while not ready():
                left = deadline - time.monotonic()
                assert left > 0, f"timed out; heard {[c[0] for c in self.calls]}"
                self.heard.wait(left)


class Raises(RelayListener):
    """A broken listener: every hook raises."""

    def __init__(self) -> None:
        self.calls = 0

    def _boom(self) -> None:
        self.calls += 1
        raise RuntimeError("listener bug")

    def published(self, sent: Sequence[Sent], path: Path) -> None:
        self._boom()

    def retried(self, failed: Sequence[Failed], path: Path) -> None:
        self._boom()

    def swept(self, result: SweepResult, seconds: float) -> None:
        self._boom()


class Finisher:
    """Stands in for the DB: records each batch of acks marked; ``fail`` raises instead."""

    def __init__(self, fail: bool = False) -> None:
        self.batches: list[list[str]] = []
        self.fail = fail

    def __call__(self, acks: Sequence[tuple[str, str]]) -> int:
        if self.fail:
            raise OperationalError("UPDATE", {}, Exception("connection lost"))
        self.batches.append([msg_id for msg_id, _ in acks])
        return len(acks)


def messages(n: int) -> list[Message]:
    return [build_message("t.x", f"m{i}", max_payload_bytes=1000) for i in range(n)]


Run = Callable[..., Dispatcher]


@pytest.fixture
def running() -> Iterator[Run]:
    started: list[Dispatcher] = []

    def start(
        broker: Broker,
        listener: RelayListener,
        settings: Settings = FAST,
        finisher: Callable[[Sequence[tuple[str, str]]], int] | None = None,
    ) -> Dispatcher:
        dispatcher = DispatcherWithLoop(broker, finisher or Finisher(), settings, listener=listener)
        dispatcher.start()
        started.append(dispatcher)
        return dispatcher

    yield start
    for dispatcher in started:
        dispatcher.stop(2)


def test_published_once_per_ack_batch_after_the_rows_are_marked(running: Run) -> None:
    heard, finisher = Recorder(), Finisher()
    batch = messages(500)
    running(MemoryBroker(), heard, finisher=finisher).submit(batch)
    heard.wait(lambda: len(heard.items("published")) == 500)
    assert sorted(heard.ids("published", "fast")) == sorted(m.msg_id for m in batch)
    assert heard.count("published") == len(finisher.batches), "one call per marked batch"
    sent = heard.items("published")
    assert all(s.topic == "t.x" and s.receipt and s.latency_s > 0 for s in sent)
    assert [c[0] for c in heard.calls] == ["published"] * len(finisher.batches)
    assert heard.threads == {"outbox-relay"}, "hooks run on the relay's loop"


def test_retried_attempts_are_numbered_and_carry_the_error(running: Run) -> None:
    attempts: Counter[str] = Counter()

    def fail_twice(message: Message) -> Any:
        attempts[message.msg_id] += 1
        return retry("broker busy") if attempts[message.msg_id] <= 2 else None

    heard = Recorder()
    running(MemoryBroker(policy=fail_twice), heard).submit(messages(30))
    heard.wait(lambda: len(heard.items("published")) == 30)
    retried = heard.items("retried", "fast")
    assert Counter(f.attempt for f in retried) == {1: 30, 2: 30}
    assert {f.error for f in retried} == {"broker busy"}
    assert heard.count("retried") < len(retried), "retries are told per batch"


def test_a_poison_is_rejected_alone_and_its_neighbours_published(running: Run) -> None:
    good, bad = messages(10), messages(1)[0]
    heard = Recorder()
    broker = FaultyBroker(MemoryBroker(), {bad.msg_id: TypeError("a client library's bug")})
    running(broker, heard).submit([*good[:5], bad, *good[5:]])
    heard.wait(lambda: len(heard.items("published")) == 10 and bool(heard.items("rejected")))
    [rejected] = heard.items("rejected")
    assert (rejected.msg_id, rejected.attempt) == (bad.msg_id, 1)
    assert "TypeError" in rejected.error
    assert sorted(heard.ids("published")) == sorted(m.msg_id for m in good)
    assert not heard.items("retried")


def test_a_spent_schedule_is_left_for_the_sweeper(running: Run) -> None:
    heard = Recorder()
    batch = messages(20)
    running(FaultyBroker(MemoryBroker(), lambda m: retry("down")), heard).submit(batch)
    heard.wait(lambda: len(heard.ids("left_for_sweeper", "exhausted")) == 20)
    assert sorted(heard.ids("left_for_sweeper")) == sorted(m.msg_id for m in batch)
    assert len(heard.items("retried")) == 20 * (len(FAST.retry_delays_ms) - 1)
    assert not heard.items("published")


def test_a_full_queue_is_told_on_the_committing_thread(running: Run) -> None:
    heard = Recorder()
    d = running(MemoryBroker(), heard, Settings(queue_size=10))
    batch = messages(11)
    assert d.submit(batch) == 0
    assert heard.ids("left_for_sweeper", "queue_full") == [m.msg_id for m in batch]
    assert heard.threads == {threading.current_thread().name}


def test_too_old_and_stopped_are_left_for_the_sweeper(running: Run) -> None:
    heard = Recorder()
    d = running(MemoryBroker(policy=lambda m: retry("down")), heard, Settings())
    old = Message("0190c2a0-0000-7000-8000-000000000000", "t.x", b"x", born=time.monotonic() - 9)
    waiting = messages(3)
    d.submit([old, *waiting])
    heard.wait(lambda: len(heard.items("retried")) >= 3)  # the young ones wait on the wheel
    d.stop(2)
    assert heard.ids("left_for_sweeper", "too_old") == [old.msg_id]
    assert sorted(heard.ids("left_for_sweeper", "stopped")) == sorted(m.msg_id for m in waiting)


def test_acks_whose_marking_failed_are_left_for_the_sweeper(running: Run) -> None:
    heard = Recorder()
    batch = messages(5)
    running(MemoryBroker(), heard, finisher=Finisher(fail=True)).submit(batch)
    heard.wait(lambda: len(heard.ids("left_for_sweeper", "mark_failed")) == 5, timeout=5)
    assert not heard.items("published"), "published means marked"


def test_acks_still_waiting_when_the_relay_stops_are_left_for_the_sweeper(running: Run) -> None:
    """stop()'s deadline passed while a mark hung: the acks behind it are told, not dropped."""
    heard, release, writing = Recorder(), threading.Event(), threading.Event()

    def hanging(acks: Sequence[tuple[str, str]]) -> int:
        writing.set()
        release.wait(10)
        return len(acks)

    d = running(MemoryBroker(), heard, finisher=hanging)
    d.submit(messages(1))
    assert writing.wait(5), "the first mark started"
    behind = messages(3)
    d.submit(behind)
    wait_until(lambda: d.stats.published == 4, what="four acks")
    d.stop(0.3)
    release.set()
    heard.wait(lambda: len(heard.ids("left_for_sweeper", "stopped")) == 3)
    assert sorted(heard.ids("left_for_sweeper", "stopped")) == sorted(m.msg_id for m in behind)


def test_every_message_ends_in_exactly_one_fast_path_outcome(running: Run) -> None:
    """published, rejected or left_for_sweeper: once each, whatever happened before."""
    batch = messages(60)
    fate = {m.msg_id: i % 3 for i, m in enumerate(batch)}  # 0 healthy, 1 refused, 2 down
    tries: Counter[str] = Counter()

    def policy(message: Message) -> Any:
        tries[message.msg_id] += 1
        kind = fate[message.msg_id]
        if kind == 1:
            return permanent("unroutable")
        return retry("down") if kind == 2 or tries[message.msg_id] == 1 else None

    heard = Recorder()
    running(MemoryBroker(policy=policy), heard).submit(batch)

    def ended() -> list[str]:
        return heard.ids("published") + heard.ids("rejected") + heard.ids("left_for_sweeper")

    heard.wait(lambda: len(ended()) == 60)
    assert Counter(ended()) == Counter(m.msg_id for m in batch)


def test_a_raising_listener_is_logged_and_the_relay_goes_on(
    running: Run, caplog: pytest.LogCaptureFixture
) -> None:
    broken, heard, finisher = Raises(), Recorder(), Finisher()
    attempts: Counter[str] = Counter()

    def fail_once(message: Message) -> Any:
        attempts[message.msg_id] += 1
        return retry("busy") if attempts[message.msg_id] == 1 else None

    batch = messages(50)
    with caplog.at_level(logging.ERROR, logger="relay.listener"):
        d = running(MemoryBroker(policy=fail_once), Listeners(broken, heard), finisher=finisher)
        d.submit(batch)
        heard.wait(lambda: len(heard.items("published")) == 50)
    assert sorted(m for b in finisher.batches for m in b) == sorted(m.msg_id for m in batch)
    assert set(attempts.values()) == {2}, "no message was repeated or dropped"
    assert broken.calls >= 2
    assert "listener Raises.published raised; the relay goes on" in caplog.text
    assert "listener Raises.retried raised" in caplog.text
    assert d.submit(messages(1)) == 1, "the relay still takes work"


def test_listeners_add_each_once_and_parts_share_one() -> None:
    heard = Recorder()
    listeners = Listeners(heard)
    listeners.add(heard)
    listeners.published([Sent("id", "t.x", "1")], "sweeper")
    assert heard.count("published") == 1
    assert Listeners.of(listeners) is listeners
    assert Listeners.of(None) is not Listeners.of(None)
    RelayListener().dead([Failed("id", "t.x", 1, "e")])  # the defaults do nothing


@pytest.fixture
def sweeper_of(sqlite_url: str) -> Iterator[Callable[[Broker, RelayListener], Sweeper]]:
    migrate.upgrade(sqlite_url)
    engine = create_engine(sqlite_url)
    loops: list[BrokerLoop] = []

    def make(broker: Broker, listener: RelayListener) -> Sweeper:
        loop = BrokerLoop(broker)
        loop.start()
        loops.append(loop)
        assert loop.wait_connected(5)
        settings = Settings(max_attempts=2, backoff_base_s=0.001, backoff_cap_s=0.002)
        return Sweeper(engine, loop, settings, listener)

    yield make
    for loop in loops:
        loop.stop()
    engine.dispose()


def test_the_sweeper_tells_published_retried_dead_and_swept(
    sweeper_of: Callable[[Broker, RelayListener], Sweeper], sqlite_url: str
) -> None:
    heard = Recorder()
    engine: Engine = create_engine(sqlite_url)
    good = [plant(engine, "p.ok") for _ in range(5)]
    poison = plant(engine, "p.bad")
    sweeper = sweeper_of(FaultyBroker(MemoryBroker(), {poison: permanent("too large")}), heard)
    first = sweeper.sweep_once(min_age_s=0, due_only=False)
    second = sweeper.sweep_once(min_age_s=0, due_only=False)
    assert sorted(heard.ids("published", "sweeper")) == sorted(good)
    assert heard.items("retried", "sweeper") == [Failed(poison, "p.bad", 1, "permanent: too large")]
    assert heard.items("dead") == [Failed(poison, "p.bad", 2, "permanent: too large")]
    assert [(c[1], c[2] > 0) for c in heard.calls if c[0] == "swept"] == [
        (first, True),
        (second, True),
    ]
    assert [c[0] for c in heard.calls] == ["published", "retried", "swept", "dead", "swept"]
    assert row_of(engine, poison).status == DEAD and row_of(engine, good[0]).status == SENT
    engine.dispose()


def test_a_raising_listener_never_rolls_back_a_sweep(
    sweeper_of: Callable[[Broker, RelayListener], Sweeper], sqlite_url: str
) -> None:
    engine = create_engine(sqlite_url)
    rows = [plant(engine, "p.ok") for _ in range(3)]
    sweeper = sweeper_of(MemoryBroker(), Raises())
    assert sweeper.sweep_once(min_age_s=0).sent == 3
    assert {row_of(engine, r).status for r in rows} == {SENT}
    assert sweeper.totals.sent == 3
    engine.dispose()
