"""The NATS side of model B shared by producers and the coordinator.

A producer sends halfs to the half stream (synchronously: the JetStream ack is the
broker's SEND_OK and its sequence is the half offset), sends end-transaction
requests one-way, and answers check requests arriving on a queue-group subscription,
so that exactly one live producer of a group gets each.

A half carries its transaction id as ``Nats-Msg-Id``: a second attempt after a lost
ack is dropped by the server, whose ack then names the first copy's sequence. The
link survives the server closing its connection for good (nats-py gives up after some
``-ERR``s, e.g. a maximum payload violation): it connects again, subscribes again and
ensures the half stream, as at start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import PubAck

from outbox.errors import OutboxError, PayloadTooLarge
from relay.brokers.nats import DEDUP_HEADER, PERMANENT_ERRORS, too_large
from relay.lab.halfop.protocol import (
    CHECK_MAX_TOPIC,
    CHECK_SUBJECT,
    COMMIT_OR_ROLLBACK,
    END_SUBJECT,
    HALF_OFFSET,
    HALF_TOPIC,
    HEADER_HEADROOM,
    OP_TOPIC,
    PGROUP,
    TRANSACTION_ID,
    UNIQ_KEY,
    LocalTransactionState,
    TransactionMessage,
    half_headers,
    message_from_half,
)
from relay.loop import ConnectionLoop

log = logging.getLogger("relay.lab.halfop")

STREAMS = {HALF_TOPIC: [HALF_TOPIC], OP_TOPIC: [OP_TOPIC], CHECK_MAX_TOPIC: [CHECK_MAX_TOPIC]}


async def ensure_streams(js: JetStreamContext, names: list[str] | None = None) -> None:
    for name in names or list(STREAMS):
        try:
            await js.stream_info(name)
        except nats.js.errors.NotFoundError:
            with contextlib.suppress(nats.js.errors.BadRequestError):  # created meanwhile
                await js.add_stream(name=name, subjects=STREAMS[name])


def worth_retrying(exc: BaseException) -> bool:
    """Whether sending the half again may succeed: a timeout, no connection, JetStream
    unavailable; never bad input (too large, bad subject, a 400 from JetStream)."""
    if isinstance(exc, (OutboxError, *PERMANENT_ERRORS, nats.js.errors.BadRequestError)):
        return False
    return isinstance(exc, (TimeoutError, OSError, nats.errors.Error))


class _Connection:
    """Holds the NATS connection on a ConnectionLoop; the link publishes through ``nc``.

    ``on_lost(error)`` runs (on the loop) when the client closed the connection for good
    by itself, not by ``close()``."""

    def __init__(
        self,
        url: str,
        on_connect: Callable[[Client], object],
        on_lost: Callable[[Exception | None], None],
    ) -> None:
        self.url = url
        self.nc: Client | None = None
        self._on_connect = on_connect
        self._on_lost = on_lost
        self._closing = False

    async def connect(self) -> None:
        nc = await nats.connect(
            servers=[self.url],
            reconnect_time_wait=0.2,
            max_reconnect_attempts=-1,
            closed_cb=self._closed,
        )
        try:
            result = self._on_connect(nc)
            if asyncio.iscoroutine(result):
                await result
        except BaseException:
            await nc.close()
            raise
        # Only now: start() waits for nc, and the half stream must exist by then.
        self.nc = nc

    async def _closed(self) -> None:
        # Every client's closed_cb lands here: act only when the current one closed.
        nc = self.nc
        if nc is not None and nc.is_closed and not self._closing:
            self._on_lost(nc.last_error)

    async def close(self) -> None:
        self._closing = True
        nc, self.nc = self.nc, None
        if nc is not None and not nc.is_closed:
            await nc.close()


class ProducerLink:
    def __init__(
        self, url: str, group: str, on_check: Callable[[TransactionMessage], None]
    ) -> None:
        self.group = group
        self._on_check = on_check
        self._conn = _Connection(url, self._subscribe, self._lost)
        self._loop = ConnectionLoop(self._conn, name=f"halfop-{group}")
        # TransactionProducer.drop_end_requests: phase-2 end requests never leave.
        self.drop_end_requests = False
        self.ends_sent = 0
        self.reconnects = 0  # new connections after the client gave one up

    def start(self, timeout: float) -> None:
        self._loop.start()
        self._loop.submit(self._wait_connected()).result(timeout)

    def stop(self, timeout: float) -> None:
        self._loop.stop(timeout)

    async def _wait_connected(self) -> Client:
        while (nc := self._conn.nc) is None or not nc.is_connected:
            await asyncio.sleep(0.01)
        return nc

    async def _jetstream_ready(self) -> Client:
        while True:
            nc = await self._wait_connected()
            try:
                await ensure_streams(nc.jetstream(), [HALF_TOPIC])
                return nc
            except (TimeoutError, nats.errors.Error):  # e.g. no responders: not up yet
                await asyncio.sleep(0.05)

    def _lost(self, error: Exception | None) -> None:
        self.reconnects += 1
        self._loop.outage.failed(f"connection closed by the client ({error!r}); connecting anew")
        self._loop.reconnect()

    async def _subscribe(self, nc: Client) -> None:
        await ensure_streams(nc.jetstream(), [HALF_TOPIC])
        await nc.subscribe(
            f"{CHECK_SUBJECT}.{self.group}", queue=self.group, cb=self._check_request
        )

    async def _check_request(self, msg: Msg) -> None:
        headers = dict(msg.headers or {})
        offset = int(headers.get(HALF_OFFSET, "0") or 0)
        self._on_check(message_from_half(headers, msg.data, offset))

    def send_half(self, msg: TransactionMessage, timeout: float, retry: bool = False) -> PubAck:
        """One attempt to store the half, within ``timeout``; raises when the broker did
        not take it. It first waits for the connection while it is down; a ``retry``
        also waits for JetStream to answer (just after a restart it has no responders),
        and creates the half stream if it is gone."""
        future = self._loop.submit(self._send_half(msg, timeout, retry))
        try:
            return future.result(timeout + 1)
        except TimeoutError:
            future.cancel()  # a stuck loop must not publish this attempt after the next one
            raise

    async def _send_half(self, msg: TransactionMessage, timeout: float, retry: bool) -> PubAck:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        ready = self._jetstream_ready() if retry else self._wait_connected()
        try:
            nc = await asyncio.wait_for(ready, timeout)
        except TimeoutError:
            raise ConnectionError(f"not connected to NATS JetStream within {timeout:g} s") from None
        headers = {**half_headers(msg, self.group), DEDUP_HEADER: msg.transaction_id}
        if error := too_large(nc, msg.payload, headers, HEADER_HEADROOM):
            raise PayloadTooLarge("payload", error)  # no room for the coordinator's copies
        return await nc.jetstream().publish(
            HALF_TOPIC, msg.payload, timeout=max(deadline - loop.time(), 0.01), headers=headers
        )

    def end_transaction(
        self, msg: TransactionMessage, state: LocalTransactionState, check_answer: bool = False
    ) -> None:
        """One-way: queued for sending, no answer awaited (lost if the process dies now)."""
        if self.drop_end_requests and not check_answer:
            return
        loop = self._loop.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(lambda: loop.create_task(self._send_end(msg, state)))

    async def _send_end(self, msg: TransactionMessage, state: LocalTransactionState) -> None:
        nc = self._conn.nc
        if nc is None:
            return
        headers = {
            HALF_OFFSET: str(msg.half_offset),
            COMMIT_OR_ROLLBACK: state.value,
            TRANSACTION_ID: msg.transaction_id,
            UNIQ_KEY: msg.msg_id,
            PGROUP: self.group,
        }
        try:
            await nc.publish(END_SUBJECT, b"", headers=headers)
            self.ends_sent += 1
        except Exception as exc:  # one-way: check-back covers a lost request
            log.warning("end-transaction request for %s not sent: %r", msg.msg_id, exc)
