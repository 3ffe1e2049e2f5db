"""The sweeper and ordered keys: a key's rows go out in seq order, one at a time, however
many sweepers run; a failing row holds back its own key only."""

from __future__ import annotations

import threading
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from datetime import timedelta

import pytest
from sqlalchemy import Engine, event, func, select, text, update
from sqlalchemy.orm import Session

from outbox import Outbox, outbox_message
from outbox.broker import Broker, PublishResult, retry
from outbox.message import Message
from outbox.settings import Settings
from relay import store
from relay.brokers.base import NOT_CONNECTED
from relay.loop import BrokerLoop
from relay.sweep.sweeper import Cursor, Sweeper
from relay.testing.faults import kill_app_after_commit
from relay.testing.memory import MemoryBroker
from tests.helpers import migrated, running

t = outbox_message


def quick(sweep_batch: int = 500) -> Settings:
    return Settings(
        sweeper_age_s=0.5, handoff_limit_s=0.2, backoff_base_s=0.01, backoff_cap_s=0.02,
        max_attempts=3, sweep_batch=sweep_batch,
    )  # fmt: skip


QUICK = quick()


@pytest.fixture(params=["postgresql", "mariadb"])
def locking_db(request: pytest.FixtureRequest) -> str:
    """A database whose claims lock (SKIP LOCKED): where many sweepers can run."""
    return str(request.getfixturevalue({"postgresql": "pg_url", "mariadb": "mariadb_url"}[
        request.param]))  # fmt: skip


@pytest.fixture
def engine(locking_db: str) -> Iterator[Engine]:
    with migrated(locking_db) as eng:
        yield eng


def send_ordered(engine: Engine, keys: int, per_key: int, topic: str = "o.x") -> None:
    """``per_key`` transactions, each one message to every key (seq n in the n-th)."""
    ob = Outbox(engine)
    for n in range(per_key):
        with Session(engine) as session, session.begin():
            for k in range(keys):
                ob.send(session, topic, {"n": n}, key=f"k{k}", ordered=True)


def send_unordered(engine: Engine, count: int, topic: str = "o.free") -> None:
    ob = Outbox(engine)
    with Session(engine) as session, session.begin():
        for n in range(count):
            ob.send(session, topic, {"n": n})


def age_rows(engine: Engine, seconds: int = 60) -> None:
    """Every row ``seconds`` older, as a crashed app's rows are by the time a sweeper looks."""
    older = {
        "postgresql": f"created_at - interval '{seconds} seconds'",
        "mysql": f"created_at - INTERVAL {seconds} SECOND",
        "mariadb": f"created_at - INTERVAL {seconds} SECOND",
        "sqlite": f"strftime('%Y-%m-%d %H:%M:%f', created_at, '-{seconds} seconds')",
    }[engine.dialect.name]
    with engine.begin() as conn:
        conn.execute(update(t).values(created_at=text(older)))


def statuses(engine: Engine) -> Counter[str]:
    with engine.connect() as conn:
        found = conn.execute(select(t.c.status, func.count()).group_by(t.c.status))
        return Counter(dict(found.all()))


def sequences(published: Sequence[Message]) -> dict[str, list[int]]:
    """Per key, the seqs of the first copies, in publish order."""
    seen: set[str] = set()
    keys: dict[str, list[int]] = defaultdict(list)
    for m in published:
        if m.seq is not None and m.key is not None and m.msg_id not in seen:
            seen.add(m.msg_id)
            keys[m.key].append(m.seq)
    return dict(keys)


def assert_in_order(published: Sequence[Message], keys: int, per_key: int) -> None:
    found = sequences(published)
    expected = list(range(1, per_key + 1))
    wrong = {k: s for k, s in found.items() if s != expected}
    assert len(found) == keys and not wrong, f"keys out of order or short: {wrong}"


def sweep_until(sweeper: Sweeper, done: object, rounds: int = 200) -> None:
    for _ in range(rounds):
        if callable(done) and done():
            return
        sweeper.sweep()
    assert not callable(done) or done(), "not done after the sweeps"


class Recorder:
    """Shared by the brokers of several sweepers: counts the rows of a key in flight at
    once (more than one is a violation) and a row published before its predecessor's ack."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_flight: Counter[str] = Counter()
        self.acked: dict[str, int] = defaultdict(int)  # highest seq acked per key
        self.overlaps: list[tuple[str, int]] = []
        self.early: list[tuple[str, int, int]] = []  # (key, seq, acked before it)
        self.published: list[Message] = []

    def starting(self, messages: Sequence[Message]) -> None:
        with self.lock:
            for m in messages:
                if m.key is None or m.seq is None:
                    continue
                self.in_flight[m.key] += 1
                if self.in_flight[m.key] > 1:
                    self.overlaps.append((m.key, m.seq))
                if m.seq > self.acked[m.key] + 1:
                    self.early.append((m.key, m.seq, self.acked[m.key]))

    def answered(self, messages: Sequence[Message], results: Sequence[PublishResult]) -> None:
        with self.lock:
            for m, r in zip(messages, results, strict=True):
                if m.key is None or m.seq is None:
                    continue
                self.in_flight[m.key] -= 1
                if r.ok:
                    self.acked[m.key] = max(self.acked[m.key], m.seq)
                    self.published.append(m)


class RecordingBroker(Broker):
    """A MemoryBroker that takes a little while and tells a shared Recorder."""

    def __init__(self, recorder: Recorder, delay: float = 0.001) -> None:
        self.recorder = recorder
        self.inner = MemoryBroker(delay=delay)

    async def connect(self) -> None:
        await self.inner.connect()

    async def publish(self, messages: Sequence[Message]) -> list[PublishResult]:
        self.recorder.starting(messages)
        results = await self.inner.publish(messages)
        self.recorder.answered(messages, results)
        return results

    async def close(self) -> None:
        await self.inner.close()


def test_a_poison_message_blocks_its_key_while_99_others_drain(
    any_db: str, loops: list[BrokerLoop]
) -> None:
    """k0's second message is refused: k0 stops there (dead after its attempts, the rows
    behind it never tried), 99 keys drain; a small batch is not filled by k0's rows."""
    with migrated(any_db) as engine:
        send_ordered(engine, keys=100, per_key=5)
        send_ordered(engine, keys=1, per_key=40)  # k0 has 45 rows: 43 behind the poison
        with engine.connect() as conn:
            poison = str(conn.execute(select(t.c.msg_id).where(t.c.key == "k0", t.c.seq == 2))
                         .scalar_one())  # fmt: skip
        cured = threading.Event()
        broker = MemoryBroker(
            policy=lambda m: None if cured.is_set() or m.msg_id != poison else retry("refused")
        )
        age_rows(engine)
        sweeper = Sweeper(engine, running(broker, loops), quick(sweep_batch=20))
        sweep_until(sweeper, lambda: statuses(engine)["dead"] == 1)
        sweeper.sweep()  # once more: the key stays blocked
        assert statuses(engine) == Counter({"sent": 99 * 5 + 1, "dead": 1, "pending": 43})
        with engine.connect() as conn:
            held = conn.execute(select(t.c.attempts).where(t.c.key == "k0", t.c.seq > 2))
            assert set(held.scalars()) == {0}, "rows behind the poison cost no attempt"
        assert sequences(broker.published)["k0"] == [1]
        assert_in_order([m for m in broker.published if m.key != "k0"], 99, 5)

        cured.set()
        with engine.begin() as conn:
            assert store.requeue(conn, dead_only=True, topic=None, msg_ids=[]) == 1
        sweep_until(sweeper, lambda: statuses(engine) == Counter({"sent": 100 * 5 + 40}))
        assert sequences(broker.published)["k0"] == list(range(1, 46))


def test_four_sweepers_publish_each_key_in_order_one_row_at_a_time(
    engine: Engine, loops: list[BrokerLoop]
) -> None:
    send_ordered(engine, keys=100, per_key=30)
    send_unordered(engine, 300)
    age_rows(engine)
    recorder = Recorder()
    sweepers = [
        Sweeper(engine, running(RecordingBroker(recorder), loops), quick(sweep_batch=200))
        for _ in range(4)
    ]
    stop = threading.Event()

    def work(sweeper: Sweeper) -> None:
        while not stop.is_set():
            sweeper.sweep()

    threads = [threading.Thread(target=work, args=(s,)) for s in sweepers]
    for th in threads:
        th.start()
    try:
        sweep_until(sweepers[0], lambda: statuses(engine) == Counter({"sent": 3300}), 2000)
    finally:
        stop.set()
        for th in threads:
            th.join(30)
    assert not recorder.overlaps, f"two rows of a key in flight at once: {recorder.overlaps[:5]}"
    assert not recorder.early, f"published before the ack of the row before: {recorder.early[:5]}"
    assert_in_order(recorder.published, 100, 30)
    shares = [s.totals.sent for s in sweepers]
    assert sum(1 for s in shares if s) >= 2, f"the work should be shared: {shares}"


def test_a_crashed_apps_ordered_rows_are_swept_in_order(
    locking_db: str, loops: list[BrokerLoop]
) -> None:
    """The app committed and died with its messages in memory (its broker was down):
    two sweepers deliver every key's rows in order."""
    with migrated(locking_db) as engine:
        kill_app_after_commit(locking_db, "redis://127.0.0.1:9/0", "crash.o", 200, keys=5)
        age_rows(engine)
        recorder = Recorder()
        sweepers = [Sweeper(engine, running(RecordingBroker(recorder), loops),
                            quick(sweep_batch=16)) for _ in range(2)]  # fmt: skip
        threads = [threading.Thread(target=s.sweep, kwargs={"concurrency": 2}) for s in sweepers]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        sweep_until(sweepers[0], lambda: statuses(engine) == Counter({"sent": 200}))
        assert not recorder.overlaps and not recorder.early
        assert_in_order(recorder.published, 5, 40)


def test_rolled_back_transactions_between_a_keys_messages_leave_no_gap(
    any_db: str, loops: list[BrokerLoop]
) -> None:
    with migrated(any_db) as engine:
        ob = Outbox(engine)
        for n in range(12):
            with Session(engine) as session:
                ob.send(session, "o.rb", {"n": n}, key="a", ordered=True)
                ob.send(session, "o.rb", {"n": n}, key="b", ordered=True)
                if n % 3 == 2:
                    session.rollback()  # its numbers are given back
                else:
                    session.commit()
        with engine.connect() as conn:
            found = conn.execute(select(t.c.key, t.c.seq).order_by(t.c.key, t.c.seq)).all()
        assert [tuple(r) for r in found] == [(k, s) for k in "ab" for s in range(1, 9)]
        age_rows(engine)
        broker = MemoryBroker()
        sweeper = Sweeper(engine, running(broker, loops), quick(sweep_batch=3))
        sweep_until(sweeper, lambda: statuses(engine) == Counter({"sent": 16}))
        assert_in_order(broker.published, 2, 8)


def test_a_head_failed_by_another_sweep_after_the_claim_was_built_is_not_tried_again(
    engine: Engine, loops: list[BrokerLoop], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race a busy machine hit in a drain of two sweeps: one builds its claim while
    the other fails k0's head and commits, then the claim locks that head. It is dropped
    once locked, with no follower of its key, so the head spends one attempt per pass."""
    send_ordered(engine, keys=2, per_key=2)
    with engine.connect() as conn:
        head = conn.execute(select(t.c.id).where(t.c.key == "k0", t.c.seq == 1)).scalar_one()
    broker = MemoryBroker()
    sweeper = Sweeper(engine, running(broker, loops), QUICK)
    claim = store.claim

    def failed_meanwhile(conn: object, stmt: object) -> list[store.Claimed]:
        rows = claim(conn, stmt)  # type: ignore[arg-type]
        cursor.failed_ordered([head])  # the other sweep's failure, recorded before its commit
        return rows

    cursor = Cursor()
    monkeypatch.setattr(store, "claim", failed_meanwhile)
    with engine.begin() as conn:
        rows = sweeper._claim(conn, 0, False, cursor)
    assert sorted((r.key, r.seq) for r in rows) == [("k1", 1), ("k1", 2)]


def test_a_drain_delivers_every_key_in_order_and_tries_a_failing_head_once(
    any_db: str, loops: list[BrokerLoop]
) -> None:
    """A drain claims by id; a key's later rows are taken as heads by key, past the id
    cursor, so that a small batch leaves none behind. k0's first row fails: once."""
    with migrated(any_db) as engine:
        for _ in range(3):
            send_unordered(engine, 5)
            send_ordered(engine, keys=4, per_key=6)
        with engine.connect() as conn:
            poison = str(conn.execute(select(t.c.msg_id).where(t.c.key == "k0", t.c.seq == 1))
                         .scalar_one())  # fmt: skip
        broker = MemoryBroker(policy=lambda m: retry("refused") if m.msg_id == poison else None)
        sweeper = Sweeper(engine, running(broker, loops), quick(sweep_batch=4))
        concurrency = 1 if any_db.startswith("sqlite") else 2
        result = sweeper.sweep(concurrency, min_age_s=0, due_only=False)
        assert result.sent == 15 + 3 * 18 and result.failed == 1
        assert statuses(engine) == Counter({"sent": 69, "pending": 18})
        with engine.connect() as conn:
            tried = conn.execute(select(t.c.attempts).where(t.c.msg_id == uuid.UUID(poison)))
            assert tried.scalar_one() == 1
        assert_in_order([m for m in broker.published if m.key != "k0"], 3, 18)


def test_a_claim_does_not_take_a_row_whose_locked_predecessor_committed_just_before(
    engine: Engine, loops: list[BrokerLoop]
) -> None:
    """seq 1 and 2 of a key commit after the sweeper's transaction began; another
    sweeper holds seq 1. The claim must not take seq 2 (on MariaDB, its subquery's
    snapshot may predate both rows: the claimed heads are checked again, fresh)."""
    broker = MemoryBroker()
    sweeper = Sweeper(engine, running(broker, loops), QUICK)
    holder = engine.connect()
    armed = [True]

    def before_claim(conn: object, cursor: object, statement: str, *_: object) -> None:
        if not (armed[0] and "FOR UPDATE" in statement):
            return
        armed[0] = False
        send_ordered(engine, keys=1, per_key=2)
        age_rows(engine)
        with engine.connect() as conn:
            first = conn.execute(select(t.c.id).where(t.c.seq == 1)).scalar_one()
        # By its primary key: a scan would lock every row it passes on InnoDB.
        holder.execute(select(t.c.id).where(t.c.id == first).with_for_update()).all()

    event.listen(sweeper.engine, "before_cursor_execute", before_claim)
    try:
        with sweeper.engine.begin() as conn:  # the transaction's first read, before the rows
            conn.execute(select(func.count()).select_from(t)).scalar_one()
            now = store.db_clock(conn)
            claim = store.claim_due_stmt(now + timedelta(seconds=1), now + timedelta(seconds=1), 10)
            rows = store.claim(conn, claim)
        assert [r.seq for r in rows] == [], "seq 2 taken while seq 1 is in another's hands"
        assert sweeper.sweep_once().claimed == 0
        holder.rollback()
        assert sweeper.sweep_once().sent == 2
        assert sequences(broker.published) == {"k0": [1, 2]}
    finally:
        event.remove(sweeper.engine, "before_cursor_execute", before_claim)
        holder.close()


class GoesAway(Broker):
    """Answers the first publish, then is not connected."""

    def __init__(self) -> None:
        self.inner = MemoryBroker()

    async def connect(self) -> None:
        await self.inner.connect()

    async def publish(self, messages: Sequence[Message]) -> list[PublishResult]:
        if self.inner.batches:
            return [retry(NOT_CONNECTED) for _ in messages]
        return await self.inner.publish(messages)

    async def close(self) -> None:
        await self.inner.close()


def test_a_broker_lost_between_waves_keeps_the_acked_rows_and_costs_the_rest_nothing(
    engine: Engine, loops: list[BrokerLoop]
) -> None:
    send_ordered(engine, keys=3, per_key=4)
    age_rows(engine)
    broker = GoesAway()
    sweeper = Sweeper(engine, running(broker, loops), QUICK)
    result = sweeper.sweep_once()
    assert result.aborted and result.sent == 3
    assert sequences(broker.inner.published) == {f"k{k}": [1] for k in range(3)}
    assert statuses(engine) == Counter({"sent": 3, "pending": 9})
    with engine.connect() as conn:
        assert set(conn.execute(select(t.c.attempts)).scalars()) == {0}


def test_the_claim_filter_is_one_step_back_on_the_key_index(pg_url: str) -> None:
    """The plan of the claim: each candidate's head check is an index scan of its key
    (ix_outbox_message_key_seq, or ix_outbox_message_heads: its pending and dead rows)."""
    with migrated(pg_url) as engine:
        send_ordered(engine, keys=3, per_key=3)
        with engine.connect() as conn:
            now = store.db_clock(conn)
            stmt = store.claim_due_stmt(now, now, 500)
            sql = str(stmt.compile(engine, compile_kwargs={"literal_binds": True}))
            plan = "\n".join(conn.execute(text(f"EXPLAIN {sql}")).scalars())
        assert "ix_outbox_message_key_seq" in plan or "ix_outbox_message_heads" in plan, plan
