"""One contract for the store (relay.store) on every database: PostgreSQL (one table, and
partitioned by day as `outbox migrate --partitioned` makes it), MariaDB and SQLite (a
file), as tests/contract/test_broker_contract.py is one for every broker.

Each test plants the rows it needs, dated by the database clock, and runs the store's
statements as the relay, the scheduler and the operator do: claims pass over rows another
transaction holds (SKIP LOCKED; SQLite has no row locks: there the marks' status condition
keeps a row from being finished twice), marks change pending rows only, an ordered key
has one head, scheduled rows wait for their time, the purge takes old settled rows only,
and the backlog counts as `outbox status` shows it.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, delete, insert, select, update

from outbox import partitions
from outbox.dialects import dialect_for
from outbox.message import uuid7
from outbox.table import CANCELED, DEAD, PENDING, SENT, SKIPPED, outbox_message
from relay import store
from relay.testing import scratch_schema
from tests.conftest import PG_URL, scratch_mariadb
from tests.helpers import migrated

t = outbox_message
TOPIC = "orders"
DEADLINE_S = 30.0  # a claim that waits this long on a held row waited for its lock


@pytest.fixture(
    scope="module", params=["postgresql", "postgresql-partitioned", "mariadb", "sqlite"]
)
def database(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    """A migrated database of this module's own per kind (a migration per test would cost
    more than the tests), at the isolation level the sweeps use (READ COMMITTED on
    MariaDB: relay.sweep.sweeper.fresh_reads)."""
    with contextlib.ExitStack() as stack:
        if request.param == "sqlite":
            url = f"sqlite:///{tmp_path_factory.mktemp('store') / Path('outbox.sqlite')}"
        elif request.param.startswith("postgresql"):
            url = stack.enter_context(scratch_schema(PG_URL, "store"))
        else:
            url = stack.enter_context(scratch_mariadb("store"))
        engine = stack.enter_context(migrated(url))
        if request.param == "postgresql-partitioned":  # outbox migrate --partitioned
            partitions.convert(engine)
        level = dialect_for(engine).fresh_reads_isolation
        yield engine if level is None else engine.execution_options(isolation_level=level)


@pytest.fixture
def db(database: Engine) -> Engine:
    """The module's database, its outbox empty: each test starts from no rows."""
    with database.begin() as conn:
        conn.execute(delete(t))
    return database


def clock(engine: Engine) -> datetime:
    with engine.connect() as conn:
        return store.db_clock(conn)


def put(engine: Engine, now: datetime, age_s: float = 30.0, **columns: Any) -> int:
    """Plant one row created ``age_s`` before ``now`` (pending unless ``status`` says);
    its row id."""
    values = {"msg_id": uuid7(), "topic": TOPIC, "payload": b"{}", **columns}
    values["created_at"] = now - timedelta(seconds=age_s)
    with engine.begin() as conn:
        key = conn.execute(insert(t).values(**values)).inserted_primary_key
        assert key is not None
        return int(key[0])


def keyed(engine: Engine, now: datetime, key: str, *statuses: str) -> list[int]:
    """A key's ordered rows, seq 1, 2, ... with these statuses, oldest first."""
    return [
        put(engine, now, age_s=30.0 - seq, key=key, seq=seq, status=status)
        for seq, status in enumerate(statuses, start=1)
    ]


def rows(engine: Engine, *ids: int) -> dict[int, Any]:
    with engine.connect() as conn:
        return {r.id: r for r in conn.execute(select(t).where(t.c.id.in_(ids)))}


def status_of(engine: Engine, *ids: int) -> list[str | None]:
    found = rows(engine, *ids)
    return [found[i].status if i in found else None for i in ids]


def msg_id(engine: Engine, row_id: int) -> str:
    return str(rows(engine, row_id)[row_id].msg_id)


def claim_due(conn: Connection, now: datetime, limit: int = 10) -> list[store.Claimed]:
    return store.claim(conn, store.claim_due_stmt(now, now, limit))


# Claims


def test_a_claim_passes_over_rows_another_transaction_holds(db: Engine) -> None:
    """Two of four due rows are held by another transaction (locked for update; on SQLite,
    written): where the database skips locked rows the claim takes the other two at once;
    SQLite has no row locks, so the claim takes all four, and the marks' status condition
    leaves the holder's two as the holder marked them."""
    now = clock(db)
    ids = [put(db, now) for _ in range(4)]
    held, free = ids[:2], ids[2:]
    skips_locked = dialect_for(db).supports_skip_locked

    def claim_ids() -> list[int]:  # on a thread: a claim that waits for a lock fails
        with db.begin() as conn:
            return sorted(r.id for r in claim_due(conn, now))

    with db.connect() as holder, ThreadPoolExecutor(1) as pool:
        holding = holder.begin()
        try:
            if skips_locked:  # a row at a time: for an IN list over four rows MariaDB
                for i in held:  # scans an index, locking each record it reads
                    holder.execute(select(t.c.id).where(t.c.id == i).with_for_update())
            else:  # the database's write lock: SQLite's one writer
                holder.execute(update(t).where(t.c.id.in_(held)).values(attempts=t.c.attempts))
            taken = pool.submit(claim_ids).result(timeout=DEADLINE_S)
            assert taken == (free if skips_locked else ids)
            store.finish(holder, [(i, "holder") for i in held], "keep", by_row_id=True)
            holding.commit()
        finally:
            if holding.is_active:
                holding.rollback()
    with db.begin() as conn:
        marked = store.finish(conn, [(i, "claimer") for i in taken], "keep", by_row_id=True)
    assert marked == len(free)
    found = rows(db, *ids)
    assert [found[i].status for i in ids] == [SENT] * 4
    assert [found[i].receipt for i in ids] == ["holder", "holder", "claimer", "claimer"]


def test_a_claim_takes_due_rows_oldest_first_up_to_its_limit(db: Engine) -> None:
    now = clock(db)
    young = put(db, now, age_s=-60)  # created after the cutoff
    backing_off = put(db, now, next_attempt_at=now + timedelta(hours=1))
    oldest, older = put(db, now, age_s=300), put(db, now, age_s=200)
    dead = put(db, now, age_s=400, status=DEAD)
    with db.begin() as conn:
        assert [r.id for r in claim_due(conn, now, limit=2)] == [oldest, older]
    with db.begin() as conn:
        assert [r.id for r in claim_due(conn, now)] == [oldest, older]
    with db.begin() as conn:
        every = store.claim(conn, store.claim_due_stmt(now, now, 10, due_only=False))
    assert [r.id for r in every] == [oldest, older, backing_off]
    assert young not in {r.id for r in every} and dead not in {r.id for r in every}


def test_a_claim_leaves_a_big_payload_to_load_payloads(db: Engine) -> None:
    """A claim of ``limit`` rows brings payloads up to its share of LOAD_PAYLOAD_BYTES;
    a bigger one comes with its size only, and load_payloads fetches it."""
    now = clock(db)
    small = put(db, now, age_s=70, payload=b"s" * 10)
    big_payload = b"b" * (store.LOAD_PAYLOAD_BYTES // 2 + 1)
    big = put(db, now, payload=big_payload)
    with db.begin() as conn:
        claimed = {r.id: r for r in claim_due(conn, now, limit=2)}
        assert claimed[small].payload == b"s" * 10
        assert (claimed[big].payload, claimed[big].size) == (None, len(big_payload))
        assert store.load_payloads(conn, list(claimed.values())) == {big: big_payload}


# Marks: each is conditional on status = 'pending'


@pytest.mark.parametrize("by_row_id", [False, True], ids=["msg_id", "row_id"])
def test_marks_change_pending_rows_only(db: Engine, by_row_id: bool) -> None:
    now = clock(db)
    pending = put(db, now)
    dead = put(db, now, status=DEAD)
    sent = put(db, now, status=SENT, receipt="first", sent_at=now - timedelta(minutes=5))
    skipped = put(db, now, status=SKIPPED)
    ids = [pending, dead, sent, skipped]
    before = rows(db, *ids)
    acks = [(i if by_row_id else msg_id(db, i), "again") for i in ids]
    with db.begin() as conn:
        assert store.finish(conn, acks, "keep", by_row_id) == 1
    after = rows(db, *ids)
    assert (after[pending].status, after[pending].receipt) == (SENT, "again")
    assert after[pending].sent_at is not None
    for i in (dead, sent, skipped):
        assert after[i] == before[i], "a settled row is never changed again"


def test_the_delete_mode_removes_pending_rows_only(db: Engine) -> None:
    now = clock(db)
    pending, dead = put(db, now), put(db, now, status=DEAD)
    sent = put(db, now, status=SENT, sent_at=now)
    with db.begin() as conn:
        assert store.finish(conn, [(i, "r") for i in (pending, dead, sent)], "delete", True) == 1
    assert status_of(db, pending, dead, sent) == [None, DEAD, SENT]


def test_a_failure_is_recorded_on_a_pending_row_only(db: Engine) -> None:
    now = clock(db)
    pending, sent = put(db, now), put(db, now, status=SENT, sent_at=now)
    retry_at = now + timedelta(minutes=1)
    failures = [
        {"row_id": i, "error": "refused", "next_at": retry_at, "new_status": PENDING}
        for i in (pending, sent)
    ]
    with db.begin() as conn:
        conn.execute(store.record_failures_stmt(), failures)
    found = rows(db, pending, sent)
    assert (found[pending].attempts, found[pending].last_error) == (1, "refused")
    assert found[pending].next_attempt_at == retry_at
    assert (found[sent].attempts, found[sent].last_error, found[sent].status) == (0, None, SENT)
    with db.begin() as conn:  # past its retries: dead
        conn.execute(store.record_failures_stmt(), [failures[0] | {"new_status": DEAD}])
    assert status_of(db, pending) == [DEAD]


def test_pending_among_names_committed_pending_messages(db: Engine) -> None:
    now = clock(db)
    pending, sent = put(db, now), put(db, now, status=SENT, sent_at=now)
    never = str(uuid7())
    with db.connect() as conn:
        found = store.pending_among(conn, [msg_id(db, pending), msg_id(db, sent), never])
    assert found == {msg_id(db, pending)}


# An ordered key: one head at a time


def test_a_keys_later_row_waits_while_an_earlier_one_is_unsettled(db: Engine) -> None:
    """Of each key only its head is claimed: k's second row waits for its pending first,
    d's for its dead first; a sent or skipped first lets the second go."""
    now = clock(db)
    k1, k2 = keyed(db, now, "k", PENDING, PENDING)
    _, d2 = keyed(db, now, "d", DEAD, PENDING)
    _, s2 = keyed(db, now, "s", SENT, PENDING)
    _, x2 = keyed(db, now, "x", SKIPPED, PENDING)
    unordered = put(db, now)
    with db.begin() as conn:
        assert {r.id for r in claim_due(conn, now)} == {k1, s2, x2, unordered}
    heads: list[store.Head] = [(TOPIC, key, 2) for key in "kdsx"]
    with db.connect() as conn:
        assert store.blocked_keys(conn, heads) == {(TOPIC, "k"), (TOPIC, "d")}
        assert store.blocked_keys(conn, []) == set()
        assert store.still_heads(conn, [k1, k2, d2, s2, x2]) == {k1, s2, x2}
        row = rows(db, k2)[k2]
        assert store.earlier_unsettled(conn, row)
        assert not store.earlier_unsettled(conn, rows(db, s2)[s2])
    with db.begin() as conn:
        store.finish(conn, [(k1, "r")], "keep", by_row_id=True)
    with db.begin() as conn:
        assert k2 in {r.id for r in claim_due(conn, now)}, "k's first sent: its second is head"


def test_followers_come_in_seq_order_up_to_a_gap(db: Engine) -> None:
    """A claimed head brings the rows after it in its key while they are pending, old
    enough and free; the first gap (here a dead row) stops them."""
    now = clock(db)
    a1, a2, a3, _, a5 = keyed(db, now, "a", PENDING, PENDING, PENDING, DEAD, PENDING)
    with db.begin() as conn:
        [head] = claim_due(conn, now)
        assert head.id == a1
        taken = store.followers(conn, [head], now, room=10, limit=10)
    assert [r.id for r in taken] == [a2, a3]
    assert a5 not in {r.id for r in taken}


def test_a_dead_head_blocks_its_key_until_skipped(db: Engine) -> None:
    now = clock(db)
    j1, j2, j3 = keyed(db, now, "j", DEAD, PENDING, PENDING)
    head_id = msg_id(db, j1)
    with db.connect() as conn:
        [blocked] = store.dead_heads(conn, 10)
        [backlog] = store.backlog_by_topic(conn, store.db_clock(conn))
    assert (blocked.topic, blocked.key, blocked.seq, blocked.behind) == (TOPIC, "j", 1, 2)
    assert str(blocked.msg_id) == head_id
    assert (backlog.pending, backlog.blocked, backlog.dead, backlog.blocked_keys) == (2, 2, 1, 1)
    with db.begin() as conn:
        assert claim_due(conn, now) == []
        [outcome] = store.skip(conn, [head_id])
    assert (outcome.outcome, outcome.was, outcome.held_by_earlier) == ("skipped", DEAD, False)
    with db.begin() as conn:
        assert [r.id for r in claim_due(conn, now)] == [j2]
        assert store.dead_heads(conn, 10) == []
    assert status_of(db, j1, j3) == [SKIPPED, PENDING]


# Scheduled rows


def test_a_row_due_later_is_not_claimed_and_tells_the_next_due_time(db: Engine) -> None:
    now = clock(db)
    later = put(db, now, deliver_at=now + timedelta(hours=1))
    due = put(db, now, deliver_at=now - timedelta(seconds=1))
    plain = put(db, now)
    due_at = rows(db, later)[later].deliver_at
    with db.begin() as conn:
        assert [r.id for r in claim_due(conn, now)] == [plain], "scheduled rows: the scheduler's"
        at = store.db_clock(conn)
        assert [r.id for r in store.claim(conn, store.claim_scheduled_stmt(at, 10))] == [due]
    with db.connect() as conn:
        next_due = store.next_due(conn)
        assert next_due.next_due == due_at and next_due.now >= now
        assert store.scheduled_count(conn) == 1
        [backlog] = store.backlog_by_topic(conn, store.db_clock(conn))
    assert (backlog.pending, backlog.scheduled, backlog.next_due) == (2, 1, due_at)


def test_no_next_due_time_without_a_row_scheduled_for_later(db: Engine) -> None:
    now = clock(db)
    put(db, now, deliver_at=now - timedelta(seconds=1))  # already due: not "next"
    with db.connect() as conn:
        assert store.next_due(conn).next_due is None
        assert store.scheduled_count(conn) == 0


# Operator actions


def test_requeue_takes_dead_rows_unless_messages_are_named(db: Engine) -> None:
    now = clock(db)
    dead = put(db, now, status=DEAD, attempts=5, last_error="refused")
    pending = put(db, now, attempts=2)
    sent = put(db, now, status=SENT, sent_at=now, receipt="r")
    canceled = put(db, now, status=CANCELED)
    with db.begin() as conn:
        assert store.requeue_count(conn, False, TOPIC, []) == 1
        assert store.requeue(conn, False, TOPIC, []) == 1
    found = rows(db, dead, pending)
    assert (found[dead].status, found[dead].attempts, found[dead].last_error) == (PENDING, 0, None)
    assert found[pending].attempts == 2, "a pending row is not requeued"
    named = [msg_id(db, i) for i in (sent, canceled, pending)]
    with db.begin() as conn:
        assert store.requeue(conn, False, None, named) == 1
        assert store.requeue(conn, True, None, named) == 0, "dead only: none of them is"
    found = rows(db, sent, canceled)
    assert (found[sent].status, found[sent].sent_at, found[sent].receipt) == (PENDING, None, None)
    assert found[canceled].status == CANCELED, "a canceled message never goes out"


def test_requeue_goes_batch_by_batch_past_an_id(db: Engine) -> None:
    now = clock(db)
    ids = [put(db, now, status=DEAD) for _ in range(3)]
    with db.begin() as conn:
        assert store.requeue_batch(conn, True, None, [], 0, size=2) == (2, ids[1])
        assert store.requeue_batch(conn, True, None, [], ids[1], size=2) == (1, ids[2])
        assert store.requeue_batch(conn, True, None, [], ids[2], size=2) == (0, None)
    assert status_of(db, *ids) == [PENDING] * 3


def test_skip_tells_an_outcome_per_message(db: Engine) -> None:
    now = clock(db)
    pending, dead = put(db, now), put(db, now, status=DEAD)
    sent = put(db, now, status=SENT, sent_at=now)
    _, held = keyed(db, now, "h", PENDING, PENDING)
    unknown = str(uuid7())
    names = [msg_id(db, i) for i in (pending, dead, sent, held)] + [unknown]
    with db.begin() as conn:
        outcomes = store.skip(conn, names)
    assert [o.msg_id for o in outcomes] == names
    assert [(o.outcome, o.was) for o in outcomes] == [
        ("skipped", PENDING),
        ("skipped", DEAD),
        ("already_sent", SENT),
        ("skipped", PENDING),
        ("unknown", None),
    ]
    assert [o.held_by_earlier for o in outcomes] == [False, False, False, True, False]
    assert status_of(db, pending, dead, sent, held) == [SKIPPED, SKIPPED, SENT, SKIPPED]


def test_delete_dead_deletes_a_dead_message_only(db: Engine) -> None:
    now = clock(db)
    dead, pending = put(db, now, status=DEAD), put(db, now)
    with db.begin() as conn:
        assert store.delete_dead(conn, msg_id(db, pending)) is False
        assert store.delete_dead(conn, msg_id(db, dead)) is True
    assert status_of(db, dead, pending) == [None, PENDING]


def test_failures_list_dead_and_failing_rows_newest_first(db: Engine) -> None:
    now = clock(db)
    dead = put(db, now, status=DEAD, attempts=3, last_error="refused")
    failing = put(db, now, attempts=1, last_error="timeout")
    put(db, now)  # pending, never failed
    with db.connect() as conn:
        both = store.failures(conn, [DEAD, store.FAILING], None, 10, None)
        only_dead = store.failures(conn, [DEAD], None, 10, None)
        page = store.failures(conn, [DEAD, store.FAILING], None, 10, failing)
        assert store.row_id_of(conn, msg_id(db, dead)) == dead
        assert store.unknown_ids(conn, [msg_id(db, dead), str(uuid.UUID(int=1))]) == [
            str(uuid.UUID(int=1))
        ]
    assert [(f.id, f.status, f.last_error) for f in both] == [
        (failing, PENDING, "timeout"),
        (dead, DEAD, "refused"),
    ]
    assert [f.id for f in only_dead] == [dead] and [f.id for f in page] == [dead]


# The purge


def test_the_purge_deletes_old_sent_and_canceled_rows_only(db: Engine) -> None:
    now = clock(db)
    hour_ago = now - timedelta(hours=1)
    old_sent = put(db, now, age_s=10800, status=SENT, sent_at=now - timedelta(hours=2))
    # Sent recently, though created long ago: the purge goes by sent_at.
    new_sent = put(db, now, age_s=10800, status=SENT, sent_at=now - timedelta(minutes=1))
    old_canceled = put(db, now, age_s=7200, status=CANCELED)
    new_canceled = put(db, now, age_s=60, status=CANCELED)
    kept = [put(db, now, age_s=7200, status=s) for s in (PENDING, DEAD, SKIPPED)]
    with db.begin() as conn:
        assert store.purge_sent(conn, hour_ago, limit=1) == 1
        assert store.purge_sent(conn, hour_ago, limit=10) == 1
        assert store.purge_sent(conn, hour_ago, limit=10) == 0
    assert status_of(db, old_sent, old_canceled) == [None, None]
    assert status_of(db, new_sent, new_canceled, *kept) == [SENT, CANCELED, PENDING, DEAD, SKIPPED]


# What status, the dashboard and the gauges count


def test_backlog_by_topic_counts_as_status_shows_it(db: Engine) -> None:
    now = clock(db)
    fresh = [put(db, now, age_s=5) for _ in range(2)]
    stuck = put(db, now, age_s=600)
    put(db, now, status=DEAD)
    put(db, now, deliver_at=now + timedelta(hours=1))  # scheduled: not pending yet
    put(db, now, status=SENT, sent_at=now)  # the retained ledger: not counted
    keyed(db, now, "j", DEAD, PENDING, PENDING)  # a blocked key: two rows behind its head
    put(db, now, topic="payments")
    stuck_since = rows(db, stuck)[stuck].created_at
    with db.connect() as conn:
        at = store.db_clock(conn)
        backlog = {b.topic: b for b in store.backlog_by_topic(conn, at, sla_s=60)}
        settled = store.settled_by_topic(conn, at)
        sent = store.sent_by_topic(conn, now - timedelta(minutes=1))
    orders = backlog[TOPIC]
    counts = (orders.pending, orders.blocked, orders.stuck, orders.dead, orders.blocked_keys)
    assert counts == (len(fresh) + 1 + 2, 2, 1, 2, 1)
    assert (orders.scheduled, orders.oldest_pending) == (1, stuck_since)
    assert (backlog["payments"].pending, backlog["payments"].dead) == (1, 0)
    assert settled[TOPIC]["sent_1h"] == 1 and TOPIC in sent and "payments" not in sent
