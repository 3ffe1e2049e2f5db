"""Holds each session's messages in memory until its transaction's fate is known.

Nothing reaches the relay before COMMIT: a message is attached to the (nested)
transaction it was written in, dropped if that savepoint or the whole transaction
rolls back, and handed on only when the outermost transaction commits.

Messages sent through an AsyncSession cannot be written by send() (it is not
awaited): they are staged here the same way and written by one INSERT just before
the outermost COMMIT, inside it, on the session's own connection.

The listeners are registered once, on the Session class, and cost a dict lookup for
sessions that never sent anything: registering them per session would cost more
than the INSERT of the message itself.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from sqlalchemy import Connection, Engine, event
from sqlalchemy.orm import Session, SessionTransaction

from outbox import rows
from outbox.message import Message
from outbox.table import outbox_message

log = logging.getLogger("outbox.tracking")

# on_commit(messages, certain): certain is False when the commit could not be proven
# from the connection's own state; the relay then re-reads the rows before publishing.
OnCommit = Callable[[list[Message], bool], None]
PENDING_KEY = "outbox.pending"
OUTLOOK_KEY = "outbox.outlook"
STAGED_KEY = "outbox.staged"
CANCELED_KEY = "outbox.canceled"  # staged scheduled messages canceled: (transaction, msg_id)
CONNECTION_KEY = "outbox.connection"  # the transaction's connection, when send() knew it
KEYS = (PENDING_KEY, OUTLOOK_KEY, STAGED_KEY, CANCELED_KEY, CONNECTION_KEY)
CERTAIN, UNCERTAIN, DOOMED = "certain", "uncertain", "doomed"
PG_TRANSACTION_INERROR = 3  # libpq PQTRANS_INERROR: the COMMIT will be a ROLLBACK

_registered = False
_register_lock = threading.Lock()


def _new_register_lock() -> None:
    global _register_lock
    _register_lock = threading.Lock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=_new_register_lock)


def remember(
    session: Session, message: Message, on_commit: OnCommit, conn: Connection | None = None
) -> None:
    """Keep ``message`` until the transaction it was written in commits or rolls back.

    ``conn``: the connection it was written on, the session bound to an Engine; the
    COMMIT's outlook reads it then, without asking the session again."""
    if not _registered:
        _register_listeners()
    current = session.get_nested_transaction() or session.get_transaction()
    assert current is not None, "send() runs inside a transaction"
    info = session.info
    pending: list[tuple[SessionTransaction, Message, OnCommit]]
    pending = info.setdefault(PENDING_KEY, [])
    pending.append((current, message, on_commit))
    if conn is not None and CONNECTION_KEY not in info:
        info[CONNECTION_KEY] = conn


def stage(session: Session, message: Message, on_commit: OnCommit) -> None:
    """Write ``message``'s row just before the outermost COMMIT, unless its transaction
    rolls back."""
    if session.get_transaction() is None:
        session.begin()  # what the first statement would do; send() runs no statement now
    remember(session, message, on_commit)
    current = session.get_nested_transaction() or session.get_transaction()
    staged: list[tuple[SessionTransaction | None, Message]]
    staged = session.info.setdefault(STAGED_KEY, [])
    staged.append((current, message))


def cancel_staged(session: Session, msg_id: str) -> bool:
    """Cancel the staged (not yet written) scheduled message ``msg_id``: True iff one was
    staged and not canceled before. The cancel belongs to the current (nested)
    transaction: a savepoint rolled back undoes it, like an UPDATE."""
    staged = session.info.get(STAGED_KEY) or []
    if not any(m.msg_id == msg_id and m.scheduled for _, m in staged):
        return False
    canceled: list[tuple[SessionTransaction | None, str]]
    canceled = session.info.setdefault(CANCELED_KEY, [])
    if any(done == msg_id for _, done in canceled):
        return False
    canceled.append((session.get_nested_transaction() or session.get_transaction(), msg_id))
    return True


def _drop_canceled(session: Session) -> None:
    """Take the canceled staged messages out: never written, never handed off."""
    canceled = {msg_id for _, msg_id in session.info.pop(CANCELED_KEY, None) or []}
    if not canceled:
        return
    for key in (STAGED_KEY, PENDING_KEY):
        entries = session.info.get(key)
        if entries:
            entries[:] = [e for e in entries if e[1].msg_id not in canceled]


def _before_commit(session: Session) -> None:
    if not _holds_any(session.info):
        return  # a session that sent nothing in this transaction (most of an app's)
    if session.get_nested_transaction() is not None:
        return  # a savepoint is released: its messages are written with the outer COMMIT
    _drop_canceled(session)
    staged = session.info.pop(STAGED_KEY, None)
    if staged:
        conn = rows.flushed_connection(session)  # AUTOCOMMIT refused before the write
        written = rows.write(conn, [message for _, message in staged])
        numbered(session, {m.msg_id: m for m in written if m.seq is not None})
    if session.info.get(PENDING_KEY):
        session.info[OUTLOOK_KEY] = commit_outlook(session)


def numbered(session: Session, by_msg_id: dict[str, Message]) -> None:
    """Hand the relay the staged messages as written: the ordered ones have their seq now."""
    if not by_msg_id:
        return
    pending = session.info.get(PENDING_KEY, [])
    pending[:] = [(t, by_msg_id.get(m.msg_id, m), on) for t, m, on in pending]


def commit_outlook(session: Session) -> str:
    """Will this COMMIT really commit? Judged from the connection, before it is sent.

    PostgreSQL answers COMMIT of an aborted transaction (an error the app caught and
    ignored) with ROLLBACK, and drivers raise nothing; SQLAlchemy then still fires
    after_commit. A session bound to a Connection may only have joined an outer
    transaction that can still roll back: that is "uncertain", checked by the relay.
    """
    conn = session.info.get(CONNECTION_KEY)  # send() wrote on it, bound to an Engine
    if conn is None:
        if not isinstance(session.get_bind(clause=outbox_message), Engine):
            return UNCERTAIN
        conn = session.connection(bind_arguments={"clause": outbox_message})
    driver = conn.connection.driver_connection
    info = getattr(driver, "info", None)  # psycopg 3
    status = getattr(info, "transaction_status", None)
    if status is None and hasattr(driver, "get_transaction_status"):  # psycopg2
        status = driver.get_transaction_status()  # type: ignore[union-attr]
    return DOOMED if status is not None and int(status) == PG_TRANSACTION_INERROR else CERTAIN


def _after_commit(session: Session) -> None:
    if not _holds_any(session.info):
        return
    if session.get_nested_transaction() is not None:
        return  # a savepoint was released; the outer transaction may still roll back
    pending = session.info.pop(PENDING_KEY, None)
    outlook = session.info.pop(OUTLOOK_KEY, UNCERTAIN)
    if not pending:
        return
    if outlook == DOOMED:
        log.warning(
            "COMMIT of an aborted transaction rolled back: %d message(s) dropped", len(pending)
        )
        return
    if len(pending) == 1:  # one message, one target: no grouping
        _hand_off(pending[0][2], [pending[0][1]], outlook == CERTAIN)
        return
    by_target: dict[OnCommit, list[Message]] = {}
    for _, message, on_commit in pending:
        by_target.setdefault(on_commit, []).append(message)
    for on_commit, messages in by_target.items():
        _hand_off(on_commit, messages, outlook == CERTAIN)


def _hand_off(on_commit: OnCommit, messages: list[Message], certain: bool) -> None:
    try:
        on_commit(messages, certain)
    except Exception:  # the rows are committed; the sweeper will publish them
        log.exception("hand-off of %d committed message(s) failed", len(messages))


def _holds_any(info: dict[object, object]) -> bool:
    """Whether the session holds anything of the outbox's (sent, staged or canceled)."""
    return bool(info) and not info.keys().isdisjoint(KEYS)


def _after_soft_rollback(session: Session, rolled_back: SessionTransaction) -> None:
    if not _holds_any(session.info):
        return
    for key in (PENDING_KEY, STAGED_KEY, CANCELED_KEY):
        entries = session.info.get(key)
        if entries:
            entries[:] = [entry for entry in entries if not _within(entry[0], rolled_back)]


def _after_transaction_end(session: Session, ended: SessionTransaction) -> None:
    if ended.parent is None and _holds_any(session.info):
        for key in KEYS:  # closed without commit: nothing survives it
            session.info.pop(key, None)


def _within(trans: SessionTransaction | None, ancestor: SessionTransaction) -> bool:
    while trans is not None:
        if trans is ancestor:
            return True
        trans = trans.parent
    return False


def _register_listeners() -> None:
    global _registered
    with _register_lock:
        if _registered:
            return
        event.listen(Session, "before_commit", _before_commit)
        event.listen(Session, "after_commit", _after_commit)
        event.listen(Session, "after_soft_rollback", _after_soft_rollback)
        event.listen(Session, "after_transaction_end", _after_transaction_end)
        _registered = True
