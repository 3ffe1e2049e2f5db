"""What the inbox and its runner share (outbox.inbox, relay.consume): a message as a
handler gets it, the outcome of one delivery, and what the runner asks of an inbox."""

from __future__ import annotations

import enum
import json
import re
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeAlias

from sqlalchemy.orm import Session

from outbox.errors import OutboxError
from outbox.message import KEY_HEADER, SEQ_HEADER, TAGS_HEADER

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession

OWN_HEADERS = (KEY_HEADER, TAGS_HEADER, SEQ_HEADER)  # the outbox's, not the app's
CANONICAL_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


@dataclass(frozen=True)
class InboxMessage:
    """One message as a handler gets it: the outbox's msg_id, its topic, ordering key and
    place in that key (``seq``, the ``Outbox-Seq`` header), the app's headers and the
    payload's bytes (``json()`` decodes them)."""

    msg_id: uuid.UUID
    topic: str
    payload: bytes
    headers: Mapping[str, str] = field(default_factory=dict)
    key: str | None = None
    seq: int | None = None
    tags: str | None = None

    def json(self) -> Any:
        return json.loads(self.payload)

    @classmethod
    def from_broker(
        cls, msg_id: str, topic: str, payload: bytes, headers: Mapping[str, str]
    ) -> InboxMessage:
        """The message from what a broker delivered: the outbox's own headers (key, tags,
        seq) taken out of the app's; an OutboxError when it is not one the outbox sent."""
        if not isinstance(msg_id, str) or not CANONICAL_UUID.fullmatch(msg_id):
            # The relay writes the canonical form; a client's random hex id is not one.
            raise OutboxError(f"not a message of the outbox: msg_id {msg_id!r}")
        parsed = uuid.UUID(msg_id)
        seq = headers.get(SEQ_HEADER)
        if seq is not None and not seq.isdigit():
            raise OutboxError(f"not a message of the outbox: {SEQ_HEADER} {seq!r}")
        own = {k: v for k, v in headers.items() if k not in OWN_HEADERS}
        return cls(parsed, topic, payload, own, headers.get(KEY_HEADER),
                   None if seq is None else int(seq), headers.get(TAGS_HEADER))  # fmt: skip

    def header_map(self) -> dict[str, str]:
        """The headers as the broker carried them (the outbox's own included)."""
        own = {KEY_HEADER: self.key, TAGS_HEADER: self.tags,
               SEQ_HEADER: None if self.seq is None else str(self.seq)}  # fmt: skip
        return {**self.headers, **{k: v for k, v in own.items() if v is not None}}


SyncHandler: TypeAlias = Callable[[Session, InboxMessage], object]
AsyncHandler: TypeAlias = Callable[["AsyncSession", InboxMessage], Awaitable[object]]
Handler: TypeAlias = SyncHandler | AsyncHandler


class Outcome(enum.StrEnum):
    """What became of one delivery: what the runner tells the broker follows from it."""

    HANDLED = "handled"  # the handler committed: ack
    DUPLICATE = "duplicate"  # recorded before: ack, the handler did not run
    RETRY = "retry"  # the handler failed: not acked, tried again after ``delay_s``
    HELD = "held"  # an ordered message before its key's previous one: tried again later
    DEAD = "dead"  # failed past max_attempts (or no handler): recorded as dead, ack


class Result(NamedTuple):
    outcome: Outcome
    delay_s: float = 0.0  # RETRY, HELD: wait this long before the next attempt
    error: str | None = None
    out_of_order: str | None = None  # HANDLED, though not in its key's order: why


class Handling(Protocol):
    """What the runner (relay.consume) asks of an inbox (outbox.inbox.Inbox)."""

    consumer: str

    @property
    def patterns(self) -> list[str]: ...

    @property
    def has_handlers(self) -> bool: ...

    async def handle_async(self, message: InboxMessage, attempt: int = 1) -> Result: ...

    def requeued(self, limit: int = 100) -> list[InboxMessage]: ...

    def handle_requeued(self, message: InboxMessage) -> Result: ...

    def purge(self, batch: int = 1000) -> int: ...
