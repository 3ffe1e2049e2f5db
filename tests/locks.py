"""Whether a database session is waiting on a lock, asked of the server: a test that
needs one statement blocked behind another waits until the server says so, not a while."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, Engine, text
from sqlalchemy.orm import Session

from tests.helpers import wait_until


def session_id(conn: Session | Connection) -> int:
    """The server's id of ``conn``'s connection (PostgreSQL's backend pid, MariaDB's
    connection id); the statement also starts its transaction."""
    dialect = conn.get_bind().dialect.name
    sql = "SELECT pg_backend_pid()" if dialect == "postgresql" else "SELECT CONNECTION_ID()"
    return int(conn.execute(text(sql)).scalar_one())


def waits_on_lock(engine: Engine, session: int) -> bool:
    """True while the session ``session`` waits for a row or transaction lock (or, on
    MariaDB, a named lock: a dedup_key's, outbox.dedup_locks)."""
    with engine.connect() as conn:
        if engine.dialect.name != "postgresql":
            return session in innodb_lock_waits(conn) or waits_on_named_lock(conn, session)
        sql = "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = :id"
        return bool(conn.execute(text(sql), {"id": session}).scalar())


def waits_on_named_lock(conn: Connection, session: int) -> bool:
    """Whether MariaDB's session ``session`` waits in GET_LOCK (its state "User lock")."""
    sql = "SELECT STATE FROM information_schema.PROCESSLIST WHERE ID = :id"
    return conn.execute(text(sql), {"id": session}).scalar() == "User lock"


def innodb_lock_waits(conn: Connection) -> set[int]:
    """MariaDB's sessions waiting for a lock, from SHOW ENGINE INNODB STATUS (made afresh
    for each call). Not INFORMATION_SCHEMA.INNODB_TRX: a cache InnoDB refreshes only after
    0.1 s without a reader, which two test workers polling it may never leave it."""
    status = str(conn.execute(text("SHOW ENGINE INNODB STATUS")).one()[2])
    waiting = set()
    for block in status.split("---TRANSACTION ")[1:]:
        thread = re.search(r"thread id (\d+),", block)
        if thread and "LOCK WAIT" in block:
            waiting.add(int(thread[1]))
    return waiting


@contextmanager
def blocked_on_lock(engine: Engine, work: Callable[[Session], object], what: str) -> Iterator[Any]:
    """Run ``work(session)`` in its own transaction on a thread; enter once the server says
    it waits on a lock (and it has not finished). The caller then releases the lock; on
    leaving, the thread is joined and ``result["value"]`` holds what ``work`` returned (its
    error is raised instead)."""
    result: dict[str, Any] = {}
    ready = threading.Event()

    def run() -> None:
        try:
            with Session(engine) as session, session.begin():
                result["session"] = session_id(session)
                ready.set()
                result["value"] = work(session)
        except BaseException as exc:  # reported by the test's thread
            result["error"] = exc
            ready.set()

    thread = threading.Thread(target=run)
    thread.start()
    try:
        assert ready.wait(60)
        wait_until(
            lambda: "error" in result or waits_on_lock(engine, result["session"]),
            what=what,
        )
        assert "value" not in result and "error" not in result, result
        yield result
    finally:
        thread.join(60)
    if "error" in result:
        raise result["error"]
