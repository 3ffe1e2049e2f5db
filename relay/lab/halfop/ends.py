"""The coordinator's end-transaction handling: a producer's COMMIT or ROLLBACK for a half.

The request must match its half (producer group, transaction id, msg id: RocketMQ's
checkPrepareMessage), else it is refused. COMMIT rebuilds the real message from the
half (real topic, the app's headers, msg_id as ``Nats-Msg-Id``), publishes it, records
the outcome (the SETTLED bucket), then writes the op; ROLLBACK records and writes the
op; UNKNOW does nothing (check-back will ask). A transaction on record is not settled
again: a replayed request, or another copy's answer, only gets its op. A request for a
half older than a record lives is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from relay.brokers.nats import DEDUP_HEADER
from relay.lab.halfop.halfs import Half, HalfStore, end_refusal, half_age
from relay.lab.halfop.protocol import (
    COMMIT_OR_ROLLBACK,
    END_SUBJECT,
    HALF_OFFSET,
    PGROUP,
    REAL_TOPIC,
    SYSTEM_PROPERTIES,
    TRANSACTION_ID,
    UNIQ_KEY,
    LocalTransactionState,
)
from relay.lab.halfop.settings import CoordinatorStats

log = logging.getLogger("relay.lab.halfop.coordinator")

SETTLING_STATES = (
    LocalTransactionState.COMMIT_MESSAGE.value,
    LocalTransactionState.ROLLBACK_MESSAGE.value,
)
MAX_CONCURRENT_ENDS = 256


class EndHandler:
    """Takes end requests on a connection (``listen``), each in a task of its own, at most
    MAX_CONCURRENT_ENDS at once; ``finish`` takes no more and waits for those under way."""

    def __init__(self, stats: CoordinatorStats) -> None:
        self.stats = stats
        self.store: HalfStore | None = None  # the current connection's (listen)
        self._subscription: Subscription | None = None
        self._slots = asyncio.Semaphore(MAX_CONCURRENT_ENDS)
        self._ending: set[asyncio.Task[None]] = set()
        self._settling: dict[str, tuple[asyncio.Lock, int]] = {}  # msg id -> lock, users

    async def listen(self, nc: Client, store: HalfStore) -> None:
        self.store = store
        self._subscription = await nc.subscribe(
            END_SUBJECT, queue="outbox-coordinator", cb=self._on_end
        )

    async def finish(self) -> None:
        """Take no more end requests, then let those under way finish: one cut between
        its real message and its op would be checked and committed again."""
        subscription, self._subscription = self._subscription, None
        nc = self.store.nc if self.store is not None else None
        if subscription is not None and nc is not None and not nc.is_closed:
            with contextlib.suppress(nats.errors.Error):
                await subscription.unsubscribe()
                await nc.flush()
        while self._ending:
            await asyncio.gather(*list(self._ending), return_exceptions=True)

    async def _on_end(self, msg: Msg) -> None:
        """nats-py runs a subscription's callbacks one at a time: hand each off to a task."""
        await self._slots.acquire()
        task = asyncio.get_running_loop().create_task(self._handle(msg))
        self._ending.add(task)
        task.add_done_callback(self._end_done)

    def _end_done(self, task: asyncio.Task[None]) -> None:
        self._ending.discard(task)
        self._slots.release()

    async def _handle(self, msg: Msg) -> None:
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
        store = self.store
        assert store is not None, "listen() first"
        if state not in SETTLING_STATES:
            self.stats.unknown += 1
            return False
        half = await store.half(half_offset)
        refusal = end_refusal(half.headers if half else None, group, transaction_id, msg_id)
        if half is None or refusal is not None:
            self.stats.ends_refused += 1
            log.warning("end request (%s) for half %d refused: %s", state, half_offset, refusal)
            return False
        if (age := record_age(half)) > store.record_ttl_s:
            self.stats.ends_expired += 1
            log.warning(
                "end request (%s) for half %d refused: the half is %.0f s old, and a "
                "settlement is on record for %.0f s only (file_reserved_time_s)",
                state, half_offset, age, store.record_ttl_s,
            )  # fmt: skip
            return False
        # Every transaction is settled once: a half may be answered once per copy (put
        # back by a round, maybe by a coordinator since killed), and any end request may
        # come again (replayed, at any age, past the real stream's duplicate window).
        # The first answer settles and records; the others only finish their half.
        async with self._one_at_a_time(msg_id):
            if await store.settled_state(msg_id) is not None:
                self.stats.settled_by_copy += 1
            else:
                await self._settle(store, half, state)
            await store.write_op(half_offset, msg_id)
        return True

    async def _settle(self, store: HalfStore, half: Half, state: str) -> None:
        if state == LocalTransactionState.COMMIT_MESSAGE.value:
            if await publish_real(store, half):
                self.stats.commits += 1
        else:
            self.stats.rollbacks += 1
        # After the real message (a crash between the two asks again, and the duplicate
        # window absorbs the second publish); before the op: a copy walked later and a
        # replayed end request are finished by this outcome.
        await store.record_settled(half.headers.get(UNIQ_KEY, ""), state)

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


def record_age(half: Half) -> float:
    """The half's age by the producer's clock or the server's, whichever is older.
    A settlement is recorded after its half was stored: while this age is within the
    record's TTL, a record made for the transaction is still there."""
    return max(half_age(half), time.time() - half.time)


async def publish_real(store: HalfStore, half: Half) -> bool:
    """Publish the real message; False when it would be too large (then discarded)."""
    headers = {
        k: v for k, v in half.headers.items() if k not in SYSTEM_PROPERTIES and k != UNIQ_KEY
    }
    headers[DEDUP_HEADER] = half.headers.get(UNIQ_KEY, "")  # a second commit is dropped
    real_topic = half.headers.get(REAL_TOPIC)
    if not real_topic:
        raise ValueError(f"half {half.offset} has no {REAL_TOPIC}")
    if error := store.too_large(half.data, headers):
        await store.discard_oversize(half, "its real message", error)
        return False
    await store.js.publish(real_topic, half.data, headers=headers)
    return True
