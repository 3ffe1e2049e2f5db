"""Model B's broker side: end-transaction handling and the check-back service.

RocketMQ keeps this inside its broker; here it is a process (``outbox coordinator``)
over JetStream streams that stand in for the commit log. Messages are never changed
in place: an op message (tag ``d``, body = half offset) is how a half is marked done.

The ``Coordinator`` is a relay part (relay.part's start/stop contract) on the shared
connection loop (relay.loop.ConnectionLoop: one thread, its asyncio loop, connecting in
the background with backoff). Each connection opens a ``HalfStore`` (relay.lab.halfop
.halfs: streams and buckets) and listens for end requests (``EndHandler``, ends.py);
every ``check_interval_s`` a ``CheckService`` round (checks.py) runs on it. The offsets
are in a KV bucket, so a round after a new connection, or a restarted coordinator,
resumes where the last one stopped. When the server closes the connection for good,
the loop connects again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import nats
from nats.aio.client import Client

from relay.lab.halfop.checks import CheckService, Round
from relay.lab.halfop.ends import EndHandler
from relay.lab.halfop.halfs import (
    OFFSETS_BUCKET,
    SETTLED_BUCKET,
    TAGS_HEADER,
    HalfStore,
    end_refusal,
    record_ttl,
)
from relay.lab.halfop.oplog import build_remove_map, next_op_offset
from relay.lab.halfop.settings import CoordinatorSettings, CoordinatorStats
from relay.loop import ConnectionLoop
from relay.part import START_TIMEOUT_S, Lifecycle

log = logging.getLogger("relay.lab.halfop.coordinator")


class CoordinatorConnection:
    """The coordinator's NATS connection, as a ConnectionLoop owns it: ``connect`` opens
    the store and listens for end requests; a connection the client closed for good by
    itself calls ``on_lost`` (on the loop)."""

    def __init__(
        self,
        url: str,
        on_open: Callable[[Client], Coroutine[Any, Any, None]],
        on_lost: Callable[[Exception | None], None],
    ) -> None:
        self.url = url
        self.nc: Client | None = None
        self._on_open = on_open
        self._on_lost = on_lost
        self._closing = False

    async def connect(self) -> None:
        nc = await nats.connect(
            servers=[self.url],
            name="outbox-coordinator",
            max_reconnect_attempts=-1,
            closed_cb=self._closed,
        )
        try:
            await self._on_open(nc)
            await nc.flush()  # the server has the subscription: no end request missed
        except BaseException:
            await nc.close()
            raise
        self.nc = nc

    async def _closed(self) -> None:
        """nats-py closes a client for good on some server errors (max payload, ...)."""
        nc = self.nc
        if nc is not None and nc.is_closed and not self._closing:
            self._on_lost(nc.last_error)

    async def close(self) -> None:
        self._closing = True
        nc, self.nc = self.nc, None
        if nc is not None and not nc.is_closed:
            await nc.drain()


class Coordinator(Lifecycle):
    """``start()`` returns once connected and listening for end requests (TimeoutError
    after START_TIMEOUT_S without a connection); ``stop(timeout)`` lets the check round
    and the end requests under way finish, then closes the connection."""

    def __init__(self, url: str, settings: CoordinatorSettings | None = None) -> None:
        super().__init__()
        self.url = url
        self.settings = settings or CoordinatorSettings()
        self.stats = CoordinatorStats()
        self.checks = CheckService(self.settings, self.stats)
        self.ends = EndHandler(self.stats)
        self.connection = CoordinatorConnection(url, self._opened, self._lost)
        self.loop = ConnectionLoop(self.connection, name="coordinator")
        self._connections = 0
        self._stopping = False
        self._wake = asyncio.Event()  # a stop: the check timer ends now
        self._timer: concurrent.futures.Future[None] | None = None

    def stop(self, timeout: float = 10.0) -> bool:
        return super().stop(timeout)

    def _start(self) -> None:
        self.loop.start()
        if not self.loop.wait_connected(START_TIMEOUT_S):
            self.loop.stop(1.0)
            raise TimeoutError(f"coordinator did not start within {START_TIMEOUT_S:g} s")
        self._timer = self.loop.submit(self._check_every())
        log.info("coordinator up: check every %.1f s", self.settings.check_interval_s)

    def _stop(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        try:
            self.loop.submit(self._quiesce()).result(timeout)
        except (concurrent.futures.TimeoutError, RuntimeError):
            log.warning("coordinator: the round or end requests under way did not finish")
        return self.loop.stop(max(0.0, deadline - time.monotonic()))

    def check_now(self, timeout: float = 30.0) -> None:
        """Run one check round now, from another thread, and wait for its end."""
        if not self.running:
            raise RuntimeError("the coordinator is not running")
        self.loop.submit(self.checks.check_round()).result(timeout)

    async def end_transaction(
        self, half_offset: int, state: str, *, group: str, transaction_id: str, msg_id: str
    ) -> bool:
        """EndHandler.end_transaction, on the loop (as an end request is settled)."""
        return await self.ends.end_transaction(
            half_offset, state, group=group, transaction_id=transaction_id, msg_id=msg_id
        )

    async def _opened(self, nc: Client) -> None:
        store = await HalfStore.open(nc, self.settings.file_reserved_time_s, self.stats)
        self.checks.store = store
        await self.ends.listen(nc, store)
        self._connections += 1
        if self._connections > 1:
            self.stats.reconnects += 1
            log.info("coordinator connected again")

    def _lost(self, error: Exception | None) -> None:
        log.warning("connection closed (%r): connecting again", error)
        self.loop.reconnect()

    async def _check_every(self) -> None:
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.settings.check_interval_s)
            if self._stopping:
                return
            nc = self.connection.nc
            if nc is None or nc.is_closed:
                continue  # the loop is connecting again
            try:
                await self.checks.check_round()
            except Exception:  # a bad round must not end the coordinator
                log.exception("check round failed; the next one starts from the saved offsets")

    async def _quiesce(self) -> None:
        """No more rounds (the one under way finishes) and no more end requests."""
        self._stopping = True
        self._wake.set()
        if self._timer is not None:
            await asyncio.wrap_future(self._timer)
        await self.ends.finish()


__all__ = [
    "OFFSETS_BUCKET",
    "SETTLED_BUCKET",
    "TAGS_HEADER",
    "Coordinator",
    "CoordinatorSettings",
    "CoordinatorStats",
    "Round",
    "build_remove_map",
    "end_refusal",
    "next_op_offset",
    "record_ttl",
]
