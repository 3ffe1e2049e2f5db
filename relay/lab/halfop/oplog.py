"""The check service's reading of the op stream, and its bookkeeping.

RocketMQ's ``fillOpRemoveMap``, ``isNeedCheck`` and ``calculateOpOffset`` as small
functions (no I/O), and ``BatchReader``, which pulls op messages 32 to a request.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext

OP_BATCH = 32  # op messages per pull, as RocketMQ pulls them
DIRECT_GET = "$JS.API.DIRECT.GET"
END_OF_BATCH = "204"
NO_MESSAGE = "404"
MAX_OFFSET_DIGITS = 20  # a stream sequence is a uint64


@dataclass(frozen=True)
class Op:
    offset: int  # its sequence in the op stream
    half: int | None  # the half offset its body names; None: it names none
    born: float  # when the server stored it, seconds since the epoch
    problem: str = ""  # why it names no half (when ``half`` is None)


def fill_remove_map(
    remove: dict[int, list[int]], done: list[int], ops: Iterable[Op], half_offset: int
) -> None:
    """Add ``ops`` to removeMap (half offset -> its op offsets, for halfs at or past
    ``half_offset``) or to ``done`` (ops of halfs already walked past, and messages
    that are no op: counting them done keeps the op offset from sticking there)."""
    for op in ops:
        if op.half is None or op.half < half_offset:
            done.append(op.offset)
        else:
            remove.setdefault(op.half, []).append(op.offset)


def build_remove_map(
    ops: Iterable[tuple[int, int]], half_offset: int
) -> tuple[dict[int, list[int]], list[int]]:
    """``fill_remove_map`` from empty, for (op offset, half offset) pairs.

    A half may have more than one op (an end request and a check answer both settled it).
    """
    remove: dict[int, list[int]] = {}
    done: list[int] = []
    fill_remove_map(remove, done, (Op(o, h, 0.0) for o, h in ops), half_offset)
    return remove, done


def need_check(
    *,
    last_op_born: float | None,
    age_s: float,
    immunity_s: float,
    round_started: float,
    timeout_s: float,
) -> bool:
    """RocketMQ's isNeedCheck for a half not in the removeMap.

    ``last_op_born``: the last op of the latest pull, None when that pull found none.
    False means its op may be among the ops not read yet: pull the next batch first.
    """
    if age_s < 0:
        return True  # born in the future: a clock is off, ask rather than wait
    if last_op_born is None:
        return age_s > immunity_s
    return last_op_born - round_started > timeout_s


def no_real_half(op: Op, last_half: int) -> str:
    """Why ``op`` cannot name a real half, or '' when it may.

    ``last_half``: the half stream's last offset, read after ``op`` was pulled. A half is
    stored before its op, so an op naming a half past it names one that never was.
    """
    if op.half is None:
        return op.problem or "it names no half"
    if op.half < 1:
        return f"half offset {op.half} is below 1"
    if op.half > last_half:
        return f"half offset {op.half} is past the half stream's last, {last_half}"
    return ""


def missing_offsets(start: int, ops: list[Op]) -> list[int]:
    """The op offsets from ``start`` up to the last of ``ops`` that the stream no longer
    holds (deleted, or purged by a limit): done, or the op offset would stick there."""
    present = {op.offset for op in ops}
    return [o for o in range(start, ops[-1].offset) if o not in present] if ops else []


def next_op_offset(op_offset: int, done: Iterable[int]) -> int:
    """Advance past the run of done op offsets that starts at ``op_offset``."""
    finished = set(done)
    while op_offset in finished:
        op_offset += 1
    return op_offset


def op_of(msg: Msg, tag_header: str, tag: str) -> Op:
    """An op from a message of a batched direct get."""
    headers = msg.headers or {}
    seq = int(headers["Nats-Sequence"])
    stamp = headers.get("Nats-Time-Stamp", "")
    born = datetime.fromisoformat(stamp).timestamp() if stamp else 0.0
    if headers.get(tag_header) != tag:
        return Op(seq, None, born, f"no {tag_header}: {tag} (not an op)")
    body = msg.data or b""
    # Only what the coordinator writes, str(offset): int() would also take "+1", " 1",
    # "1_0" and, past 4,300 digits, raise.
    if not body.isdigit() or len(body) > MAX_OFFSET_DIGITS:
        return Op(seq, None, born, f"its body {body[:24]!r} is no half offset")
    return Op(seq, int(body), born)


class BatchReader:
    """Reads a stream from a sequence, up to ``batch`` messages in one request.

    JetStream's batched direct get (ADR-31, nats-server 2.11+, a stream with
    ``allow_direct``); nats-py has no call for it, so the messages come to one
    wildcard inbox, a token per request, followed by an end-of-batch status.
    Stateless on the server, unlike a consumer made for each round.
    """

    def __init__(self, nc: Client, stream: str, timeout: float = 5.0) -> None:
        self._nc = nc
        self._stream = stream
        self._timeout = timeout
        self._prefix = nc.new_inbox()
        self._tokens = itertools.count(1)
        self._waiting: dict[str, asyncio.Queue[Msg]] = {}
        self._sub: Subscription | None = None
        self.requests = 0

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(f"{self._prefix}.*", cb=self._arrived)

    async def _arrived(self, msg: Msg) -> None:
        queue = self._waiting.get(msg.subject)
        if queue is not None:  # else: a request that timed out
            queue.put_nowait(msg)

    async def read(self, seq: int, batch: int = OP_BATCH) -> list[Msg]:
        """The messages from ``seq`` on (fewer at the stream's end, none past it)."""
        reply = f"{self._prefix}.{next(self._tokens)}"
        queue: asyncio.Queue[Msg] = asyncio.Queue()
        self._waiting[reply] = queue
        try:
            request = json.dumps({"seq": seq, "batch": batch}).encode()
            await self._nc.publish(f"{DIRECT_GET}.{self._stream}", request, reply=reply)
            self.requests += 1
            return await asyncio.wait_for(self._collect(queue), self._timeout)
        finally:
            del self._waiting[reply]

    @staticmethod
    async def _collect(queue: asyncio.Queue[Msg]) -> list[Msg]:
        msgs: list[Msg] = []
        while True:
            msg = await queue.get()
            status = (msg.headers or {}).get("Status")
            if status is None:
                msgs.append(msg)
            elif status in (END_OF_BATCH, NO_MESSAGE):
                return msgs
            else:
                description = (msg.headers or {}).get("Description", "")
                raise RuntimeError(f"direct get answered {status} {description}")


async def allow_direct(js: JetStreamContext, stream: str) -> None:
    """Turn on direct gets for ``stream`` (BatchReader needs them); a no-op when on."""
    info = await js.stream_info(stream)
    if not info.config.allow_direct:
        info.config.allow_direct = True
        await js.update_stream(info.config)
