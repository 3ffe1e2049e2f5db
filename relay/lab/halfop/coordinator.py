"""Model B's broker side: end-transaction handling and the check-back service.

RocketMQ keeps this inside its broker; here it is a process (``outbox coordinator``)
over JetStream streams that stand in for the commit log. Messages are never changed
in place: an op message (tag ``d``, body = half offset) is how a half is marked done.

End transaction: the request must match its half (producer group, transaction id,
msg id: RocketMQ's checkPrepareMessage), else it is refused. COMMIT rebuilds the real
message from the half (real topic, the app's headers, msg_id as ``Nats-Msg-Id``),
publishes it, records the outcome (the SETTLED bucket), then writes the op; ROLLBACK
records and writes the op; UNKNOW does nothing (check-back will ask). A transaction on
record is not settled again: a replayed request, or another copy's answer, only gets
its op. A request for a half older than a record lives is refused.

Check service, every ``check_interval_s`` (RocketMQ 4.x TransactionalMessageServiceImpl
.check): pull 32 op messages from the op consume offset into a removeMap (a message that
cannot name a real half is skipped and passed); walk the
halfs from the half consume offset: a half in the removeMap is done; discard those
checked ``check_max`` times or older than ``file_reserved_time_s`` into
TRANS_CHECK_MAX_TIME_TOPIC; stop at a half stored after the round began or younger
than its immunity (``transaction_timeout_s`` or CHECK_IMMUNITY_TIME); for the others,
while its op may still be unread (``oplog.need_check``) pull the next 32 ops, then put
it back at the end of the half stream with its check count raised and ask one
producer of the group. A round stops after ``max_round_s``; offsets are saved at its
end (the op offset past the contiguous done ops) in a KV bucket, so the next round
and a restarted coordinator resume there. The connection is made again when the
server closes it for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from outbox.errors import ConfigError
from relay.brokers.nats import DEDUP_HEADER, too_large
from relay.lab.halfop.link import ensure_streams
from relay.lab.halfop.oplog import (
    OP_BATCH,
    BatchReader,
    Op,
    allow_direct,
    build_remove_map,
    fill_remove_map,
    missing_offsets,
    need_check,
    next_op_offset,
    no_real_half,
    op_of,
)
from relay.lab.halfop.protocol import (
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
    PAYLOAD_IN_HALF,
    PGROUP,
    REAL_TOPIC,
    SYSTEM_PROPERTIES,
    TRAN_MSG,
    TRANSACTION_ID,
    UNIQ_KEY,
    LocalTransactionState,
)

log = logging.getLogger("relay.lab.halfop.coordinator")

OFFSETS_BUCKET = "RMQ_SYS_TRANS_OFFSETS"
SETTLED_BUCKET = "RMQ_SYS_TRANS_SETTLED"  # msg id -> the state it was settled as
SETTLING_STATES = (
    LocalTransactionState.COMMIT_MESSAGE.value,
    LocalTransactionState.ROLLBACK_MESSAGE.value,
)
TAGS_HEADER = "TAGS"
MAX_CONCURRENT_ENDS = 256
WIDEST_OFFSET = str(2**64 - 1)  # a size check before the put-back gives the real one
HALF_PROPERTIES = (REAL_TOPIC, PGROUP, UNIQ_KEY)  # a message without them is no half


@dataclass(frozen=True)
class CoordinatorSettings:
    check_interval_s: float = 60.0
    transaction_timeout_s: float = 6.0
    check_max: int = 15
    file_reserved_time_s: float = 72 * 3600.0
    max_round_s: float = 60.0  # RocketMQ's MAX_PROCESS_TIME_LIMIT
    half_read_retries: int = 1  # RocketMQ's MAX_RETRY_COUNT_WHEN_HALF_NULL

    def __post_init__(self) -> None:
        for name in ("check_interval_s", "transaction_timeout_s", "file_reserved_time_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}: must be above 0, got {getattr(self, name)!r}")
        if not self.max_round_s > 0:
            raise ConfigError(f"max_round_s: must be above 0, got {self.max_round_s!r}")
        if self.check_max < 1:
            raise ConfigError(f"check_max: must be at least 1, got {self.check_max!r}")
        if self.half_read_retries < 0:
            raise ConfigError(
                f"half_read_retries: must be 0 or more, got {self.half_read_retries!r}"
            )


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
    ends_refused: int = 0  # end requests that did not match a half
    ends_expired: int = 0  # refused: the half is older than its settlement's record lives
    ops_skipped: int = 0  # messages of the op stream that cannot name a real half
    halfs_unreadable: int = 0  # skipped: gone from the half stream, or no half
    half_read_errors: int = 0  # rounds ended at a half whose reads kept failing
    too_large: int = 0  # halfs discarded: a copy of them would exceed max_payload
    rounds_cut: int = 0  # rounds stopped by max_round_s
    reconnects: int = 0
    settled_by_copy: int = 0  # answers for a settled transaction: another copy's, or replayed
    last_round_s: float = 0.0
    last_round_ops_read: int = 0
    last_round_op_requests: int = 0
    last_round_halfs_walked: int = 0


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


def record_ttl(setting: float, bucket_ttl: float | None) -> float:
    """How long a settlement's record surely lives: the setting, or the bucket's own
    TTL when it is shorter (a bucket made earlier keeps the TTL it was made with)."""
    return min(setting, bucket_ttl) if bucket_ttl else setting


def settled_key(msg_id: str) -> str:
    """A KV key for a msg id (KV keys allow letters, digits, '-', '_', '=', '.')."""
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in msg_id) or "_"


@dataclass
class _Half:
    offset: int
    headers: dict[str, str]
    data: bytes
    time: float = field(default=0.0)


@dataclass
class _Round:
    """One check round's state: RocketMQ's removeMap, doneOpOffset and pull result."""

    started: float  # wall clock, as op stored times
    deadline: float  # monotonic
    half_offset: int
    op_offset: int
    last_half: int  # halfs past it were stored after the round began
    next_op: int = 0
    half_seen: int = 0  # the half stream's last offset as last read (>= last_half)
    last_op_born: float | None = None  # of the latest pull; None: it found no op
    remove: dict[int, list[int]] = field(default_factory=dict)
    done: list[int] = field(default_factory=list)
    ops_read: int = 0
    op_requests: int = 0
    walked: int = 0


class _HalfReadFailed(Exception):
    """Reading a half failed, retries included, for a reason other than its absence."""


Verdict = Literal["done", "check", "stop"]


class Coordinator:
    def __init__(self, url: str, settings: CoordinatorSettings | None = None) -> None:
        self.url = url
        self.settings = settings or CoordinatorSettings()
        self.stats = CoordinatorStats()
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._kv: KeyValue | None = None
        self._settled: KeyValue | None = None
        self._ops: BatchReader | None = None
        self._record_ttl = self.settings.file_reserved_time_s  # of the SETTLED bucket
        self._skipped: set[int] = set()  # op offsets skipped and logged, not yet passed
        self._stop: asyncio.Event | None = None
        self._wake: asyncio.Event | None = None  # a stop, or the connection closed
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._check_lock = asyncio.Lock()
        self._settling: dict[str, tuple[asyncio.Lock, int]] = {}  # msg id -> lock, users
        self._ends: Subscription | None = None

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
                self._loop.call_soon_threadsafe(self._request_stop)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def check_now(self, timeout: float = 30.0) -> None:
        """Run one check round now, from another thread, and wait for its end."""
        if self._loop is None:
            raise RuntimeError("the coordinator is not running")
        asyncio.run_coroutine_threadsafe(self.check_round(), self._loop).result(timeout)

    def _request_stop(self) -> None:
        assert self._stop is not None and self._wake is not None
        self._stop.set()
        self._wake.set()

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()
        self._check_lock = asyncio.Lock()
        self._end_slots = asyncio.Semaphore(MAX_CONCURRENT_ENDS)
        self._ending: set[asyncio.Task[None]] = set()
        await self._connect()
        self._ready.set()
        log.info("coordinator up: check every %.1f s", self.settings.check_interval_s)
        try:
            while not self._stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.settings.check_interval_s)
                self._wake.clear()
                if self._stop.is_set():
                    break
                if self._nc is None or self._nc.is_closed:
                    await self._reconnect()
                    continue
                try:
                    await self.check_round()
                except Exception:  # a bad round must not end the coordinator
                    log.exception("check round failed; the next one starts from the saved offsets")
        finally:
            await self._finish_ends()
            if self._nc is not None and not self._nc.is_closed:
                await self._nc.drain()

    async def _finish_ends(self) -> None:
        """Take no more end requests, then let those under way finish: one cut between
        its real message and its op would be checked and committed again."""
        if self._ends is not None and self._nc is not None and not self._nc.is_closed:
            with contextlib.suppress(nats.errors.Error):
                await self._ends.unsubscribe()
                await self._nc.flush()
        while self._ending:
            await asyncio.gather(*list(self._ending), return_exceptions=True)

    async def _connect(self) -> None:
        """Connect, make sure of the streams and buckets, and listen for end requests."""
        nc = await nats.connect(
            servers=[self.url],
            name="outbox-coordinator",
            max_reconnect_attempts=-1,
            closed_cb=self._closed,
        )
        try:
            js = nc.jetstream(timeout=5)
            await ensure_streams(js)
            await allow_direct(js, OP_TOPIC)
            ops = BatchReader(nc, OP_TOPIC)
            await ops.start()
            self._nc, self._js, self._ops = nc, js, ops
            self._kv = await self._bucket(OFFSETS_BUCKET)
            ttl = self.settings.file_reserved_time_s
            self._settled = await self._bucket(SETTLED_BUCKET, ttl=ttl, direct=True)
            self._record_ttl = record_ttl(ttl, (await self._settled.status()).ttl)
            self._ends = await nc.subscribe(
                END_SUBJECT, queue="outbox-coordinator", cb=self._on_end
            )
            await nc.flush()  # the server has the subscription: no end request missed
        except BaseException:
            await nc.close()
            raise

    async def _closed(self) -> None:
        """nats-py closes a client for good on some server errors (max payload, ...)."""
        if self._wake is not None:
            self._wake.set()

    async def _reconnect(self) -> None:
        """A new connection; the offsets are in KV, so the check service resumes there."""
        assert self._stop is not None
        reason = self._nc.last_error if self._nc is not None else None
        log.warning("connection closed (%r): connecting again", reason)
        delay = 0.1
        while not self._stop.is_set():
            try:
                await self._connect()
            except Exception as exc:
                log.warning("reconnect failed (%r): again in %.1f s", exc, delay)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), delay)
                delay = min(delay * 2, 5.0)
                continue
            self.stats.reconnects += 1
            log.info("coordinator connected again")
            return

    async def _bucket(self, name: str, ttl: float | None = None, direct: bool = False) -> KeyValue:
        """The bucket, made if missing; ``direct``: its gets are direct gets (lighter on
        the server than the stream API's), for a bucket read once per end request."""
        assert self._js is not None
        try:
            kv = await self._js.key_value(name)
        except nats.js.errors.BucketNotFoundError:
            kv = await self._js.create_key_value(bucket=name, ttl=ttl)
        if not direct:
            return kv
        await allow_direct(self._js, f"KV_{name}")
        return await self._js.key_value(name)  # nats-py reads allow_direct here

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
            self.stats.ends_refused += 1
            log.warning("end request refused: no %s in it", HALF_OFFSET)
            return
        try:
            await self.end_transaction(
                offset,
                headers.get(COMMIT_OR_ROLLBACK, ""),
                group=headers.get(PGROUP, ""),
                transaction_id=headers.get(TRANSACTION_ID, ""),
                msg_id=headers.get(UNIQ_KEY, ""),
            )
        except Exception:  # check-back settles it later
            log.exception("end transaction for half %d failed", offset)

    async def end_transaction(
        self, half_offset: int, state: str, *, group: str, transaction_id: str, msg_id: str
    ) -> bool:
        """Settle the half at ``half_offset`` as ``state``, unless its transaction was
        settled already (then only the op is written); False when nothing was done
        (UNKNOW, a request that does not match its half, or one too old to tell)."""
        if state not in SETTLING_STATES:
            self.stats.unknown += 1
            return False
        half = await self._half(half_offset)
        refusal = end_refusal(half.headers if half else None, group, transaction_id, msg_id)
        if half is None or refusal is not None:
            self.stats.ends_refused += 1
            log.warning("end request (%s) for half %d refused: %s", state, half_offset, refusal)
            return False
        if (age := self._record_age(half)) > self._record_ttl:
            self.stats.ends_expired += 1
            log.warning(
                "end request (%s) for half %d refused: the half is %.0f s old, and a "
                "settlement is on record for %.0f s only (file_reserved_time_s)",
                state, half_offset, age, self._record_ttl,
            )  # fmt: skip
            return False
        # Every transaction is settled once: a half may be answered once per copy (put
        # back by a round, maybe by a coordinator since killed), and any end request may
        # come again (replayed, at any age, past the real stream's duplicate window).
        # The first answer settles and records; the others only finish their half.
        async with self._one_at_a_time(msg_id):
            if await self._settled_state(msg_id) is not None:
                self.stats.settled_by_copy += 1
            else:
                await self._settle(half, state)
            await self._write_op(half_offset, msg_id)
        return True

    def _record_age(self, half: _Half) -> float:
        """The half's age by the producer's clock or the server's, whichever is older.
        A settlement is recorded after its half was stored: while this age is within the
        record's TTL, a record made for the transaction is still there."""
        return max(self._age(half), time.time() - half.time)

    async def _settle(self, half: _Half, state: str) -> None:
        if state == LocalTransactionState.COMMIT_MESSAGE.value:
            if await self._publish_real(half):
                self.stats.commits += 1
        else:
            self.stats.rollbacks += 1
        # After the real message (a crash between the two asks again, and the duplicate
        # window absorbs the second publish); before the op: a copy walked later and a
        # replayed end request are finished by this outcome.
        assert self._settled is not None
        await self._settled.put(settled_key(half.headers.get(UNIQ_KEY, "")), state.encode())

    @contextlib.asynccontextmanager
    async def _one_at_a_time(self, msg_id: str) -> AsyncIterator[None]:
        """One settlement per transaction at a time (two copies answered together)."""
        lock, users = self._settling.get(msg_id, (asyncio.Lock(), 0))
        self._settling[msg_id] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._settling[msg_id]
            if users == 1:
                del self._settling[msg_id]
            else:
                self._settling[msg_id] = (lock, users - 1)

    async def _settled_state(self, msg_id: str) -> bytes | None:
        """How another copy of this transaction's half was settled, if one was."""
        assert self._settled is not None
        try:
            entry = await self._settled.get(settled_key(msg_id))
        except nats.js.errors.KeyNotFoundError:
            return None
        return entry.value or b""

    async def _publish_real(self, half: _Half) -> bool:
        """Publish the real message; False when it would be too large (then discarded)."""
        assert self._js is not None
        headers = {
            k: v for k, v in half.headers.items() if k not in SYSTEM_PROPERTIES and k != UNIQ_KEY
        }
        headers[DEDUP_HEADER] = half.headers.get(UNIQ_KEY, "")  # a second commit is dropped
        real_topic = half.headers.get(REAL_TOPIC)
        if not real_topic:
            raise ValueError(f"half {half.offset} has no {REAL_TOPIC}")
        if error := self._too_large(half.data, headers):
            await self._discard_oversize(half, "its real message", error)
            return False
        await self._js.publish(real_topic, half.data, headers=headers)
        return True

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
            began = time.monotonic()
            rnd = _Round(
                started=time.time(),
                deadline=began + self.settings.max_round_s,
                half_offset=await self._offset("half"),
                op_offset=await self._offset("op"),
                # JetStream's sequence is the store order: the halfs stored after the
                # round began are those past this (no clock is compared).
                last_half=await self._last_seq(HALF_TOPIC),
            )
            rnd.next_op, rnd.half_seen = rnd.op_offset, rnd.last_half
            await self._pull_ops(rnd)
            new_half = await self._walk(rnd)
            if new_half != rnd.half_offset:
                await self._save_offset("half", new_half)
            new_op = next_op_offset(rnd.op_offset, rnd.done)
            if new_op != rnd.op_offset:
                await self._save_offset("op", new_op)
            self._skipped = {o for o in self._skipped if o >= new_op}
            self._round_stats(rnd, time.monotonic() - began, new_half, new_op)

    def _round_stats(self, rnd: _Round, seconds: float, new_half: int, new_op: int) -> None:
        s = self.stats
        s.last_round_s, s.last_round_ops_read = seconds, rnd.ops_read
        s.last_round_op_requests, s.last_round_halfs_walked = rnd.op_requests, rnd.walked
        log.info(
            "check round: %.1f ms, %d ops read in %d requests, %d halfs walked, "
            "offsets half %d op %d",
            seconds * 1000, rnd.ops_read, rnd.op_requests, rnd.walked, new_half, new_op,
        )  # fmt: skip

    async def _walk(self, rnd: _Round) -> int:
        """Walk the halfs from the half offset; returns the new half offset."""
        offset = rnd.half_offset
        while offset <= rnd.last_half:
            # At least one half a round, so that even a tiny limit makes progress.
            if offset > rnd.half_offset and time.monotonic() > rnd.deadline:
                self.stats.rounds_cut += 1
                log.info(
                    "check round stopped at half %d after %.1f s", offset, self.settings.max_round_s
                )
                break
            rnd.walked += 1
            if offset in rnd.remove:
                rnd.done += rnd.remove.pop(offset)
            elif not await self._visit(rnd, offset):
                break
            offset += 1
        return offset

    async def _visit(self, rnd: _Round, offset: int) -> bool:
        """A half without a known op: settle, discard, put back and ask, or (False)
        leave it and those behind it for the next round."""
        try:
            half = await self._read_half(offset)
        except _HalfReadFailed as exc:
            self.stats.half_read_errors += 1
            log.warning("half %d could not be read (%s): the next round starts there", offset, exc)
            return False
        if half is None:
            return True
        age = self._age(half)
        if (
            CHECK_IMMUNITY_TIME not in half.headers
            and 0 <= age < self.settings.transaction_timeout_s
        ):
            return False  # too young (its end request may be on its way); all behind it too
        if await self._settled_earlier(half):
            return True
        check_times = int(header_number(half.headers, CHECK_TIMES, 0))
        if check_times >= self.settings.check_max or age > self.settings.file_reserved_time_s:
            await self._discard(half)
            return True
        immunity = self.settings.transaction_timeout_s
        if CHECK_IMMUNITY_TIME in half.headers:
            # Its own immunity: put it back unchecked and go on with the halfs behind it.
            immunity = header_number(half.headers, CHECK_IMMUNITY_TIME, immunity)
            if age < immunity:
                await self._put_back(half, check_times)
                return True
        verdict = await self._op_or_check(rnd, half, immunity)
        if verdict == "stop":
            return False
        if verdict == "check":
            await self._put_back_and_check(half, check_times + 1)
        return True

    async def _op_or_check(self, rnd: _Round, half: _Half, immunity: float) -> Verdict:
        """While its op may be among the ops not read yet, pull the next batch."""
        timeout = self.settings.transaction_timeout_s
        while not need_check(
            last_op_born=rnd.last_op_born,
            age_s=self._age(half),
            immunity_s=immunity,
            round_started=rnd.started,
            timeout_s=timeout,
        ):
            if rnd.walked > 1 and time.monotonic() > rnd.deadline:
                return "stop"  # the round's first half is seen through, as in _walk
            await self._pull_ops(rnd)
            if half.offset in rnd.remove:
                rnd.done += rnd.remove.pop(half.offset)
                return "done"
        return "check"

    @staticmethod
    def _age(half: _Half) -> float:
        return time.time() - header_number(half.headers, BORN_TIMESTAMP, half.time * 1000) / 1000

    async def _pull_ops(self, rnd: _Round) -> None:
        """RocketMQ's fillOpRemoveMap: the next batch of op messages, one request."""
        assert self._ops is not None
        msgs = await self._ops.read(rnd.next_op, OP_BATCH)
        ops = [op_of(m, TAGS_HEADER, OP_TAG) for m in msgs]
        rnd.op_requests += 1
        rnd.ops_read += len(ops)
        rnd.last_op_born = ops[-1].born if ops else None
        if ops:
            rnd.done += missing_offsets(rnd.next_op, ops)
            rnd.next_op = ops[-1].offset + 1
        ops = await self._naming_real_halfs(rnd, ops)
        fill_remove_map(rnd.remove, rnd.done, ops, rnd.half_offset)

    async def _naming_real_halfs(self, rnd: _Round, ops: list[Op]) -> list[Op]:
        """``ops`` without those that cannot name a real half: those are done (skipped,
        counted and logged once), or the op offset would stick at them for good."""
        if any(op.half is not None and op.half > rnd.half_seen for op in ops):
            # Stored after the round began, or never: a half is stored before its op,
            # so the half stream's end as of now tells (one request, in this case only).
            rnd.half_seen = await self._last_seq(HALF_TOPIC)
        naming: list[Op] = []
        for op in ops:
            why = no_real_half(op, rnd.half_seen)
            if not why:
                naming.append(op)
                continue
            rnd.done.append(op.offset)
            if op.offset not in self._skipped:
                self._skipped.add(op.offset)
                self.stats.ops_skipped += 1
                log.warning("op %d skipped: %s", op.offset, why)
        return naming

    async def _settled_earlier(self, half: _Half) -> bool:
        """Another copy of this half was settled: finish this copy too."""
        key = half.headers.get(UNIQ_KEY, "")
        state = await self._settled_state(key)
        if state is None:
            return False
        await self._write_op(half.offset, key)
        log.info("half %d settled earlier as %s", half.offset, state.decode())
        return True

    async def _discard(self, half: _Half) -> None:
        """Into TRANS_CHECK_MAX_TIME_TOPIC; without the payload when the copy would not
        fit (the payload stays in the half stream at HALF_OFFSET)."""
        assert self._js is not None
        headers = {**half.headers, HALF_OFFSET: str(half.offset)}
        data = half.data
        if self._too_large(data, headers):
            headers[PAYLOAD_IN_HALF], data = str(len(data)), b""
        if error := self._too_large(data, headers):
            log.error("half %d not recorded as discarded: %s", half.offset, error)
        else:
            await self._js.publish(CHECK_MAX_TOPIC, data, headers=headers)
        self.stats.discarded += 1
        log.warning(
            "half %d (%s) discarded after %s checks",
            half.offset,
            half.headers.get(UNIQ_KEY),
            half.headers.get(CHECK_TIMES),
        )

    async def _discard_oversize(self, half: _Half, what: str, error: str) -> None:
        self.stats.too_large += 1
        log.warning("half %d: %s would be too large (%s)", half.offset, what, error)
        await self._discard(half)

    def _too_large(self, data: bytes, headers: dict[str, str]) -> str | None:
        assert self._nc is not None
        return too_large(self._nc, data, headers)

    async def _put_back(self, half: _Half, check_times: int) -> tuple[int, dict[str, str]] | None:
        """Write the half again at the end of the half stream (the base of later checks);
        None when that copy would be too large (the half is discarded instead)."""
        assert self._js is not None
        headers = {**half.headers, CHECK_TIMES: str(check_times), TRAN_MSG: "true"}
        headers.pop(DEDUP_HEADER, None)  # the producer's half id: the server would drop a copy
        if error := self._too_large(half.data, headers):
            await self._discard_oversize(half, "its put-back copy", error)
            return None
        ack = await self._js.publish(HALF_TOPIC, half.data, headers=headers)
        self.stats.halfs_written += 1
        return int(ack.seq), headers

    async def _put_back_and_check(self, half: _Half, check_times: int) -> None:
        assert self._nc is not None
        widest = {**half.headers, CHECK_TIMES: str(check_times), HALF_OFFSET: WIDEST_OFFSET}
        if error := self._too_large(half.data, widest):
            await self._discard_oversize(half, "its check request", error)
            return
        put = await self._put_back(half, check_times)
        if put is None:
            return
        seq, headers = put
        request = {**headers, HALF_OFFSET: str(seq)}
        await self._nc.publish(f"{CHECK_SUBJECT}.{headers[PGROUP]}", half.data, headers=request)
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

    async def _read_half(self, offset: int) -> _Half | None:
        """The half for the walk; None (counted, logged) when it is gone from the
        stream or is no half. Other errors are retried ``half_read_retries`` times,
        then raise: skipping a half that exists would lose its transaction."""
        error: Exception | None = None
        for _ in range(self.settings.half_read_retries + 1):
            try:
                half = await self._half(offset)
            except (TimeoutError, nats.errors.Error) as exc:
                error = exc
                continue
            why = "gone from the half stream" if half is None else no_half(half.headers)
            if why:
                self.stats.halfs_unreadable += 1
                log.warning("half %d skipped: %s", offset, why)
                return None
            return half
        raise _HalfReadFailed(repr(error))

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
    "CoordinatorStats",
    "build_remove_map",
    "end_refusal",
    "next_op_offset",
]
