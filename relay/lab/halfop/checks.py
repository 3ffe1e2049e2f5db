"""The coordinator's check service: one round walks the halfs not known to be done.

RocketMQ 4.x TransactionalMessageServiceImpl.check: pull 32 op messages from the op
consume offset into a removeMap (a message that cannot name a real half is skipped and
passed); walk the halfs from the half consume offset: a half in the removeMap is done;
discard those checked ``check_max`` times or older than ``file_reserved_time_s`` into
TRANS_CHECK_MAX_TIME_TOPIC; stop at a half stored after the round began or younger than
its immunity (``transaction_timeout_s`` or CHECK_IMMUNITY_TIME); for the others, while
its op may still be unread (``oplog.need_check``) pull the next 32 ops, then put it back
at the end of the half stream with its check count raised and ask one producer of the
group. A round stops after ``max_round_s``; offsets are saved at its end (the op offset
past the contiguous done ops) in a KV bucket, so the next round and a restarted
coordinator resume there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Literal

import nats.errors

from relay.brokers.nats import DEDUP_HEADER
from relay.lab.halfop.halfs import (
    TAGS_HEADER,
    Half,
    HalfStore,
    half_age,
    header_number,
    no_half,
)
from relay.lab.halfop.oplog import (
    OP_BATCH,
    Op,
    fill_remove_map,
    missing_offsets,
    need_check,
    next_op_offset,
    no_real_half,
    op_of,
)
from relay.lab.halfop.protocol import (
    CHECK_IMMUNITY_TIME,
    CHECK_SUBJECT,
    CHECK_TIMES,
    HALF_OFFSET,
    HALF_TOPIC,
    OP_TAG,
    PGROUP,
    TRAN_MSG,
    UNIQ_KEY,
)
from relay.lab.halfop.settings import CoordinatorSettings, CoordinatorStats

log = logging.getLogger("relay.lab.halfop.coordinator")

WIDEST_OFFSET = str(2**64 - 1)  # a size check before the put-back gives the real one
Verdict = Literal["done", "check", "stop"]


@dataclass
class Round:
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


class HalfReadFailed(Exception):
    """Reading a half failed, retries included, for a reason other than its absence."""


class CheckService:
    """Check rounds, one at a time, on the current connection's ``store``."""

    def __init__(self, settings: CoordinatorSettings, stats: CoordinatorStats) -> None:
        self.settings = settings
        self.stats = stats
        self.store: HalfStore | None = None  # the current connection's
        self._skipped: set[int] = set()  # op offsets skipped and logged, not yet passed
        self._one_round = asyncio.Lock()

    async def check_round(self) -> None:
        """One pass of the check service; offsets advance only past settled halfs."""
        async with self._one_round:
            store = self.store
            assert store is not None, "not connected"
            self.stats.rounds += 1
            began = time.monotonic()
            rnd = Round(
                started=time.time(),
                deadline=began + self.settings.max_round_s,
                half_offset=await store.offset("half"),
                op_offset=await store.offset("op"),
                # JetStream's sequence is the store order: the halfs stored after the
                # round began are those past this (no clock is compared).
                last_half=await store.last_seq(HALF_TOPIC),
            )
            rnd.next_op, rnd.half_seen = rnd.op_offset, rnd.last_half
            await self.pull_ops(rnd)
            new_half = await self._walk(rnd)
            if new_half != rnd.half_offset:
                await store.save_offset("half", new_half)
            new_op = next_op_offset(rnd.op_offset, rnd.done)
            if new_op != rnd.op_offset:
                await store.save_offset("op", new_op)
            self._skipped = {o for o in self._skipped if o >= new_op}
            self._round_stats(rnd, time.monotonic() - began, new_half, new_op)

    def _round_stats(self, rnd: Round, seconds: float, new_half: int, new_op: int) -> None:
        s = self.stats
        s.last_round_s, s.last_round_ops_read = seconds, rnd.ops_read
        s.last_round_op_requests, s.last_round_halfs_walked = rnd.op_requests, rnd.walked
        log.info(
            "check round: %.1f ms, %d ops read in %d requests, %d halfs walked, "
            "offsets half %d op %d",
            seconds * 1000, rnd.ops_read, rnd.op_requests, rnd.walked, new_half, new_op,
        )  # fmt: skip

    async def _walk(self, rnd: Round) -> int:
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

    async def _visit(self, rnd: Round, offset: int) -> bool:
        """A half without a known op: settle, discard, put back and ask, or (False)
        leave it and those behind it for the next round."""
        try:
            half = await self._read_half(offset)
        except HalfReadFailed as exc:
            self.stats.half_read_errors += 1
            log.warning("half %d could not be read (%s): the next round starts there", offset, exc)
            return False
        if half is None:
            return True
        age = half_age(half)
        if (
            CHECK_IMMUNITY_TIME not in half.headers
            and 0 <= age < self.settings.transaction_timeout_s
        ):
            return False  # too young (its end request may be on its way); all behind it too
        if await self._settled_earlier(half):
            return True
        check_times = int(header_number(half.headers, CHECK_TIMES, 0))
        if check_times >= self.settings.check_max or age > self.settings.file_reserved_time_s:
            await self._store.discard(half)
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

    @property
    def _store(self) -> HalfStore:
        assert self.store is not None, "not connected"
        return self.store

    async def _op_or_check(self, rnd: Round, half: Half, immunity: float) -> Verdict:
        """While its op may be among the ops not read yet, pull the next batch."""
        timeout = self.settings.transaction_timeout_s
        while not need_check(
            last_op_born=rnd.last_op_born,
            age_s=half_age(half),
            immunity_s=immunity,
            round_started=rnd.started,
            timeout_s=timeout,
        ):
            if rnd.walked > 1 and time.monotonic() > rnd.deadline:
                return "stop"  # the round's first half is seen through, as in _walk
            await self.pull_ops(rnd)
            if half.offset in rnd.remove:
                rnd.done += rnd.remove.pop(half.offset)
                return "done"
        return "check"

    async def pull_ops(self, rnd: Round) -> None:
        """RocketMQ's fillOpRemoveMap: the next batch of op messages, one request."""
        msgs = await self._store.ops.read(rnd.next_op, OP_BATCH)
        ops = [op_of(m, TAGS_HEADER, OP_TAG) for m in msgs]
        rnd.op_requests += 1
        rnd.ops_read += len(ops)
        rnd.last_op_born = ops[-1].born if ops else None
        if ops:
            rnd.done += missing_offsets(rnd.next_op, ops)
            rnd.next_op = ops[-1].offset + 1
        ops = await self._naming_real_halfs(rnd, ops)
        fill_remove_map(rnd.remove, rnd.done, ops, rnd.half_offset)

    async def _naming_real_halfs(self, rnd: Round, ops: list[Op]) -> list[Op]:
        """``ops`` without those that cannot name a real half: those are done (skipped,
        counted and logged once), or the op offset would stick at them for good."""
        if any(op.half is not None and op.half > rnd.half_seen for op in ops):
            # Stored after the round began, or never: a half is stored before its op,
            # so the half stream's end as of now tells (one request, in this case only).
            rnd.half_seen = await self._store.last_seq(HALF_TOPIC)
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

    async def _settled_earlier(self, half: Half) -> bool:
        """Another copy of this half was settled: finish this copy too."""
        key = half.headers.get(UNIQ_KEY, "")
        state = await self._store.settled_state(key)
        if state is None:
            return False
        await self._store.write_op(half.offset, key)
        log.info("half %d settled earlier as %s", half.offset, state.decode())
        return True

    async def _put_back(self, half: Half, check_times: int) -> tuple[int, dict[str, str]] | None:
        """Write the half again at the end of the half stream (the base of later checks);
        None when that copy would be too large (the half is discarded instead)."""
        store = self._store
        headers = {**half.headers, CHECK_TIMES: str(check_times), TRAN_MSG: "true"}
        headers.pop(DEDUP_HEADER, None)  # the producer's half id: the server would drop a copy
        if error := store.too_large(half.data, headers):
            await store.discard_oversize(half, "its put-back copy", error)
            return None
        ack = await store.js.publish(HALF_TOPIC, half.data, headers=headers)
        self.stats.halfs_written += 1
        return int(ack.seq), headers

    async def _put_back_and_check(self, half: Half, check_times: int) -> None:
        store = self._store
        widest = {**half.headers, CHECK_TIMES: str(check_times), HALF_OFFSET: WIDEST_OFFSET}
        if error := store.too_large(half.data, widest):
            await store.discard_oversize(half, "its check request", error)
            return
        put = await self._put_back(half, check_times)
        if put is None:
            return
        seq, headers = put
        request = {**headers, HALF_OFFSET: str(seq)}
        await store.nc.publish(f"{CHECK_SUBJECT}.{headers[PGROUP]}", half.data, headers=request)
        self.stats.check_requests += 1

    async def _read_half(self, offset: int) -> Half | None:
        """The half for the walk; None (counted, logged) when it is gone from the
        stream or is no half. Other errors are retried ``half_read_retries`` times,
        then raise: skipping a half that exists would lose its transaction."""
        error: Exception | None = None
        for _ in range(self.settings.half_read_retries + 1):
            try:
                half = await self._store.half(offset)
            except (TimeoutError, nats.errors.Error) as exc:
                error = exc
                continue
            why = "gone from the half stream" if half is None else no_half(half.headers)
            if why:
                self.stats.halfs_unreadable += 1
                log.warning("half %d skipped: %s", offset, why)
                return None
            return half
        raise HalfReadFailed(repr(error))
