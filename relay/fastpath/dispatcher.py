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

Unordered messages never enter a lane: they cost one branch more than before. The
ordering policy (``relay.fastpath.lanes.OrderedLanes``) is called at a few named points:
admitting what was submitted, an ack, a delivery leaving, a retry, a head that must wait.
What the table must confirm before a delivery goes is its ``look`` (relay.fastpath.delivery),
asked by ``relay.fastpath.checks``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Sequence

from outbox.broker import Outcome, PublishResult, retry
from outbox.events import Failed, RelayListener, Sent, Stats
from outbox.message import Message
from outbox.settings import Settings
from outbox.tracing import publish_span
from relay.brokers.base import publish_isolated
from relay.fastpath.acks import AckBatcher, Finish, Heads, Verify
from relay.fastpath.batches import BatchReport
from relay.fastpath.checks import Checks
from relay.fastpath.delivery import Delivery, Look
from relay.fastpath.inbox import Inbox
from relay.fastpath.lanes import ACKED_KEYS, OrderedLanes
from relay.fastpath.stats import Slots
from relay.fastpath.timewheel import Ticker, TimeWheel
from relay.listener import Listeners
from relay.loop import BrokerLoop
from relay.part import START_TIMEOUT_S, Lifecycle

log = logging.getLogger("relay.fastpath.dispatcher")

__all__ = ["Delivery", "Dispatcher"]


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
        self._ordering = OrderedLanes(self.acked_keys, heads is not None, verify is not None)
        self._lanes = self._ordering.lanes
        self._inbox = Inbox(self._slots, self.stats, self.listeners, clock)

    def submit(self, messages: Sequence[Message], check: bool = True) -> int:
        """Queue committed messages for publishing; returns how many were taken.

        Never blocks: a message not taken (the fast path holds ``queue_size`` messages
        already, fast path stopped) is still in the table and the sweeper will publish it.
        ``check``: re-read the rows before publishing (the commit could not be proven
        by the app side).
        """
        look = Look.COMMIT if check and self._verify is not None else Look.NONE
        return self._inbox.submit(messages, look)

    def _start(self) -> None:
        """Set up on the broker loop (started already: the owner's job)."""
        assert self.broker_loop.running, "start the BrokerLoop before its Dispatcher"
        self.broker_loop.submit(self._setup()).result(START_TIMEOUT_S)

    def _stop(self, timeout: float) -> bool:
        """Take no new work, finish in-flight publishes and acks within ``timeout``.

        What is still queued or waiting for a retry stays in the table for the sweeper.
        """
        self._inbox.close()
        deadline = time.monotonic() + timeout
        finished = False
        try:
            finished = self.broker_loop.submit(self._shutdown(deadline)).result(timeout + 1.0)
        except (TimeoutError, RuntimeError):
            log.warning("stop: the broker loop did not answer in time")
        # The acks were closed by _shutdown already, unless the loop did not answer.
        acks_ended = self._acks.stop(max(0.0, deadline - time.monotonic()))
        self._inbox.drop()  # what is left in it: the loop did not answer
        return finished and acks_ended

    async def _setup(self) -> None:
        self._queue: collections.deque[Delivery] = collections.deque()
        self._in_flight = 0
        self._checking = False  # a SELECT of rows to publish is running
        self._publishing: set[asyncio.Task[None]] = set()
        self._stopping = False
        settings = self.settings
        wheel = TimeWheel[Delivery](settings.tick_ms, max(settings.retry_delays_ms), self._clock)
        self._wheel = Ticker(wheel, self._due)
        self._acks = AckBatcher(self._finish, self.stats, settings.ack_batch_size,
                                settings.ack_flush_ms, self.listeners, self._slots)  # fmt: skip
        self._acks.start()
        self._checks = Checks(self._verify, self._heads)
        self._inbox.open(asyncio.get_running_loop(), self._take_inbox)

    def _take_inbox(self) -> None:
        if deliveries := self._inbox.take():  # empty when _shutdown took them first
            self._enqueue(deliveries)

    def _enqueue(self, deliveries: list[Delivery]) -> None:
        if self._stopping:  # raced with stop(): the rows stay for the sweeper
            self._stopped(deliveries)
            return
        self.stats.accepted += len(deliveries)
        if behind := self._ordering.admit(deliveries, self._queue, self.lane_limit):
            # Their key's head is failing (or its lane is full): left in the table behind it.
            self.stats.behind_head += len(behind)
            self._slots.free(len(behind))
            self.listeners.left_for_sweeper([d.message.msg_id for d in behind], "behind_head")
        self._dispatch()

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
            self._checking = any(d.look for d in batch)
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
            if self._checking_any(taken):  # else nothing to ask the table: no await for it
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

    @staticmethod
    def _checking_any(batch: list[Delivery]) -> bool:
        """Whether a delivery of ``batch`` must be looked at in the table first."""
        return any(d.look for d in batch)

    def _stopped(self, deliveries: Sequence[Delivery], report: BatchReport | None = None) -> None:
        """Leave ``deliveries`` (and what ``report`` let go) to the sweeper at stop."""
        report = report or BatchReport()
        report.stopped += [d.message.msg_id for d in deliveries]
        self.stats.dropped_at_stop += len(deliveries)
        self._slots.free(report.left())
        report.tell(self.listeners, "fast")

    async def _committed_only(self, batch: list[Delivery], report: BatchReport) -> list[Delivery]:
        """Keep the deliveries the table confirms (relay.fastpath.checks); a row not visible
        retries like a failed publish, a head whose key is blocked waits for its turn."""
        try:
            checked = await self._checks.sort(batch)
        finally:
            self._checking = False
            if not self._stopping:
                self._dispatch()  # check what arrived meanwhile while this batch publishes
        now = self._clock()
        for delivery in checked.held:
            if delivery.look & Look.COMMIT:
                self.stats.not_visible += 1
                not_visible = retry("row not visible: transaction not committed")
                self._settle(delivery, not_visible, now, report)
            else:
                self._wait_for_key(delivery, report)
        return checked.kept

    def _wait_for_key(self, delivery: Delivery, report: BatchReport) -> None:
        """An earlier row of its key is not settled: try again later, on the retry
        schedule, unless a lower seq of its lane arrived meanwhile (that one goes first)."""
        self.stats.key_waits += 1
        delivery.waits += 1
        if self._stopping or delivery.waits >= len(self.settings.retry_delays_ms):
            self._give_up(delivery, report)
        elif lower := self._ordering.step_back(delivery):
            self._queue.append(lower)
        else:
            self._wheel.schedule(delivery, self.settings.retry_delays_ms[delivery.waits])

    def _give_up(self, delivery: Delivery, report: BatchReport) -> None:
        """``delivery`` leaves the fast path at stop, or with its retry schedule spent."""
        if self._stopping:
            self.stats.dropped_at_stop += 1
            report.stopped.append(delivery.message.msg_id)
        else:
            self.stats.exhausted += 1
            report.exhausted.append(delivery.message.msg_id)
        self._leave_lane(delivery, report)

    def _leave_lane(self, delivery: Delivery, report: BatchReport) -> None:
        """``delivery`` leaves the fast path: if it heads a lane, its followers go too."""
        if behind := self._ordering.leave(delivery):
            self.stats.behind_head += len(behind)
            report.behind += [d.message.msg_id for d in behind]

    def depths(self) -> tuple[int, int]:
        """(messages in msgQueue or waiting in a lane, messages in the time wheel), for
        metrics; any thread."""
        return len(self._queue) + self._ordering.waiting, len(self._wheel)

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
            if (head := self._ordering.acked(delivery)) and self._stopping:
                self._stopped([head])
            elif head:  # its lane's next may go now
                self._queue.append(head)
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
        elif self._stopping or delivery.attempt + 1 >= len(self.settings.retry_delays_ms):
            self._give_up(delivery, report)
        else:
            delivery.attempt += 1
            self._ordering.retrying(delivery)
            self.stats.retried += 1
            report.retried.append(failed)
            self._wheel.schedule(delivery, self.settings.retry_delays_ms[delivery.attempt])

    def _due(self, due: list[Delivery]) -> None:
        """Their retry (or their look at their key) is due: from the time wheel's task."""
        if self._stopping:  # none by construction: _shutdown emptied the wheel
            self._stopped(due)
        else:
            self._queue.extend(due)
            self._dispatch()

    async def _shutdown(self, deadline: float) -> bool:
        """True when the publishes and acks in flight finished before ``deadline``."""
        self._stopping = True
        left = [*self._inbox.take(), *self._queue, *self._wheel.clear()]
        left += self._ordering.clear()
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
            self._wheel.cancel()
            self._acks.close()
            self._checks.shutdown()

    async def _finish_in_flight(self) -> None:
        while self._publishing:
            await asyncio.gather(*list(self._publishing))
        await self._acks.drain()
