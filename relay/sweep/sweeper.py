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
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, NamedTuple

from sqlalchemy import Connection, Engine

from outbox.broker import Outcome, PublishResult, permanent
from outbox.events import Failed, Path, RelayListener, Sent, SweepResult
from outbox.message import Message
from outbox.rows import KnownForms, StoredRow, stored_message
from outbox.settings import Settings
from outbox.table import DEAD, PENDING
from outbox.tracing import publish_span
from relay import store
from relay.brokers.base import NOT_CONNECTED, publish_isolated
from relay.fastpath.batches import BatchReport
from relay.listener import Listeners
from relay.loop import BrokerLoop
from relay.sweep.dead_letters import REASON_CHARS as REASON_CHARS  # its old home
from relay.sweep.dead_letters import DeadLetters, named, reason

log = logging.getLogger("relay.sweep.sweeper")

Claim = Callable[[Connection], list[store.Claimed]]  # locks a batch in the given transaction


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
        self.engine = fresh_reads(engine)
        self.broker_loop = broker_loop
        self.settings = settings or Settings()
        self.listeners = Listeners.of(listener)
        self.totals = SweepResult()
        self._totals_lock = threading.Lock()
        self._stopping = threading.Event()
        self._sweeping = 0  # sweep_once calls in progress
        self._sweeping_changed = threading.Condition()
        self.known = KnownForms()
        # A worker's routine lines (a batch swept, a retention purge): one INFO line each
        # suits a worker; a command showing progress and an app's relay lower it.
        self.batch_log_level = logging.INFO
        # A row going dead is a WARNING whoever runs the sweeper, an app or a worker.
        self.dead_letters = DeadLetters()

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
                published = self._publish_in_order(rows, prepared)
                report = self._record(conn, rows, published.results)
                if cursor is not None:  # before the commit: no other sweep retakes them
                    cursor.failed_ordered(ordered_ids(rows, published.results, ok=False))
        except _BrokerUnreachable as why:
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
        now = store.db_clock(conn)
        cutoff, limit = now - timedelta(seconds=age), self.settings.sweep_batch
        claim = store.claim_due_stmt(
            cutoff, now, limit, due_only,
            after_id=cursor.claimed_up_to if cursor else None,
            failed=cursor.failed_ids() if cursor else (),
        )  # fmt: skip
        rows = store.claim(conn, claim)
        if rows and cursor is not None:
            cursor.advance(max(row.id for row in rows))  # not the followers': see Cursor
            rows = cursor.not_failed(rows)
        return rows + store.followers(conn, rows, cutoff, limit - len(rows), limit)

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
        """Delete sent rows older than the retention period, in bounded batches."""
        purged = 0
        while True:
            with self.engine.begin() as conn:
                cutoff = store.db_clock(conn) - timedelta(seconds=self.settings.retention_s)
                deleted = store.purge_sent(conn, cutoff, self.settings.purge_batch)
            purged += deleted
            if deleted < self.settings.purge_batch:
                if purged:
                    log.log(self.batch_log_level, "retention: purged=%d", purged)
                return purged

    def _publish_in_order(
        self, rows: Sequence[store.Claimed], prepared: list[Message | PublishResult]
    ) -> _Published:
        """Publish in waves: the first has the unordered rows and each key's first row;
        each next wave the next row of each key whose rows have all been acked so far.
        A key's row is never in flight beside, nor before the ack of, the row before it;
        a failure stops its key for this sweep (the rest stay pending, unattempted).

        If the broker stops answering after the first wave, the answers so far are kept
        and the rest is left pending (``cut_short``); in the first, _BrokerUnreachable.
        """
        results: list[PublishResult | None] = [None] * len(rows)
        chains = [deque(chain) for chain in key_chains(rows)]
        first = True
        while chains:
            wave = [chain.popleft() for chain in chains]
            try:
                answers = self._publish([prepared[i] for i in wave])
            except _BrokerUnreachable as why:
                if first:
                    raise
                return _Published(results, str(why), sum(map(len, chains)) + len(wave))
            for i, answer in zip(wave, answers, strict=True):
                results[i] = answer
            chains = [c for c, a in zip(chains, answers, strict=True) if c and a.ok]
            first = False
        return _Published(results, None, sum(r is None for r in results))

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
        self,
        conn: Connection,
        rows: Sequence[store.Claimed],
        results: Sequence[PublishResult | None],
    ) -> BatchReport:
        """Mark the acked rows, record the failed ones; a row not tried (None) is left as it is."""
        report = BatchReport()
        failures: list[dict[str, Any]] = []
        acks: list[tuple[int, str]] = []
        for row, result in zip(rows, results, strict=True):
            if result is None:
                continue
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


def fresh_reads(engine: Engine) -> Engine:
    """``engine`` for the sweeps: on MySQL and MariaDB at READ COMMITTED, so that each
    statement reads what committed before it (store.still_heads needs it), not the
    snapshot of the transaction's first read. PostgreSQL's default already is."""
    if engine.dialect.name not in ("mysql", "mariadb"):
        return engine
    return engine.execution_options(isolation_level="READ COMMITTED")


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


class _BrokerUnreachable(Exception):
    """Raised inside the claiming transaction to roll it back; the message says why."""


class Cursor:
    """Where the sweeps of one drain pass are (thread-safe): the highest row id claimed
    (unordered rows are taken past it only, each once) and the ordered rows that failed
    (a key's next head may sit below that id: ordered heads are taken by key, not by id,
    but a failed one is not taken again in the pass). The followers claimed with their
    head do not move the id: the rows between stay to be taken."""

    def __init__(self) -> None:
        self.claimed_up_to = 0
        self.failed: set[int] = set()
        self._lock = threading.Lock()

    def advance(self, row_id: int) -> None:
        with self._lock:
            self.claimed_up_to = max(self.claimed_up_to, row_id)

    def failed_ordered(self, row_ids: Iterable[int]) -> None:
        with self._lock:
            self.failed.update(row_ids)

    def failed_ids(self) -> list[int]:
        with self._lock:
            return list(self.failed)

    def not_failed(self, rows: list[store.Claimed]) -> list[store.Claimed]:
        """``rows`` less those that failed in this pass, asked again once they are locked:
        a sweep that failed one may have committed after the claim's statement was built
        (its failure is recorded before its commit, so it is seen here)."""
        with self._lock:
            return [row for row in rows if row.id not in self.failed]


class _Published(NamedTuple):
    """A batch's answers, one per row (None: not tried), and why it was cut short if it was."""

    results: list[PublishResult | None]
    cut_short: str | None
    held: int  # rows not tried: behind a failure of their key, or after a cut


def ordered_ids(
    rows: Sequence[store.Claimed], results: Sequence[PublishResult | None], ok: bool
) -> list[int]:
    """The ids of the ordered rows that were tried and succeeded (``ok``) or failed."""
    return [
        row.id
        for row, result in zip(rows, results, strict=True)
        if row.seq is not None and result is not None and result.ok is ok
    ]


def key_chains(rows: Sequence[store.Claimed]) -> list[list[int]]:
    """The rows' indexes as publishing chains: each unordered row alone (first), then each
    ordered (topic, key)'s rows in seq order."""
    alone: list[list[int]] = []
    keys: dict[tuple[str, str | None], list[int]] = {}
    for i, row in enumerate(rows):
        if row.seq is None:
            alone.append([i])
        else:
            keys.setdefault((row.topic, row.key), []).append(i)
    ordered = [sorted(chain, key=lambda i: (rows[i].seq, rows[i].id)) for chain in keys.values()]
    return alone + ordered


def checked_message(
    row: StoredRow, payload: bytes | None = None, known: KnownForms | None = None
) -> Message | PublishResult:
    """The row's message if it keeps the contract ``send()`` enforces, else the row's own
    PERMANENT result: it is recorded as a failed attempt and not published."""
    try:
        return stored_message(row, payload, known)
    except Exception as exc:  # whatever is wrong with a stored row is that row's fault
        return permanent(f"invalid row: {exc}"[:500])
