"""What one message is, and the rules ``send()`` checks before anything is written."""

from __future__ import annotations

import math
import os
import re
import reprlib
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

from outbox.brokers_registry import strictest_limits
from outbox.errors import (
    InvalidHeaders,
    InvalidKey,
    InvalidMessage,
    InvalidPayload,
    InvalidSchedule,
    InvalidTags,
    InvalidTopic,
    PayloadTooLarge,
)
from outbox.payload import JsonDefault, encode_payload

# Topics, keys, tags, dedup keys, header names: at most 255 bytes (the table's name columns
# are 255 wide), or less where a broker takes less. Each broker's own wire limits (AMQP's
# short strings, JetStream's header block, the header names it reserves) are declared in
# its registration (relay.brokers.registrations); send() checks the strictest of every
# registered broker's, loaded once on first use (outbox.brokers_registry.strictest_limits).
# MAX_HEADER_BYTES, RESERVED_HEADER_PREFIXES and RESERVED_HEADER_NAMES are read from there
# too (``__getattr__`` below).
MAX_TEXT_BYTES = 255
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
# Headers the relay sets itself (and, from their registrations, those the brokers reserve);
# an app setting them would break dedup or routing.
RELAY_HEADER_PREFIX = "outbox-"
# RFC 7230 token characters: what nats-py accepts as a header name (BadHeaderError else).
HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# Values in error messages: cut short, and safe from a __repr__ that raises.
_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 80
shown = _repr.repr
# Control characters (Unicode Cc) and surrogates: a NATS header line ends at CR or LF,
# and a surrogate has no UTF-8 form.
BAD_VALUE_CHAR = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
# send(delay_level=n): RocketMQ's default messageDelayLevel, in seconds, level 1 first.
DELAY_LEVELS_S = (1, 5, 10, 30, 60, 120, 180, 240, 300, 360, 420, 480, 540, 600, 1200, 1800,
                  3600, 7200)  # fmt: skip
# The longest delay: its due time fits every column (MariaDB's DATETIME ends in 9999) and
# its microseconds a BIGINT, with centuries to spare.
MAX_DELAY_S = 100 * 366 * 86_400
# MariaDB's DATETIME holds years 1000 to 9999; a due time in the past means "now" anyway.
EARLIEST_DELIVER_AT = datetime(1000, 1, 1, tzinfo=UTC)
# send(dedup_key=K): the msg_id is uuid5(DEDUP_NAMESPACE, topic NUL K). Fixed forever: a
# new namespace would let a scheduler that runs again schedule its messages twice.
DEDUP_NAMESPACE = uuid.UUID("6f0d3c55-8a1e-4c2b-9d41-3b1f2d7e9a10")


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
    delay: object = None,
    deliver_at: object = None,
    delay_level: object = None,
    dedup_key: object = None,
    max_payload_bytes: int,
    json_default: JsonDefault | None = None,
) -> Message:
    """Validate and encode one message; raises an ``InvalidMessage`` subclass on bad input.

    ``json_default`` encodes the objects of a JSON payload that ``outbox.payload`` does
    not (like ``json.dumps``' ``default``).
    """
    topic, key, tags = check_topic(topic), check_key(key), check_tags(tags)
    ordered = check_ordered(ordered, key)
    schedule = check_schedule(delay, deliver_at, delay_level, dedup_key)
    if ordered and schedule.given:
        raise InvalidSchedule(
            "ordered",
            f"cannot be combined with a delay ({schedule.given} given): a delayed message "
            "would hold back its key's later messages for the whole delay",
        )
    all_headers = check_headers(headers)
    body, content_type = encode_payload(payload, json_default)
    if content_type and CONTENT_TYPE not in {name.lower() for name in all_headers}:
        all_headers[CONTENT_TYPE] = content_type
    key_id = schedule.dedup_key
    msg_id = uuid7_text() if key_id is None else str(dedup_id(topic, key_id))
    message = Message(
        msg_id,
        topic,
        body,
        key,
        tags,
        all_headers,
        ordered=ordered,
        delay_s=schedule.delay_s,
        deliver_at=schedule.deliver_at,
    )
    check_size(message, max_payload_bytes)
    return message


@dataclass(frozen=True, slots=True)
class Schedule:
    """send()'s scheduling arguments, checked: at most one of delay_s and deliver_at set."""

    delay_s: float | None = None
    deliver_at: datetime | None = None
    dedup_key: str | None = None
    given: str = ""  # the arguments given, for error messages ("" when none)


UNSCHEDULED = Schedule()


def check_schedule(
    delay: object, deliver_at: object, delay_level: object, dedup_key: object
) -> Schedule:
    """A message with any of these is scheduled: a relay's scheduler publishes it once the
    database clock reaches its due time. ``dedup_key`` alone means due now."""
    if delay is None and deliver_at is None and delay_level is None and dedup_key is None:
        return UNSCHEDULED  # every unscheduled send(): no work
    times = {"delay": delay, "deliver_at": deliver_at, "delay_level": delay_level}
    named = [name for name, value in times.items() if value is not None]
    if len(named) > 1:
        raise InvalidSchedule(
            named[1], f"cannot be combined with {named[0]}: give one of delay, deliver_at, "
            "delay_level",
        )  # fmt: skip
    key = check_dedup_key(dedup_key)
    given = ", ".join(named + (["dedup_key"] if key is not None else []))
    if delay is not None:
        return Schedule(delay_s=check_delay(delay), dedup_key=key, given=given)
    if delay_level is not None:
        return Schedule(delay_s=float(level_delay(delay_level)), dedup_key=key, given=given)
    if deliver_at is not None:
        return Schedule(deliver_at=check_deliver_at(deliver_at), dedup_key=key, given=given)
    return Schedule(delay_s=None if key is None else 0.0, dedup_key=key, given=given)


def check_delay(delay: object) -> float:
    """Seconds: a timedelta, or an int or float of seconds; finite, 0 to ``MAX_DELAY_S``."""
    if isinstance(delay, timedelta):
        seconds = delay.total_seconds()
    elif isinstance(delay, int | float) and not isinstance(delay, bool):
        try:
            seconds = float(delay)
        except OverflowError:  # an int beyond any float
            seconds = math.inf if delay > 0 else -math.inf
    else:
        raise InvalidSchedule(
            "delay", f"must be a timedelta or a number of seconds, got {type(delay).__name__}"
        )
    if seconds < 0:
        raise InvalidSchedule("delay", f"must not be negative, got {shown(delay)}")
    if not math.isfinite(seconds):
        raise InvalidSchedule("delay", f"must be a finite number of seconds, got {shown(delay)}")
    if seconds > MAX_DELAY_S:
        raise InvalidSchedule(
            "delay", f"must be at most {MAX_DELAY_S} seconds (100 years), got {shown(delay)}"
        )
    return seconds


def level_delay(level: object) -> int:
    """RocketMQ's delay level ``level`` (1 to 18) in seconds."""
    if not isinstance(level, int) or isinstance(level, bool) or not 1 <= level <= 18:
        raise InvalidSchedule(
            "delay_level",
            f"must be an int from 1 to {len(DELAY_LEVELS_S)} (RocketMQ's levels 1s 5s 10s 30s "
            f"1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h), got {shown(level)}",
        )
    return DELAY_LEVELS_S[level - 1]


def check_deliver_at(deliver_at: object) -> datetime:
    """An aware datetime, returned in UTC; one in the past is kept (it is due at once)."""
    if not isinstance(deliver_at, datetime):
        raise InvalidSchedule(
            "deliver_at", f"must be a datetime with a time zone, got {type(deliver_at).__name__}"
        )
    try:
        offset = deliver_at.utcoffset()
        at = deliver_at.astimezone(UTC) if offset is not None else None
    except (OverflowError, ValueError) as exc:  # e.g. 9999-12-31 23:00-05:00
        raise InvalidSchedule("deliver_at", f"must be a time up to 9999 in UTC: {exc}") from None
    if at is None:
        raise InvalidSchedule(
            "deliver_at",
            "must be aware: give it a time zone, e.g. datetime.now(UTC) + timedelta(minutes=5) "
            f"or .replace(tzinfo=UTC), got the naive {shown(deliver_at)}",
        )
    if at < EARLIEST_DELIVER_AT:
        raise InvalidSchedule("deliver_at", f"must be in the year 1000 or later, got {at}")
    return at


def check_dedup_key(dedup_key: object) -> str | None:
    """A non-empty string of at most 255 bytes in UTF-8, without control characters."""
    if dedup_key is None:
        return None
    if not isinstance(dedup_key, str) or not dedup_key:
        raise InvalidSchedule("dedup_key", "must be a non-empty string or None")
    _check_text_bytes(InvalidSchedule, "dedup_key", dedup_key)
    _check_no_control_chars(InvalidSchedule, "dedup_key", dedup_key, "it")
    return dedup_key


def dedup_id(topic: str, dedup_key: str) -> uuid.UUID:
    """The msg_id of (topic, dedup_key): the same on every run, process and host. NUL
    cannot occur in a topic, so two different pairs never join to the same text."""
    return uuid.uuid5(DEDUP_NAMESPACE, f"{topic}\x00{dedup_key}")


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


def check_cancel_id(msg_id: object) -> str:
    """A msg_id given to ``cancel()``: a UUID, or its text in any case; canonical form."""
    if isinstance(msg_id, uuid.UUID):
        return str(msg_id)
    if isinstance(msg_id, str):
        return check_msg_id(msg_id.lower())
    raise InvalidMessage("msg_id", f"must be a UUID string, got {type(msg_id).__name__}")


# Topics that passed check_topic under these limits: an app sends to a few topics, and
# a topic checked once passes again (the rules read nothing else). Forgotten all at once
# when full, or when a broker registered at run time changes the limits.
GOOD_TOPICS_LIMIT = 4096
_good_topics: tuple[object, set[str]] = (None, set())


def check_topic(topic: object) -> str:
    """NATS subject rules (the strictest broker), in at most 255 bytes or the brokers'
    ``max_topic_bytes`` (AMQP's routing key)."""
    limits, good = _good_topics
    if type(topic) is str and topic in good and limits is strictest_limits():
        return topic
    checked = _check_topic(topic)
    _remember_topic(checked)
    return checked


def _remember_topic(topic: str) -> None:
    global _good_topics
    limits, good = _good_topics
    if type(topic) is not str:  # a subclass may compare or hash as it likes
        return
    if limits is not strictest_limits() or len(good) >= GOOD_TOPICS_LIMIT:
        limits, good = strictest_limits(), set()
        _good_topics = (limits, good)
    good.add(topic)


def _check_topic(topic: object) -> str:
    if not isinstance(topic, str) or not topic:
        raise InvalidTopic("topic", "must be a non-empty string")
    limit = _at_most(strictest_limits().max_topic_bytes)
    if len(topic) > limit:
        _check_text_bytes(InvalidTopic, "topic", topic, limit=limit)
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
    _check_text_bytes(InvalidTopic, "topic", topic, limit=limit)
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
            _check_text_bytes(
                InvalidHeaders, "headers", value, f"for the value of {shown(name)}",
                limit=_at_most(strictest_limits().max_content_type_bytes),
            )  # fmt: skip
        checked[name] = value
    return checked


def check_header_name(name: object) -> str:
    """The name in lower case, once it is one an app may set."""
    if not isinstance(name, str) or not name:
        raise InvalidHeaders("headers", f"names must be non-empty strings, got {shown(name)}")
    wire = strictest_limits()
    limit = _at_most(wire.max_header_name_bytes)
    if len(name) > limit or not HEADER_NAME.fullmatch(name):
        raise InvalidHeaders(
            "headers",
            f"name must be 1 to {limit} of the ASCII letters, digits and "
            f"!#$%&'*+-.^_`|~ (an HTTP token; no ':', spaces or controls): {shown(name)}",
        )
    lowered = name.lower()
    if (
        lowered.startswith(RELAY_HEADER_PREFIX)
        or lowered.startswith(wire.reserved_header_prefixes)
        or lowered in wire.reserved_header_names
    ):
        raise InvalidHeaders("headers", f"name {shown(name)} is reserved by the relay or a broker")
    return lowered


def _check_header_value(
    error: type[InvalidMessage], field_name: str, value: str, what: str = "value"
) -> None:
    _check_no_control_chars(error, field_name, value, what)
    if value != value.strip():
        raise error(field_name, f"{what} must not begin or end with whitespace (NATS strips it)")


def _check_no_control_chars(
    error: type[InvalidMessage], field_name: str, value: str, what: str
) -> None:
    if bad := BAD_VALUE_CHAR.search(value):
        raise error(
            field_name,
            f"{what} must not contain control characters or surrogates, got {shown(bad.group())}",
        )


def _check_text_bytes(
    error: type[InvalidMessage],
    field_name: str,
    text: str,
    how: str = "",
    limit: int = MAX_TEXT_BYTES,
) -> None:
    """Valid UTF-8 of at most ``limit`` bytes; ``how`` says what was measured."""
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise error(field_name, "must be valid Unicode text (no lone surrogates)") from None
    if size > limit:
        raise error(
            field_name,
            f"must be at most {limit} bytes in UTF-8{' ' + how if how else ''}, got {size}",
        )


def _at_most(broker_limit: int | None) -> int:
    """``MAX_TEXT_BYTES``, or a broker's lower limit."""
    return MAX_TEXT_BYTES if broker_limit is None else min(broker_limit, MAX_TEXT_BYTES)


def check_size(message: Message, max_payload_bytes: int) -> None:
    """The headers, as the relay sends them, fit the brokers' ``max_header_bytes``
    (JetStream's), and with the payload ``max_payload_bytes``.

    The default of 1 MiB is nats-server's default ``max_payload``, which counts the
    header block too: what ``send()`` accepts then fits the broker.
    """
    most = strictest_limits().max_header_bytes
    bound = headers_bound(message)
    if (most is None or bound <= most) and len(message.payload) + bound <= max_payload_bytes:
        return  # fits even at 4 bytes a character: no need to encode the headers
    headers = headers_size(message)
    if most is not None and headers > most:
        raise InvalidHeaders(
            "headers", f"must be at most {most} bytes in all once encoded, got {headers}"
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


def headers_bound(message: Message) -> int:
    """``headers_size`` or more, counting 4 bytes (UTF-8's most) for every character."""
    chars = sum(len(name) + len(value) for name, value in message.headers.items())
    lines = len(message.headers) + 1  # the msg_id's line too
    for name, value in ((KEY_HEADER, message.key), (TAGS_HEADER, message.tags)):
        if value is not None:
            chars, lines = chars + len(name) + len(value), lines + 1
    if message.seq is not None:
        chars, lines = chars + len(SEQ_HEADER) + len(str(message.seq)), lines + 1
    elif message.ordered:  # its number comes with the row
        chars, lines = chars + len(SEQ_HEADER) + SEQ_DIGITS, lines + 1
    chars += len(message.msg_id)
    return HEADER_BLOCK_BYTES + ID_HEADER_NAME_BYTES + 4 * chars + lines * HEADER_LINE_BYTES


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


def __getattr__(name: str) -> int | tuple[str, ...] | frozenset[str] | None:
    """The brokers' limits by their former names here (read from their registrations)."""
    if name == "MAX_HEADER_BYTES":
        return strictest_limits().max_header_bytes
    if name == "RESERVED_HEADER_PREFIXES":
        return (*strictest_limits().reserved_header_prefixes, RELAY_HEADER_PREFIX)
    if name == "RESERVED_HEADER_NAMES":
        return strictest_limits().reserved_header_names
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_uuid_lock = threading.Lock()
_last_uuid_ms = 0
_uuid_seq = 0
# Random bytes for the ids, read from os.urandom a pool at a time (one syscall per 409
# ids, not one per id); a forked child drops the parent's pool: its ids never repeat them.
RANDOM_POOL_BYTES = 4090
_random_pool = b""
_random_at = 0


def _new_uuid_lock() -> None:
    global _uuid_lock, _random_pool, _random_at
    _uuid_lock = threading.Lock()  # another thread may have held it at the fork
    _random_pool, _random_at = b"", 0


os.register_at_fork(after_in_child=_new_uuid_lock)


def uuid7() -> uuid.UUID:
    """A UUIDv7 (RFC 9562): 48-bit Unix ms, then a 12-bit counter, then random bits.

    The counter keeps ids from one process strictly increasing within a millisecond.
    """
    return uuid.UUID(int=_uuid7_int())


def uuid7_text() -> str:
    """``str(uuid7())``, without making the UUID object: send()'s msg_id."""
    h = f"{_uuid7_int():032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _uuid7_int() -> int:
    global _last_uuid_ms, _uuid_seq, _random_pool, _random_at
    with _uuid_lock:
        at = _random_at
        if at + 10 > len(_random_pool):
            _random_pool, at = os.urandom(RANDOM_POOL_BYTES), 0
        _random_at = at + 10
        random = int.from_bytes(_random_pool[at : at + 10])  # 62 random bits, 10 for the counter
        now_ms = time.time_ns() // 1_000_000
        if now_ms > _last_uuid_ms:
            _last_uuid_ms, _uuid_seq = now_ms, (random >> 64) & 0x3FF
        else:
            _uuid_seq += 1
            if _uuid_seq > 0xFFF:  # counter spent: borrow the next millisecond
                _last_uuid_ms, _uuid_seq = _last_uuid_ms + 1, 0
        ms, seq = _last_uuid_ms, _uuid_seq
    rand_b = random & ((1 << 62) - 1)
    return (ms << 80) | (0x7 << 76) | (seq << 64) | (0b10 << 62) | rand_b
