"""The NATS side of model B shared by producers and the coordinator.

A producer sends halfs to the half stream (synchronously: the JetStream ack is the
broker's SEND_OK and its sequence is the half offset), sends end-transaction
requests one-way, and answers check requests arriving on a queue-group subscription,
so that exactly one live producer of a group gets each.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import nats
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from outbox.errors import PayloadTooLarge
from relay.brokers.nats import too_large
from relay.halfop.protocol import (
    CHECK_MAX_TOPIC,
    CHECK_SUBJECT,
    COMMIT_OR_ROLLBACK,
    END_SUBJECT,
    HALF_OFFSET,
    HALF_TOPIC,
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

log = logging.getLogger("relay.halfop")

STREAMS = {HALF_TOPIC: [HALF_TOPIC], OP_TOPIC: [OP_TOPIC], CHECK_MAX_TOPIC: [CHECK_MAX_TOPIC]}


async def ensure_streams(js: JetStreamContext, names: list[str] | None = None) -> None:
    for name in names or list(STREAMS):
        try:
            await js.stream_info(name)
        except nats.js.errors.NotFoundError:
            with contextlib.suppress(nats.js.errors.BadRequestError):  # created meanwhile
                await js.add_stream(name=name, subjects=STREAMS[name])


class _Connection:
    """Holds the NATS connection on a ConnectionLoop; the link publishes through ``nc``."""

    def __init__(self, url: str, on_connect: Callable[[Client], object]) -> None:
        self.url = url
        self.nc: Client | None = None
        self._on_connect = on_connect

    async def connect(self) -> None:
        nc = await nats.connect(
            servers=[self.url], reconnect_time_wait=0.2, max_reconnect_attempts=-1
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

    async def close(self) -> None:
        nc, self.nc = self.nc, None
        if nc is not None and not nc.is_closed:
            await nc.close()


class ProducerLink:
    def __init__(
        self, url: str, group: str, on_check: Callable[[TransactionMessage], None]
    ) -> None:
        self.group = group
        self._on_check = on_check
        self._conn = _Connection(url, self._subscribe)
        self._loop = ConnectionLoop(self._conn, name=f"halfop-{group}")
        self._ready: asyncio.Event | None = None
        # TransactionProducer.drop_end_requests: phase-2 end requests never leave.
        self.drop_end_requests = False
        self.ends_sent = 0

    def start(self, timeout: float) -> None:
        self._loop.start()
        self._loop.submit(self._wait_connected()).result(timeout)

    def stop(self, timeout: float) -> None:
        self._loop.stop(timeout)

    async def _wait_connected(self) -> None:
        while self._conn.nc is None or not self._conn.nc.is_connected:
            await asyncio.sleep(0.01)

    async def _subscribe(self, nc: Client) -> None:
        await ensure_streams(nc.jetstream(), [HALF_TOPIC])
        await nc.subscribe(
            f"{CHECK_SUBJECT}.{self.group}", queue=self.group, cb=self._check_request
        )

    async def _check_request(self, msg: Msg) -> None:
        headers = dict(msg.headers or {})
        offset = int(headers.get(HALF_OFFSET, "0") or 0)
        self._on_check(message_from_half(headers, msg.data, offset))

    def send_half(self, msg: TransactionMessage, timeout: float) -> int:
        """Store the half; returns its offset. Raises when the broker did not take it."""
        return self._loop.submit(self._send_half(msg, timeout)).result(timeout + 1)

    async def _send_half(self, msg: TransactionMessage, timeout: float) -> int:
        nc = self._conn.nc
        if nc is None or not nc.is_connected:
            raise ConnectionError("not connected to NATS")
        headers = half_headers(msg, self.group)
        if error := too_large(nc, msg.payload, headers):
            raise PayloadTooLarge("payload", error)  # with the headers, over the server's limit
        ack = await nc.jetstream().publish(
            HALF_TOPIC, msg.payload, timeout=timeout, headers=headers
        )
        return int(ack.seq)

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
