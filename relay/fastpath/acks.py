"""Group commit for broker acknowledgements: many acks, one statement (relay.fastpath.marking).

An ack waits at most ``flush_ms`` (or until ``batch_size`` acks are waiting) before
its row is marked; then the listeners hear ``published``. If marking fails the row
simply stays pending and the sweeper publishes it again later: a duplicate, never a loss.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from outbox.dialects import dialect_for
from outbox.events import Sent, Stats
from relay import store
from relay.fastpath import marking
from relay.fastpath.stats import Slots
from relay.listener import Listeners
from relay.outage import Outage
from relay.part import Lifecycle

log = logging.getLogger("relay.fastpath.acks")

Finish = Callable[[Sequence[tuple[str, str]]], int]
Verify = Callable[[Sequence[str]], set[str]]
# Which of these ordered heads (topic, key, seq) must wait for an earlier row of their key.
Heads = Callable[[Sequence[store.Head]], set[tuple[str, str]]]
RETRY_DELAYS_S = (0.0, 0.05, 0.2)  # a terminated connection is replaced by the second try


def one_statement(engine: Engine) -> Engine:
    """``engine``'s pool, each statement its own transaction where that is free.

    The relay's ack UPDATE and its verify SELECT are one statement each, atomic alone:
    on PostgreSQL, autocommit saves the BEGIN and COMMIT (or the ROLLBACK when the
    connection goes back to the pool) round trips, a third of the marking's CPU.
    The drivers switch autocommit there without a round trip; MySQL's would send a
    SET each way, so other databases keep the transaction.
    """
    if not dialect_for(engine).free_autocommit:
        return engine
    return engine.execution_options(isolation_level="AUTOCOMMIT")


def sql_finisher(engine: Engine, mode: str) -> Finish:
    engine = one_statement(engine)

    def finish(acks: Sequence[tuple[str, str]]) -> int:
        with engine.begin() as conn:
            return marking.write(conn, acks, mode)

    return finish


def sql_verifier(engine: Engine) -> Verify:
    engine = one_statement(engine)

    def verify(msg_ids: Sequence[str]) -> set[str]:
        with engine.connect() as conn:
            return store.pending_among(conn, msg_ids)

    return verify


def sql_heads(engine: Engine) -> Heads:
    """The head check (store.blocked_keys), a statement of its own on a connection of its
    own: a new transaction, so its snapshot is newer than the heads' commits (MariaDB's
    REPEATABLE READ takes it at this first read)."""
    engine = one_statement(engine)

    def blocked(heads: Sequence[store.Head]) -> set[tuple[str, str]]:
        with engine.connect() as conn:
            return store.blocked_keys(conn, heads)

    return blocked


class AckBatcher(Lifecycle):
    """Collects acks from the broker loop; one thread of its own waits, batches and writes them.

    Made on the loop by the dispatcher, which starts it and, at its own stop, closes it
    from the loop (``close``: no wait) and then stops it from its caller's thread.

    Each ack's message still holds its fast-path slot (``slots``) until its batch is
    marked or given up to the sweeper: then the thread frees the batch's slots.

    The loop only appends an ack (and wakes the thread when it was idle): no timer, task
    or executor future per batch and, unless listeners want to hear ``published`` (on
    the loop), no wake-up of the loop when a write ends: at low rates, one ack per
    batch, those came with every message.
    """

    def __init__(
        self,
        finish: Finish,
        stats: Stats,
        batch_size: int = 256,
        flush_ms: float = 50.0,
        listeners: Listeners | None = None,
        slots: Slots | None = None,
    ) -> None:
        super().__init__()
        self._finish = finish
        self.database = Outage("database", log)  # failed marks: logged once, then summaries
        self._slots = slots
        self.stats = stats
        self.listeners = Listeners() if listeners is None else listeners
        self.batch_size = batch_size
        self.flush_s = flush_ms / 1000
        self._waiting: list[Sent] = []
        self._first_at = 0.0  # time.monotonic() when the first of _waiting came
        self._writing = False
        self._closing = False
        self._ended = False  # the thread took its last acks: add() refuses more
        self._now = False  # drain(): write what waits without waiting out flush_ms
        self._idle_waiters: list[asyncio.Future[None]] = []
        self._loop = asyncio.get_running_loop()  # made on the loop, by the dispatcher
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="outbox-acks", daemon=True)

    def _start(self) -> None:
        self._thread.start()

    def add(self, sent: Sent) -> bool:
        """Queue one ack for marking; False once the thread has ended (nobody would)."""
        with self._cond:
            if self._ended:
                return False
            self._waiting.append(sent)
            if len(self._waiting) == 1:
                self._first_at = time.monotonic()
                self._cond.notify()
            elif len(self._waiting) == self.batch_size:
                self._cond.notify()
            return True

    async def drain(self) -> None:
        """Write everything waiting and wait for writes in progress."""
        with self._cond:
            if not self._waiting and not self._writing:
                return
            idle: asyncio.Future[None] = self._loop.create_future()
            self._idle_waiters.append(idle)
            self._now = True
            self._cond.notify()
        await idle

    def close(self) -> None:
        """Take no more acks; never blocks the loop: a write still running finishes on
        its own thread, which then ends (``stop`` waits for that)."""
        with self._cond:
            self._closing = True
            self._cond.notify()

    def _stop(self, timeout: float) -> bool:
        """Close, and wait (off the loop) up to ``timeout`` for the thread to end."""
        self.close()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while (batch := self._next_batch()) is not None:
            try:
                self._write(batch)
            finally:  # marked or given up: these messages left the fast path
                self._free(len(batch))
        with self._cond:  # closed before these were written: their rows stay pending
            left, self._waiting, self._ended = self._waiting, [], True
        self._free(len(left))
        if left:
            self.listeners.left_for_sweeper([sent.msg_id for sent in left], "stopped")

    def _free(self, n: int) -> None:
        if self._slots is not None:
            self._slots.free(n)

    def _next_batch(self) -> list[Sent] | None:
        """The next batch once full or ``flush_ms`` after its first ack; None once closed."""
        with self._cond:
            self._writing = False
            self._tell_idle()
            while not self._waiting and not self._closing:
                self._cond.wait()
            deadline = self._first_at + self.flush_s
            while (
                len(self._waiting) < self.batch_size
                and not (self._closing or self._now)
                and (left := deadline - time.monotonic()) > 0
            ):
                self._cond.wait(left)
            if self._closing:
                return None
            batch, self._waiting = (
                self._waiting[: self.batch_size],
                self._waiting[self.batch_size :],
            )
            if self._waiting:  # more than a batch came during the last write: no more waiting
                self._first_at = 0.0
            self._now = self._now and bool(self._waiting)
            self._writing = True
            return batch

    def _tell_idle(self) -> None:
        if self._waiting or not self._idle_waiters:
            return
        for idle in self._idle_waiters:
            self._on_loop(_set_done, idle)
        self._idle_waiters.clear()

    def _published(self, batch: list[Sent], changed: int) -> None:
        self.listeners.published(batch, "fast")  # before the count: waiting on it sees both
        self.stats.marked += changed

    def _on_loop(self, fn: Callable[..., None], *args: object) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop has closed (stop's deadline passed): no one hears it
            log.debug("broker loop closed; %s not run", fn.__name__)

    def _write(self, batch: list[Sent]) -> None:
        acks = marking.acks_of(batch)
        for delay in RETRY_DELAYS_S:
            if delay:
                time.sleep(delay)  # this thread's own pause: the loop goes on publishing
            self.stats.mark_statements += 1
            try:
                changed = self._finish(acks)
            except SQLAlchemyError as exc:
                self.database.failed(f"marking acked messages: {exc.__class__.__name__}")
                continue
            except Exception:  # a listener or driver bug: this batch's, never the thread's end
                log.exception("marking %d acked message(s) failed", len(batch))
                break
            self.database.ok()
            if self.listeners:  # published runs on the loop, like the fast path's others
                self._on_loop(self._published, batch, changed)
            else:
                self.stats.marked += changed
            return
        self.listeners.left_for_sweeper([msg_id for msg_id, _ in acks], "mark_failed")
        self.stats.mark_failed += len(batch)
        log.error("gave up marking %d acked message(s); the sweeper will resend them", len(batch))


def _set_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
