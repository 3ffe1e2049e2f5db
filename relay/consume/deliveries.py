"""What a broker gives the inbox's runner: deliveries, and the subscription they come from."""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Delivery:
    """One message as a broker delivered it, with what settles it there.

    ``attempt``: the broker's delivery count (1: the first delivery). ``ack`` settles it
    for good; ``retry(delay_s)`` has the broker deliver it again after the delay;
    ``reject`` drops it without a redelivery (a message the outbox did not send).
    """

    msg_id: str | None
    topic: str
    payload: bytes
    headers: Mapping[str, str]
    attempt: int
    ack: Callable[[], Awaitable[object]]
    retry: Callable[[float], Awaitable[object]]
    reject: Callable[[], Awaitable[object]]


class Subscription(abc.ABC):
    """A consumer's share of the broker's messages for its topic patterns: a durable
    consumer (NATS), a queue (RabbitMQ), a consumer group (Redis). Processes that open
    the same consumer's subscription share its messages; an unsettled delivery comes
    again (to any of them) once its process is gone."""

    @abc.abstractmethod
    async def open(self) -> None: ...

    @abc.abstractmethod
    async def fetch(self, most: int, wait_s: float) -> list[Delivery]:
        """Up to ``most`` deliveries, waiting at most ``wait_s`` for the first."""

    @abc.abstractmethod
    async def close(self) -> None: ...

    async def lag(self) -> int | None:
        """Messages for the consumer not yet settled at the broker, if it tells (NATS)."""
        return None
