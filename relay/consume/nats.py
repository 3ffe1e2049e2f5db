"""NATS JetStream for the inbox: a durable pull consumer named after the inbox's consumer
on every stream whose subjects overlap its patterns, filtered to those patterns.

Processes of one consumer pull from the same durable consumers, so they share the
messages. A message is acked after the inbox's commit; a retry is a ``nak`` with the
backoff's delay; a delivery not settled within ``ACK_WAIT_S`` (its process died) comes
again. The delivery count is JetStream's own, so attempts survive a restart.

URL: ``nats://host:4222[?stream=NAME&ack_wait=SECONDS]``: only that stream (default:
every stream that captures a pattern); the ack wait (default 60 s).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from urllib.parse import parse_qs, urlsplit

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from outbox.errors import ConfigError, OutboxError
from outbox.secrets import mask_url
from relay.consume.deliveries import Delivery, Subscription
from relay.consume.subjects import intersection

log = logging.getLogger("relay.consume")
ACK_WAIT_S = 60.0  # a delivery unsettled this long is delivered again (its process died)
MSG_ID_HEADER = "Nats-Msg-Id"


class NatsSubscription(Subscription):
    def __init__(self, url: str, consumer: str, patterns: Sequence[str]) -> None:
        parts = urlsplit(url)
        self.url = parts._replace(query="").geturl()
        query = parse_qs(parts.query)
        self.stream = query["stream"][0] if "stream" in query else None
        self.ack_wait = ack_wait(query.get("ack_wait", [str(ACK_WAIT_S)])[0])
        self.consumer, self.patterns = consumer, list(patterns)
        self._nc: Client | None = None
        self._subs: list[JetStreamContext.PullSubscription] = []
        self._next = 0  # the subscription fetched from first next time: round robin

    async def open(self) -> None:
        try:
            self._nc = await nats.connect(self.url, name=f"outbox-consume-{self.consumer}",
                                          connect_timeout=2, max_reconnect_attempts=-1)  # fmt: skip
        except Exception as exc:
            raise OutboxError(f"broker {mask_url(self.url)} unreachable: {exc}") from None
        js = self._nc.jetstream()
        filters = await self.filters(js)
        if not filters:
            raise ConfigError(
                f"broker: no JetStream stream at {mask_url(self.url)} captures the "
                f"consumer's topics {', '.join(self.patterns)}"
            )
        for stream, subjects in filters.items():
            config = ConsumerConfig(
                durable_name=self.consumer,
                ack_policy=AckPolicy.EXPLICIT,
                deliver_policy=DeliverPolicy.ALL,
                ack_wait=self.ack_wait,
                filter_subjects=subjects,
            )
            await js.add_consumer(stream, config)
            self._subs.append(await js.pull_subscribe_bind(self.consumer, stream=stream))
            log.info("consumer %s: stream %s, subjects %s", self.consumer, stream, subjects)

    async def filters(self, js: JetStreamContext) -> dict[str, list[str]]:
        """Per stream, the subjects of the patterns it captures (the URL's stream only,
        where it names one)."""
        found: dict[str, list[str]] = {}
        for info in await js.streams_info():
            name = info.config.name
            if name is None or (self.stream and name != self.stream):
                continue
            shared = {intersection(p, s) for p in self.patterns for s in info.config.subjects or []}
            if subjects := sorted(s for s in shared if s is not None):
                found[name] = subjects
        return found

    async def fetch(self, most: int, wait_s: float) -> list[Delivery]:
        """From each stream's consumer in turn, the first that has messages."""
        for _ in range(len(self._subs)):
            sub = self._subs[self._next % len(self._subs)]
            self._next += 1
            try:
                msgs = await sub.fetch(most, timeout=max(wait_s / len(self._subs), 0.05))
            except (nats.errors.TimeoutError, TimeoutError):  # nats-py raises either
                continue
            return [delivery(m) for m in msgs]
        return []

    async def lag(self) -> int | None:
        """Not yet delivered plus delivered and not yet acked, over the streams."""
        total = 0
        for sub in self._subs:
            info = await sub.consumer_info()
            total += (info.num_pending or 0) + (info.num_ack_pending or 0)
        return total

    async def close(self) -> None:
        nc, self._nc = self._nc, None
        if nc is not None and not nc.is_closed:
            # Acks out first; not drain(): it waits out the pull subscriptions' timeout.
            with contextlib.suppress(Exception):
                await nc.flush(timeout=2)
            await nc.close()
        self._subs = []


def ack_wait(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not 1 <= seconds <= 86400:
        raise ConfigError(f"broker: 'ack_wait' must be seconds from 1 to 86400, got {text!r}")
    return seconds


def delivery(msg: Msg) -> Delivery:
    headers: Mapping[str, str] = msg.headers or {}
    own = {k: v for k, v in headers.items() if not k.startswith("Nats-")}

    async def retry(delay_s: float) -> None:
        await msg.nak(delay=delay_s)

    return Delivery(headers.get(MSG_ID_HEADER), msg.subject, msg.data, own,
                    msg.metadata.num_delivered or 1, msg.ack, retry, msg.term)  # fmt: skip
