"""The sweeper: publishes what the fast path did not, from the table.

It takes pending rows older than ``sweeper_age_s`` (10 s, by the database clock) that
are due, oldest first, locked with SKIP LOCKED so that any number of sweepers, in
apps and in ``outbox relay`` workers, share the work without a coordinator. A row
that fails is retried later with exponential backoff and jitter, and is marked
``dead`` after ``max_attempts`` (a permanent failure: after ``permanent_attempts``);
a failing row never holds back the rows beside it.
Listeners (outbox.events.RelayListener) hear each batch's outcomes once it is committed.

Delivery is at least once: if the process dies between publishing and committing
the marks, the rows stay pending and are published again (JetStream drops the copy
by ``Nats-Msg-Id`` within its duplicate window).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

from sqlalchemy import Connection, Engine

from outbox.broker import Outcome, PublishResult, permanent
from outbox.events import Failed, RelayListener, Sent, SweepResult
from outbox.message import Message
from outbox.rows import KnownForms, StoredRow, stored_message
from outbox.settings import Settings
from outbox.table import DEAD, PENDING
from outbox.tracing import publish_span
from relay import store
from relay.batches import BatchReport
from relay.brokers.base import NOT_CONNECTED, publish_isolated
from relay.listener import Listeners
from relay.loop import BrokerLoop

log = logging.getLogger("relay.sweeper")


class Sweeper:
    """Publishes due rows through ``broker_loop`` (started and stopped by its owner).

    A sweep runs on its caller's thread (a scheduled job, ``outbox drain``'s thread or a
    test), so ``start()`` has nothing to do; ``stop(timeout)`` lets the sweeps in hand
    finish their batch, claims no more, and waits for them (relay.part's contract).
    """

    def __init__(
        self,
        engine: Engine,
        broker_loop: BrokerLoop,
        settings: Settings | None = None,
        listener: RelayListener | None = None,
    ) -> None:
        self.engine = engine
        self.broker_loop = broker_loop
        self.settings = settings or Settings()
        self.listeners = Listeners.of(listener)
        self.totals = SweepResult()
        self._totals_lock = threading.Lock()
        self._stopping = threading.Event()
        self._sweeping = 0  # sweep_once calls in progress
        self._sweeping_changed = threading.Condition()
        self.known = KnownForms()
        # One INFO line per batch suits a worker; a command showing progress lowers it.
        self.batch_log_level = logging.INFO

    def sweep_once(
        self, min_age_s: float | None = None, due_only: bool = True, cursor: Cursor | None = None
    ) -> SweepResult:
        """Claim one batch, publish it, record the outcome; all in one transaction.

        When the broker cannot be reached at all (not connected, the publish call
        timed out as a whole, the relay is stopping) the transaction rolls back: an
        outage is not the rows' fault and costs them no attempt. Any other fault is one
        row's: a row that breaks the send() contract (planted by hand or by an older
        version) is recorded as failed without being published, and a message the
        broker or adapter refuses fails alone; the rest of the batch is marked once.
        """
        with self._sweeping_changed:
            self._sweeping += 1
        try:
            return self._sweep_once(min_age_s, due_only, cursor)
        finally:
            with self._sweeping_changed:
                self._sweeping -= 1
                self._sweeping_changed.notify_all()

    def _sweep_once(
        self, min_age_s: float | None, due_only: bool, cursor: Cursor | None
    ) -> SweepResult:
        age = self.settings.sweeper_age_s if min_age_s is None else min_age_s
        started = time.monotonic()
        rows: list[store.Claimed] = []
        try:
            with self.engine.begin() as conn:
                now = store.db_clock(conn)
                claim = store.claim_due_stmt(
                    now - timedelta(seconds=age), now, self.settings.sweep_batch, due_only,
                    after_id=cursor.claimed_up_to if cursor else None,
                )  # fmt: skip
                rows = store.claim(conn, claim)
                if not rows:
                    return SweepResult()
                if cursor is not None:
                    cursor.advance(max(row.id for row in rows))
                big = store.load_payloads(conn, rows)
                prepared = [checked_message(r, big.get(r.id), self.known) for r in rows]
                results = self._publish(prepared)
                report = self._record(conn, rows, results)
        except _BrokerUnreachable as why:
            if self._stopping.is_set():
                log.info("sweep: stopping, batch of %d left pending", len(rows))
            else:
                self.broker_loop.outage.failed(f"{why}; sweep: batch of {len(rows)} left pending")
            return SweepResult(claimed=len(rows), aborted=True)
        if any(isinstance(m, Message) for m in prepared):  # the broker answered
            self.broker_loop.outage.ok()
        result = sweep_result(report)
        log.log(
            self.batch_log_level,
            "sweep: claimed=%d sent=%d retry_later=%d dead=%d",
            result.claimed, result.sent, result.failed, result.dead,
        )  # fmt: skip
        with self._totals_lock:
            self.totals += result
        report.tell(self.listeners, "sweeper")
        self.listeners.swept(result, time.monotonic() - started)
        return result

    def sweep(
        self,
        concurrency: int = 1,
        min_age_s: float | None = None,
        due_only: bool = True,
        on_batch: Callable[[SweepResult], None] | None = None,
    ) -> SweepResult:
        """Sweep until no full batch is left, with ``concurrency`` sweeps side by side.

        Stops early when ``stop()`` was called or the broker is unreachable. With
        ``due_only=False`` (a drain) each row is claimed at most once per call, so a
        failing row is not retried at once and spends no more than one attempt.
        """
        cursor = None if due_only else Cursor()

        def loop() -> SweepResult:
            done = SweepResult()
            while not self._stopping.is_set():
                batch = self.sweep_once(min_age_s, due_only, cursor)
                done += batch
                if on_batch is not None and batch.claimed and not batch.aborted:
                    on_batch(batch)
                if batch.aborted or batch.claimed < self.settings.sweep_batch:
                    break
            return done

        if concurrency == 1:
            return loop()
        total = SweepResult()
        with ThreadPoolExecutor(concurrency, thread_name_prefix="outbox-sweep") as pool:
            for part in [pool.submit(loop) for _ in range(concurrency)]:
                total += part.result()
        return total

    def start(self) -> None:
        """Nothing to start: sweeps run on their callers' threads."""

    def stop(self, timeout: float = 5.0) -> bool:
        """Finish the batches in hand, claim no more; True once none is left in hand
        (within ``timeout``). Idempotent, from any thread."""
        self._stopping.set()
        with self._sweeping_changed:
            return self._sweeping_changed.wait_for(lambda: self._sweeping == 0, timeout)

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

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

    def _publish(self, prepared: list[Message | PublishResult]) -> list[PublishResult]:
        """One result per row (the broker's, or the row's own refusal); _BrokerUnreachable
        when the broker could not be asked at all."""
        messages = [m for m in prepared if isinstance(m, Message)]
        if not messages:
            return [r for r in prepared if isinstance(r, PublishResult)]
        if self._stopping.is_set() or not self.broker_loop.running:
            raise _BrokerUnreachable("stopping" if self._stopping.is_set() else "loop stopped")
        loop = self.broker_loop
        try:
            with publish_span(messages):
                answers = loop.submit(publish_isolated(loop.broker, messages))
                results = answers.result(self.settings.publish_timeout_s)
        except Exception as exc:  # timeout, loop closed: the broker was not answering
            raise _BrokerUnreachable(f"publish failed: {exc!r}") from None
        if all(r.outcome is Outcome.RETRY and r.error == NOT_CONNECTED for r in results):
            raise _BrokerUnreachable("not connected")
        found = iter(results)
        return [next(found) if isinstance(m, Message) else m for m in prepared]

    def _record(
        self, conn: Connection, rows: Sequence[store.Claimed], results: list[PublishResult]
    ) -> BatchReport:
        report = BatchReport()
        failures: list[dict[str, Any]] = []
        acks: list[tuple[int, str]] = []
        for row, result in zip(rows, results, strict=True):
            msg_id = str(row.msg_id)
            if result.ok:
                report.sent.append(Sent(msg_id, row.topic, result.receipt or ""))
                acks.append((row.id, result.receipt or ""))
                continue
            error = f"{result.outcome.value}: {result.error}"[:2000]
            failed = Failed(msg_id, row.topic, row.attempts + 1, error)
            dead = self.gives_up(result.outcome, failed.attempt)
            (report.dead if dead else report.retried).append(failed)
            failures.append(self._failure(row.id, failed, dead))
        if acks:
            store.finish(conn, acks, self.settings.mark_mode, by_row_id=True)
        if failures:
            now = store.db_clock(conn)  # after the publish: backoff counts from the failure
            for failure in failures:
                failure["next_at"] = now + timedelta(seconds=failure.pop("backoff_s"))
            conn.execute(store.record_failures_stmt(), failures)
        return report

    def _failure(self, row_id: int, failed: Failed, dead: bool) -> dict[str, Any]:
        return {
            "row_id": row_id,
            "error": failed.error,
            "backoff_s": self.backoff(failed.attempt),
            "new_status": DEAD if dead else PENDING,
        }

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


def sweep_result(report: BatchReport) -> SweepResult:
    """The counts of one swept batch: each claimed row was sent, retried or dead."""
    claimed = len(report.sent) + len(report.retried) + len(report.dead)
    return SweepResult(
        claimed, len(report.sent), len(report.retried), len(report.dead),
        retry_reasons=Counter(reason(f.error) for f in report.retried),
        dead_reasons=Counter(reason(f.error) for f in report.dead),
    )  # fmt: skip


REASON_CHARS = 120  # a reason is one line of a summary


def reason(error: str) -> str:
    """An error as a summary groups it: its first line, spaces collapsed, cut."""
    lines = error.strip().splitlines()
    line = " ".join(lines[0].split()) if lines else "(no error text)"
    return line if len(line) <= REASON_CHARS else line[: REASON_CHARS - 3] + "..."


class _BrokerUnreachable(Exception):
    """Raised inside the claiming transaction to roll it back; the message says why."""


class Cursor:
    """The highest row id claimed so far by the sweeps of one drain (thread-safe)."""

    def __init__(self) -> None:
        self.claimed_up_to = 0
        self._lock = threading.Lock()

    def advance(self, row_id: int) -> None:
        with self._lock:
            self.claimed_up_to = max(self.claimed_up_to, row_id)


def checked_message(
    row: StoredRow, payload: bytes | None = None, known: KnownForms | None = None
) -> Message | PublishResult:
    """The row's message if it keeps the contract ``send()`` enforces, else the row's own
    PERMANENT result: it is recorded as a failed attempt and not published."""
    try:
        return stored_message(row, payload, known)
    except Exception as exc:  # whatever is wrong with a stored row is that row's fault
        return permanent(f"invalid row: {exc}"[:500])
