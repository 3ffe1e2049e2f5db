"""An in-memory broker: publishes into a list, reads it back. No URL scheme reaches it;
hand the object itself to ``Outbox(db, broker=MemoryBroker())`` or a ``BrokerLoop``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from outbox.broker import Broker, LogEntry, LogReader, PublishResult, ok
from outbox.message import Message, carried_headers
from relay.brokers.base import Chunk, checked, malformed

# Decides a message's fate before it is stored; None means store it.
Policy = Callable[[Message], PublishResult | None]


@dataclass
class MemoryBroker(Broker, LogReader):
    """Keeps accepted messages in ``published``; drops a second copy of a msg_id, like JetStream.

    Its receipt is the message's place in ``published``, counting from 1; ``read_log``
    gives them back as a broker's log (``sources``: topics, all when empty).
    """

    policy: Policy | None = None
    delay: float = 0.0  # seconds each batch takes, to keep publishes in flight
    published: list[Message] = field(default_factory=list)
    connected: bool = False
    batches: int = 0
    _receipts: dict[str, str] = field(default_factory=dict)
    _stored_at: list[datetime] = field(default_factory=list)

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
        self._stored_at.append(datetime.now(UTC))
        receipt = self._receipts[message.msg_id] = str(len(self.published))
        return ok(receipt)

    def store_stranger(self, message: Message) -> None:
        """Store ``message`` as it is (any values in it), not checked nor deduplicated:
        an entry someone else than the relay wrote, for tests of the log readers."""
        self.published.append(message)
        self._stored_at.append(datetime.now(UTC))

    async def close(self) -> None:
        self.connected = False

    async def read_log(
        self,
        sources: Sequence[str] = (),
        since: datetime | None = None,
        until: datetime | None = None,
    ) -> AsyncIterator[list[LogEntry]]:
        topics = set(sources)
        held = list(zip(self.published, self._stored_at, strict=False))  # as it is now
        chunk = Chunk()
        for seq, (message, at) in enumerate(held, start=1):
            if topics and message.topic not in topics:
                continue
            if (since is not None and at < since) or (until is not None and at >= until):
                continue
            chunk.add(entry_of(message, str(seq), at))
            if chunk.full:
                yield chunk.take()
        if chunk.entries:
            yield chunk.take()


def entry_of(message: Message, seq: str, at: datetime) -> LogEntry:
    """A stored message as an entry; one the relay cannot have written (a test's
    stranger, appended to ``published`` with any values) is a malformed entry."""
    try:
        headers = carried_headers(message)
    except Exception as exc:  # headers that are not a mapping, a key that is no text
        fields = {"msg_id": message.msg_id, "key": message.key, "tags": message.tags,
                  "headers": message.headers, "payload": message.payload}  # fmt: skip
        stranger = LogEntry(message.msg_id, message.topic, seq, at, message.payload, {})
        return malformed(stranger, f"headers unreadable ({type(exc).__name__})", fields)
    return checked(LogEntry(message.msg_id, message.topic, seq, at, message.payload, headers))
