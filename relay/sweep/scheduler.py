"""The scheduler: publishes scheduled messages (``send(delay=...)``, ``deliver_at=...``)
once they are due, in every relay that has the fast path or the sweeper duty.

A scheduled row is never published before its ``deliver_at`` by the database clock:
the claim (relay.store claim_scheduled_stmt) takes only rows due by a clock reading of
the database, in the claiming transaction, with SKIP LOCKED so that any number of
schedulers share the rows. The claimed batch goes through the sweeper's machinery
(``Sweeper.publish_claimed``): published while the row locks are held, marked sent,
committed; a failure is that row's, backed off through ``next_attempt_at``, dead after
``max_attempts``. A cancel (``UPDATE ... SET status='canceled' WHERE status='pending'``)
waits for a batch in flight on the row lock, then finds the row sent (or still pending,
if its publish failed).

When to claim (``Timing``): at the earliest known due time, which comes from
- the table: each claim reads the database's now and the earliest ``deliver_at`` after
  it (relay.store next_due), converted to this process's monotonic clock by its offset
  from that reading, so the app's wall clock and its skew from the database's play no
  part;
- hints: the app's own commits hand their scheduled messages over (``Relay.submit``),
  due at the monotonic time of ``send()`` plus the delay, or at ``deliver_at`` by the
  wall clock corrected by the last measured database offset;
- a refresh every ``sweep_interval_s``: rows other processes committed, and failed rows
  whose backoff ran out.
A hint or a conversion may be early (the row is inserted after ``send()`` began; clocks
are measured a round trip apart): the claim then finds nothing, and the table's answer
puts the next claim at the row's real time, at least a ``TICK_S`` later.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from datetime import datetime

from sqlalchemy import Connection
from sqlalchemy.exc import SQLAlchemyError

from outbox.events import SweepResult
from outbox.message import Message
from outbox.rows import missing_table
from outbox.secrets import url_of
from relay import store
from relay.outage import Outage
from relay.part import Lifecycle
from relay.sweep.jobs import describe
from relay.sweep.sweeper import Sweeper

log = logging.getLogger("relay.sweep.scheduler")

TICK_S = 0.002  # the soonest a claim that found nothing due is tried again
Clock = Callable[[], float]


class Timing:
    """When the scheduler claims next, on the monotonic ``clock`` (thread-safe, no I/O).

    The loop asks ``wake_at()``; ``claim_begins()`` and ``claim_ended()`` bracket a claim
    and its reading of the table; ``hint()`` (any thread) brings the next claim forward
    and says whether the loop must be woken for it.
    """

    def __init__(self, refresh_s: float, clock: Clock = time.monotonic, wall: Clock = time.time):
        self.refresh_s = refresh_s
        self.clock, self.wall = clock, wall
        self._lock = threading.Lock()
        self._due: float | None = None  # the earliest due time known (table or hints)
        self._hinted: float | None = None  # the earliest hint since the claim in hand began
        self._refresh_at = clock()  # the first claim at once
        self._offset_s = 0.0  # the database clock minus the wall clock, last measured

    def wake_at(self) -> float:
        with self._lock:
            return self._wake_at()

    def _wake_at(self) -> float:
        return self._refresh_at if self._due is None else min(self._due, self._refresh_at)

    def hint(self, at: float) -> bool:
        """A committed scheduled row is due at monotonic ``at`` (or later): True when
        that is before the planned wake-up, so the loop must be woken."""
        with self._lock:
            sooner = at < self._wake_at()
            self._due = earliest(self._due, at)
            self._hinted = earliest(self._hinted, at)
            return sooner

    def due_at(self, message: Message) -> float:
        """The monotonic time a committed scheduled message is due, about (see hint)."""
        if message.delay_s is not None:
            return message.born + message.delay_s
        assert message.deliver_at is not None, "a scheduled message"
        return self.from_db_time(message.deliver_at)

    def from_db_time(self, instant: datetime) -> float:
        """``instant`` by the database clock, on the monotonic clock (by the offset last
        measured between the database clock and the wall clock)."""
        ahead_s = instant.timestamp() - (self.wall() + self._offset_s)
        return self.clock() + ahead_s

    def claim_begins(self) -> None:
        """Rows hinted so far are committed: the claim or its reading sees them."""
        with self._lock:
            self._hinted = None
            self._refresh_at = self.clock() + self.refresh_s

    def claim_ended(self, read: store.NextDue, read_at: float, wall_at: float, claimed: int,
                    full: bool) -> None:  # fmt: skip
        """The claim took ``claimed`` rows (``full``: as many as it may: claim again at
        once); ``read`` is the table's now and next due time, read at monotonic
        ``read_at`` and wall ``wall_at`` (taken just after it returned: the row is
        planned a round trip late at most, never early)."""
        now_s = read.now.timestamp()
        due = None if read.next_due is None else read_at + (read.next_due.timestamp() - now_s)
        if full:
            due = read_at
        elif due is not None and claimed == 0:  # woken early for nothing: a tick at least
            due = max(due, read_at + TICK_S)
        with self._lock:
            self._offset_s = now_s - wall_at
            self._due = earliest(due, self._hinted)
            self._hinted = None

    def failed(self) -> None:
        """The claim could not run (the database): try again at the next refresh."""
        with self._lock:
            self._due = self._hinted


def earliest(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None else min(a, b)


class Scheduler(Lifecycle):
    """Publishes due scheduled rows through ``sweeper`` on its own thread
    (``outbox-scheduler``); ``hint`` takes the app's committed scheduled messages.
    relay.part's contract: ``start()``, ``stop(timeout)``, idempotent, any thread."""

    def __init__(self, sweeper: Sweeper, clock: Clock = time.monotonic,
                 wall: Clock = time.time) -> None:  # fmt: skip
        super().__init__()
        self.sweeper = sweeper
        self.timing = Timing(sweeper.settings.sweep_interval_s, clock, wall)
        self.totals = SweepResult()
        self.database = Outage("database", log)
        self._told_missing = False  # "no outbox tables" said once, until they exist
        self._wakeup = threading.Condition()
        self._woken = False
        self._stopping = False
        self._thread: threading.Thread | None = None

    def hint(self, messages: Sequence[Message]) -> None:
        """Committed scheduled messages (any thread, never blocks on the database)."""
        if not messages:
            return
        # Only the earliest matters: one lock round per hand-off, not one per message.
        if self.timing.hint(min(self.timing.due_at(m) for m in messages)):
            with self._wakeup:
                self._woken = True
                self._wakeup.notify()

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="outbox-scheduler", daemon=True)
        self._thread.start()

    def _stop(self, timeout: float) -> bool:
        """The batch in hand finishes (published and marked, or left pending); no new one."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        assert self._thread is not None, "started"
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("a scheduled batch was still in flight at the stop deadline")
            return False
        return True

    def _run(self) -> None:
        while self._sleep_until(self.timing.wake_at()):
            self.tick()

    def _sleep_until(self, at: float) -> bool:
        """Wait until monotonic ``at`` or a sooner hint; False once stopping."""
        with self._wakeup:
            while not self._stopping and not self._woken:
                left = at - self.timing.clock()
                if left <= 0:
                    break
                self._wakeup.wait(left)
            self._woken = False
            return not self._stopping and not self.sweeper.stopping

    def tick(self) -> SweepResult:
        """Claim and publish what is due now, one batch; plan the next claim."""
        self.timing.claim_begins()
        try:
            result, read = self._claim_once()
        except SQLAlchemyError as exc:
            self.timing.failed()
            self._claim_failed(exc)
            return SweepResult()
        except Exception:  # a bug: its traceback; the loop goes on at the next refresh
            self.timing.failed()
            log.exception("scheduler: claim failed")
            return SweepResult()
        self.database.ok()
        self._told_missing = False
        self.totals += result
        full = result.claimed >= self.sweeper.settings.sweep_batch and not result.aborted
        read_at, wall_at = read.at
        self.timing.claim_ended(read.next, read_at, wall_at, result.claimed, full)
        return result

    def _claim_failed(self, exc: SQLAlchemyError) -> None:
        """A missing table is said once as what it is (a relay started before the app
        created its tables, say), not as an outage of a database that answered."""
        if not missing_table(exc):
            self.database.failed(f"scheduler: claim failed: {describe(exc)}")
        elif not self._told_missing:
            self._told_missing = True
            where = url_of(self.sweeper.engine)
            log.warning("scheduler waiting: no outbox tables in %s: run `outbox migrate`", where)

    def _claim_once(self) -> tuple[SweepResult, Reading]:
        reading = Reading(self.sweeper.settings.sweep_batch, self.timing.clock, self.timing.wall)
        result = self.sweeper.publish_claimed(reading.claim)
        return result, reading


class Reading:
    """A claim of due scheduled rows (``claim``, for Sweeper.publish_claimed): first the
    table's now and next due time (``next``, read at monotonic and wall ``at``), then the
    rows due by that now, in the same transaction."""

    def __init__(self, limit: int, clock: Clock = time.monotonic, wall: Clock = time.time):
        self.limit, self.clock, self.wall = limit, clock, wall
        self.next = store.NextDue(datetime.min, None)  # until the claim ran
        self.at = (0.0, 0.0)

    def claim(self, conn: Connection) -> list[store.Claimed]:
        self.next = store.next_due(conn)
        self.at = (self.clock(), self.wall())
        return store.claim(conn, store.claim_scheduled_stmt(self.next.now, self.limit))


def publish_due(
    sweeper: Sweeper, on_batch: Callable[[SweepResult], None] | None = None
) -> SweepResult:
    """Publish every scheduled row due now, batch after batch (``outbox drain``)."""
    done = SweepResult()
    limit = sweeper.settings.sweep_batch
    while not sweeper.stopping:
        batch = sweeper.publish_claimed(Reading(limit).claim)
        done += batch
        if on_batch is not None and (batch.sent or batch.failed or batch.dead):
            on_batch(batch)
        if batch.aborted or batch.claimed < limit:
            break
    return done
