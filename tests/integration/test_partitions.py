"""A partitioned outbox on PostgreSQL (outbox.partitions): days made ahead, rows never
lost when a day is made or dropped, msg_id unique across partitions under concurrent
writers, and an existing table converted (and back) while senders go on.

Each test has a schema of its own (relay.testing.scratch_schema); rows of past and future
days get a UUIDv7 of that day's time (``uuid7_on``), as a sender on that day would write.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, date, datetime, timedelta
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Engine, MetaData, func, insert, inspect, select, text
from sqlalchemy.exc import IntegrityError

from outbox import migrate, partitions
from outbox.message import dedup_id, uuid7
from outbox.table import CANCELED, DEAD, PENDING, SENT, SKIPPED, outbox_message
from relay import cli as cli_module
from relay.operator import Operator
from relay.testing import scratch_schema
from tests.conftest import PG_URL
from tests.helpers import migrated

t = outbox_message
DAY = timedelta(days=1)
DEADLINE_S = 60.0


@pytest.fixture
def plain() -> Iterator[Engine]:
    """A migrated, unpartitioned outbox in a schema of its own."""
    with scratch_schema(PG_URL, "parts") as url, migrated(url) as engine:
        yield engine


@pytest.fixture
def parted(plain: Engine) -> Engine:
    """The same, partitioned (as `outbox migrate --partitioned` leaves it)."""
    partitions.convert(plain)
    return plain


def uuid7_on(moment: datetime) -> uuid.UUID:
    """A UUIDv7 as a sender writes it at ``moment``."""
    ms = int(moment.timestamp() * 1000)
    rand = int.from_bytes(os.urandom(10)) & ((1 << 74) - 1)
    return uuid.UUID(
        int=(ms << 80) | (0x7 << 76) | ((rand >> 62) << 64) | (0b10 << 62) | rand & ((1 << 62) - 1)
    )


def today(engine: Engine) -> date:
    with engine.connect() as conn:
        return partitions.db_today(conn)


def noon(day: date) -> datetime:
    return datetime(day.year, day.month, day.day, 12, tzinfo=UTC)


def put(engine: Engine, msg_id: uuid.UUID, **columns: Any) -> int:
    values = {"msg_id": msg_id, "topic": "parts.x", "payload": b"{}", **columns}
    with engine.begin() as conn:
        key = conn.execute(insert(t).values(**values)).inserted_primary_key
        assert key is not None
        return int(key[0])


def home(engine: Engine, msg_id: uuid.UUID) -> str:
    """The partition holding ``msg_id``."""
    with engine.connect() as conn:
        where = conn.execute(
            text("SELECT tableoid::regclass::text FROM outbox_message WHERE msg_id = :m"),
            {"m": msg_id},
        ).scalar_one()
    return str(where).rsplit(".", 1)[-1]


def names(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        return partitions.partitions(conn)


def rows(engine: Engine) -> dict[uuid.UUID, tuple[int, str]]:
    with engine.connect() as conn:
        return {m: (i, s) for m, i, s in conn.execute(select(t.c.msg_id, t.c.id, t.c.status))}


def test_migrate_partitioned_makes_the_days_ahead_and_a_default(
    plain: Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    url = plain.url.render_as_string(hide_password=False)
    assert cli_module.main(["migrate", "--db", url, "--partitioned"]) == 0
    assert "now partitioned by day" in capsys.readouterr().out
    day = today(plain)
    expected = [partitions.day_name(day + n * DAY) for n in range(partitions.DAYS_AHEAD + 1)]
    assert names(plain) == sorted([*expected, partitions.DEFAULT])
    now, keyed, far = uuid7(), dedup_id("parts.x", "k1"), uuid7_on(noon(date(2099, 1, 1)))
    for msg_id in (now, keyed, far):
        put(plain, msg_id)
    assert home(plain, now) == partitions.day_name(day)
    assert home(plain, keyed) == home(plain, far) == partitions.DEFAULT  # never refused
    assert cli_module.main(["migrate", "--db", url, "--partitioned"]) == 0
    assert "already partitioned" in capsys.readouterr().out


def test_a_new_day_takes_its_rows_from_the_default_partition(parted: Engine) -> None:
    later = today(parted) + 10 * DAY
    msg_id = uuid7_on(noon(later))
    row_id = put(parted, msg_id)
    assert home(parted, msg_id) == partitions.DEFAULT
    assert partitions.day_name(later) in partitions.ensure(parted, ahead=10)
    assert home(parted, msg_id) == partitions.day_name(later)
    assert rows(parted)[msg_id] == (row_id, PENDING)


def test_retention_drops_old_days_and_keeps_what_it_must(
    parted: Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    day = today(parted)
    old = day - 5 * DAY
    partitions.ensure(parted, since=old)
    at, now = noon(old), datetime.now(UTC)
    gone = {put(parted, uuid7_on(at), status=SENT, created_at=at, sent_at=at),
            put(parted, uuid7_on(at), status=CANCELED, created_at=at)}  # fmt: skip
    kept: dict[uuid.UUID, dict[str, Any]] = {
        uuid7_on(at): {"status": PENDING},
        uuid7_on(at): {"status": DEAD, "attempts": 9},
        uuid7_on(at): {"status": SKIPPED},
        uuid7_on(at): {"status": SENT, "sent_at": now},  # sent late: within the retention
    }
    kept_ids = {m: put(parted, m, created_at=at, **v) for m, v in kept.items()}
    fresh = put(parted, uuid7(), status=SENT, sent_at=now)
    # Older than the retention, but its day (yesterday) is not over for it: it stays in
    # its partition until the whole day can go; no day is thinned row by row.
    early = datetime(day.year, day.month, day.day, tzinfo=UTC) - DAY + timedelta(milliseconds=1)
    waits = put(parted, uuid7_on(early), status=SENT, created_at=early, sent_at=early)
    url = parted.url.render_as_string(hide_password=False)
    assert cli_module.main(["purge", "--db", url, "--retention-days", "1"]) == 0
    said = capsys.readouterr().out
    dropped = [partitions.day_name(old + n * DAY) for n in range(4)]  # days ending >1 day ago
    assert "purged 2 message(s)" in said and f"dropped {len(dropped)} partition(s)" in said
    assert "4 message(s) they held kept" in said
    left = rows(parted)
    assert {m: left[m][0] for m in kept} == kept_ids  # same rows, same ids
    assert {home(parted, m) for m in kept} == {partitions.DEFAULT}
    assert not gone & {i for i, _ in left.values()}
    assert {fresh, waits} <= {i for i, _ in left.values()}
    assert not set(dropped) & set(names(parted))
    # The workers' retention job (Sweeper.purge) runs this pass: it makes the days ahead.
    last = partitions.day_name(day + partitions.DAYS_AHEAD * DAY)
    with parted.begin() as conn:
        conn.execute(text(f"DROP TABLE {last}"))
    done = Operator(parted).purge(86400.0, 1000)
    assert (done.rows, done.partitions) == (0, ())
    assert last in names(parted)


def test_msg_id_is_unique_across_partitions_under_concurrent_writers(parted: Engine) -> None:
    day = today(parted)
    partitions.ensure(parted, since=day - 3 * DAY)
    ids = [uuid7_on(noon(day + n * DAY)) for n in (-3, -1, 0, 2)]
    ids += [dedup_id("parts.x", "same-key"), uuid7_on(noon(date(2099, 1, 1)))]
    writers = 6
    start = threading.Barrier(writers * len(ids), timeout=DEADLINE_S)

    def write(msg_id: uuid.UUID) -> bool:
        start.wait()
        try:
            put(parted, msg_id)
        except IntegrityError:
            return False
        return True

    with ThreadPoolExecutor(writers * len(ids)) as pool:
        wins = list(pool.map(write, [m for m in ids for _ in range(writers)], timeout=DEADLINE_S))
    assert [sum(wins[i * writers : (i + 1) * writers]) for i in range(len(ids))] == [1] * len(ids)
    homes = {home(parted, m) for m in ids}
    assert len(homes) == 5  # four days and the default: the duplicates met across partitions
    with parted.connect() as conn:
        assert conn.execute(select(func.count()).select_from(t)).scalar_one() == len(ids)


def retained(engine: Engine, n: int) -> None:
    """``n`` settled rows of the last two days, a few pending and dead, written in SQL."""
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO outbox_message (msg_id, topic, payload, status, created_at, sent_at) "
                "SELECT (lpad(to_hex((extract(epoch FROM now()) * 1000)::bigint - i * 10), 12, "
                "'0') || '7' || substr(md5(i::text), 1, 19))::uuid, 'parts.old', '\\x7b7d', "
                "CASE WHEN i % 100 = 0 THEN 'pending' WHEN i % 100 = 1 THEN 'dead' ELSE 'sent' "
                "END, now() - i * interval '10 ms', CASE WHEN i % 100 > 1 THEN now() END "
                "FROM generate_series(1, :n) i"
            ),
            {"n": n},
        )


class Senders:
    """Threads committing one message per transaction until stopped; what they committed."""

    def __init__(self, engine: Engine, threads: int = 3) -> None:
        self.engine, self.stop = engine, threading.Event()
        self.sent: list[uuid.UUID] = []
        self.errors: list[BaseException] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.run) for _ in range(threads)]
        for thread in self.threads:
            thread.start()

    def run(self) -> None:
        try:
            self.send()
        except BaseException as exc:  # the test fails on it, not the thread alone
            self.errors.append(exc)

    def send(self) -> None:
        with self.engine.connect() as conn:  # one connection: its statements get prepared
            while not self.stop.is_set():
                msg_id = uuid7()
                with conn.begin():
                    conn.execute(insert(t).values(msg_id=msg_id, topic="parts.new", payload=b"1"))
                with self.lock:
                    self.sent.append(msg_id)

    def finish(self) -> list[uuid.UUID]:
        self.stop.set()
        for thread in self.threads:
            thread.join(DEADLINE_S)
        assert not self.errors, f"a sender failed while the table was converted: {self.errors}"
        return self.sent


@pytest.mark.parametrize("back", [False, True], ids=["partition", "and-back"])
def test_conversion_while_senders_send_loses_and_repeats_nothing(plain: Engine, back: bool) -> None:
    retained(plain, 20_000)
    before = rows(plain)
    if back:
        partitions.convert(plain)
    senders = Senders(plain)
    try:
        done = partitions.convert(plain, partitioned=not back, batch=2_000)
    finally:
        sent = senders.finish()
    # The pending and dead rows move under the swap's lock (the senders' first ones too),
    # the settled ones are copied after it.
    assert done.changed and done.moved >= 400 and done.copied == 19_600
    after = rows(plain)
    assert {m: after[m] for m in before} == before  # every old row, same id and status
    assert set(sent) <= after.keys() and len(after) == len(before) + len(sent)
    assert len({i for i, _ in after.values()}) == len(after)  # ids stay unique
    with plain.connect() as conn:
        assert partitions.is_partitioned(conn) is not back
        assert (
            conn.execute(text("SELECT to_regclass(:t)"), {"t": partitions.LEGACY}).scalar() is None
        )
    assert len(sent) > 3 * len(senders.threads)  # they kept committing, none failed


def test_later_migrations_and_the_apps_autogenerate_see_one_table(parted: Engine) -> None:
    """Alembic's changes reach every partition (0009 and on, downgraded and made again);
    an app's autogenerate with the outbox's hooks proposes nothing for the partitions."""
    url = parted.url.render_as_string(hide_password=False)
    migrate.downgrade(url, "0008")
    migrate.upgrade(url)
    migrate.require_schema(url)
    day_index = f"{partitions.day_name(today(parted))}_sent_at_idx"
    with parted.connect() as conn:
        assert day_index in {
            i["name"] for i in inspect(conn).get_indexes(partitions.day_name(today(parted)))
        }
        context = MigrationContext.configure(
            conn,
            opts={"include_name": migrate.include_name, "include_object": migrate.include_object},
        )
        assert compare_metadata(context, MetaData()) == []  # the app has no tables: no drops


def test_dropping_a_day_reads_only_the_rows_it_keeps(parted: Engine) -> None:
    """The rows a day keeps are moved under the table's lock: their read goes by the
    partial indexes, never through the day's sent rows (a seq scan of 16.7M rows held
    senders for 1.4 s in bench/retained.py)."""
    old = today(parted) - 5 * DAY
    partitions.ensure(parted, since=old)
    name, at = partitions.day_name(old), noon(old)
    with parted.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO outbox_message (msg_id, topic, payload, status, created_at, sent_at) "
                "SELECT (lpad(to_hex((extract(epoch FROM CAST(:at AS timestamptz)) * 1000)::bigint"
                " + g), 12, '0') || '7' || substr(md5(g::text), 1, 19))::uuid, 'parts.old', "
                "'\\x7b7d', 'sent', :at, :at FROM generate_series(1, 30000) g"
            ),
            {"at": at},
        )
    put(parted, uuid7_on(at), status=DEAD, created_at=at)
    with parted.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f"ANALYZE {name}"))
        plan = conn.execute(
            text(f"EXPLAIN {partitions.kept_rows(name)}"), {"older_than": datetime.now(UTC)}
        ).scalars()
        lines = "\n".join(plan)
    assert "Seq Scan" not in lines, lines
    done = Operator(parted).purge(86400.0, 1000)
    assert (done.rows, done.kept, done.partitions[0]) == (30_000, 1, name)
