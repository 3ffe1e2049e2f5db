"""A partitioned ``outbox_message`` on PostgreSQL: retention drops a day, not 86M rows.

Layout: ``PARTITION BY RANGE (msg_id)``, one partition a day (``outbox_message_p20261128``)
and a default one (``outbox_message_default``). A UUIDv7 msg_id (every ``send()`` without
``dedup_key``) begins with its Unix milliseconds, so the msg_ids of a UTC day form one
range. Partitioning on msg_id keeps msg_id unique across the whole table: PostgreSQL
allows a unique index on a partitioned table only over the partition key, and here the key
is msg_id itself, so one msg_id can only ever land in one partition and that partition's
unique index sees every duplicate (JetStream's dedup and ``dedup_key``'s conflict rely on
it). A ``dedup_key`` msg_id (UUIDv5: no time inside) and any msg_id outside the days made
so far land in the default partition: an insert never fails.

- ``ensure(engine)`` makes today's partition and the next ``DAYS_AHEAD`` days' (the
  relay's retention job and ``outbox migrate --partitioned`` call it); rows the default
  partition holds in a new day's range are moved into it, never lost.
- ``drop_expired(engine, older_than)`` is the retention of whole days: a day whose every
  msg_id is older than ``older_than`` is detached and dropped, after the rows retention
  must keep (pending, dead, skipped, sent later than ``older_than``) are moved to the
  default partition. No dead tuple is left behind. The batched DELETE of every database
  takes only the default partition's old settled rows (``default_table``): a settled row
  in a day partition stays until its whole day is older than the retention, up to a day
  longer than on one table.
- ``convert(engine, partitioned)`` turns an existing table into the other layout without
  stopping senders: one short locked swap (the new table takes the name, the unsettled
  rows along), then the settled rows copied over in batches, then the old table dropped.
  Interrupted, it resumes where it stopped when run again.

Each step that changes the layout takes its lock with ``LOCK_TIMEOUT_MS``: a long app
transaction makes it give up and try again later rather than queue every sender behind it.
"""

from __future__ import annotations

import functools
import re
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, date, datetime, timedelta
from typing import NamedTuple

from sqlalchemy import Connection, Engine, MetaData, Table, text
from sqlalchemy.exc import OperationalError

from outbox.dialects import dialect_for
from outbox.errors import OutboxError
from outbox.table import CANCELED, DEAD, PENDING, SENT, SKIPPED, outbox_message

TABLE = "outbox_message"
DEFAULT = f"{TABLE}_default"
LEGACY = f"{TABLE}_unpartitioned"  # the table being copied from during convert()
DAY_PREFIX = f"{TABLE}_p"
DAY_NAME = re.compile(rf"{DAY_PREFIX}(\d{{8}})")
DAYS_AHEAD = 7  # days made ahead of today: a relay down for a week still finds its day
DAYS_BACK = 14  # convert(): older rows than this go to the default partition
LOCK_TIMEOUT_MS = 2000
MOVE_MOST = 10_000  # rows a drop moves under its lock at most; more: the day waits
COPY_BATCH = 10_000
# A partition's pg_get_indexdef: ``CREATE [UNIQUE] INDEX name ON [ONLY] schema.table ...``.
INDEX_DEF = re.compile(r"^CREATE (UNIQUE )?INDEX (\S+) ON (ONLY )?(\S+) (.*)$", re.S)


class PartitionError(OutboxError):
    """Partitioning was asked of a database that has none here, or could not proceed."""


class Dropped(NamedTuple):
    """A retention pass over whole days: the partitions dropped, the settled rows they
    held, the rows kept (moved to the default partition), the days left for later."""

    partitions: list[str]
    rows: int
    kept: int
    waiting: list[str]


class Converted(NamedTuple):
    """``convert()``: whether the table changed layout, and the rows copied after the swap."""

    changed: bool
    moved: int
    copied: int


def day_bound(day: date) -> uuid.UUID:
    """The least UUIDv7 of ``day`` (UTC): its midnight's milliseconds, every other bit 0."""
    ms = int(datetime(day.year, day.month, day.day, tzinfo=UTC).timestamp() * 1000)
    return uuid.UUID(int=ms << 80)


def day_name(day: date) -> str:
    return f"{DAY_PREFIX}{day:%Y%m%d}"


def day_of(name: str) -> date | None:
    """The day a partition's name stands for; None for the default partition."""
    match = DAY_NAME.fullmatch(name)
    return datetime.strptime(match.group(1), "%Y%m%d").date() if match else None


def is_partition_name(name: str | None) -> bool:
    """A table the partitioned layout makes (an app's autogenerate must leave it alone)."""
    return name is not None and (name in (DEFAULT, LEGACY) or DAY_NAME.fullmatch(name) is not None)


@functools.cache
def default_table() -> Table:
    """The default partition as a table to delete from: on a partitioned table the
    batched retention deletes only there, so that a day is never thinned row by row (its
    dead tuples) before it is dropped whole."""
    return outbox_message.to_metadata(MetaData(), name=DEFAULT)


def supported(conn: Connection) -> bool:
    return dialect_for(conn).partitions_outbox


def is_partitioned(conn: Connection) -> bool:
    """Whether ``outbox_message`` here is partitioned (always False but on PostgreSQL)."""
    if not supported(conn):
        return False
    found = conn.execute(
        text(
            "SELECT EXISTS (SELECT 1 FROM pg_partitioned_table WHERE partrelid = to_regclass(:t))"
        ),
        {"t": TABLE},
    ).scalar()
    return bool(found)


def partitions(conn: Connection) -> list[str]:
    """The partitions of ``outbox_message``, by name."""
    rows = conn.execute(
        text(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = to_regclass(:t) ORDER BY c.relname"
        ),
        {"t": TABLE},
    )
    return list(rows.scalars())


def db_today(conn: Connection) -> date:
    today: date = conn.execute(text("SELECT (now() AT TIME ZONE 'UTC')::date")).scalar_one()
    return today


@contextmanager
def layout_lock(engine: Engine) -> Iterator[Connection | None]:
    """A transaction holding this schema's partition lock, or None when another process
    holds it (it is doing the same work), with ``LOCK_TIMEOUT_MS`` for the table locks."""
    with engine.begin() as conn:
        taken = conn.execute(
            text("SELECT pg_try_advisory_xact_lock(hashtext(current_schema() || '.' || :t))"),
            {"t": DEFAULT},
        ).scalar()
        conn.execute(text(f"SET LOCAL lock_timeout = {LOCK_TIMEOUT_MS}"))
        yield conn if taken else None


def ensure(engine: Engine, ahead: int = DAYS_AHEAD, since: date | None = None) -> list[str]:
    """Make the day partitions from ``since`` (default today) to ``ahead`` days after today
    that are missing, and the default partition; the names made. Nothing on a table that
    is not partitioned; a day whose lock could not be had is left for the next call."""
    with engine.connect() as conn:
        if not is_partitioned(conn):
            return []
        today, have = db_today(conn), set(partitions(conn))
    made = []
    if DEFAULT not in have and make_default(engine):
        made.append(DEFAULT)
    first = since or today
    for n in range((today - first).days + ahead + 1):
        day = first + timedelta(days=n)
        if day_name(day) not in have and make_day(engine, day):
            made.append(day_name(day))
    return made


def make_default(engine: Engine) -> bool:
    with layout_lock(engine) as conn:
        if conn is None:
            return False
        conn.execute(text(f"CREATE TABLE IF NOT EXISTS {DEFAULT} PARTITION OF {TABLE} DEFAULT"))
        return True


def make_day(engine: Engine, day: date) -> bool:
    """Make ``day``'s partition; rows of its range in the default partition move into it
    (PostgreSQL refuses the partition while the default one holds such rows). False when
    the lock was busy."""
    low, high = day_bound(day), day_bound(day + timedelta(days=1))
    try:
        with layout_lock(engine) as conn:
            if conn is None:
                return False
            if day_name(day) in partitions(conn):
                return True
            # Senders wait from here to the commit (milliseconds): one writing a row of
            # this range into the default partition now would make the CREATE fail.
            conn.execute(text(f"LOCK TABLE {TABLE} IN ACCESS EXCLUSIVE MODE"))
            in_range = "msg_id >= CAST(:low AS uuid) AND msg_id < CAST(:high AS uuid)"
            bounds = {"low": str(low), "high": str(high)}
            strays = (
                DEFAULT in partitions(conn)
                and conn.execute(
                    text(f"SELECT EXISTS (SELECT 1 FROM {DEFAULT} WHERE {in_range})"), bounds
                ).scalar()
            )
            if strays:
                conn.execute(
                    text(
                        f"CREATE TEMP TABLE outbox_strays ON COMMIT DROP AS "
                        f"SELECT * FROM {DEFAULT} WHERE {in_range}"
                    ),
                    bounds,
                )
                conn.execute(text(f"DELETE FROM {DEFAULT} WHERE {in_range}"), bounds)
            create_day(conn, day)
            if strays:
                conn.execute(text(f"INSERT INTO {TABLE} SELECT * FROM outbox_strays"))
            return True
    except OperationalError as exc:
        if lock_timed_out(exc):
            return False
        raise


def create_day(conn: Connection, day: date) -> None:
    low, high = day_bound(day), day_bound(day + timedelta(days=1))
    conn.execute(
        text(
            f"CREATE TABLE {day_name(day)} PARTITION OF {TABLE} "
            f"FOR VALUES FROM ('{low}') TO ('{high}')"
        )
    )


def lock_timed_out(exc: OperationalError) -> bool:
    """PostgreSQL's lock_not_available (55P03): a lock_timeout ran out."""
    return getattr(exc.orig, "sqlstate", None) == "55P03"


def drop_expired(engine: Engine, older_than: datetime) -> Dropped:
    """Drop every day partition whose days all end before ``older_than``; the rows
    retention keeps are moved to the default partition first (see the module's text)."""
    dropped = Dropped([], 0, 0, [])
    with engine.connect() as conn:
        if not is_partitioned(conn):
            return dropped
        names = partitions(conn)
    cutoff_day = older_than.astimezone(UTC).date()
    for name in names:
        day = day_of(name)
        if day is None or day + timedelta(days=1) > cutoff_day:
            continue
        done = drop_day(engine, name, older_than)
        if done is None:
            dropped.waiting.append(name)
            continue
        rows, kept = done
        dropped.partitions.append(name)
        dropped = dropped._replace(rows=dropped.rows + rows, kept=dropped.kept + kept)
    return dropped


def kept_rows(name: str) -> str:
    """The rows of partition ``name`` that retention keeps at ``:older_than`` (what
    relay.store.purge_sent would not delete), one branch per status so that each reads
    its partial index (pending, dead, skipped and canceled, sent by sent_at): the move
    runs under the table's lock, and a day's sent rows must not be scanned there."""
    branches = [
        f"status = '{PENDING}' AND deliver_at IS NULL",
        f"status = '{PENDING}' AND deliver_at IS NOT NULL",
        f"status = '{DEAD}'",
        f"status = '{SKIPPED}'",
        f"status = '{SENT}' AND sent_at >= :older_than",
        f"status = '{CANCELED}' AND created_at >= :older_than",
    ]
    return " UNION ALL ".join(f"SELECT * FROM {name} WHERE {where}" for where in branches)


def drop_day(engine: Engine, name: str, older_than: datetime) -> tuple[int, int] | None:
    """Detach and drop one day partition, its kept rows moved to the default partition:
    (settled rows dropped, rows kept), or None when it must wait (its lock was busy, or
    it holds more rows to keep than one short lock should move)."""
    at = {"older_than": older_than}
    with engine.connect() as conn:  # counted before the lock: nobody writes an old day
        total = conn.execute(text(f"SELECT count(*) FROM {name}")).scalar_one()
        keep = conn.execute(text(f"SELECT count(*) FROM ({kept_rows(name)}) k"), at).scalar_one()
    if keep > MOVE_MOST:
        return None
    try:
        with layout_lock(engine) as conn:
            if conn is None:
                return None
            conn.execute(text(f"ALTER TABLE {TABLE} DETACH PARTITION {name}"))
            kept = conn.execute(text(f"INSERT INTO {TABLE} {kept_rows(name)}"), at).rowcount
            conn.execute(text(f"DROP TABLE {name}"))
            return total - kept, kept
    except OperationalError as exc:
        if lock_timed_out(exc):
            return None
        raise


def index_defs(conn: Connection, table: str) -> list[tuple[str, str]]:
    """(name, definition) of ``table``'s indexes that no constraint owns."""
    rows = conn.execute(
        text(
            "SELECT c.relname, pg_get_indexdef(i.indexrelid) FROM pg_index i "
            "JOIN pg_class c ON c.oid = i.indexrelid WHERE i.indrelid = to_regclass(:t) "
            "AND NOT EXISTS (SELECT 1 FROM pg_constraint k WHERE k.conindid = i.indexrelid) "
            "ORDER BY c.relname"
        ),
        {"t": table},
    )
    return [(name, sql) for name, sql in rows]


def index_on(sql: str, table: str) -> str:
    """An index's definition, made on ``table`` instead (and cascading to partitions)."""
    match = INDEX_DEF.match(sql)
    if match is None:
        raise PartitionError(f"cannot read the index definition {sql!r}")
    unique, name, _, _, rest = match.groups()
    return f"CREATE {unique or ''}INDEX {name} ON {table} {rest}"


def convert(
    engine: Engine,
    partitioned: bool = True,
    batch: int = COPY_BATCH,
    on_batch: Callable[[int], None] | None = None,
) -> Converted:
    """Give ``outbox_message`` the partitioned layout (or, ``partitioned=False``, back the
    plain one) while senders go on; resumes an interrupted conversion first."""
    with engine.connect() as conn:
        if not supported(conn):
            raise PartitionError(
                f"a partitioned outbox is PostgreSQL only, not {dialect_for(conn).name}: there "
                "retention deletes in batches (docs/operations.md, retention)"
            )
        changed = is_partitioned(conn) != partitioned
        pending_copy = conn.execute(text("SELECT to_regclass(:t)"), {"t": LEGACY}).scalar()
    if pending_copy is not None and changed:
        raise PartitionError(
            f"{LEGACY} is still being copied from: run the same conversion again to finish "
            "it before converting back"
        )
    moved = swap(engine, partitioned) if changed else 0
    if partitioned:
        ensure(engine, since=oldest_day(engine))
    copied = copy_legacy(engine, batch, on_batch)
    return Converted(changed, moved, copied)


def swap(engine: Engine, partitioned: bool) -> int:
    """Under one short lock: the old table becomes ``LEGACY``, a new empty one (with the
    same columns, constraints and indexes, and ids going on from the old ones) takes its
    name, the old table's unsettled rows (pending, dead) move in. The moved count."""
    with engine.begin() as conn:
        conn.execute(text(f"SET LOCAL lock_timeout = {LOCK_TIMEOUT_MS * 5}"))
        conn.execute(text(f"LOCK TABLE {TABLE} IN ACCESS EXCLUSIVE MODE"))
        defs = index_defs(conn, TABLE)
        set_aside(conn, defs)
        layout = " PARTITION BY RANGE (msg_id)" if partitioned else ""
        conn.execute(
            text(
                f"CREATE TABLE {TABLE} (LIKE {LEGACY} INCLUDING DEFAULTS INCLUDING IDENTITY "
                f"INCLUDING CONSTRAINTS INCLUDING STORAGE){layout}"
            )
        )
        primary = "id, msg_id" if partitioned else "id"  # a partitioned key holds msg_id
        conn.execute(text(f"ALTER TABLE {TABLE} ADD CONSTRAINT pk_{TABLE} PRIMARY KEY ({primary})"))
        conn.execute(text(f"ALTER TABLE {TABLE} ADD CONSTRAINT uq_{TABLE}_msg_id UNIQUE (msg_id)"))
        for _, sql in defs:
            conn.execute(text(index_on(sql, TABLE)))
        next_id = conn.execute(text(f"SELECT coalesce(max(id), 0) + 1 FROM {LEGACY}")).scalar_one()
        sequence = conn.execute(text(f"SELECT pg_get_serial_sequence('{LEGACY}', 'id')")).scalar()
        if sequence is not None:  # ids rolled back are taken too: start after the sequence
            last = conn.execute(text(f"SELECT last_value FROM {sequence}")).scalar_one()
            next_id = max(next_id, int(last) + 1)
        conn.execute(text(f"ALTER TABLE {TABLE} ALTER COLUMN id RESTART WITH {int(next_id)}"))
        if partitioned:  # today's rows and the next days' have their partition at once
            conn.execute(text(f"CREATE TABLE {DEFAULT} PARTITION OF {TABLE} DEFAULT"))
            today = db_today(conn)
            for n in range(DAYS_AHEAD + 1):
                create_day(conn, today + timedelta(days=n))
        moved = conn.execute(
            text(
                f"INSERT INTO {TABLE} SELECT * FROM {LEGACY} WHERE status IN ('{PENDING}', 'dead')"
            )
        ).rowcount
        return int(moved)


def set_aside(conn: Connection, defs: list[tuple[str, str]]) -> None:
    """Rename the table, its constraints, indexes and id sequence out of the way."""
    sequence = conn.execute(text(f"SELECT pg_get_serial_sequence('{TABLE}', 'id')")).scalar()
    conn.execute(text(f"ALTER TABLE {TABLE} RENAME TO {LEGACY}"))
    for constraint in (f"pk_{TABLE}", f"uq_{TABLE}_msg_id"):
        conn.execute(
            text(f"ALTER TABLE {LEGACY} RENAME CONSTRAINT {constraint} TO {constraint}_old")
        )
    for name, _ in defs:
        conn.execute(text(f"ALTER INDEX {name} RENAME TO {name[:59]}_old"))
    if sequence is not None:
        conn.execute(text(f"ALTER SEQUENCE {sequence} RENAME TO {LEGACY}_id_seq"))


def oldest_day(engine: Engine) -> date | None:
    """The day of the oldest row still to copy (the first by id), so that its day and the
    later ones have partitions before the copy; None when nothing is left to copy."""
    with engine.connect() as conn:
        if conn.execute(text("SELECT to_regclass(:t)"), {"t": LEGACY}).scalar() is None:
            return None
        first: datetime | None = conn.execute(
            text(f"SELECT created_at FROM {LEGACY} ORDER BY id LIMIT 1")
        ).scalar()
    if first is None:
        return None
    return max(first.astimezone(UTC).date(), datetime.now(UTC).date() - timedelta(DAYS_BACK))


def copy_legacy(engine: Engine, batch: int, on_batch: Callable[[int], None] | None) -> int:
    """Copy ``LEGACY``'s settled rows in batches by id (each its own transaction), then
    drop it; resumable: a row copied before is skipped."""
    with engine.connect() as conn:
        if conn.execute(text("SELECT to_regclass(:t)"), {"t": LEGACY}).scalar() is None:
            return 0
        top = conn.execute(text(f"SELECT coalesce(max(id), 0) FROM {LEGACY}")).scalar_one()
    copied, after = 0, 0
    while after < top:
        with engine.begin() as conn:
            done = conn.execute(
                text(
                    f"INSERT INTO {TABLE} SELECT * FROM {LEGACY} WHERE id > :a AND id <= :b "
                    f"AND status NOT IN ('{PENDING}', 'dead') ON CONFLICT DO NOTHING"
                ),
                {"a": after, "b": after + batch},
            ).rowcount
        copied, after = copied + done, after + batch
        if done and on_batch is not None:
            on_batch(done)
    with engine.begin() as conn:
        conn.execute(text(f"DROP TABLE {LEGACY}"))
    return copied
