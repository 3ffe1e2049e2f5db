"""Marking: publish outcomes turned into row updates, written once for both paths.

An acked row is marked sent (or deleted: ``mark_mode="delete"``); a failed one gets
attempts + 1, its error, and its next attempt after a backoff with jitter, or is marked
dead once its attempts are spent. The fast path's ack batcher (relay.fastpath.acks)
groups acks across time, one statement per batch, each its own transaction; the sweeper
(relay.sweep.sweeper) marks its claimed batch inside the claim's transaction. Both build
their updates with ``Marks`` and write them with ``write``; the listeners hear a batch's
``BatchReport`` once its marks have committed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from sqlalchemy import Connection

from outbox.broker import Outcome, PublishResult
from outbox.events import Failed, Sent
from outbox.settings import Settings
from outbox.table import DEAD, PENDING
from relay import store
from relay.fastpath.batches import BatchReport

Ack = tuple[Any, str]  # (msg_id, receipt), or (row id, receipt) for a claimed row
ERROR_CHARS = 2000  # of a failure's text kept in the row


def acks_of(batch: Sequence[Sent]) -> list[Ack]:
    """The fast path's acks: its rows are known by msg_id."""
    return [(sent.msg_id, sent.receipt) for sent in batch]


class Retries:
    """When a failed row gives up (dead) and how long it waits for its next attempt."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def gives_up(self, outcome: Outcome, attempt: int) -> bool:
        """Whether a failed ``attempt`` (1 for the first) marks the row dead: a permanent
        failure after ``permanent_attempts``, any failure after ``max_attempts``."""
        if outcome is Outcome.PERMANENT and attempt >= self.settings.permanent_attempts:
            return True
        return attempt >= self.settings.max_attempts

    def backoff(self, attempts: int) -> float:
        """Seconds before the next attempt: doubling from the base, capped, with jitter."""
        ceiling = min(
            self.settings.backoff_cap_s, self.settings.backoff_base_s * 2 ** (attempts - 1)
        )
        return float(ceiling * random.uniform(0.5, 1.0))


class Marks:
    """One batch's row updates, added outcome by outcome, and the report its listeners
    hear once the updates have committed."""

    __slots__ = ("acks", "failures", "report", "retries")

    def __init__(self, retries: Retries) -> None:
        self.retries = retries
        self.acks: list[Ack] = []
        self.failures: list[dict[str, Any]] = []
        self.report = BatchReport()

    def add(
        self, row_id: int, msg_id: str, topic: str, attempts: int, result: PublishResult
    ) -> None:
        """The outcome of one row's publish (``attempts``: the failures recorded before)."""
        if result.ok:
            self.report.sent.append(Sent(msg_id, topic, result.receipt or ""))
            self.acks.append((row_id, result.receipt or ""))
            return
        error = f"{result.outcome.value}: {result.error}"[:ERROR_CHARS]
        failed = Failed(msg_id, topic, attempts + 1, error)
        dead = self.retries.gives_up(result.outcome, failed.attempt)
        (self.report.dead if dead else self.report.retried).append(failed)
        self.failures.append(
            {
                "row_id": row_id,
                "error": failed.error,
                "backoff_s": self.retries.backoff(failed.attempt),
                "new_status": DEAD if dead else PENDING,
            }
        )

    def write(self, conn: Connection, mode: str) -> int:
        """Write them in ``conn``'s transaction (rows known by id); how many were marked sent."""
        return write(conn, self.acks, mode, self.failures, by_row_id=True)


def write(
    conn: Connection,
    acks: Sequence[Ack],
    mode: str,
    failures: Sequence[dict[str, Any]] = (),
    by_row_id: bool = False,
) -> int:
    """Mark (or delete) the acked rows and record the failed ones; returns how many
    acked rows changed (a row settled meanwhile, by another sweeper or an operator, is
    left as it is)."""
    changed = store.finish(conn, acks, mode, by_row_id=by_row_id) if acks else 0
    if failures:
        now = store.db_clock(conn)  # after the publish: backoff counts from the failure
        updates = [
            {k: v for k, v in f.items() if k != "backoff_s"}
            | {"next_at": now + timedelta(seconds=f["backoff_s"])}
            for f in failures
        ]
        conn.execute(store.record_failures_stmt(), updates)
    return changed
