"""Migration 0003: MariaDB rows written on the old session-local clock become UTC."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta

import pytest
from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.pool import NullPool

from outbox import migrate
from outbox.errors import ConfigError
from tests.migration.test_model_b_branch import at_old_0002

ZONE_ENV = "OUTBOX_MIGRATE_FROM_TIME_ZONE"
HOUR = timedelta(hours=1)


def in_zone(url: str, zone: str) -> Engine:
    """An engine whose every connection runs ``SET time_zone = zone``."""
    engine = create_engine(url, poolclass=NullPool)

    @event.listens_for(engine, "connect")
    def set_zone(dbapi_conn: object, record: object) -> None:
        cursor = dbapi_conn.cursor()  # type: ignore[attr-defined]
        cursor.execute("SET time_zone = %s", (zone,))
        cursor.close()

    return engine


@pytest.fixture
def at_0002(mariadb_url: str) -> Iterator[Engine]:
    """A MariaDB database at revision 0002 (model B's table included, as 0002 made it then)
    and an app engine in +01:00 writing to it."""
    at_old_0002(mariadb_url)
    engine = in_zone(mariadb_url, "+01:00")
    yield engine
    engine.dispose()


def write_old_rows(conn: Connection) -> None:
    """One message and one model-B record as 0002 wrote them: created_at by the app's
    session (its local time), sent_at and next_attempt_at by a relay's session in the
    server's global zone (UTC on the test server)."""
    conn.execute(
        text(
            "INSERT INTO outbox_message (msg_id, topic, payload, status, sent_at, next_attempt_at)"
            " VALUES (:m, 't.a', 'x', 'sent', UTC_TIMESTAMP(6),"
            " UTC_TIMESTAMP(6) + INTERVAL 5 SECOND)"
        ),
        {"m": uuid.uuid4().hex},
    )
    conn.execute(
        text(
            "INSERT INTO outbox_transaction_record (transaction_id, producer_group, msg_id)"
            " VALUES ('tx1', 'g', :m)"
        ),
        {"m": uuid.uuid4().hex},
    )


def stored_times(engine: Engine) -> list[datetime]:
    """The raw DATETIME values (naive), whatever the column type makes of them."""
    with engine.connect() as conn:
        message = conn.execute(
            text("SELECT created_at, sent_at, next_attempt_at FROM outbox_message")
        ).one()
        record = conn.execute(
            text("SELECT created_at FROM outbox_transaction_record WHERE transaction_id = 'tx1'")
        ).one()
    return [*message, *record]


def created_default(engine: Engine, table: str) -> str:
    with engine.connect() as conn:
        return str(
            conn.execute(
                text(
                    "SELECT column_default FROM information_schema.columns WHERE"
                    " table_schema = DATABASE() AND table_name = :t AND column_name = 'created_at'"
                ),
                {"t": table},
            ).scalar_one()
        ).lower()


def test_rows_written_in_plus_one_become_utc_and_back(
    at_0002: Engine, mariadb_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with at_0002.begin() as conn:
        write_old_rows(conn)
        utc_then = conn.execute(text("SELECT UTC_TIMESTAMP(6)")).scalar_one()
    local = stored_times(at_0002)
    assert abs(local[0] - HOUR - utc_then) < timedelta(seconds=30), "written in +01:00"

    monkeypatch.setenv(ZONE_ENV, "+01:00")
    migrate.upgrade(mariadb_url)
    app_written = (True, False, False, True)  # created_at, sent_at, next_attempt_at, record
    moved = [t - HOUR if app else t for t, app in zip(local, app_written, strict=True)]
    assert stored_times(at_0002) == moved, "the app's times from +01:00, the relay's kept"
    for table in ("outbox_message", "outbox_transaction_record"):
        assert created_default(at_0002, table) == "utc_timestamp(6)"
    with at_0002.begin() as conn:  # a new row from the same +01:00 session is UTC now
        conn.execute(
            text(
                "INSERT INTO outbox_transaction_record (transaction_id, producer_group, msg_id)"
                " VALUES ('tx2', 'g', :m)"
            ),
            {"m": uuid.uuid4().hex},
        )
        fresh, utc_now = conn.execute(
            text(
                "SELECT created_at, UTC_TIMESTAMP(6) FROM outbox_transaction_record"
                " WHERE transaction_id = 'tx2'"
            )
        ).one()
    assert abs(fresh - utc_now) < timedelta(seconds=30)

    migrate.downgrade(mariadb_url, "0002")
    assert created_default(at_0002, "outbox_message") == "current_timestamp(6)"
    assert stored_times(at_0002) == local, "back in the writers' zone"


def test_a_utc_server_rewrites_nothing(at_0002: Engine, mariadb_url: str) -> None:
    """The test server's global zone is UTC: the rows are UTC already and stay as they are."""
    with at_0002.connect() as conn:
        zone = conn.execute(text("SELECT @@global.time_zone, @@system_time_zone")).one()
    assert zone[0] in ("+00:00", "UTC") or (zone[0] == "SYSTEM" and zone[1] == "UTC"), zone
    with at_0002.begin() as conn:
        write_old_rows(conn)
    before = stored_times(at_0002)
    migrate.upgrade(mariadb_url)
    assert stored_times(at_0002) == before
    assert created_default(at_0002, "outbox_message") == "utc_timestamp(6)"


@pytest.mark.parametrize("zone", ["Mars/Olympus_Mons", "+01:00'; DROP TABLE outbox_message; --"])
def test_an_unknown_zone_is_refused_before_any_row_changes(
    at_0002: Engine, mariadb_url: str, monkeypatch: pytest.MonkeyPatch, zone: str
) -> None:
    with at_0002.begin() as conn:
        write_old_rows(conn)
    before = stored_times(at_0002)
    monkeypatch.setenv(ZONE_ENV, zone)
    with pytest.raises(ConfigError, match=ZONE_ENV):
        migrate.upgrade(mariadb_url)
    assert stored_times(at_0002) == before
    assert migrate.current_revision(mariadb_url) == "0002"


def test_postgresql_and_sqlite_have_nothing_to_convert(pg_url: str, sqlite_url: str) -> None:
    for url in (pg_url, sqlite_url):
        migrate.upgrade(url, "0002")
        migrate.upgrade(url)
        assert migrate.current_revision(url) == "0011"
        migrate.downgrade(url, "0002")
