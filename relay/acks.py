"""Group commit for broker acknowledgements: many acks, one statement.

An ack waits at most ``flush_ms`` (or until ``batch_size`` acks are waiting) before
its row is marked; then the listeners hear ``published``. If marking fails the row
simply stays pending and the sweeper publishes it again later: a duplicate, never a loss.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from relay import store
from relay.listener import Listeners, Sent
from relay.stats import Stats

log = logging.getLogger("relay.acks")

Finish = Callable[[Sequence[tuple[str, str]]], int]
Verify = Callable[[Sequence[str]], set[str]]
RETRY_DELAYS_S = (0.0, 0.05, 0.2)  # a terminated connection is replaced by the second try


def sql_finisher(engine: Engine, mode: str) -> Finish:
    def finish(acks: Sequence[tuple[str, str]]) -> int:
        with engine.begin() as conn:
            return store.finish(conn, acks, mode)

    return finish


def sql_verifier(engine: Engine) -> Verify:
    def verify(msg_ids: Sequence[str]) -> set[str]:
        with engine.connect() as conn:
            return store.pending_among(conn, msg_ids)

    return verify


class AckBatcher:
    """Collects acks on the relay loop; writes them from one DB thread."""

    def __init__(
        self,
        finish: Finish,
        stats: Stats,
        batch_size: int = 256,
        flush_ms: float = 5.0,
        listeners: Listeners | None = None,
    ) -> None:
        self._finish = finish
        self.stats = stats
        self.listeners = Listeners() if listeners is None else listeners
        self.batch_size = batch_size
        self.flush_s = flush_ms / 1000
        self._waiting: list[tuple[str, str, str, float | None]] = []  # the fields of Sent
        self._timer: asyncio.TimerHandle | None = None
        self._flushes: set[asyncio.Task[None]] = set()
        self._db = ThreadPoolExecutor(max_workers=1, thread_name_prefix="outbox-acks")

    def add(self, msg_id: str, receipt: str, topic: str, latency_s: float | None) -> None:
        self._waiting.append((msg_id, receipt, topic, latency_s))
        if len(self._waiting) >= self.batch_size:
            self._flush_now()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.flush_s, self._flush_now)

    def _flush_now(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._waiting:
            return
        batch, self._waiting = self._waiting, []
        task = asyncio.get_running_loop().create_task(self._write(batch))
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)

    async def _write(self, batch: list[tuple[str, str, str, float | None]]) -> None:
        loop = asyncio.get_running_loop()
        acks = [(msg_id, receipt) for msg_id, receipt, _, _ in batch]
        for delay in RETRY_DELAYS_S:
            await asyncio.sleep(delay)
            self.stats.mark_statements += 1
            try:
                changed = await loop.run_in_executor(self._db, self._finish, acks)
            except SQLAlchemyError as exc:
                log.warning(
                    "marking %d acked message(s) failed: %s", len(batch), exc.__class__.__name__
                )
                continue
            if self.listeners:  # Sent records only for someone to hear them
                sent = [Sent(msg_id, topic, receipt, lat) for msg_id, receipt, topic, lat in batch]
                self.listeners.published(sent, "fast")  # before the count: waiting on it sees both
            self.stats.marked += changed  # added after the await: writes overlap
            return
        self.listeners.left_for_sweeper([msg_id for msg_id, _ in acks], "mark_failed")
        self.stats.mark_failed += len(batch)
        log.error("gave up marking %d acked message(s); the sweeper will resend them", len(batch))

    async def drain(self) -> None:
        """Write everything waiting and wait for writes in progress."""
        self._flush_now()
        while self._flushes:
            await asyncio.gather(*list(self._flushes))

    def close(self) -> None:
        """Never blocks the loop: a write still running finishes on its own thread."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._db.shutdown(wait=False, cancel_futures=True)
