"""An in-memory broker for unit tests of the relay logic. No URL scheme reaches it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from outbox.message import Message
from relay.brokers.base import Broker, PublishResult, ok

# Decides a message's fate before it is stored; None means store it.
Policy = Callable[[Message], PublishResult | None]


@dataclass
class MemoryBroker(Broker):
    """Keeps accepted messages in ``published``; drops a second copy of a msg_id, like JetStream."""

    policy: Policy | None = None
    delay: float = 0.0  # seconds each batch takes, to keep publishes in flight
    published: list[Message] = field(default_factory=list)
    connected: bool = False
    batches: int = 0
    _receipts: dict[str, str] = field(default_factory=dict)

    async def connect(self) -> None:
        self.connected = True

    async def publish(self, messages: Sequence[Message]) -> list[PublishResult]:
        self.batches += 1
        if self.delay:
            await asyncio.sleep(self.delay)
        return [self._publish_one(message) for message in messages]

    def _publish_one(self, message: Message) -> PublishResult:
        verdict = self.policy(message) if self.policy else None
        if verdict is not None:
            return verdict
        known = self._receipts.get(message.msg_id)
        if known is not None:
            return ok(known, duplicate=True)
        self.published.append(message)
        receipt = self._receipts[message.msg_id] = str(len(self.published))
        return ok(receipt)

    async def close(self) -> None:
        self.connected = False
