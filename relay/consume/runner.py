"""The inbox's loop: deliveries in, each handled by ``Inbox.handle_async``, settled at
the broker by its outcome, until asked to stop.

A handled or duplicate message is acked; a failing one is given back for a retry after
the inbox's backoff; a dead one (recorded with its error) is acked. A delivery the outbox
did not send (no msg_id) is rejected and logged. Dead letters an operator requeued run
again from the table every ``REQUEUED_EVERY_S``. One message at a time per process, in
the order the broker delivers them. Stopping (``stopping`` set: SIGTERM, SIGINT) lets
the handler in hand finish and settle; deliveries fetched and not begun are left to
come again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from urllib.parse import urlsplit

from outbox.consumer import Handling, InboxMessage, Outcome
from outbox.errors import ConfigError, OutboxError
from relay.consume.deliveries import Delivery, Subscription

log = logging.getLogger("relay.consume")
BATCH = 16
FETCH_WAIT_S = 1.0
REQUEUED_EVERY_S = 5.0
LAG_EVERY_S = 5.0
PURGE_EVERY_S = 300.0  # the inbox forgets msg_ids past its keep_days this often
OUT_OF_ORDER = "out of order"  # handled, not in its key's order: reported
REJECTED = "rejected"  # not a message of the outbox's: dropped at the broker, logged


def subscription_for(broker: str, inbox: Handling) -> Subscription:
    """The broker's subscription for ``inbox``'s consumer and patterns."""
    if not inbox.has_handlers:
        raise ConfigError(f"inbox {inbox.consumer!r}: no handler registered (@inbox.handler)")
    scheme = urlsplit(broker).scheme
    if scheme in ("nats", "tls"):
        from relay.consume.nats import NatsSubscription

        return NatsSubscription(broker, inbox.consumer, inbox.patterns)
    if scheme in ("redis", "rediss"):
        from relay.consume.redis import RedisSubscription

        return RedisSubscription(broker, inbox.consumer, inbox.patterns)
    if scheme in ("amqp", "amqps"):
        from relay.consume.rabbitmq import RabbitSubscription

        return RabbitSubscription(broker, inbox.consumer, inbox.patterns)
    raise ConfigError(
        "broker: the inbox consumes from nats://, redis:// or amqp:// brokers (tls://, "
        f"rediss://, amqps://), not {scheme or broker!r}"
    )


class Consumer:
    """Runs ``inbox`` on ``subscription``; ``counts`` by outcome (and rejected)."""

    def __init__(self, inbox: Handling, subscription: Subscription, batch: int = BATCH) -> None:
        self.inbox, self.subscription, self.batch = inbox, subscription, batch
        self.counts: Counter[str] = Counter()
        self._requeued_at = 0.0
        self._purged_at = 0.0
        self.lag: int | None = None  # the broker's, refreshed every LAG_EVERY_S
        self._lag_at = 0.0

    async def run(self, stopping: asyncio.Event) -> None:
        await self.subscription.open()
        try:
            while not stopping.is_set():
                for delivery in await self.subscription.fetch(self.batch, FETCH_WAIT_S):
                    if stopping.is_set():
                        break  # not begun: the broker delivers it again
                    await self.one(delivery)
                await self.requeued(stopping)
                await self.purge()
                await self.measure_lag()
        finally:
            await self.subscription.close()

    async def one(self, delivery: Delivery) -> Outcome | None:
        try:
            message = InboxMessage.from_broker(
                delivery.msg_id or "", delivery.topic, delivery.payload, delivery.headers
            )
        except OutboxError as exc:
            log.warning("consumer %s: %s on %s: rejected", self.inbox.consumer, exc, delivery.topic)
            await delivery.reject()
            self.counts[REJECTED] += 1
            return None
        result = await self.inbox.handle_async(message, delivery.attempt)
        if result.out_of_order is not None:
            log.warning("consumer %s: out of order: %s", self.inbox.consumer, result.out_of_order)
            self.counts[OUT_OF_ORDER] += 1
        if result.outcome is Outcome.HELD:
            await delivery.retry(result.delay_s)
        elif result.outcome is Outcome.RETRY:
            log.info("consumer %s: %s failed (attempt %d), again in %gs: %s", self.inbox.consumer,
                     message.msg_id, delivery.attempt, result.delay_s, result.error)  # fmt: skip
            await delivery.retry(result.delay_s)
        else:
            if result.outcome is Outcome.DEAD:
                self.buried(message, delivery.attempt, result.error)
            await delivery.ack()
        self.counts[result.outcome] += 1
        return result.outcome

    def buried(self, message: InboxMessage, attempt: int, error: str | None) -> None:
        log.warning("consumer %s: %s is dead after %d attempt(s): %s",
                    self.inbox.consumer, message.msg_id, attempt, error)  # fmt: skip

    async def measure_lag(self) -> None:
        if time.monotonic() - self._lag_at < LAG_EVERY_S:
            return
        self._lag_at = time.monotonic()
        try:
            self.lag = await self.subscription.lag()
        except Exception as exc:  # a gauge left unknown, never the consumer stopped
            log.debug("consumer %s: lag unknown: %s", self.inbox.consumer, exc)
            self.lag = None

    async def purge(self) -> None:
        """Forget old msg_ids now and then (Inbox.purge), so the table stays its window's size."""
        if time.monotonic() - self._purged_at < PURGE_EVERY_S:
            return
        self._purged_at = time.monotonic()
        removed = await asyncio.to_thread(self.inbox.purge)
        if removed:
            log.info(
                "consumer %s: forgot %d msg_id(s) handled long ago", self.inbox.consumer, removed
            )

    async def requeued(self, stopping: asyncio.Event) -> None:
        """Run the dead letters an operator gave back, now and then."""
        if time.monotonic() - self._requeued_at < REQUEUED_EVERY_S:
            return
        self._requeued_at = time.monotonic()
        for message in await asyncio.to_thread(self.inbox.requeued):
            if stopping.is_set():
                return
            result = await asyncio.to_thread(self.inbox.handle_requeued, message)
            self.counts[f"requeued {result.outcome}"] += 1


async def run(
    inbox: Handling,
    broker: str,
    stopping: asyncio.Event | None = None,
    on_start: Callable[[Consumer], None] | None = None,
) -> Counter[str]:
    """Consume for ``inbox`` from ``broker`` until ``stopping`` is set; the counts.
    ``on_start``: told the Consumer first (the metrics read its counts)."""
    consumer = Consumer(inbox, subscription_for(broker, inbox))
    if on_start is not None:
        on_start(consumer)
    await consumer.run(stopping or asyncio.Event())
    return consumer.counts


def run_until_signalled(
    inbox: Handling,
    broker: str,
    command: str = "consume",
    on_start: Callable[[Consumer], None] | None = None,
) -> Counter[str]:
    """``run`` in a new event loop until SIGINT or SIGTERM: the first lets the handler in
    hand finish and settle, a second exits at once (its transaction rolls back and the
    broker delivers the message again). Main thread only."""

    async def main() -> Counter[str]:
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal(signum: int) -> None:
            if stopping.is_set():
                force_exit(command, signum)
            log.info("consumer %s: %s, stopping", inbox.consumer, signal.Signals(signum).name)
            stopping.set()

        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, on_signal, signum)
        try:
            return await run(inbox, broker, stopping, on_start)
        finally:
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(signum)

    return asyncio.run(main())


def force_exit(command: str, signum: int) -> None:
    name = signal.Signals(signum).name
    os.write(
        2,
        f"outbox {command}: second {name}, exiting now; the message in hand comes again\n".encode(),
    )
    os._exit(128 + signum)
