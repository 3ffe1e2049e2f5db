"""Holds each session's messages in memory until its transaction's fate is known.

Nothing reaches the relay before COMMIT: a message is attached to the (nested)
transaction it was written in, dropped if that savepoint or the whole transaction
rolls back, and handed on only when the outermost transaction commits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sqlalchemy import event
from sqlalchemy.orm import Session, SessionTransaction

from outbox.message import Message

log = logging.getLogger("outbox.tracking")

OnCommit = Callable[[list[Message]], None]


class CommitTracker:
    """One per (session, outbox): the messages written in the session's current transaction."""

    def __init__(self, session: Session, on_commit: OnCommit) -> None:
        self._on_commit = on_commit
        self._pending: list[tuple[SessionTransaction, Message]] = []
        event.listen(session, "after_commit", self._after_commit)
        event.listen(session, "after_soft_rollback", self._after_soft_rollback)
        event.listen(session, "after_transaction_end", self._after_transaction_end)

    def add(self, session: Session, message: Message) -> None:
        current = session.get_nested_transaction() or session.get_transaction()
        assert current is not None, "send() runs inside a transaction"
        self._pending.append((current, message))

    def _after_commit(self, session: Session) -> None:
        if session.get_nested_transaction() is not None:
            return  # a savepoint was released; the outer transaction may still roll back
        messages = [message for _, message in self._pending]
        self._pending.clear()
        if not messages:
            return
        try:
            self._on_commit(messages)
        except Exception:  # the rows are committed; the sweeper will publish them
            log.exception("hand-off of %d committed message(s) failed", len(messages))

    def _after_soft_rollback(self, session: Session, rolled_back: SessionTransaction) -> None:
        self._pending = [
            (trans, message) for trans, message in self._pending if not _within(trans, rolled_back)
        ]

    def _after_transaction_end(self, session: Session, ended: SessionTransaction) -> None:
        if ended.parent is None:
            self._pending.clear()  # closed without commit: nothing may survive into the next


def _within(trans: SessionTransaction | None, ancestor: SessionTransaction) -> bool:
    while trans is not None:
        if trans is ancestor:
            return True
        trans = trans.parent
    return False


def tracker_for(session: Session, key: object, on_commit: OnCommit) -> CommitTracker:
    trackers: dict[Any, CommitTracker] = session.info.setdefault("outbox.trackers", {})
    tracker = trackers.get(key)
    if tracker is None:
        tracker = trackers[key] = CommitTracker(session, on_commit)
    return tracker
