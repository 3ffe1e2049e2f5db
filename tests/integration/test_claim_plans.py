"""The sweeper's, the scheduler's and the drain's ordered claims read about what they
return on a large, freshly analyzed table (issue 40, items 5 and 6).

PostgreSQL, one table built once: 60,000 pending unordered rows older than the sweeper
age, 20,000 older ones tried before (1,000 due again, the others backing off), 60,000
scheduled rows due, and ordered rows in few keys, 4 open ones and 2 blocked behind a
dead head, 6,000 rows each, the blocked ones oldest. The executed plans
(EXPLAIN ANALYZE, rows read at every scan node over its loops; tests.integration.
test_drain_plan) of each claim read a few times what they return, not the backlog:
- the sweeper's unordered rows by age (ix_outbox_message_unordered_age: no ordered
  row in it, no row backing off), where one statement for all (claim_due_stmt) read
  every blocked row and every row backing off (20,000 of them, older);
- the sweeper's retries, due ones only (ix_outbox_message_retry);
- the ordered heads key by key (relay.store.heads), the sweeper's and the drain's, one
  probe per key: the heads of the open keys, nothing of a blocked one;
- the scheduler's due rows, though half of them were sent since the ANALYZE (the
  statistics say none is): never through ix_outbox_message_scheduled, which holds the
  sent ones too.
On MariaDB, beside a retained ledger of sent rows, the sweeper's claim (one statement
there) reads its rows by ix_outbox_message_pending_age: ix_outbox_message_pending is
over every row there, so it read the ledger and the scheduled rows first; the
scheduler's reads ix_outbox_message_due.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta

import pytest
from sqlalchemy import Connection, Engine, text

from outbox.settings import Settings
from relay import store
from relay.sweep.claims import Claimer, Cursor
from relay.testing import scratch_schema
from tests.conftest import PG_URL, scratch_mariadb
from tests.helpers import migrated
from tests.integration.test_drain_plan import executed_plan

pytestmark = pytest.mark.xdist_group("claim_plans")  # the large table built once
ROWS = 60_000  # unordered pending rows, and as many scheduled ones
RETRIES, DUE_RETRIES = 20_000, 1_000  # unordered rows tried before, and those due again
OPEN, BLOCKED, PER_KEY = 4, 2, 6_000  # ordered keys: open ones, blocked ones, rows each
LIMIT = 500
AGE = timedelta(seconds=10)

FILL = [
    # unordered, an hour old
    """INSERT INTO outbox_message (msg_id, topic, payload, created_at)
       SELECT gen_random_uuid(), 'plan', '\\x7b7d'::bytea,
              now() - interval '1 hour' + make_interval(secs => g / 100.0)
       FROM generate_series(1, :rows) AS g""",
    # unordered rows tried before, older: most backing off for an hour more, a few due
    """INSERT INTO outbox_message (msg_id, topic, payload, created_at, attempts,
                                   next_attempt_at)
       SELECT gen_random_uuid(), 'plan', '\x7b7d'::bytea,
              now() - interval '90 minutes' + make_interval(secs => g / 100.0), 1,
              now() + CASE WHEN g <= :due_retries THEN interval '-1 minute'
                           ELSE interval '1 hour' END
       FROM generate_series(1, :retries) AS g""",
    # scheduled, due in the last hour
    """INSERT INTO outbox_message (msg_id, topic, payload, created_at, deliver_at)
       SELECT gen_random_uuid(), 'later', '\\x7b7d'::bytea, now() - interval '2 hours',
              now() - interval '1 hour' + make_interval(secs => g / 100.0)
       FROM generate_series(1, :rows) AS g""",
    # ordered, interleaved by key: the blocked keys' rows oldest, their first one dead
    """INSERT INTO outbox_message (msg_id, topic, key, seq, payload, created_at, status)
       SELECT gen_random_uuid(), 'ordered',
              CASE WHEN g % :keys < :blocked THEN 'blocked' ELSE 'open' END || (g % :keys),
              (g - 1) / :keys + 1, '\\x7b7d'::bytea,
              now() - CASE WHEN g % :keys < :blocked THEN interval '3 hours'
                           ELSE interval '2 hours' END + make_interval(secs => g / 100.0),
              CASE WHEN g % :keys < :blocked AND g <= :keys THEN 'dead' ELSE 'pending' END
       FROM generate_series(1, :ordered) AS g""",
]

# The earliest scheduled rows, sent after the ANALYZE: statistics that say none is sent.
SENT_SCHEDULED = 30_000
SENT_SINCE = """
    UPDATE outbox_message SET status = 'sent', sent_at = now()
    WHERE id IN (SELECT id FROM outbox_message WHERE topic = 'later'
                 ORDER BY deliver_at LIMIT :sent)"""

TEN_KEYS = """
    INSERT INTO outbox_message (msg_id, topic, key, seq, payload, created_at)
    SELECT gen_random_uuid(), 'turns', 'k' || ((g - 1) % 10), (g - 1) / 10 + 1,
           '\\x7b7d'::bytea, now() - interval '1 hour'
    FROM generate_series(1, 20) AS g"""

# MariaDB: a retained ledger of sent rows, then pending and scheduled ones, as many each.
MARIA_ROWS = 20_000
MARIA_FILL = [
    f"""INSERT INTO outbox_message (msg_id, topic, payload, created_at, status, sent_at)
        SELECT REPLACE(UUID(), '-', ''), 'plan', '{{}}',
               UTC_TIMESTAMP(6) - INTERVAL 3 HOUR + INTERVAL (seq * 1000) MICROSECOND,
               'sent', UTC_TIMESTAMP(6)
        FROM seq_1_to_{MARIA_ROWS}""",
    f"""INSERT INTO outbox_message (msg_id, topic, payload, created_at)
        SELECT REPLACE(UUID(), '-', ''), 'plan', '{{}}',
               UTC_TIMESTAMP(6) - INTERVAL 1 HOUR + INTERVAL (seq * 1000) MICROSECOND
        FROM seq_1_to_{MARIA_ROWS}""",
    f"""INSERT INTO outbox_message (msg_id, topic, payload, created_at, deliver_at)
        SELECT REPLACE(UUID(), '-', ''), 'later', '{{}}', UTC_TIMESTAMP(6) - INTERVAL 2 HOUR,
               UTC_TIMESTAMP(6) - INTERVAL 1 HOUR + INTERVAL (seq * 1000) MICROSECOND
        FROM seq_1_to_{MARIA_ROWS}""",
]


@pytest.fixture(scope="module")
def backlog() -> Iterator[Engine]:
    """A migrated PostgreSQL schema holding the rows above, VACUUM ANALYZEd."""
    with scratch_schema(PG_URL, "claims") as url, migrated(url) as engine:
        keys = OPEN + BLOCKED
        params = {"rows": ROWS, "keys": keys, "blocked": BLOCKED, "ordered": keys * PER_KEY}
        params |= {"retries": RETRIES, "due_retries": DUE_RETRIES}
        with engine.begin() as conn:
            for fill in FILL:
                conn.execute(text(fill), params)
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("VACUUM ANALYZE outbox_message"))
        with engine.begin() as conn:  # sent since the statistics were taken
            conn.execute(text(SENT_SINCE), {"sent": SENT_SCHEDULED})
        yield engine


def clock(conn: Connection) -> tuple[datetime, datetime]:
    """The database's now and the sweeper's cutoff."""
    now = store.db_clock(conn)
    conn.commit()
    return now, now - AGE


def test_the_sweepers_rows_by_age_pass_the_blocked_keys_and_the_backoffs(
    backlog: Engine,
) -> None:
    with backlog.connect() as conn:
        now, cutoff = clock(conn)
        read, returned = executed_plan(conn, store.claim_aged_stmt(cutoff, LIMIT))
        assert returned == LIMIT
        assert read < 2 * LIMIT, f"the sweeper's claim by age read {read} rows for {returned}"
        # One statement for all reads every blocked row and every backoff first: the
        # table shows a scan.
        read, returned = executed_plan(conn, store.claim_due_stmt(cutoff, now, LIMIT))
        assert read >= BLOCKED * PER_KEY + RETRIES - DUE_RETRIES, f"one claim read {read}"


def test_the_sweepers_retries_read_the_due_ones_only(backlog: Engine) -> None:
    with backlog.connect() as conn:
        now, cutoff = clock(conn)
        for limit in (LIMIT, 2 * DUE_RETRIES):
            read, returned = executed_plan(conn, store.claim_retries_stmt(cutoff, now, limit))
            assert returned == min(limit, DUE_RETRIES)
            assert read < 2 * returned, f"the retries' claim read {read} rows for {returned}"


def test_the_heads_are_found_key_by_key(backlog: Engine) -> None:
    with backlog.connect() as conn:
        now, cutoff = clock(conn)
        for due_only in (True, False):  # the sweeper's, the drain's
            stmt = store.key_heads_stmt(cutoff, now, LIMIT, due_only)
            read, returned = executed_plan(conn, stmt)
            assert returned == OPEN, "each open key's head, none of a blocked key"
            assert read < 20 * (OPEN + BLOCKED), f"the heads' claim read {read} rows"


def test_the_heads_past_a_key_and_round_to_it(backlog: Engine) -> None:
    with backlog.connect() as conn:
        now, cutoff = clock(conn)
        past = store.key_heads_stmt(cutoff, now, LIMIT, False, after=("ordered", "open3"))
        before = store.key_heads_stmt(cutoff, now, LIMIT, False, upto=("ordered", "open3"))
        assert [executed_plan(conn, s)[1] for s in (past, before)] == [OPEN - 2, 2]
        read, _ = executed_plan(conn, past)
        assert read < 20 * (OPEN + BLOCKED), f"the heads' claim read {read} rows"


def test_a_sweep_and_a_drain_take_the_open_heads_and_fill_the_batch(backlog: Engine) -> None:
    """The Claimer's batch: the open keys' heads, unordered rows to fill it, nothing of a
    blocked key."""
    claimer = Claimer(Settings(sweep_batch=LIMIT))
    for cursor in (None, Cursor()):
        with backlog.connect() as conn, conn.begin():
            rows = claimer.claim(conn, AGE.total_seconds(), cursor is None, cursor)
            conn.rollback()
        assert len(rows) == LIMIT
        ordered = sorted((row.key, row.seq) for row in rows if row.seq is not None)
        assert ordered == [(f"open{k}", 1) for k in range(BLOCKED, BLOCKED + OPEN)]


def test_the_schedulers_claim_reads_about_what_it_returns(backlog: Engine) -> None:
    with backlog.connect() as conn:
        now, _ = clock(conn)
        read, returned = executed_plan(conn, store.claim_scheduled_stmt(now, LIMIT))
        assert returned == LIMIT
        assert read < 2 * LIMIT, f"the scheduler's claim read {read} rows for {returned}"


def test_more_heads_than_a_batch_take_turns(pg_url: str) -> None:
    """10 keys of 2 rows, 4 heads a sweep (half its batch of 8): each sweep starts past
    the last key the one before took, and goes round to the first keys."""
    with migrated(pg_url) as engine:
        with engine.begin() as conn:
            conn.execute(text(TEN_KEYS))
        claimer = Claimer(Settings(sweep_batch=8))
        taken = []
        for _ in range(3):
            with engine.connect() as conn, conn.begin():
                rows = claimer.claim(conn, AGE.total_seconds(), True, None)
                taken.append(sorted(row.key or "" for row in rows if row.seq == 1))
                conn.rollback()
    assert taken == [["k0", "k1", "k2", "k3"], ["k4", "k5", "k6", "k7"], ["k0", "k1", "k8", "k9"]]


@pytest.fixture(scope="module")
def maria_backlog() -> Iterator[Engine]:
    """A migrated MariaDB database holding the rows of MARIA_FILL, analyzed."""
    with scratch_mariadb("claims") as url, migrated(url) as engine:
        with engine.begin() as conn:
            for fill in MARIA_FILL:
                conn.execute(text(fill))
            conn.execute(text("ANALYZE TABLE outbox_message"))
        yield engine


def test_mariadbs_sweeper_and_scheduler_read_about_what_they_return(
    maria_backlog: Engine,
) -> None:
    """The sweeper's claim (one statement there) by ix_outbox_message_pending_age, not
    through the ledger and the scheduled rows; the scheduler's by ix_outbox_message_due."""
    with maria_backlog.connect() as conn:
        now, cutoff = clock(conn)
        for stmt in (
            store.claim_due_stmt(cutoff, now, LIMIT),
            store.claim_scheduled_stmt(now, LIMIT),
        ):
            read, returned = executed_plan(conn, stmt)
            assert returned == LIMIT
            assert read < 2 * LIMIT, f"read {read} rows for {returned}"
