"""The sweeper: publishes what the fast path did not, from the table.

It takes pending rows older than ``sweeper_age_s`` (10 s, by the database clock) that
are due, oldest first, locked with SKIP LOCKED so that any number of sweepers, in
apps and in ``outbox relay`` workers, share the work without a coordinator. A row
that fails is retried later with exponential backoff and jitter, and is marked
``dead`` after ``max_attempts``; a failing row never holds back the rows beside it.

Delivery is at least once: if the process dies between publishing and committing
the marks, the rows stay pending and are published again (JetStream drops the copy
by ``Nats-Msg-Id`` within its duplicate window).
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine, Row

from outbox.config import Settings
from outbox.message import Message
from outbox.table import DEAD, PENDING
from relay import store
from relay.brokers.base import PublishResult, retry
from relay.loop import BrokerLoop

log = logging.getLogger("relay.sweeper")


@dataclass
class SweepResult:
    claimed: int = 0
    sent: int = 0
    failed: int = 0  # scheduled for another attempt
    dead: int = 0

    def __iadd__(self, other: SweepResult) -> SweepResult:
        self.claimed += other.claimed
        self.sent += other.sent
        self.failed += other.failed
        self.dead += other.dead
        return self


class Sweeper:
    def __init__(self, engine: Engine, relay: BrokerLoop, settings: Settings | None = None) -> None:
        self.engine = engine
        self.relay = relay
        self.settings = settings or Settings()
        self.totals = SweepResult()
        self._totals_lock = threading.Lock()

    def sweep_once(self, min_age_s: float | None = None, due_only: bool = True) -> SweepResult:
        """Claim one batch, publish it, record the outcome; all in one transaction."""
        age = self.settings.sweeper_age_s if min_age_s is None else min_age_s
        with self.engine.begin() as conn:
            now = store.db_clock(conn)
            claim = store.claim_due_stmt(
                now - timedelta(seconds=age), now, self.settings.sweep_batch, due_only
            )
            rows = conn.execute(claim).all()
            if not rows:
                return SweepResult()
            results = self._publish([message_of(row) for row in rows])
            result = self._record(conn, rows, results, now)
        log.info(
            "sweep: claimed=%d sent=%d retry_later=%d dead=%d",
            result.claimed, result.sent, result.failed, result.dead,
        )  # fmt: skip
        with self._totals_lock:
            self.totals += result
        return result

    def sweep(
        self,
        concurrency: int = 1,
        min_age_s: float | None = None,
        due_only: bool = True,
        on_batch: Callable[[int], None] | None = None,
    ) -> SweepResult:
        """Sweep until no full batch is left, with ``concurrency`` sweeps side by side."""

        def loop() -> SweepResult:
            done = SweepResult()
            while True:
                batch = self.sweep_once(min_age_s, due_only)
                done += batch
                if on_batch is not None and batch.claimed:
                    on_batch(batch.claimed)
                if batch.claimed < self.settings.sweep_batch:
                    return done

        if concurrency == 1:
            return loop()
        total = SweepResult()
        with ThreadPoolExecutor(concurrency, thread_name_prefix="outbox-sweep") as pool:
            for part in [pool.submit(loop) for _ in range(concurrency)]:
                total += part.result()
        return total

    def purge(self) -> int:
        """Delete sent rows older than the retention period, in bounded batches."""
        purged = 0
        while True:
            with self.engine.begin() as conn:
                cutoff = store.db_clock(conn) - timedelta(seconds=self.settings.retention_s)
                deleted = store.purge_sent(conn, cutoff, self.settings.purge_batch)
            purged += deleted
            if deleted < self.settings.purge_batch:
                if purged:
                    log.info("retention: purged=%d", purged)
                return purged

    def _publish(self, messages: list[Message]) -> list[PublishResult]:
        try:
            return self.relay.submit(self.relay.broker.publish(messages)).result(
                self.settings.publish_timeout_s
            )
        except Exception as exc:  # timeout or adapter bug: every row gets another attempt
            log.warning("sweep publish of %d message(s) failed: %r", len(messages), exc)
            return [retry(f"publish failed: {exc!r}") for _ in messages]

    def _record(
        self,
        conn: Connection,
        rows: Sequence[Row[Any]],
        results: list[PublishResult],
        now: datetime,
    ) -> SweepResult:
        acks = [
            (str(row.msg_id), r.receipt or "") for row, r in zip(rows, results, strict=True) if r.ok
        ]
        failures = [
            self._failure(row, r, now) for row, r in zip(rows, results, strict=True) if not r.ok
        ]
        if acks:
            store.finish(conn, acks, self.settings.mark_mode)
        if failures:
            conn.execute(store.record_failures_stmt(), failures)
        dead = sum(1 for f in failures if f["new_status"] == DEAD)
        return SweepResult(len(rows), len(acks), len(failures) - dead, dead)

    def _failure(self, row: Row[Any], result: PublishResult, now: datetime) -> dict[str, Any]:
        attempts = row.attempts + 1
        status = DEAD if attempts >= self.settings.max_attempts else PENDING
        return {
            "row_id": row.id,
            "error": f"{result.outcome.value}: {result.error}"[:2000],
            "next_at": now + timedelta(seconds=self.backoff(attempts)),
            "new_status": status,
        }

    def backoff(self, attempts: int) -> float:
        """Seconds before the next attempt: doubling from the base, capped, with jitter."""
        ceiling = min(
            self.settings.backoff_cap_s, self.settings.backoff_base_s * 2 ** (attempts - 1)
        )
        return float(ceiling * random.uniform(0.5, 1.0))


def message_of(row: Row[Any]) -> Message:
    return Message(
        msg_id=str(row.msg_id),
        topic=row.topic,
        payload=bytes(row.payload),
        key=row.key,
        tags=row.tags,
        headers=dict(row.headers or {}),
        attempts=row.attempts,
    )
