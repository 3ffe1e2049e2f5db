"""The sweeper: publishes what the fast path did not, from the table.

It takes pending rows older than ``sweeper_age_s`` (10 s, by the database clock) that
are due, oldest first, locked with SKIP LOCKED so that any number of sweepers, in
apps and in ``outbox relay`` workers, share the work without a coordinator. A row
that fails is retried later with exponential backoff and jitter, and is marked
``dead`` after ``max_attempts`` (a permanent failure: after ``permanent_attempts``);
a failing row never holds back the rows beside it, but for an ordered key's. A row
going dead is logged at WARNING once it is committed (relay.sweep.dead_letters: a line each,
a flood summed up once a minute), by an app's sweeper as by a worker's.

Ordered messages (``send(..., ordered=True)``): a key's rows are claimed from its head
(the lowest seq not yet sent or skipped) only, with the rows after it, and published
one after another, each once the broker acked the one before; keys side by side. A
failure stops its key until the head is retried (its later rows cost no attempt); a
dead head blocks its key until ``outbox requeue`` or ``outbox skip``. Locking the head
is owning the key: any number of sweepers never publish two rows of a key at once.
Listeners (outbox.events.RelayListener) hear each batch's outcomes once it is committed.

Delivery is at least once: if the process dies between publishing and committing
the marks, the rows stay pending and are published again (JetStream drops the copy
by ``Nats-Msg-Id`` within its duplicate window).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from sqlalchemy import Connection, Engine

from outbox.broker import PublishResult
from outbox.dialects import dialect_for
from outbox.events import Path, RelayListener, SweepResult
from outbox.message import Message
from outbox.rows import KnownForms
from outbox.settings import Settings
from relay import store
from relay.fastpath.batches import BatchReport
from relay.fastpath.marking import Marks, Retries
from relay.listener import Listeners
from relay.loop import BrokerLoop
from relay.operator import Operator
from relay.sweep.claims import Claim, Claimer, Cursor
from relay.sweep.dead_letters import REASON_CHARS as REASON_CHARS  # its old home
from relay.sweep.dead_letters import DeadLetters, named, reason
from relay.sweep.waves import BrokerUnreachable, Waves, checked_message, ordered_ids

__all__ = ["REASON_CHARS", "Claim", "Cursor", "Sweeper", "checked_message", "sweep_result"]

log = logging.getLogger("relay.sweep.sweeper")


class Sweeper:
    """Publishes due rows through ``broker_loop`` (started and stopped by its owner).

    A sweep runs on its caller's thread (a scheduled job, ``outbox drain``'s thread or a
    test), so ``start()`` has nothing to do; ``stop(timeout)`` lets the sweeps in hand
    finish their batch, claims no more, and waits for them (relay.part's contract).
    It coordinates: ``Claimer`` locks the batch (relay.sweep.claims), ``Waves`` publishes
    it (relay.sweep.waves), ``Marks`` records the outcomes (relay.fastpath.marking).
    """

    def __init__(
        self,
        engine: Engine,
        broker_loop: BrokerLoop,
        settings: Settings | None = None,
        listener: RelayListener | None = None,
    ) -> None:
        self.engine = fresh_reads(engine)
        self.broker_loop = broker_loop
        self._stopping = threading.Event()
        self.claimer = Claimer(settings or Settings())
        self.waves = Waves(broker_loop, self.claimer.settings, self._stopping)
        self.retries = Retries(self.claimer.settings)
        self.listeners = Listeners.of(listener)
        self.totals = SweepResult()
        self._totals_lock = threading.Lock()
        self._sweeping = 0  # sweep_once calls in progress
        self._sweeping_changed = threading.Condition()
        self.known = KnownForms()
        # A worker's routine lines (a batch swept, a retention purge): one INFO line each
        # suits a worker; a command showing progress and an app's relay lower it.
        self.batch_log_level = logging.INFO
        # A row going dead is a WARNING whoever runs the sweeper, an app or a worker.
        self.dead_letters = DeadLetters()

    @property
    def settings(self) -> Settings:
        return self.claimer.settings

    @settings.setter
    def settings(self, settings: Settings) -> None:
        """Replace the settings (a test's), the sweeper's parts' too."""
        self.claimer.settings = self.waves.settings = self.retries.settings = settings

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
        return self._counted_sweep(min_age_s, due_only, cursor)[0]

    def publish_claimed(self, claim: Claim, path: Path = "scheduler") -> SweepResult:
        """One batch of the rows ``claim`` locks (the scheduler's due rows), published and
        recorded in one transaction exactly as a sweep's; its listeners hear ``path``."""
        return self._counted_sweep(None, True, None, claim, path)[0]

    def _counted_sweep(
        self,
        min_age_s: float | None,
        due_only: bool,
        cursor: Cursor | None,
        claim: Claim | None = None,
        path: Path = "sweeper",
    ) -> tuple[SweepResult, bool]:
        with self._sweeping_changed:
            self._sweeping += 1
        self.dead_letters.tick()  # a flood's summary, once its minute is over
        try:
            return self._sweep_once(min_age_s, due_only, cursor, claim, path)
        finally:
            with self._sweeping_changed:
                self._sweeping -= 1
                self._sweeping_changed.notify_all()

    def _sweep_once(
        self,
        min_age_s: float | None,
        due_only: bool,
        cursor: Cursor | None,
        claim: Claim | None,
        path: Path,
    ) -> tuple[SweepResult, bool]:
        """The batch's result, and whether an ordered row was acked (its key may have a
        next head now, though the batch was not full)."""
        age = self.settings.sweeper_age_s if min_age_s is None else min_age_s
        started = time.monotonic()
        rows: list[store.Claimed] = []
        try:
            with self.engine.begin() as conn:
                rows = claim(conn) if claim else self._claim(conn, age, due_only, cursor)
                if not rows:
                    return SweepResult(), False
                big = store.load_payloads(conn, rows)
                prepared = [checked_message(r, big.get(r.id), self.known) for r in rows]
                published = self.waves.publish(rows, prepared)
                report = self._record(conn, rows, published.results)
                if cursor is not None:  # before the commit: no other sweep retakes them
                    cursor.failed_ordered(ordered_ids(rows, published.results, ok=False))
        except BrokerUnreachable as why:
            if self._stopping.is_set():
                log.info("%s: stopping, batch of %d left pending", path, len(rows))
            else:
                self.broker_loop.outage.failed(f"{why}; {path}: batch of {len(rows)} left pending")
            return SweepResult(claimed=len(rows), aborted=True), False
        if published.cut_short is not None:
            self._cut_short(published.cut_short, published.held)
        elif any(isinstance(m, Message) for m in prepared):  # the broker answered
            self.broker_loop.outage.ok()
        result = sweep_result(report)
        result.aborted = published.cut_short is not None
        if report.dead:  # committed: told once
            self.dead_letters.went_dead(report.dead, path)
        log.log(
            self.batch_log_level if path == "sweeper" else logging.DEBUG,  # a batch per due time
            "%s: claimed=%d sent=%d retry_later=%d dead=%d%s%s",
            "sweep" if path == "sweeper" else path,
            result.claimed, result.sent, result.failed, result.dead,
            dead_reasons(result),
            f" held_back={published.held}" if published.held else "",
        )  # fmt: skip
        with self._totals_lock:
            self.totals += result
        report.tell(self.listeners, path)
        if path == "sweeper":  # swept() is the sweeper's batches' hook
            self.listeners.swept(result, time.monotonic() - started)
        return result, bool(ordered_ids(rows, published.results, ok=True))

    def _claim(
        self, conn: Connection, age: float, due_only: bool, cursor: Cursor | None
    ) -> list[store.Claimed]:
        """Due rows and ordered heads, then the heads' followers, all locked."""
        return self.claimer.claim(conn, age, due_only, cursor)

    def _cut_short(self, why: str, held: int) -> None:
        if self._stopping.is_set():
            log.info("sweep: stopping, %d ordered row(s) left pending", held)
        else:
            self.broker_loop.outage.failed(f"{why}; sweep: {held} ordered row(s) left pending")

    def sweep(
        self,
        concurrency: int = 1,
        min_age_s: float | None = None,
        due_only: bool = True,
        on_batch: Callable[[SweepResult], None] | None = None,
    ) -> SweepResult:
        """Sweep until no full batch is left, with ``concurrency`` sweeps side by side.

        A batch that was not full goes on while it advanced an ordered key (the key's
        next rows may be heads now). Stops early when ``stop()`` was called or the
        broker is unreachable. With ``due_only=False`` (a drain) each row is claimed at
        most once per call, so a failing row is not retried at once and spends no more
        than one attempt.
        """
        cursor = None if due_only else Cursor()

        def loop() -> SweepResult:
            done = SweepResult()
            while not self._stopping.is_set():
                batch, advanced = self._counted_sweep(min_age_s, due_only, cursor)
                done += batch
                if on_batch is not None and (batch.sent or batch.failed or batch.dead):
                    on_batch(batch)
                if batch.aborted or (batch.claimed < self.settings.sweep_batch and not advanced):
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
            idle = self._sweeping_changed.wait_for(lambda: self._sweeping == 0, timeout)
        self.dead_letters.flush()  # the dead letters counted but not yet told
        return idle

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def purge(self) -> int:
        """One retention pass (relay.operator.Operator.purge, the code `outbox purge`
        runs): sent and canceled rows older than ``retention_s``, in bounded batches."""
        settings = self.settings
        purged = Operator(self.engine).purge(settings.retention_s, settings.purge_batch).rows
        if purged:
            log.log(self.batch_log_level, "retention: purged=%d", purged)
        return purged

    def _record(
        self,
        conn: Connection,
        rows: Sequence[store.Claimed],
        results: Sequence[PublishResult | None],
    ) -> BatchReport:
        """Mark the acked rows, record the failed ones; a row not tried (None) is left as it is."""
        marks = Marks(self.retries)
        for row, result in zip(rows, results, strict=True):
            if result is not None:
                marks.add(row.id, str(row.msg_id), row.topic, row.attempts, result)
        marks.write(conn, self.settings.mark_mode)
        return marks.report


def fresh_reads(engine: Engine) -> Engine:
    """``engine`` for the sweeps: on MySQL and MariaDB at READ COMMITTED, so that each
    statement reads what committed before it (store.still_heads needs it), not the
    snapshot of the transaction's first read. PostgreSQL's default already is."""
    level = dialect_for(engine).fresh_reads_isolation
    if level is None:
        return engine
    return engine.execution_options(isolation_level=level)


def sweep_result(report: BatchReport) -> SweepResult:
    """The counts of one swept batch: each claimed row was sent, retried or dead."""
    claimed = len(report.sent) + len(report.retried) + len(report.dead)
    return SweepResult(
        claimed, len(report.sent), len(report.retried), len(report.dead),
        retry_reasons=Counter(reason(f.error) for f in report.retried),
        dead_reasons=Counter(reason(f.error) for f in report.dead),
    )  # fmt: skip


def dead_reasons(result: SweepResult) -> str:
    """A sweep line's reasons for its dead rows: ' (2 x permanent: too large, 1 x ...)'."""
    return f" ({named(result.dead_reasons)})" if result.dead_reasons else ""
