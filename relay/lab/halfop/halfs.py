"""The coordinator's store: the half, op and discarded streams and its two KV buckets.

``HalfStore`` is opened on each connection (streams and buckets made if missing) and is
what the end handler and the check service read and write through: halfs by offset, op
messages, discards, the saved consume offsets (OFFSETS_BUCKET) and the settlement
records (SETTLED_BUCKET: msg id -> the state it was settled as). The small functions
here are the rules both of them apply to a half.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from relay.brokers.nats import too_large
from relay.lab.halfop.link import ensure_streams
from relay.lab.halfop.oplog import BatchReader, allow_direct
from relay.lab.halfop.protocol import (
    BORN_TIMESTAMP,
    CHECK_MAX_TOPIC,
    CHECK_TIMES,
    HALF_OFFSET,
    HALF_TOPIC,
    OP_TAG,
    OP_TOPIC,
    PAYLOAD_IN_HALF,
    PGROUP,
    REAL_TOPIC,
    TRANSACTION_ID,
    UNIQ_KEY,
)
from relay.lab.halfop.settings import CoordinatorStats

log = logging.getLogger("relay.lab.halfop.coordinator")

OFFSETS_BUCKET = "RMQ_SYS_TRANS_OFFSETS"
SETTLED_BUCKET = "RMQ_SYS_TRANS_SETTLED"  # msg id -> the state it was settled as
TAGS_HEADER = "TAGS"
HALF_PROPERTIES = (REAL_TOPIC, PGROUP, UNIQ_KEY)  # a message without them is no half


@dataclass
class Half:
    offset: int
    headers: dict[str, str]
    data: bytes
    time: float = field(default=0.0)  # when the server stored it


def end_refusal(
    half: dict[str, str] | None, group: str, transaction_id: str, msg_id: str
) -> str | None:
    """Why an end request does not match its half (RocketMQ's checkPrepareMessage), or None."""
    if half is None:
        return "no half at this offset"
    if half.get(PGROUP) != group:
        return "producer group does not match"
    if half.get(TRANSACTION_ID) != transaction_id:
        return "transaction id does not match"
    if half.get(UNIQ_KEY) != msg_id:
        return "msg id does not match"
    return None


def no_half(headers: dict[str, str]) -> str:
    """Why a message in the half stream is no half (a property missing), or ''."""
    missing = [p for p in HALF_PROPERTIES if not headers.get(p)]
    return f"no half: no {', '.join(missing)}" if missing else ""


def header_number(headers: dict[str, str], name: str, default: float) -> float:
    """A numeric property, or ``default`` when it is missing or not a number."""
    try:
        return float(headers[name])
    except (KeyError, ValueError):
        return default


def half_age(half: Half) -> float:
    """Seconds since the producer sent it (its born time; the server's when it has none)."""
    return time.time() - header_number(half.headers, BORN_TIMESTAMP, half.time * 1000) / 1000


def record_ttl(setting: float, bucket_ttl: float | None) -> float:
    """How long a settlement's record surely lives: the setting, or the bucket's own
    TTL when it is shorter (a bucket made earlier keeps the TTL it was made with)."""
    return min(setting, bucket_ttl) if bucket_ttl else setting


def settled_key(msg_id: str) -> str:
    """A KV key for a msg id (KV keys allow letters, digits, '-', '_', '=', '.')."""
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in msg_id) or "_"


class HalfStore:
    """The streams and buckets of one connection (``open``), read and written by offset."""

    def __init__(
        self,
        nc: Client,
        ops: BatchReader,
        offsets: KeyValue,
        settled: KeyValue,
        record_ttl_s: float,
        stats: CoordinatorStats,
    ) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream(timeout=5)
        self.ops = ops
        self.offsets = offsets
        self.settled = settled
        self.record_ttl_s = record_ttl_s  # of the SETTLED bucket
        self.stats = stats

    @classmethod
    async def open(cls, nc: Client, reserved_s: float, stats: CoordinatorStats) -> HalfStore:
        """Make sure of the streams and buckets; settlement records live ``reserved_s``."""
        js = nc.jetstream(timeout=5)
        await ensure_streams(js)
        await allow_direct(js, OP_TOPIC)
        ops = BatchReader(nc, OP_TOPIC)
        await ops.start()
        offsets = await bucket(js, OFFSETS_BUCKET)
        settled = await bucket(js, SETTLED_BUCKET, ttl=reserved_s, direct=True)
        ttl = record_ttl(reserved_s, (await settled.status()).ttl)
        return cls(nc, ops, offsets, settled, ttl, stats)

    async def half(self, offset: int) -> Half | None:
        try:
            raw = await self.js.get_msg(HALF_TOPIC, offset)
        except nats.js.errors.NotFoundError:
            return None
        born = raw.time.timestamp() if raw.time else time.time()
        return Half(offset, dict(raw.headers or {}), raw.data or b"", born)

    async def last_seq(self, stream: str) -> int:
        return int((await self.js.stream_info(stream)).state.last_seq)

    async def offset(self, name: str) -> int:
        try:
            entry = await self.offsets.get(name)
        except nats.js.errors.KeyNotFoundError:
            return 1
        return int(entry.value or b"1")

    async def save_offset(self, name: str, value: int) -> None:
        await self.offsets.put(name, str(value).encode())

    async def settled_state(self, msg_id: str) -> bytes | None:
        """How another copy of this transaction's half was settled, if one was."""
        try:
            entry = await self.settled.get(settled_key(msg_id))
        except nats.js.errors.KeyNotFoundError:
            return None
        return entry.value or b""

    async def record_settled(self, msg_id: str, state: str) -> None:
        await self.settled.put(settled_key(msg_id), state.encode())

    async def write_op(self, half_offset: int, key: str) -> None:
        headers = {TAGS_HEADER: OP_TAG, UNIQ_KEY: key}
        await self.js.publish(OP_TOPIC, str(half_offset).encode(), headers=headers)
        self.stats.ops_written += 1

    def too_large(self, data: bytes, headers: dict[str, str]) -> str | None:
        return too_large(self.nc, data, headers)

    async def discard(self, half: Half) -> None:
        """Into TRANS_CHECK_MAX_TIME_TOPIC; without the payload when the copy would not
        fit (the payload stays in the half stream at HALF_OFFSET)."""
        headers = {**half.headers, HALF_OFFSET: str(half.offset)}
        data = half.data
        if self.too_large(data, headers):
            headers[PAYLOAD_IN_HALF], data = str(len(data)), b""
        if error := self.too_large(data, headers):
            log.error("half %d not recorded as discarded: %s", half.offset, error)
        else:
            await self.js.publish(CHECK_MAX_TOPIC, data, headers=headers)
        self.stats.discarded += 1
        log.warning(
            "half %d (%s) discarded after %s checks",
            half.offset,
            half.headers.get(UNIQ_KEY),
            half.headers.get(CHECK_TIMES),
        )

    async def discard_oversize(self, half: Half, what: str, error: str) -> None:
        self.stats.too_large += 1
        log.warning("half %d: %s would be too large (%s)", half.offset, what, error)
        await self.discard(half)


async def bucket(
    js: JetStreamContext, name: str, ttl: float | None = None, direct: bool = False
) -> KeyValue:
    """The bucket, made if missing; ``direct``: its gets are direct gets (lighter on
    the server than the stream API's), for a bucket read once per end request."""
    try:
        kv = await js.key_value(name)
    except nats.js.errors.BucketNotFoundError:
        kv = await js.create_key_value(bucket=name, ttl=ttl)
    if not direct:
        return kv
    await allow_direct(js, f"KV_{name}")
    return await js.key_value(name)  # nats-py reads allow_direct here
