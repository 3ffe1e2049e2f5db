"""Several transactions sending one (topic, dedup_key) at once, on every database server.

The first holds its row; the others wait for its end. If it commits they write nothing
and return its msg_id; if it rolls back exactly one of them writes its own row and the
rest then find that one. No waiter sees an error: on MariaDB a bug looks like
``OperationalError 1213 Deadlock found`` from a waiter's send() (InnoDB grants the
waiters' gap locks together when the first rolls back, then their inserts deadlock).
"""

from __future__ import annotations

import uuid
from contextlib import ExitStack
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, select, text
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from outbox import Outbox, outbox_message
from tests.locks import blocked_on_lock

t = outbox_message
WAITERS = 3


def rows(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(t.c.msg_id, t.c.payload)).all())


@pytest.mark.parametrize("first_commits", [True, False], ids=["commit", "rollback"])
def test_waiters_of_one_dedup_key_get_the_documented_outcome(
    server_db: Engine, first_commits: bool
) -> None:
    ob = Outbox(server_db)
    with Session(server_db) as first:
        first.begin()
        msg_id = ob.send(first, "r", b"first", dedup_key="k", delay=60)
        with ExitStack() as waiting:
            waiters = [
                waiting.enter_context(
                    blocked_on_lock(
                        server_db,
                        lambda s, i=i: ob.send(s, "r", b"w%d" % i, dedup_key="k", delay=60),
                        f"waiter {i} behind the first transaction",
                    )
                )
                for i in range(WAITERS)
            ]
            first.commit() if first_commits else first.rollback()
    assert [w["value"] for w in waiters] == [msg_id] * WAITERS
    [(row_id, payload)] = rows(server_db)
    assert str(row_id if isinstance(row_id, uuid.UUID) else uuid.UUID(bytes=row_id)) == msg_id
    if first_commits:
        assert payload == b"first"
    else:
        assert payload in {b"w%d" % i for i in range(WAITERS)}


@pytest.mark.parametrize("end", ["commit", "rollback", "close"])
def test_a_dedup_send_holds_nothing_after_its_transaction(server_db: Engine, end: str) -> None:
    """Whatever ends the transaction (commit, rollback, a close that rolls back), another
    connection sending the same dedup_key at once does not wait: a lock the send took
    for the key (MariaDB) ended with the transaction. A leaked one times out here."""
    ob = Outbox(server_db)
    session = Session(server_db)
    session.begin()
    ob.send(session, "r", b"a", dedup_key="a", delay=60)
    getattr(session, end)()
    other_engine = create_engine(server_db.url, poolclass=NullPool)
    try:
        with Session(other_engine) as other, other.begin():
            other.execute(text(QUICK_LOCK_WAIT[server_db.dialect.name]))
            ob.send(other, "r", b"b", dedup_key="a", delay=60)
    finally:
        other_engine.dispose()
    assert len(rows(server_db)) == 1


QUICK_LOCK_WAIT = {
    "postgresql": "SET LOCAL lock_timeout = '1s'",
    "mysql": "SET SESSION innodb_lock_wait_timeout = 1",
    "mariadb": "SET SESSION innodb_lock_wait_timeout = 1",
}
