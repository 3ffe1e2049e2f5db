"""One clock: on MariaDB every time becomes UTC (rows converted, defaults UTC_TIMESTAMP(6)).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-24

Until 0002 the MariaDB default was ``CURRENT_TIMESTAMP(6)`` into a ``DATETIME(6)``: the
writing session's local time, and the relay compared it with its own session's. This
migration converts the stored times to UTC and makes ``UTC_TIMESTAMP(6)`` the default.

What is knowable: a row holds no zone. Each was written in its session's time zone, which
is the server's global one (``@@global.time_zone``, ``SYSTEM`` = the host's zone) unless
the app set another; the conversion assumes that zone. If your apps ran ``SET time_zone``,
name their zone in ``OUTBOX_MIGRATE_FROM_TIME_ZONE`` (e.g. ``+01:00``) for this run: it
applies to what apps wrote (``created_at``); what relays wrote (``sent_at``,
``next_attempt_at``) is taken in the global zone. A
named zone (``Europe/Paris``) needs the server's time zone tables; a local time inside a
DST fall-back hour is ambiguous and MariaDB picks one reading. Every row is rewritten, in
one statement per table: stop writers (apps, relays) while it runs, or a row written
between the conversion and the new default keeps its local time.

PostgreSQL (``timestamptz``) and SQLite (``CURRENT_TIMESTAMP`` is UTC) have nothing to do.
Model B's table is converted where an old 0002 created it; a new one (branch ``modelb``)
is created on UTC.
"""

from __future__ import annotations

import os

import sqlalchemy as sa
from alembic import context, op

from outbox.dialects import dialect_for
from outbox.errors import ConfigError
from outbox.table import db_now, session_now

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

ZONE_ENV = "OUTBOX_MIGRATE_FROM_TIME_ZONE"
# Who wrote each time: the app's session (created_at's default), or the relay's
# (sent_at, next_attempt_at), whose session had the server's global zone.
TIMES = {
    "outbox_message": {"created_at": "app", "next_attempt_at": "relay", "sent_at": "relay"},
    "outbox_transaction_record": {"created_at": "app"},
}
MODEL_B_TABLE = "outbox_transaction_record"
GLOBAL_ZONE = "@@global.time_zone"
UTC = "'+00:00'"


def upgrade() -> None:
    if not dialect_for(op.get_context().dialect).local_session_clock:
        return
    zones = writers_zones()
    for table, writers in present(TIMES).items():
        columns = zoned(writers, zones)
        if columns and on_session_clock(table):  # once: a run that died after the ALTER did them
            convert(table, {c: (zone, UTC) for c, zone in columns.items()})
        set_default(table, db_now())


def downgrade() -> None:
    if not dialect_for(op.get_context().dialect).local_session_clock:
        return
    zones = writers_zones()
    for table, writers in present(TIMES).items():
        columns = zoned(writers, zones)
        if columns and not on_session_clock(table):
            convert(table, {c: (UTC, zone) for c, zone in columns.items()})
        set_default(table, session_now())


def present(tables: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """The tables that exist: model B's is missing unless an old 0002 made it (it has its
    own branch now, created on UTC). Offline, the SQL is for a new database: it has none."""
    if context.is_offline_mode():
        return {t: w for t, w in tables.items() if t != MODEL_B_TABLE}
    inspector = sa.inspect(op.get_bind())
    return {t: w for t, w in tables.items() if inspector.has_table(t)}


def writers_zones() -> dict[str, str | None]:
    """The zone (as SQL) the app's and the relay's old times are in; None where UTC."""
    app = written_zone()
    return {
        "app": None if is_utc(app) else app,
        "relay": None if is_utc(GLOBAL_ZONE) else GLOBAL_ZONE,
    }


def zoned(writers: dict[str, str], zones: dict[str, str | None]) -> dict[str, str]:
    """Each column whose writer's zone is not UTC, with that zone."""
    found = {}
    for column, writer in writers.items():
        if (zone := zones[writer]) is not None:
            found[column] = zone
    return found


def written_zone() -> str:
    """The zone the old rows are in, as SQL (``:zone`` bound by convert): the one named in
    OUTBOX_MIGRATE_FROM_TIME_ZONE, else the server's global zone."""
    source = ":zone" if zone_name() else GLOBAL_ZONE
    if not context.is_offline_mode():
        known = op.get_bind().execute(zone_sql(f"SELECT CONVERT_TZ('2001-01-01', {source}, {UTC})"))
        if known.scalar() is None:
            what = f"{ZONE_ENV}={zone_name()!r}" if zone_name() else GLOBAL_ZONE
            raise ConfigError(
                f"{what}: MariaDB does not know this time zone; give an offset such as "
                f"+01:00 in {ZONE_ENV}, or load the server's time zone tables "
                "(mariadb-tzinfo-to-sql)"
            )
    return source


def is_utc(zone: str) -> bool:
    """Whether times in ``zone`` are UTC already, winter and summer: nothing to rewrite."""
    if context.is_offline_mode():
        return False
    same = " AND ".join(
        f"CONVERT_TZ('{day}', {zone}, {UTC}) = '{day}'" for day in ("2001-01-01", "2001-07-01")
    )
    return bool(op.get_bind().execute(zone_sql(f"SELECT {same}")).scalar())


def zone_name() -> str:
    return os.environ.get(ZONE_ENV, "").strip()


def zone_sql(sql: str) -> sa.TextClause:
    """``sql`` with ``:zone`` bound to OUTBOX_MIGRATE_FROM_TIME_ZONE: never pasted into SQL."""
    return sa.text(sql).bindparams(zone=zone_name()) if ":zone" in sql else sa.text(sql)


def on_session_clock(table: str) -> bool:
    """Whether ``table.created_at`` still has the session-local default (not yet converted)."""
    if context.is_offline_mode():
        return True
    columns = sa.inspect(op.get_bind()).get_columns(table)
    default = next(c["default"] for c in columns if c["name"] == "created_at")
    return str(default).lower().startswith("current_timestamp")


def convert(table: str, columns: dict[str, tuple[str, str]]) -> None:
    """One UPDATE of ``table``: each column from its source zone to its target zone."""
    sets = ", ".join(f"{c} = CONVERT_TZ({c}, {a}, {b})" for c, (a, b) in columns.items())
    op.execute(zone_sql(f"UPDATE {table} SET {sets}"))


def set_default(table: str, default: db_now) -> None:
    # Only the default (ALTER COLUMN ... SET DEFAULT): metadata, no copy of the table.
    op.alter_column(table, "created_at", server_default=default)
