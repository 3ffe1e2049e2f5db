"""Whether a database session is waiting on a lock, asked of the server: a test that
needs one statement blocked behind another waits until the server says so, not a while."""

from __future__ import annotations

from sqlalchemy import Connection, Engine, text
from sqlalchemy.orm import Session


def session_id(conn: Session | Connection) -> int:
    """The server's id of ``conn``'s connection (PostgreSQL's backend pid, MariaDB's
    connection id); the statement also starts its transaction."""
    dialect = conn.get_bind().dialect.name
    sql = "SELECT pg_backend_pid()" if dialect == "postgresql" else "SELECT CONNECTION_ID()"
    return int(conn.execute(text(sql)).scalar_one())


def waits_on_lock(engine: Engine, session: int) -> bool:
    """True while the session ``session`` waits for a row or transaction lock."""
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            sql = "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = :id"
        else:
            sql = (
                "SELECT trx_state = 'LOCK WAIT' FROM information_schema.INNODB_TRX"
                " WHERE trx_mysql_thread_id = :id"
            )
        return bool(conn.execute(text(sql), {"id": session}).scalar())
