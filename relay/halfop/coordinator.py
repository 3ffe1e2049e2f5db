"""Model B's broker side: end-transaction handling and the check-back service.

RocketMQ keeps this inside its broker; here it is a process (``outbox coordinator``)
over JetStream streams that stand in for the commit log. Messages are never changed
in place: an op message (tag ``d``, body = half offset) is how a half is marked done.

End transaction: COMMIT rebuilds the real message from the half (real topic, the
app's headers, msg_id as ``Nats-Msg-Id``), publishes it, then writes the op;
ROLLBACK writes only the op; UNKNOW does nothing (check-back will ask).

Check service, every ``check_interval_s``: build a removeMap from op messages read 32
at a time; walk the halfs from the half consume offset; skip removed ones; discard
those checked ``check_max`` times or older than ``file_reserved_time_s`` into
TRANS_CHECK_MAX_TIME_TOPIC; stop at the first one younger than its immunity time
(``transaction_timeout_s`` or CHECK_IMMUNITY_TIME); put the others back at the end of
the half stream with their check count raised, and ask one producer of the group.
Consume offsets live in a KV bucket, so a restarted coordinator resumes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from relay.brokers.nats import DEDUP_HEADER
from relay.halfop.link import ensure_streams
from relay.halfop.protocol import (
    BORN_TIMESTAMP,
    CHECK_IMMUNITY_TIME,
    CHECK_MAX_TOPIC,
    CHECK_SUBJECT,
    CHECK_TIMES,
    COMMIT_OR_ROLLBACK,
    END_SUBJECT,
    HALF_OFFSET,
    HALF_TOPIC,
    OP_TAG,
    OP_TOPIC,
    PGROUP,
    REAL_TOPIC,
    SYSTEM_PROPERTIES,
    TRAN_MSG,
    UNIQ_KEY,
    LocalTransactionState,
)

log = logging.getLogger("relay.halfop.coordinator")

OFFSETS_BUCKET = "RMQ_SYS_TRANS_OFFSETS"
SETTLED_BUCKET = "RMQ_SYS_TRANS_SETTLED"  # msg ids settled by a late end request
SETTLING_STATES = (
    LocalTransactionState.COMMIT_MESSAGE.value,
    LocalTransactionState.ROLLBACK_MESSAGE.value,
)
OP_BATCH = 32  # op messages read at a time, as RocketMQ pulls them
TAGS_HEADER = "TAGS"
MAX_CONCURRENT_ENDS = 256


@dataclass(frozen=True)
class CoordinatorSettings:
    check_interval_s: float = 60.0
    transaction_timeout_s: float = 6.0
    check_max: int = 15
    file_reserved_time_s: float = 72 * 3600.0


@dataclass
class CoordinatorStats:
    halfs_written: int = 0  # put back by the check service
    ops_written: int = 0
    commits: int = 0
    rollbacks: int = 0
    unknown: int = 0
    check_requests: int = 0
    discarded: int = 0
    rounds: int = 0


def build_remove_map(
    ops: Iterable[tuple[int, int]], half_offset: int
) -> tuple[dict[int, list[int]], list[int]]:
    """removeMap (half offset -> its op offsets) of halfs at or past ``half_offset`` that
    are done, and the op offsets that only concern halfs already walked past (done ops).

    ``ops`` are (op offset, half offset) pairs in any order, from any number of batches;
    a half may have more than one op (an end request and a check answer both settled it).
    """
    remove: dict[int, list[int]] = {}
    done: list[int] = []
    for op_offset, half in ops:
        if half < half_offset:
            done.append(op_offset)
        else:
            remove.setdefault(half, []).append(op_offset)
    return remove, done


def header_number(headers: dict[str, str], name: str, default: float) -> float:
    """A numeric property, or ``default`` when it is missing or not a number."""
    try:
        return float(headers[name])
    except (KeyError, ValueError):
        return default


def settled_key(msg_id: str) -> str:
    """A KV key for a msg id (KV keys allow letters, digits, '-', '_', '=', '.')."""
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in msg_id) or "_"


def next_op_offset(op_offset: int, done: Iterable[int]) -> int:
    """Advance past the run of done op offsets that starts at ``op_offset``."""
    finished = set(done)
    while op_offset in finished:
        op_offset += 1
    return op_offset


@dataclass
class _Half:
    offset: int
    headers: dict[str, str]
    data: bytes
    time: float = field(default=0.0)


class Coordinator:
    def __init__(self, url: str, settings: CoordinatorSettings | None = None) -> None:
        self.url = url
        self.settings = settings or CoordinatorSettings()
        self.stats = CoordinatorStats()
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._kv: KeyValue | None = None
        self._settled: KeyValue | None = None
        self._walked_to = 1  # the half consume offset as of the last round
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._check_lock = asyncio.Lock()

    # -- lifecycle (a thread of its own, or `await run()` from a CLI) ----------------

    def start(self, timeout: float = 10.0) -> None:
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self.run()), name="coordinator", daemon=True
        )
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("coordinator did not start")

    def stop(self, timeout: float = 10.0) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop ended meanwhile
                self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._check_lock = asyncio.Lock()
        self._end_slots = asyncio.Semaphore(MAX_CONCURRENT_ENDS)
        self._ending: set[asyncio.Task[None]] = set()
        nc = await nats.connect(
            servers=[self.url], name="outbox-coordinator", max_reconnect_attempts=-1
        )
        self._nc, self._js = nc, nc.jetstream(timeout=5)
        await ensure_streams(self._js)
        self._kv = await self._bucket(OFFSETS_BUCKET)
        self._settled = await self._bucket(SETTLED_BUCKET, ttl=self.settings.file_reserved_time_s)
        await nc.subscribe(END_SUBJECT, queue="outbox-coordinator", cb=self._on_end)
        self._ready.set()
        log.info("coordinator up: check every %.1f s", self.settings.check_interval_s)
        try:
            while not self._stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.settings.check_interval_s)
                if not self._stop.is_set():
                    try:
                        await self.check_round()
                    except Exception:  # a bad round must not end the coordinator
                        log.exception(
                            "check round failed; the next one starts from the saved offsets"
                        )
        finally:
            if self._ending:
                await asyncio.gather(*list(self._ending), return_exceptions=True)
            await nc.drain()

    async def _bucket(self, name: str, ttl: float | None = None) -> KeyValue:
        assert self._js is not None
        try:
            return await self._js.key_value(name)
        except nats.js.errors.BucketNotFoundError:
            return await self._js.create_key_value(bucket=name, ttl=ttl)

    # -- end transaction ------------------------------------------------------------

    async def _on_end(self, msg: Msg) -> None:
        """nats-py runs a subscription's callbacks one at a time: hand each off to a task."""
        await self._end_slots.acquire()
        task = asyncio.get_running_loop().create_task(self._handle_end(msg))
        self._ending.add(task)
        task.add_done_callback(self._end_done)

    def _end_done(self, task: asyncio.Task[None]) -> None:
        self._ending.discard(task)
        self._end_slots.release()

    async def _handle_end(self, msg: Msg) -> None:
        headers = dict(msg.headers or {})
        try:
            offset = int(headers.get(HALF_OFFSET, ""))
        except ValueError:
            log.warning("end request without a half offset: %s", headers)
            return
        state = headers.get(COMMIT_OR_ROLLBACK, "")
        try:
            await self.end_transaction(offset, state)
        except Exception:  # check-back settles it later
            log.exception("end transaction for half %d failed", offset)

    async def end_transaction(self, half_offset: int, state: str) -> None:
        if state not in SETTLING_STATES:
            self.stats.unknown += 1
            return
        half = await self._half(half_offset)
        if half is None:
            return
        key = half.headers.get(UNIQ_KEY, "")
        if state == LocalTransactionState.COMMIT_MESSAGE.value:
            await self._publish_real(half)
            self.stats.commits += 1
        else:
            self.stats.rollbacks += 1
        if half_offset < self._walked_to:
            # The check service already put this half back as a newer copy: remember
            # the outcome so that copy is finished, not checked and delivered again.
            assert self._settled is not None
            await self._settled.put(settled_key(key), state.encode())
        await self._write_op(half_offset, key)

    async def _publish_real(self, half: _Half) -> None:
        assert self._js is not None
        headers = {
            k: v for k, v in half.headers.items() if k not in SYSTEM_PROPERTIES and k != UNIQ_KEY
        }
        headers[DEDUP_HEADER] = half.headers.get(UNIQ_KEY, "")  # a second commit is dropped
        real_topic = half.headers.get(REAL_TOPIC)
        if not real_topic:
            raise ValueError(f"half {half.offset} has no {REAL_TOPIC}")
        await self._js.publish(real_topic, half.data, headers=headers)

    async def _write_op(self, half_offset: int, key: str) -> None:
        assert self._js is not None
        headers = {TAGS_HEADER: OP_TAG, UNIQ_KEY: key}
        await self._js.publish(OP_TOPIC, str(half_offset).encode(), headers=headers)
        self.stats.ops_written += 1

    # -- check-back -----------------------------------------------------------------

    async def check_round(self) -> None:
        """One pass of the check service; offsets advance only past settled halfs."""
        async with self._check_lock:
            self.stats.rounds += 1
            half_offset = await self._offset("half")
            op_offset = await self._offset("op")
            last_half = await self._last_seq(HALF_TOPIC)
            ops = await self._ops_from(op_offset)
            remove, done = build_remove_map(ops, half_offset)
            new_half = half_offset
            self._walked_to = half_offset
            for offset in range(half_offset, last_half + 1):
                if offset in remove:
                    done += remove.pop(offset)
                    new_half = offset + 1
                    continue
                if not await self._settle_unfinished(offset):
                    break  # too young: this one and all after it wait for the next round
                new_half = offset + 1
            await self._save_offset("half", new_half)
            await self._save_offset("op", next_op_offset(op_offset, done))
            self._walked_to = new_half

    async def _settle_unfinished(self, offset: int) -> bool:
        """Discard, put back and ask, or (returning False) leave for the next round."""
        half = await self._half(offset)
        if half is None:
            return True  # gone from the stream: nothing to settle
        if await self._settled_earlier(half):
            return True
        check_times = int(header_number(half.headers, CHECK_TIMES, 0))
        age = time.time() - header_number(half.headers, BORN_TIMESTAMP, half.time * 1000) / 1000
        if check_times >= self.settings.check_max or age > self.settings.file_reserved_time_s:
            await self._discard(half)
            return True
        if CHECK_IMMUNITY_TIME in half.headers:
            # Its own immunity: put it back unchecked and go on with the halfs behind it.
            if age < header_number(half.headers, CHECK_IMMUNITY_TIME, 0):
                await self._put_back(half, check_times)
                return True
        elif age < self.settings.transaction_timeout_s:
            return False  # too young; all behind it are younger still
        await self._put_back_and_check(half, check_times + 1)
        return True

    async def _settled_earlier(self, half: _Half) -> bool:
        """A late end request settled an older copy of this half: finish this copy too."""
        assert self._settled is not None
        try:
            entry = await self._settled.get(settled_key(half.headers.get(UNIQ_KEY, "")))
        except nats.js.errors.KeyNotFoundError:
            return False
        await self._write_op(half.offset, half.headers.get(UNIQ_KEY, ""))
        log.info("half %d settled earlier as %s", half.offset, (entry.value or b"").decode())
        return True

    async def _discard(self, half: _Half) -> None:
        assert self._js is not None
        await self._js.publish(
            CHECK_MAX_TOPIC, half.data, headers={**half.headers, HALF_OFFSET: str(half.offset)}
        )
        self.stats.discarded += 1
        log.warning(
            "half %d (%s) discarded after %s checks",
            half.offset,
            half.headers.get(UNIQ_KEY),
            half.headers.get(CHECK_TIMES),
        )

    async def _put_back(self, half: _Half, check_times: int) -> tuple[int, dict[str, str]]:
        """Write the half again at the end of the half stream (the base of later checks)."""
        assert self._js is not None
        headers = {**half.headers, CHECK_TIMES: str(check_times), TRAN_MSG: "true"}
        headers.pop(DEDUP_HEADER, None)  # the producer's half id: the server would drop a copy
        ack = await self._js.publish(HALF_TOPIC, half.data, headers=headers)
        self.stats.halfs_written += 1
        return int(ack.seq), headers

    async def _put_back_and_check(self, half: _Half, check_times: int) -> None:
        assert self._nc is not None
        seq, headers = await self._put_back(half, check_times)
        group = headers.get(PGROUP, "")
        request = {**headers, HALF_OFFSET: str(seq)}
        await self._nc.publish(f"{CHECK_SUBJECT}.{group}", half.data, headers=request)
        self.stats.check_requests += 1

    # -- stream access ----------------------------------------------------------------

    async def _half(self, offset: int) -> _Half | None:
        assert self._js is not None
        try:
            raw = await self._js.get_msg(HALF_TOPIC, offset)
        except nats.js.errors.NotFoundError:
            return None
        born = raw.time.timestamp() if raw.time else time.time()
        return _Half(offset, dict(raw.headers or {}), raw.data or b"", born)

    async def _ops_from(self, op_offset: int) -> list[tuple[int, int]]:
        assert self._js is not None
        last = await self._last_seq(OP_TOPIC)
        ops: list[tuple[int, int]] = []
        for start in range(op_offset, last + 1, OP_BATCH):
            seqs = range(start, min(start + OP_BATCH, last + 1))
            batch = await asyncio.gather(
                *(self._js.get_msg(OP_TOPIC, s) for s in seqs), return_exceptions=True
            )
            for seq, raw in zip(seqs, batch, strict=True):
                if isinstance(raw, nats.js.errors.NotFoundError):
                    continue
                if isinstance(raw, BaseException):
                    raise raw
                if (raw.headers or {}).get(TAGS_HEADER) == OP_TAG:
                    ops.append((seq, int(raw.data or b"0")))
        return ops

    async def _last_seq(self, stream: str) -> int:
        assert self._js is not None
        return int((await self._js.stream_info(stream)).state.last_seq)

    async def _offset(self, name: str) -> int:
        assert self._kv is not None
        try:
            entry = await self._kv.get(name)
        except nats.js.errors.KeyNotFoundError:
            return 1
        return int(entry.value or b"1")

    async def _save_offset(self, name: str, value: int) -> None:
        assert self._kv is not None
        await self._kv.put(name, str(value).encode())


__all__ = [
    "Coordinator",
    "CoordinatorSettings",
    "build_remove_map",
    "next_op_offset",
]
