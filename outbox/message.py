"""What one message is, and the rules ``send()`` checks before anything is written."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from outbox.errors import (
    InvalidHeaders,
    InvalidKey,
    InvalidPayload,
    InvalidTags,
    InvalidTopic,
    PayloadTooLarge,
)

MAX_TEXT = 255  # topic, key and joined tags share the column width
CONTENT_TYPE = "content-type"
# Headers the relay sets itself; an app setting them would break dedup or routing.
RESERVED_HEADER_PREFIXES = ("nats-", "outbox-")


@dataclass(frozen=True, slots=True)
class Message:
    """A committed-or-about-to-be message, as the relay will publish it."""

    msg_id: str
    topic: str
    payload: bytes
    key: str | None = None
    tags: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    # time.monotonic() when send() was called: the start of commit->ack latency.
    born: float = field(default_factory=time.monotonic)


def build_message(
    topic: object,
    payload: object,
    *,
    key: object = None,
    tags: object = None,
    headers: object = None,
    max_payload_bytes: int,
) -> Message:
    """Validate and encode one message; raises an ``InvalidMessage`` subclass on bad input."""
    topic, key, tags = check_topic(topic), check_key(key), check_tags(tags)
    all_headers = check_headers(headers)
    body, content_type = encode_payload(payload)
    if len(body) > max_payload_bytes:
        raise PayloadTooLarge(
            "payload", f"must be at most {max_payload_bytes} bytes once encoded, got {len(body)}"
        )
    if content_type and CONTENT_TYPE not in {name.lower() for name in all_headers}:
        all_headers[CONTENT_TYPE] = content_type
    return Message(str(uuid7()), topic, body, key, tags, all_headers)


def recheck(message: Message) -> None:
    """Check a stored message (a row planted by hand or by an older version) against the
    contract ``send()`` enforces; raises an ``InvalidMessage`` subclass when it breaks it.

    The relay calls this before publishing a row it did not build itself, so such a row
    fails alone instead of breaking its batch.
    """
    check_topic(message.topic)
    check_key(message.key)
    if message.tags is not None:
        check_tags(message.tags.split(","))
    check_headers(message.headers)
    if not isinstance(message.payload, bytes):
        raise InvalidPayload("payload", "must be stored as bytes")


def check_topic(topic: object) -> str:
    """Topics follow NATS subject rules, the strictest of the supported brokers."""
    if not isinstance(topic, str) or not topic:
        raise InvalidTopic("topic", "must be a non-empty string")
    if len(topic) > MAX_TEXT:
        raise InvalidTopic("topic", f"must be at most {MAX_TEXT} characters")
    if any(ch.isspace() or not ch.isprintable() for ch in topic):
        raise InvalidTopic("topic", f"must not contain spaces or control characters: {topic!r}")
    if "*" in topic or ">" in topic:
        raise InvalidTopic("topic", f"must not contain the wildcards '*' or '>': {topic!r}")
    if "" in topic.split("."):
        raise InvalidTopic(
            "topic", f"must not have empty tokens ('..' or a dot at an end): {topic!r}"
        )
    return topic


def check_key(key: object) -> str | None:
    if key is None:
        return None
    if not isinstance(key, str) or not key:
        raise InvalidKey("key", "must be a non-empty string or None")
    if len(key) > MAX_TEXT:
        raise InvalidKey("key", f"must be at most {MAX_TEXT} characters")
    if not key.isprintable():
        raise InvalidKey("key", "must not contain control characters")
    return key


def check_tags(tags: object) -> str | None:
    """Tags are a string or a sequence of strings, stored comma-joined."""
    if tags is None:
        return None
    items = [tags] if isinstance(tags, str) else tags
    if not isinstance(items, Sequence) or not items:
        raise InvalidTags("tags", "must be a string or a non-empty list of strings")
    for tag in items:
        if not isinstance(tag, str) or not tag:
            raise InvalidTags("tags", f"each tag must be a non-empty string, got {tag!r}")
        if "," in tag or any(ch.isspace() or not ch.isprintable() for ch in tag):
            raise InvalidTags("tags", f"a tag must not contain commas or spaces: {tag!r}")
    joined = ",".join(items)
    if len(joined) > MAX_TEXT:
        raise InvalidTags("tags", f"must be at most {MAX_TEXT} characters joined")
    return joined


def check_headers(headers: object) -> dict[str, str]:
    if headers is None:
        return {}
    if not isinstance(headers, Mapping):
        raise InvalidHeaders("headers", "must be a mapping of strings to strings")
    checked: dict[str, str] = {}
    for name, value in headers.items():
        if not isinstance(name, str) or not name:
            raise InvalidHeaders("headers", f"names must be non-empty strings, got {name!r}")
        if ":" in name or any(ch.isspace() or not ch.isprintable() for ch in name):
            raise InvalidHeaders(
                "headers", f"name must not contain ':', spaces or controls: {name!r}"
            )
        if name.lower().startswith(RESERVED_HEADER_PREFIXES):
            raise InvalidHeaders("headers", f"name {name!r} uses a prefix the relay reserves")
        if not isinstance(value, str):
            raise InvalidHeaders("headers", f"value of {name!r} must be a string, got {value!r}")
        if "\r" in value or "\n" in value:
            raise InvalidHeaders("headers", f"value of {name!r} must not contain line breaks")
        checked[name] = value
    return checked


def encode_payload(payload: object) -> tuple[bytes, str | None]:
    """bytes as they are, str as UTF-8, anything else as JSON; returns (body, content type)."""
    if isinstance(payload, bytes | bytearray | memoryview):
        return bytes(payload), None
    if isinstance(payload, str):
        try:
            return payload.encode("utf-8"), "text/plain; charset=utf-8"
        except UnicodeEncodeError as exc:
            raise InvalidPayload("payload", f"str must be encodable as UTF-8: {exc}") from None
    try:
        text = json.dumps(payload, allow_nan=False, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise InvalidPayload("payload", f"must be bytes, str or JSON-serialisable: {exc}") from None
    return text.encode("utf-8"), "application/json"


_uuid_lock = threading.Lock()
_last_uuid_ms = 0
_uuid_seq = 0


def uuid7() -> uuid.UUID:
    """A UUIDv7 (RFC 9562): 48-bit Unix ms, then a 12-bit counter, then random bits.

    The counter keeps ids from one process strictly increasing within a millisecond.
    """
    global _last_uuid_ms, _uuid_seq
    with _uuid_lock:
        now_ms = time.time_ns() // 1_000_000
        if now_ms > _last_uuid_ms:
            _last_uuid_ms, _uuid_seq = now_ms, int.from_bytes(os.urandom(2)) & 0x3FF
        else:
            _uuid_seq += 1
            if _uuid_seq > 0xFFF:  # counter spent: borrow the next millisecond
                _last_uuid_ms, _uuid_seq = _last_uuid_ms + 1, 0
        ms, seq = _last_uuid_ms, _uuid_seq
    rand_b = int.from_bytes(os.urandom(8)) & ((1 << 62) - 1)
    value = (ms << 80) | (0x7 << 76) | (seq << 64) | (0b10 << 62) | rand_b
    return uuid.UUID(int=value)
