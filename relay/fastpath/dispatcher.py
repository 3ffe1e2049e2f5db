"""The fast path: committed messages go from memory to the broker within milliseconds.

After COMMIT the app thread hands its messages to ``submit`` (never blocking: when
the fast path already holds ``queue_size`` messages they stay in the table for the
sweeper; ``relay.fastpath.stats.Slots`` counts every message held, from commit until it is
marked or given up, wherever it waits). One background thread runs
an asyncio loop that keeps many publishes in flight; an ack goes to the AckBatcher, a
retryable failure to the TimeWheel for its next attempt. When the retry schedule is
spent, or a message is older than the hand-off limit, it leaves memory and waits in
the table for the sweeper, which only takes rows older than its own threshold.
Listeners (outbox.events.RelayListener) hear each batch's outcomes.

Ordered messages (``send(..., ordered=True)``: ``message.seq`` set) go through a lane
per (topic, key) (relay.fastpath.lanes). What a lane guarantees:

- one at a time: at most one message of a key is being checked, published or waiting
  in the time wheel; the key's next goes only once the broker acked it, so a key's
  messages reach the broker in seq order, which is their commit order;
- the turn is certain: a lane's head whose predecessor this process did not ack itself
  (another process's, the sweeper's, or not handed over yet) is checked against the
  table first (``heads``, with the commit check): while an earlier row of its key is
  pending or dead it waits in the time wheel, on the retry schedule
  (``stats.key_waits``; not a failed attempt);
- a failing key holds only itself: a head waiting to retry keeps its followers in the
  lane, while other keys and unordered messages go on; a head that leaves the fast path
  (schedule spent, too old, rejected, stopped) takes its followers with it, left to the
  sweeper (``left_for_sweeper(reason="behind_head")``), which goes on in order;
- memory stays bounded: followers hold their slots like any message (``queue_size``),
  and the last acked seq is kept for at most ``relay.fastpath.lanes.ACKED_KEYS`` keys.

Unordered messages never enter a lane: they cost one branch more than before.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from outbox.broker import Outcome, PublishResult, retry
from outbox.events import Failed, RelayListener, Sent, Stats
from outbox.message import Message
from outbox.settings import Settings
from outbox.tracing import publish_span
from relay.brokers.base import publish_isolated
from relay.fastpath.acks import AckBatcher, Finish, Heads, Verify
from relay.fastpath.batches import BatchReport
from relay.fastpath.lanes import ACKED_KEYS, Lanes
from relay.fastpath.stats import Slots
from relay.fastpath.timewheel import TimeWheel
from relay.listener import Listeners
from relay.loop import BrokerLoop
from relay.part import START_TIMEOUT_S, Lifecycle

log = logging.getLogger("relay.fastpath.dispatcher")


@dataclass(slots=True)
class Delivery:
    message: Message
    committed: float  # clock() at commit: the start of commit->ack latency
    attempt: int = 0  # index into retry_delays_ms of the attempt being made
    check: bool = True  # re-read the row before publishing
    head: bool = False  # an ordered lane's head whose turn the table must confirm
    waits: int = 0  # times it waited for its key: index into retry_delays_ms like attempt


class Dispatcher(Lifecycle):
    """The fast path: publishes through ``broker_loop``, which its owner (the Relay)
    starts before and stops after it; ``finish`` marks acked rows, ``verify`` re-reads
    rows whose commit is not proven, ``heads`` says which ordered heads must wait (None:
    none ever does; only for tests without a table)."""

    acked_keys = ACKED_KEYS  # keys whose last acked seq the lanes remember
    lane_limit = 1000  # deliveries one key may hold waiting behind its head

    def __init__(
        self,
        broker_loop: BrokerLoop,
        finish: Finish,
        settings: Settings | None = None,
        clock: Callable[[], float] = time.monotonic,
        verify: Verify | None = None,
        listener: RelayListener | None = None,
        heads: Heads | None = None,
    ) -> None:
        super().__init__()
        self.broker_loop = broker_loop
        self.broker = broker_loop.broker
        self.settings = settings or Settings()
        self.stats = Stats()
        self._slots = Slots(self.settings.queue_size, self.stats)
        self.listeners = Listeners.of(listener)
        self._clock = clock
        self._finish = finish
        self._verify = verify
        self._heads = heads
        self._count_lock = threading.Lock()
        self._accepting = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inbox: list[Delivery] = []  # submitted, not yet taken by the loop
        self._woken = False  # a _take_inbox is scheduled on the loop

    # -- app threads --------------------------------------------------------------

    def submit(self, messages: Sequence[Message], check: bool = True) -> int:
        """Queue committed messages for publishing; returns how many were taken.

        Never blocks: a message not taken (the fast path holds ``queue_size`` messages
        already, fast path stopped) is still in the table and the sweeper will publish it.
        ``check``: re-read the rows before publishing (the commit could not be proven
        by the app side).
        """
        loop = self._loop
        now = self._clock()
        check = check and self._verify is not None
        with self._count_lock:
            live = self._accepting and loop is not None
            taken = len(messages) if live and self._slots.take(len(messages)) else 0
            full = taken == 0 and self._accepting
            if full:
                self.stats.queue_full += len(messages)
            if taken:
                self._inbox.extend(Delivery(m, now, check=check) for m in messages)
                wake, self._woken = not self._woken, True
        if full:
            self.listeners.left_for_sweeper([m.msg_id for m in messages], "queue_full")
        if taken == 0:
            return 0
        if wake:  # one wake-up for all the commits that arrive before the loop takes them
            assert loop is not None
            loop.call_soon_threadsafe(self._take_inbox)
        return taken

    def _start(self) -> None:
        """Set up on the broker loop (started already: the owner's job)."""
        assert self.broker_loop.running, "start the BrokerLoop before its Dispatcher"
        self.broker_loop.submit(self._setup()).result(START_TIMEOUT_S)

    def _stop(self, timeout: float) -> bool:
        """Take no new work, finish in-flight publishes and acks within ``timeout``.

        What is still queued or waiting for a retry stays in the table for the sweeper.
        """
        with self._count_lock:
            self._accepting = False
        deadline = time.monotonic() + timeout
        finished = False
        try:
            finished = self.broker_loop.submit(self._shutdown(deadline)).result(timeout + 1.0)
        except (TimeoutError, RuntimeError):
            log.warning("stop: the broker loop did not answer in time")
        # The acks were closed by _shutdown already, unless the loop did not answer.
        acks_ended = self._acks.stop(max(0.0, deadline - time.monotonic()))
        if left := [d.message.msg_id for d in self._take_inbox_now()]:  # the loop did not answer
            self._slots.free(len(left))
            self.stats.dropped_at_stop += len(left)
            self.listeners.left_for_sweeper(left, "stopped")
        self._loop = None
        return finished and acks_ended

    # -- on the broker loop ----------------------------------------------------------

    async def _setup(self) -> None:
        self._queue: collections.deque[Delivery] = collections.deque()
        self._in_flight = 0
        self._checking = False  # a SELECT of rows to publish is running
        self._wheel_busy = asyncio.Event()
        self._publishing: set[asyncio.Task[None]] = set()
        self._stopping = False
        self._lanes: Lanes[Delivery] = Lanes(self.acked_keys)
        self._wheel: TimeWheel[Delivery] = TimeWheel(
            self.settings.tick_ms, max(self.settings.retry_delays_ms), self._clock
        )
        self._acks = AckBatcher(
            self._finish,
            self.stats,
            self.settings.ack_batch_size,
            self.settings.ack_flush_ms,
            self.listeners,
            self._slots,
        )
        self._acks.start()
        self._verifier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="outbox-verify")
        self._ticker = asyncio.create_task(self._tick())
        self._loop = asyncio.get_running_loop()
        with self._count_lock:
            self._accepting = True

    def _take_inbox(self) -> None:
        if deliveries := self._take_inbox_now():  # empty when _shutdown took them first
            self._enqueue(deliveries)

    def _take_inbox_now(self) -> list[Delivery]:
        """What was submitted, with its wake-up done or still on its way (any thread)."""
        with self._count_lock:
            deliveries, self._inbox, self._woken = self._inbox, [], False
        return deliveries

    def _enqueue(self, deliveries: list[Delivery]) -> None:
        if self._stopping:  # raced with stop(): the rows stay for the sweeper
            self._stopped(deliveries)
            return
        self.stats.accepted += len(deliveries)
        queue, lanes = self._queue, self._lanes
        held_back: list[Delivery] = []
        for delivery in deliveries:
            if delivery.message.seq is None:
                queue.append(delivery)
            elif self._lane_full(delivery):
                held_back.append(delivery)
            elif lanes.arrive(delivery):  # its lane's head: its turn may come now
                queue.append(self._turn(delivery))
        if held_back:
            self._behind_failing(held_back)
        self._dispatch()

    def _lane_full(self, delivery: Delivery) -> bool:
        """Whether ``delivery``'s key takes no more into memory: its head's publish failed
        (it retries from the time wheel), or its head waits for another process's row and
        ``lane_limit`` wait behind it already. A key that does not move must not fill the
        slots every other key and unordered message share; one that moves takes what comes."""
        head, waiting = self._lanes.ahead(delivery.message)
        if head is None:
            return False
        return head.attempt > 0 or (head.waits > 0 and waiting >= self.lane_limit)

    def _behind_failing(self, deliveries: list[Delivery]) -> None:
        """Leave ``deliveries`` to the sweeper: their key's head is failing (or its lane is
        full); they wait in the table, in order, behind it."""
        self.stats.behind_head += len(deliveries)
        self._slots.free(len(deliveries))
        self.listeners.left_for_sweeper([d.message.msg_id for d in deliveries], "behind_head")

    def _turn(self, delivery: Delivery) -> Delivery:
        """``delivery`` became its lane's head: look at the table unless its predecessor
        was acked by this process."""
        delivery.head = self._heads is not None and not self._lanes.follows_ack(delivery.message)
        return delivery

    def _dispatch(self) -> None:
        """Start publishing what is queued, as far as the in-flight limit allows.

        Called where work appears (enqueue, retry due, a publish or a check finished),
        so an idle loop costs nothing. While one batch's rows are being checked, new
        messages wait and are checked together next: one SELECT covers all that
        arrived meanwhile, like group commit.
        """
        while self._queue and not self._checking and self._in_flight < self.settings.max_in_flight:
            batch = self._take_batch()
            if not batch:
                continue
            self._in_flight += len(batch)
            self._checking = any(d.check or d.head for d in batch)
            task = asyncio.get_running_loop().create_task(self._publish(batch))
            self._publishing.add(task)
            task.add_done_callback(self._publishing.discard)

    def _take_batch(self) -> list[Delivery]:
        batch: list[Delivery] = []
        too_old: list[Delivery] = []
        now = self._clock()
        while self._queue and len(batch) < self.settings.publish_batch:
            delivery = self._queue.popleft()
            if now - delivery.message.born > self.settings.handoff_limit_s:
                too_old.append(delivery)  # the sweeper may already be on it
            else:
                batch.append(delivery)
        if too_old:
            self._too_old(too_old)
        return batch

    def _too_old(self, deliveries: list[Delivery]) -> None:
        report = BatchReport()
        for delivery in deliveries:
            self._leave_lane(delivery, report)
        self.stats.too_old += len(deliveries)
        self._slots.free(len(deliveries) + report.left())
        self.listeners.left_for_sweeper([d.message.msg_id for d in deliveries], "too_old")
        report.tell(self.listeners, "fast")

    async def _publish(self, taken: list[Delivery]) -> None:
        batch = taken  # what this task still holds: all of it until the check is done
        report = BatchReport()
        try:
            batch = await self._committed_only(taken, report)
            messages = [d.message for d in batch]
            with publish_span(messages):
                # One message's exception is that message's: it never fails its batch.
                results = await publish_isolated(self.broker, messages) if batch else []
        except asyncio.CancelledError:  # the loop closes (stop's deadline): leave them
            self._stopped(batch, report)
            raise
        except Exception as exc:  # a bug must not lose the batch from the schedule
            log.exception("broker.publish raised")
            results = [PublishResult(Outcome.RETRY, error=repr(exc)) for _ in batch]
        finally:
            self._in_flight -= len(taken)
        now = self._clock()
        for delivery, result in zip(batch, results, strict=True):
            self._settle(delivery, result, now, report)
        self._slots.free(report.left())
        report.tell(self.listeners, "fast")
        if not self._stopping:
            self._dispatch()

    def _stopped(self, deliveries: Sequence[Delivery], report: BatchReport | None = None) -> None:
        """Leave ``deliveries`` (and what ``report`` let go) to the sweeper at stop."""
        report = report or BatchReport()
        report.stopped += [d.message.msg_id for d in deliveries]
        self.stats.dropped_at_stop += len(deliveries)
        self._slots.free(report.left())
        report.tell(self.listeners, "fast")

    async def _committed_only(self, batch: list[Delivery], report: BatchReport) -> list[Delivery]:
        """Keep the deliveries whose rows are visible and pending, and whose key's turn
        it is; the others wait in the time wheel.

        Only deliveries marked ``check`` are looked up. A row not visible yet belongs
        to a transaction that has not really committed (or never will): it goes to the
        time wheel like a failed publish; if it does commit later, a retry or the
        sweeper takes it. Ordered heads marked ``head`` are checked after that, by a
        statement of their own (a newer snapshot): one whose key has an earlier row
        pending or dead waits for it (``_wait_for_key``).
        """
        to_check = [d for d in batch if d.check or d.head]
        if not to_check:
            return batch
        loop = asyncio.get_running_loop()
        try:
            found, blocked = await loop.run_in_executor(self._verifier, self._look, to_check)
        except Exception as exc:
            log.warning("verifying %d message(s) failed: %s", len(to_check), exc.__class__.__name__)
            found, blocked = set(), {(d.message.topic, d.message.key or "") for d in to_check}
        finally:
            self._checking = False
            if not self._stopping:
                self._dispatch()  # check what arrived meanwhile while this batch publishes
        now = self._clock()
        kept: list[Delivery] = []
        for delivery in batch:
            message = delivery.message
            if delivery.check and message.msg_id not in found:
                self.stats.not_visible += 1
                not_visible = retry("row not visible: transaction not committed")
                self._settle(delivery, not_visible, now, report)
                continue
            delivery.check = False  # seen committed once: retries need no new look
            if delivery.head and (message.topic, message.key) in blocked:
                self._wait_for_key(delivery, report)
                continue
            delivery.head = False  # its predecessors are settled: retries need no new look
            kept.append(delivery)
        return kept

    def _look(self, to_check: list[Delivery]) -> tuple[set[str], set[tuple[str, str]]]:
        """On the verifier's thread: the commit check, then the head check (if any)."""
        ids = [d.message.msg_id for d in to_check if d.check]
        found = self._verify(ids) if ids and self._verify is not None else set()
        heads = [
            (d.message.topic, d.message.key or "", d.message.seq or 0)
            for d in to_check
            if d.head and (not d.check or d.message.msg_id in found)
        ]
        blocked = self._heads(heads) if heads and self._heads is not None else set()
        return found, blocked

    def _wait_for_key(self, delivery: Delivery, report: BatchReport) -> None:
        """An earlier row of its key is not settled: try again later, on the retry
        schedule, unless a lower seq of its lane arrived meanwhile (that one goes first)."""
        self.stats.key_waits += 1
        delivery.waits += 1
        if self._stopping:
            self.stats.dropped_at_stop += 1
            report.stopped.append(delivery.message.msg_id)
            self._leave_lane(delivery, report)
        elif delivery.waits >= len(self.settings.retry_delays_ms):
            self.stats.exhausted += 1
            report.exhausted.append(delivery.message.msg_id)
            self._leave_lane(delivery, report)
        elif lower := self._lanes.yield_to_lower(delivery):
            self._queue.append(self._turn(lower))
        else:
            self._wheel.schedule(delivery, self.settings.retry_delays_ms[delivery.waits])
            self._wheel_busy.set()

    def _leave_lane(self, delivery: Delivery, report: BatchReport) -> None:
        """``delivery`` leaves the fast path: if it heads a lane, its followers go too."""
        if delivery.message.seq is None:
            return
        if behind := self._lanes.drop(delivery):
            self.stats.behind_head += len(behind)
            report.behind += [d.message.msg_id for d in behind]

    def _next_in_lane(self, delivery: Delivery) -> None:
        """``delivery`` was acked: its lane's next one may go now."""
        if (head := self._lanes.acked(delivery)) is None:
            return
        if self._stopping:
            self._stopped([head])
        else:
            self._queue.append(self._turn(head))

    def depths(self) -> tuple[int, int]:
        """(messages in msgQueue or waiting in a lane, messages in the time wheel), for
        metrics; any thread."""
        return len(self._queue) + self._lanes.waiting, len(self._wheel)

    def held(self) -> int:
        """Messages the fast path holds now, wherever they wait: at most ``queue_size``."""
        return self._slots.held

    def _settle(
        self, delivery: Delivery, result: PublishResult, now: float, report: BatchReport
    ) -> None:
        message = delivery.message
        if result.ok:
            latency = now - delivery.committed
            self.stats.published += 1
            self.stats.first_attempt += delivery.attempt == 0
            self.stats.duplicates += result.duplicate
            self.stats.latencies.append(latency)
            if message.seq is not None:
                self._next_in_lane(delivery)
            if self._acks.add(Sent(message.msg_id, message.topic, result.receipt or "", latency)):
                return
            # Acked after stop() closed the acks thread: nobody marks it; the sweeper will.
            self.stats.dropped_at_stop += 1
            report.stopped.append(message.msg_id)
            return
        failed = Failed(message.msg_id, message.topic, delivery.attempt + 1, result.error or "")
        if result.outcome is Outcome.PERMANENT:
            self.stats.rejected += 1
            report.rejected.append(failed)
            log.warning("%s rejected by the broker: %s", message.msg_id, result.error)
            self._leave_lane(delivery, report)
        elif self._stopping:
            self.stats.dropped_at_stop += 1
            report.stopped.append(message.msg_id)
            self._leave_lane(delivery, report)
        elif delivery.attempt + 1 >= len(self.settings.retry_delays_ms):
            self.stats.exhausted += 1
            report.exhausted.append(message.msg_id)
            self._leave_lane(delivery, report)
        else:
            delivery.attempt += 1
            # An operator may skip a failing ordered head (`outbox skip`): its retry looks
            # whether the row is still pending, or its key's next could overtake it.
            if message.seq is not None and self._verify is not None:
                delivery.check = True
            self.stats.retried += 1
            report.retried.append(failed)
            self._wheel.schedule(delivery, self.settings.retry_delays_ms[delivery.attempt])
            self._wheel_busy.set()

    async def _tick(self) -> None:
        while True:
            if not self._wheel:
                self._wheel_busy.clear()
                await self._wheel_busy.wait()
                continue
            await asyncio.sleep(self._wheel.next_due_in())
            due = self._wheel.advance()
            if due and self._stopping:  # none by construction: _shutdown emptied the wheel
                self._stopped(due)
            elif due:
                self._queue.extend(due)
                self._dispatch()

    async def _shutdown(self, deadline: float) -> bool:
        """True when the publishes and acks in flight finished before ``deadline``."""
        self._stopping = True
        left = [*self._take_inbox_now(), *self._queue, *self._wheel.clear(), *self._lanes.clear()]
        self._queue.clear()
        self._stopped(left)
        try:
            await asyncio.wait_for(self._finish_in_flight(), max(0.0, deadline - time.monotonic()))
            return True
        except TimeoutError:
            log.warning(
                "stop: deadline reached with publishes or acks unfinished; the sweeper will resend"
            )
            return False
        finally:
            self._ticker.cancel()
            self._acks.close()
            self._verifier.shutdown(wait=False, cancel_futures=True)

    async def _finish_in_flight(self) -> None:
        while self._publishing:
            await asyncio.gather(*list(self._publishing))
        await self._acks.drain()
