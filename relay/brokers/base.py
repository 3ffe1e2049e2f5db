"""What the broker adapters share: the safety net around ``publish``, and the log readers'
chunks, errors and times. The protocols themselves (``Broker``, ``LogReader``) and their
value types are in ``outbox.broker``."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

from outbox.broker import Broker, LogEntry, PublishResult, permanent, retry
from outbox.errors import ConfigError, OutboxError
from outbox.message import SEQ_HEADER, Message
from outbox.secrets import mask_url

NOT_CONNECTED = "not connected"  # every adapter's error while it has no connection
# Exceptions that say the connection, not the message, failed.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (TimeoutError, ConnectionError)

log = logging.getLogger("relay.brokers")
# Reading a broker's log back: entries come in chunks of at most LOG_CHUNK entries and
# about LOG_CHUNK_BYTES of payload, so a reader's memory does not grow with the log.
LOG_CHUNK = 50_000
LOG_CHUNK_BYTES = 64 * 1024 * 1024
READ_TIMEOUT_S = 30.0  # a broker silent this long while read is stuck, not done


def unexpected(exc: BaseException) -> PublishResult:
    """The result of a message whose publish raised an exception no adapter foresaw."""
    return permanent(f"{type(exc).__name__}: {exc}")


async def publish_isolated(broker: Broker, messages: Sequence[Message]) -> list[PublishResult]:
    """``broker.publish(messages)``, with a fault of one message kept to that message.

    Safety net for an adapter that still raises from ``publish`` as a whole (or answers
    with the wrong number of results) for a reason other than its connection: each
    message is then published alone, concurrently, and a message whose own publish
    raises gets a PERMANENT result. Trade-off: messages the failed batch call had
    already handed to the broker are published a second time, so this costs at most
    one extra copy per message per call (at least once, as after a crash; JetStream
    drops it by msg_id), instead of a rolled-back batch republished on every pass.
    A connection-level exception (CONNECTION_ERRORS) makes every result RETRY.
    """
    try:
        results = await broker.publish(messages)
        if len(results) == len(messages):
            return results
        error: BaseException = RuntimeError(
            f"{len(results)} result(s) for {len(messages)} message(s)"
        )
    except CONNECTION_ERRORS as exc:
        return [retry(f"{type(exc).__name__}: {exc}") for _ in messages]
    except Exception as exc:
        error = exc
    if len(messages) == 1:
        return [unexpected(error)]
    log.warning(
        "publish of %d message(s) raised %s; publishing them one by one",
        len(messages), type(error).__name__,
    )  # fmt: skip
    return list(await asyncio.gather(*(_alone(broker, m) for m in messages)))


async def _alone(broker: Broker, message: Message) -> PublishResult:
    try:
        [result] = await broker.publish([message])
    except CONNECTION_ERRORS as exc:
        return retry(f"{type(exc).__name__}: {exc}")
    except Exception as exc:
        return unexpected(exc)
    return result


class BrokerRefused(ConfigError):
    """The broker answered and refused what the broker URL asks it to set up (a stream,
    an exchange, a queue): connecting again changes nothing until a setting or the
    broker does. The message holds the broker's own words and the setting to change.
    The relay's connect loop logs it as a refusal, never as an unreachable broker."""


def unreachable(url: str, reason: object) -> OutboxError:
    """A log reader's error: the broker did not answer (the URL masked)."""
    return OutboxError(f"broker {mask_url(url)} unreachable ({reason}); nothing was written")


def utc(value: datetime | None) -> datetime | None:
    if value is None:
        return None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Chunk:
    """Collects a reader's entries until it is ``full``, then ``take`` empties it."""

    __slots__ = ("bytes", "entries")

    def __init__(self) -> None:
        self.entries: list[LogEntry] = []
        self.bytes = 0

    def add(self, entry: LogEntry) -> None:
        self.entries.append(entry)
        self.bytes += len(entry.payload)

    @property
    def full(self) -> bool:
        return len(self.entries) >= LOG_CHUNK or self.bytes >= LOG_CHUNK_BYTES

    def take(self) -> list[LogEntry]:
        entries, self.entries, self.bytes = self.entries, [], 0
        return entries


# A malformed entry's fields are kept as printable ASCII of at most this many characters
# (and each value is cut to it before it is escaped): enough to tell what it is, bounded
# whatever a stranger stored.
RAW_MAX = 1000
RAW_ITEMS = 100  # items of a list or mapping kept in ``raw``
RAW_DEPTH = 20  # nesting kept in ``raw``
SEQ_MAX = 2**63 - 1  # the widest Outbox-Seq (BIGINT's, and the Parquet int64's, bound)


def checked(entry: LogEntry) -> LogEntry:
    """``vetted`` for a reader whose entries hold all the broker held: a malformed one's
    ``raw`` is its msg_id, headers, properties and payload."""
    return vetted(entry, lambda: as_fields(entry))


def as_fields(entry: LogEntry) -> dict[str, object]:
    return {"msg_id": entry.msg_id, "headers": entry.headers, "properties": entry.properties,
            "payload": entry.payload}  # fmt: skip


def vetted(entry: LogEntry, fields: Callable[[], object]) -> LogEntry:
    """``entry``, or its malformed copy when the relay cannot have written it (see
    ``problem``); ``fields`` gives what the broker held, for the copy's ``raw``."""
    reason = problem(entry)
    return entry if reason is None else malformed(entry, reason, fields())


def malformed(entry: LogEntry, reason: str, fields: object) -> LogEntry:
    """A malformed entry: its place (topic, seq, time) and its msg_id where it is text,
    why (``reason``) and ``fields`` escaped into ``raw``; no headers or properties."""
    msg_id = entry.msg_id if isinstance(entry.msg_id, str) and utf8(entry.msg_id) else None
    return dataclasses.replace(
        entry,
        msg_id=msg_id or None,
        payload=entry.payload if isinstance(entry.payload, bytes) else b"",
        headers={},
        properties={},
        malformed=reason,
        raw=raw_text(fields),
    )


def problem(entry: LogEntry) -> str | None:
    """Why the relay cannot have written ``entry``, or None: the relay writes a non-empty
    msg_id, text headers (UTF-8 names and values) and an Outbox-Seq of digits."""
    msg_id: object = entry.msg_id
    if msg_id is None or msg_id == "":
        return "no msg_id"
    if not isinstance(msg_id, str):
        return f"msg_id is {type(msg_id).__name__}, not text"
    if not utf8(msg_id):
        return f"msg_id {shown(msg_id)} is not UTF-8 text"
    if not isinstance(entry.payload, bytes):
        return f"payload is {type(entry.payload).__name__}, not bytes"
    headers: object = entry.headers
    if not isinstance(headers, dict):
        return f"headers are {type(headers).__name__}, not names and text values"
    for name, value in headers.items():
        if not isinstance(name, str) or not isinstance(value, str):
            return f"header {shown(name)} is {type(value).__name__}, not text"
        if not (utf8(name) and utf8(value)):
            return f"header {shown(name)} is not UTF-8 text"
    seq = headers.get(SEQ_HEADER)
    if seq is not None and not whole_number(seq):
        return f"{SEQ_HEADER} {shown(seq)} is not a whole number up to {SEQ_MAX}"
    return None


def utf8(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (a lone surrogate, from JSON's \\ud800, does not)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def whole_number(text: str) -> bool:
    return text.isascii() and text.isdigit() and len(text) <= 19 and int(text) <= SEQ_MAX


def shown(value: object) -> str:
    """A short printable-ASCII form of a stranger's value, for a reason."""
    try:
        text = ascii(value)
    except Exception:  # a repr that raises, or nests too deep
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 40 else text[:40] + "..."


def raw_text(fields: object) -> str:
    """``fields`` as printable ASCII (JSON, every other character escaped; bytes as their
    UTF-8 text with \\xNN for the rest), cut to about RAW_MAX characters."""
    try:
        text = json.dumps(plain(fields), ensure_ascii=True).replace("\x7f", "\\u007f")
    except (TypeError, ValueError, RecursionError):
        text = shown(fields)
    return text if len(text) <= RAW_MAX else f"{text[:RAW_MAX]}... ({len(text)} characters)"


def plain(value: object, depth: int = 0) -> object:
    """``value`` as JSON can hold it, each piece bounded (RAW_MAX, RAW_ITEMS, RAW_DEPTH)."""
    if depth > RAW_DEPTH:
        return "..."
    if isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
        text = data[:RAW_MAX].decode("utf-8", "backslashreplace")
        return text if len(data) <= RAW_MAX else f"{text}... ({len(data)} bytes)"
    if isinstance(value, str):
        return value if len(value) <= RAW_MAX else f"{value[:RAW_MAX]}... ({len(value)} characters)"
    if isinstance(value, bool | float) or value is None:
        return value
    if isinstance(value, int):
        return value if abs(value) <= SEQ_MAX else f"<int of {value.bit_length()} bits>"
    if isinstance(value, dict):
        items = list(value.items())[:RAW_ITEMS]
        return {key_text(k): plain(v, depth + 1) for k, v in items}
    if isinstance(value, list | tuple):
        return [plain(v, depth + 1) for v in value[:RAW_ITEMS]]
    return shown(value)


def key_text(key: object) -> str:
    text = plain(key, RAW_DEPTH)
    return text if isinstance(text, str) else shown(key)
