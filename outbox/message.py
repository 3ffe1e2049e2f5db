"""What one message is, and the rules ``send()`` checks before anything is written."""

from __future__ import annotations

import json
import os
import re
import reprlib
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime

from outbox.errors import (
    InvalidHeaders,
    InvalidKey,
    InvalidMessage,
    InvalidPayload,
    InvalidTags,
    InvalidTopic,
    PayloadTooLarge,
)

MAX_TEXT_BYTES = 255  # AMQP's routing key and header names are short strings of 255 bytes
# JetStream refuses a header block over 65,535 bytes (a 16-bit length); RabbitMQ, which
# carries all headers in one frame of at most frame_max (128 KiB by default), has room.
MAX_HEADER_BYTES = 65_535
CONTENT_TYPE = "content-type"
# Headers the relay adds beside the app's own (relay.brokers); they count toward the size.
KEY_HEADER = "Outbox-Key"
TAGS_HEADER = "Outbox-Tags"
SEQ_HEADER = "Outbox-Seq"  # an ordered message's place in its key: consumers can check it
SEQ_DIGITS = 19  # the widest BIGINT: the size check counts it before the number is taken
# How send() measures a message, one rule for every broker: the payload, plus each
# header (the app's, key and tags) as its name and value in UTF-8 and HEADER_LINE_BYTES
# more (a separator and a line end), plus the msg_id as one more header whose name takes
# ID_HEADER_NAME_BYTES, plus HEADER_BLOCK_BYTES around them all. These are the figures of
# the NATS header block, the strictest broker's (its max_payload counts the headers);
# relay.brokers.nats builds that block itself, and a test keeps the two in step.
HEADER_LINE_BYTES = 4
ID_HEADER_NAME_BYTES = 11
HEADER_BLOCK_BYTES = 12
# Headers the relay sets itself; an app setting them would break dedup or routing.
RESERVED_HEADER_PREFIXES = ("nats-", "outbox-")
# RabbitMQ routes a message to the routing keys in these headers too (sender-selected
# distribution): through them a message would reach queues its topic does not.
RESERVED_HEADER_NAMES = frozenset({"cc", "bcc"})
# RFC 7230 token characters: what nats-py accepts as a header name (BadHeaderError else).
HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# Values in error messages: cut short, and safe from a __repr__ that raises.
_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 80
shown = _repr.repr
# Control characters (Unicode Cc) and surrogates: a NATS header line ends at CR or LF,
# and a surrogate has no UTF-8 form.
BAD_VALUE_CHAR = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


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
    # send(ordered=True): published after the key's earlier messages, with its ``seq``
    # (taken when its row is written; None until then and for unordered messages).
    ordered: bool = False
    seq: int | None = None
    # A scheduled message (send(delay=..., deliver_at=..., delay_level=..., dedup_key=...)):
    # a relay's scheduler publishes it once the database clock passes its due time. One of
    # the two is set: ``delay_s`` counts from the row's INSERT, ``deliver_at`` is aware UTC.
    delay_s: float | None = None
    deliver_at: datetime | None = None

    @property
    def scheduled(self) -> bool:
        return self.delay_s is not None or self.deliver_at is not None


def build_message(
    topic: object,
    payload: object,
    *,
    key: object = None,
    tags: object = None,
    headers: object = None,
    ordered: object = False,
    max_payload_bytes: int,
) -> Message:
    """Validate and encode one message; raises an ``InvalidMessage`` subclass on bad input."""
    topic, key, tags = check_topic(topic), check_key(key), check_tags(tags)
    ordered = check_ordered(ordered, key)
    all_headers = check_headers(headers)
    body, content_type = encode_payload(payload)
    if content_type and CONTENT_TYPE not in {name.lower() for name in all_headers}:
        all_headers[CONTENT_TYPE] = content_type
    message = Message(str(uuid7()), topic, body, key, tags, all_headers, ordered=ordered)
    check_size(message, max_payload_bytes)
    return message


def recheck(message: object, max_payload_bytes: int | None = None) -> None:
    """Check a stored message (a row planted by hand or by an older version) against the
    contract ``send()`` enforces; raises an ``InvalidMessage`` subclass when it breaks it,
    and nothing else, whatever the fields hold. The size is checked when a limit is given.

    The relay calls this before publishing a row it did not build itself, so such a row
    fails alone instead of breaking its batch.
    """
    if not isinstance(message, Message):
        raise InvalidMessage("message", f"must be a Message, got {type(message).__name__}")
    check_msg_id(message.msg_id)
    check_topic(message.topic)
    check_key(message.key)
    if message.tags is not None:
        if not isinstance(message.tags, str):
            raise InvalidTags("tags", "must be stored as a comma-joined string")
        check_tags(message.tags.split(","))
    headers = check_headers(message.headers)  # None (a JSON null) is no headers
    if not isinstance(message.payload, bytes):
        raise InvalidPayload("payload", "must be stored as bytes")
    if max_payload_bytes is not None:
        check_size(replace(message, headers=headers), max_payload_bytes)


def check_msg_id(msg_id: object) -> str:
    """A UUID in its canonical form: the relay publishes the id exactly as stored."""
    try:
        if isinstance(msg_id, str) and str(uuid.UUID(msg_id)) == msg_id:
            return msg_id
    except ValueError:
        pass
    raise InvalidMessage("msg_id", f"must be a UUID in canonical form, got {shown(msg_id)}")


def check_topic(topic: object) -> str:
    """NATS subject rules (the strictest broker), in at most 255 bytes (AMQP's routing key)."""
    if not isinstance(topic, str) or not topic:
        raise InvalidTopic("topic", "must be a non-empty string")
    if len(topic) > MAX_TEXT_BYTES:
        _check_text_bytes(InvalidTopic, "topic", topic)
    # isprintable() is False for every whitespace character but the ASCII space.
    if " " in topic or not topic.isprintable():
        raise InvalidTopic(
            "topic", f"must not contain spaces, control or unprintable characters: {shown(topic)}"
        )
    if "*" in topic or ">" in topic:
        raise InvalidTopic("topic", f"must not contain the wildcards '*' or '>': {shown(topic)}")
    tokens = topic.split(".")
    if "" in tokens:
        raise InvalidTopic(
            "topic", f"must not have empty tokens ('..' or a dot at an end): {shown(topic)}"
        )
    if reserved_topic(topic):
        raise InvalidTopic(
            "topic", f"must not start with '$' or '_INBOX': NATS reserves them: {shown(topic)}"
        )
    _check_text_bytes(InvalidTopic, "topic", topic)
    return topic


def reserved_topic(topic: str) -> bool:
    """True for the topics a broker keeps for itself: the NATS server's own APIs ($JS,
    $SYS, ...) and request replies (_INBOX)."""
    return topic.startswith("$") or topic.split(".", 1)[0].upper() == "_INBOX"


def check_key(key: object) -> str | None:
    """The key travels as a header value (``Outbox-Key``), so it follows those rules."""
    if key is None:
        return None
    if not isinstance(key, str) or not key:
        raise InvalidKey("key", "must be a non-empty string or None")
    _check_text_bytes(InvalidKey, "key", key)
    _check_header_value(InvalidKey, "key", key)
    return key


def check_ordered(ordered: object, key: str | None) -> bool:
    """``ordered=True`` keeps the order of one key's messages: it needs the key."""
    if not isinstance(ordered, bool):
        raise InvalidMessage("ordered", f"must be True or False, got {type(ordered).__name__}")
    if ordered and key is None:
        raise InvalidKey("key", "is required with ordered=True: the order is kept per key")
    return ordered


def check_tags(tags: object) -> str | None:
    """Tags are a string or a sequence of strings, stored comma-joined."""
    if tags is None:
        return None
    items = [tags] if isinstance(tags, str) else tags
    if not isinstance(items, Sequence) or not items:
        raise InvalidTags("tags", "must be a string or a non-empty list of strings")
    for tag in items:
        if not isinstance(tag, str) or not tag:
            raise InvalidTags("tags", f"each tag must be a non-empty string, got {shown(tag)}")
        if "," in tag or " " in tag or not tag.isprintable():
            raise InvalidTags(
                "tags",
                f"a tag must not contain commas, spaces or unprintable characters: {shown(tag)}",
            )
    joined = ",".join(items)
    _check_text_bytes(InvalidTags, "tags", joined, "joined with commas")
    return joined


def check_headers(headers: object) -> dict[str, str]:
    """Names are RFC 7230 tokens, unique ignoring case; values are one-line text."""
    if headers is None:
        return {}
    if not isinstance(headers, Mapping):
        raise InvalidHeaders("headers", "must be a mapping of strings to strings")
    checked: dict[str, str] = {}
    seen: set[str] = set()
    for name, value in headers.items():
        lowered = check_header_name(name)
        if lowered in seen:
            raise InvalidHeaders(
                "headers", f"name {shown(name)} is given twice (names ignore case)"
            )
        seen.add(lowered)
        if not isinstance(value, str):
            raise InvalidHeaders(
                "headers", f"value of {shown(name)} must be a string, got {shown(value)}"
            )
        _check_header_value(InvalidHeaders, "headers", value, f"value of {shown(name)}")
        if lowered == CONTENT_TYPE:  # AMQP's content_type property is a short string
            _check_text_bytes(InvalidHeaders, "headers", value, f"for the value of {shown(name)}")
        checked[name] = value
    return checked


def check_header_name(name: object) -> str:
    """The name in lower case, once it is one an app may set."""
    if not isinstance(name, str) or not name:
        raise InvalidHeaders("headers", f"names must be non-empty strings, got {shown(name)}")
    if len(name) > MAX_TEXT_BYTES or not HEADER_NAME.fullmatch(name):
        raise InvalidHeaders(
            "headers",
            f"name must be 1 to {MAX_TEXT_BYTES} of the ASCII letters, digits and "
            f"!#$%&'*+-.^_`|~ (an HTTP token; no ':', spaces or controls): {shown(name)}",
        )
    lowered = name.lower()
    if lowered.startswith(RESERVED_HEADER_PREFIXES) or lowered in RESERVED_HEADER_NAMES:
        raise InvalidHeaders("headers", f"name {shown(name)} is reserved by the relay or a broker")
    return lowered


def _check_header_value(
    error: type[InvalidMessage], field_name: str, value: str, what: str = "value"
) -> None:
    if bad := BAD_VALUE_CHAR.search(value):
        raise error(
            field_name,
            f"{what} must not contain control characters or surrogates, got {shown(bad.group())}",
        )
    if value != value.strip():
        raise error(field_name, f"{what} must not begin or end with whitespace (NATS strips it)")


def _check_text_bytes(
    error: type[InvalidMessage], field_name: str, text: str, how: str = ""
) -> None:
    """Valid UTF-8 of at most ``MAX_TEXT_BYTES``; ``how`` says what was measured."""
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise error(field_name, "must be valid Unicode text (no lone surrogates)") from None
    if size > MAX_TEXT_BYTES:
        raise error(
            field_name,
            f"must be at most {MAX_TEXT_BYTES} bytes in UTF-8{' ' + how if how else ''}, "
            f"got {size}",
        )


def encode_payload(payload: object) -> tuple[bytes, str | None]:
    """bytes as they are, str as UTF-8, anything else as JSON; returns (body, content type)."""
    if isinstance(payload, bytes | bytearray | memoryview):
        try:
            return bytes(payload), None
        except (TypeError, ValueError) as exc:  # e.g. a released memoryview
            raise InvalidPayload("payload", f"cannot be read as bytes: {exc}") from None
    if isinstance(payload, str):
        return _utf8(payload), "text/plain; charset=utf-8"
    try:
        text = json.dumps(payload, allow_nan=False, separators=(",", ":"), ensure_ascii=False)
    except RecursionError:
        raise InvalidPayload("payload", "is nested too deeply to encode as JSON") from None
    except (TypeError, ValueError) as exc:
        raise InvalidPayload("payload", f"must be bytes, str or JSON-serialisable: {exc}") from None
    return _utf8(text), "application/json"


def _utf8(text: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidPayload("payload", f"text must be encodable as UTF-8: {exc}") from None


def check_size(message: Message, max_payload_bytes: int) -> None:
    """The headers, as the relay sends them, fit ``MAX_HEADER_BYTES``, and with the payload
    ``max_payload_bytes``.

    The default of 1 MiB is nats-server's default ``max_payload``, which counts the
    header block too: what ``send()`` accepts then fits the broker.
    """
    headers = headers_size(message)
    if headers > MAX_HEADER_BYTES:
        raise InvalidHeaders(
            "headers",
            f"must be at most {MAX_HEADER_BYTES} bytes in all once encoded, got {headers}",
        )
    size = len(message.payload) + headers
    if size > max_payload_bytes:
        raise PayloadTooLarge(
            "payload",
            f"with its headers must be at most {max_payload_bytes} bytes once encoded, "
            f"got {size} ({len(message.payload)} of payload)",
        )


def encoded_size(message: Message) -> int:
    """The size ``send()`` holds against ``max_payload_bytes``: the payload and the headers
    the relay sends, the msg_id among them (``headers_size``)."""
    return len(message.payload) + headers_size(message)


def headers_size(message: Message) -> int:
    """Bytes of the message's headers once encoded, by the size rule above."""
    lines = sum(
        len(name.encode()) + len(value.encode()) + HEADER_LINE_BYTES
        for name, value in carried_headers(message).items()
    )
    msg_id = ID_HEADER_NAME_BYTES + len(message.msg_id.encode()) + HEADER_LINE_BYTES
    if message.ordered and message.seq is None:  # its number comes with the row
        lines += len(SEQ_HEADER) + SEQ_DIGITS + HEADER_LINE_BYTES
    return HEADER_BLOCK_BYTES + lines + msg_id


def carried_headers(message: Message) -> dict[str, str]:
    """The app's headers plus the key and tags, as every broker adapter carries them."""
    headers = dict(message.headers)
    if message.key is not None:
        headers[KEY_HEADER] = message.key
    if message.tags is not None:
        headers[TAGS_HEADER] = message.tags
    if message.seq is not None:
        headers[SEQ_HEADER] = str(message.seq)
    return headers


def uncarried(headers: Mapping[str, str]) -> tuple[dict[str, str], str | None, str | None]:
    """The app's headers, the key and the tags of carried headers: ``carried_headers``
    undone (``Outbox-Seq`` dropped: the sequence belongs to the table, not the message)."""
    app_headers = dict(headers)
    app_headers.pop(SEQ_HEADER, None)
    key = app_headers.pop(KEY_HEADER, None)
    tags = app_headers.pop(TAGS_HEADER, None)
    return app_headers, key, tags


_uuid_lock = threading.Lock()
_last_uuid_ms = 0
_uuid_seq = 0


def _new_uuid_lock() -> None:
    global _uuid_lock
    _uuid_lock = threading.Lock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=_new_uuid_lock)


def uuid7() -> uuid.UUID:
    """A UUIDv7 (RFC 9562): 48-bit Unix ms, then a 12-bit counter, then random bits.

    The counter keeps ids from one process strictly increasing within a millisecond.
    """
    global _last_uuid_ms, _uuid_seq
    random = int.from_bytes(os.urandom(10))  # one syscall: 62 random bits, 10 for the counter
    with _uuid_lock:
        now_ms = time.time_ns() // 1_000_000
        if now_ms > _last_uuid_ms:
            _last_uuid_ms, _uuid_seq = now_ms, (random >> 64) & 0x3FF
        else:
            _uuid_seq += 1
            if _uuid_seq > 0xFFF:  # counter spent: borrow the next millisecond
                _last_uuid_ms, _uuid_seq = _last_uuid_ms + 1, 0
        ms, seq = _last_uuid_ms, _uuid_seq
    rand_b = random & ((1 << 62) - 1)
    value = (ms << 80) | (0x7 << 76) | (seq << 64) | (0b10 << 62) | rand_b
    return uuid.UUID(int=value)
