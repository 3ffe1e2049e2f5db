"""The one protocol every broker adapter implements: connect, publish a batch, close."""

from __future__ import annotations

import abc
import enum
from collections.abc import Sequence
from dataclasses import dataclass

from outbox.message import Message

# Headers the relay adds to every message, beside the app's own.
KEY_HEADER = "Outbox-Key"
TAGS_HEADER = "Outbox-Tags"
NOT_CONNECTED = "not connected"  # every adapter's error while it has no connection


class Outcome(enum.Enum):
    OK = "ok"
    RETRY = "retry"  # may succeed later: timeouts, disconnects, overload
    PERMANENT = "permanent"  # will not succeed as it is: unroutable, rejected, too large


@dataclass(frozen=True, slots=True)
class PublishResult:
    outcome: Outcome
    receipt: str | None = None  # the broker's id for the stored message, e.g. a stream sequence
    error: str | None = None
    duplicate: bool = False  # the broker already held this msg_id and dropped the copy

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK


def ok(receipt: str, duplicate: bool = False) -> PublishResult:
    return PublishResult(Outcome.OK, receipt=receipt, duplicate=duplicate)


def retry(error: str) -> PublishResult:
    return PublishResult(Outcome.RETRY, error=error)


def permanent(error: str) -> PublishResult:
    return PublishResult(Outcome.PERMANENT, error=error)


class Broker(abc.ABC):
    """A connection to one broker, used from one asyncio loop.

    ``publish`` never raises for a message's own failure: it returns one result per
    message, in the order given, and keeps many publishes in flight at once.
    """

    @abc.abstractmethod
    async def connect(self) -> None: ...

    @abc.abstractmethod
    async def publish(self, messages: Sequence[Message]) -> list[PublishResult]: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    async def __aenter__(self) -> Broker:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def relay_headers(message: Message) -> dict[str, str]:
    """The app's headers plus the key and tags, as every adapter carries them."""
    headers = dict(message.headers)
    if message.key is not None:
        headers[KEY_HEADER] = message.key
    if message.tags is not None:
        headers[TAGS_HEADER] = message.tags
    return headers
