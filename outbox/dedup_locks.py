"""MariaDB: transactions sending one ``dedup_key`` wait for each other one at a time.

InnoDB lets several inserts of one key wait behind the transaction holding it; when that
one rolls back it grants their gap locks together, and their inserts then deadlock: one
waiter's whole transaction is rolled back (error 1213), which the app sees from send().
So before inserting a ``dedup_key``'s row a transaction takes a named lock on its
msg_id (``GET_LOCK``), held until its COMMIT or ROLLBACK: at most one waiter reaches the
row, and one waiter alone cannot deadlock. PostgreSQL and SQLite need none of this.

A named lock belongs to the server session, not to the transaction: it is released when
the transaction ends (the Connection's commit or rollback, or the pool's reset of the
connection), just before the end itself. The next waiter then waits on the row for that
instant, alone.
"""

from __future__ import annotations

import uuid
import weakref
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, Engine, event
from sqlalchemy.orm import Session

from outbox.errors import OutboxError
from outbox.message import Message

HELD = "outbox_dedup_locks"  # the pooled connection's info: names of the locks it holds
DEDUP_UUID_VERSION = 5  # send(dedup_key=...) makes a UUIDv5; every other msg_id is a v7
_watched: weakref.WeakSet[Engine] = weakref.WeakSet()


class DedupWaitTimeout(OutboxError):
    """Another transaction sending the same (topic, dedup_key) held it past the lock wait."""


def lock_dedup_keys(conn: Session | Connection, messages: Sequence[Message]) -> None:
    """Take the named locks of ``messages``' dedup msg_ids in ``conn``'s transaction, in
    one statement and a fixed order (two transactions' keys never wait in a cycle here);
    they wait as long as a row lock would (``innodb_lock_wait_timeout``)."""
    names = sorted({lock_name(m.msg_id) for m in messages if is_dedup(m.msg_id)})
    if not names:
        return
    connection = conn.connection() if isinstance(conn, Session) else conn
    held: set[str] = connection.connection.info.setdefault(HELD, set())
    wanted = [n for n in names if n not in held]
    if not wanted:
        return
    watch(connection.engine)
    calls = ", ".join("GET_LOCK(%s, @@innodb_lock_wait_timeout)" for _ in wanted)
    got = connection.exec_driver_sql(f"SELECT {calls}", tuple(wanted)).one()
    held.update(n for n, ok in zip(wanted, got, strict=True) if ok == 1)
    if any(ok != 1 for ok in got):
        raise DedupWaitTimeout(
            "dedup_key: another transaction sending the same (topic, dedup_key) held it "
            "longer than innodb_lock_wait_timeout"
        )


def is_dedup(msg_id: str) -> bool:
    return uuid.UUID(msg_id).version == DEDUP_UUID_VERSION


def lock_name(msg_id: str) -> str:
    return "outbox_dedup." + uuid.UUID(msg_id).hex  # 45 characters: the limit is 64


def watch(engine: Engine) -> None:
    """Release the locks whenever a transaction of ``engine`` ends (registered once)."""
    if engine in _watched:
        return
    event.listen(engine, "commit", _released_by_connection)
    event.listen(engine, "rollback", _released_by_connection)
    event.listen(engine.pool, "reset", _released_by_pool)
    _watched.add(engine)


def _released_by_connection(conn: Connection) -> None:
    record = conn.connection
    release(record.dbapi_connection, record.info)


def _released_by_pool(dbapi_connection: Any, record: Any, reset_state: object) -> None:
    release(dbapi_connection, record.info)


def release(dbapi_connection: Any, info: dict[Any, Any]) -> None:
    names = info.pop(HELD, None)
    if not names or dbapi_connection is None:
        return
    calls = ", ".join("RELEASE_LOCK(%s)" for _ in names)
    try:
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"DO {calls}", tuple(names))
        finally:
            cursor.close()
    except Exception:  # a broken connection: the server ended its locks with it
        pass
