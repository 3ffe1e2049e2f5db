"""Redis Streams adapter.

Mapping: topic -> stream key (``<prefix><topic>``, no prefix by default); one XADD per
message with the fields ``msg_id``, ``payload``, ``headers`` (JSON, with key and tags
as ``Outbox-Key`` / ``Outbox-Tags``); receipt -> the entry id (``<ms>-<seq>``).

Redis has no broker-side deduplication before 8.6: a message published twice (a
crash between publish and mark) is stored twice, so consumers dedupe by ``msg_id``.

URL: ``redis://[:password@]host:port[/db][?prefix=outbox:&maxlen=1000000&timeout=1]``
(``rediss://`` for TLS). ``maxlen`` trims streams approximately (``MAXLEN ~``).

Reading back: ``RedisBroker.read_log`` (the ``LogReader``) pages through each topic's
stream with XRANGE (a window of entry ids, as ids count milliseconds) for ``outbox
export broker``; ``xrange_pages`` is the paging itself.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

import redis.asyncio as aioredis
import redis.exceptions

from outbox.broker import Broker, LogEntry, LogReader, PublishResult, ok, permanent, retry
from outbox.errors import ConfigError
from outbox.message import Message, carried_headers
from relay.brokers import base
from relay.brokers.base import (
    LOG_CHUNK,
    NOT_CONNECTED,
    READ_TIMEOUT_S,
    Chunk,
    unexpected,
    unreachable,
)

OUR_OPTIONS = ("prefix", "maxlen", "timeout")
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
RETRYABLE = (
    redis.exceptions.ConnectionError,  # LOADING (BusyLoadingError) too
    redis.exceptions.TimeoutError,
    OSError,
    # Replies that pass: a replica promoted (READONLY), memory freed (OOM), a cluster
    # settling. A failure called permanent goes dead after permanent_attempts tries.
    redis.exceptions.ReadOnlyError,
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.MasterDownError,
)


class RedisBroker(Broker, LogReader):
    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        query = parse_qs(parts.query)
        # Our options leave the URL; the rest (password=, ssl_cert_reqs=, ...) is redis-py's.
        theirs = {k: v for k, v in query.items() if k not in OUR_OPTIONS}
        self.url = parts._replace(query=urlencode(theirs, doseq=True)).geturl()
        self.prefix = query.get("prefix", [""])[-1]
        try:
            maxlen = query.get("maxlen", [None])[-1]
            self.maxlen = int(maxlen) if maxlen else None
            self.timeout = float(query.get("timeout", ["1"])[-1])
        except ValueError:
            raise ConfigError(
                "broker: 'maxlen' must be an integer and 'timeout' a number"
            ) from None
        self._client: aioredis.Redis | None = None

    async def connect(self) -> None:
        client = aioredis.from_url(
            self.url, socket_timeout=self.timeout, socket_connect_timeout=self.timeout
        )
        await client.ping()  # fail here, not at the first publish, when the URL is wrong
        self._client = client

    async def publish(self, messages: Sequence[Message]) -> list[PublishResult]:
        """One pipeline for the batch; a message whose XADD cannot even be built (it
        does not encode, redis-py refuses its arguments) gets its own PERMANENT result
        and stays out of the pipeline, so it cannot fail the others' round trip."""
        if self._client is None:
            return [retry(NOT_CONNECTED) for _ in messages]
        results: list[PublishResult | None] = [None] * len(messages)
        pipe = self._client.pipeline(transaction=False)
        for i, message in enumerate(messages):
            try:
                pipe.xadd(
                    (self.prefix + message.topic).encode(),
                    fields(message),  # type: ignore[arg-type]
                    maxlen=self.maxlen,
                    approximate=self.maxlen is not None,
                )
            except Exception as exc:  # redis DataError, UnicodeEncodeError: this message's own
                results[i] = unexpected(exc)
        if not len(pipe):
            return [r for r in results if r is not None]  # every message failed alone
        try:
            replies = iter(await pipe.execute(raise_on_error=False))
        except RETRYABLE as exc:
            down = retry(f"{type(exc).__name__}: {exc}")
            return [down if r is None else r for r in results]
        return [
            result_of(next(replies), self.prefix + m.topic) if r is None else r
            for r, m in zip(results, messages, strict=True)
        ]

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def read_log(
        self,
        sources: Sequence[str] = (),
        since: datetime | None = None,
        until: datetime | None = None,
    ) -> AsyncIterator[list[LogEntry]]:
        """The ``LogReader``: ``sources`` are topics (their streams, with the URL's prefix),
        entries added in [since, until); broker_ts is the entry id's milliseconds."""
        if not sources:
            raise ConfigError("broker: name the topics to read (--topic)")
        client = aioredis.from_url(
            self.url, socket_timeout=READ_TIMEOUT_S, socket_connect_timeout=self.timeout
        )
        start = f"{ms_at_or_after(since)}-0" if since else "-"
        end = f"({ms_at_or_after(until)}-0" if until else "+"
        try:
            try:
                await client.ping()
            except redis.exceptions.RedisError as exc:
                raise unreachable(self.url, exc) from None
            chunk = Chunk()
            for topic in sources:
                async for page in xrange_pages(client, self.prefix + topic, start, end):
                    for entry_id, fields in page:
                        chunk.add(entry_of(topic, entry_id, fields))
                        if chunk.full:
                            yield chunk.take()
            if chunk.entries:
                yield chunk.take()
        finally:
            await client.aclose()

    async def log_sources(self, names: Sequence[str] = ()) -> dict[str, list[str]]:
        """The topics an export reads, each capturing itself (a topic is its own stream):
        ``names``, or by default every stream key under the URL's prefix."""
        if names:
            return {topic: [topic] for topic in dict.fromkeys(names)}
        client = aioredis.from_url(
            self.url, socket_timeout=READ_TIMEOUT_S, socket_connect_timeout=self.timeout
        )
        try:
            try:
                keys = [
                    key async for key in client.scan_iter(match=f"{self.prefix}*", _type="STREAM")
                ]
            except redis.exceptions.RedisError as exc:
                raise unreachable(self.url, exc) from None
        finally:
            await client.aclose()
        topics = sorted({key.decode("utf-8", "replace")[len(self.prefix) :] for key in keys})
        return {topic: [topic] for topic in topics}


def fields(message: Message) -> dict[str | bytes, str | bytes]:
    """The entry's fields as bytes, encoded here: a value that cannot be encoded fails its
    own message, not the pipeline (redis-py encodes when the pipeline is sent)."""
    if not isinstance(message.payload, bytes):
        raise TypeError(f"payload must be bytes, got {type(message.payload).__name__}")
    headers = carried_headers(message)
    for text in (*headers, *headers.values()):
        text.encode()  # JSON would escape a lone surrogate that NATS and AMQP cannot carry
    return {
        "msg_id": message.msg_id.encode(),
        "payload": message.payload,
        "headers": json.dumps(headers, separators=(",", ":")).encode(),
    }


def result_of(reply: object, key: str = "") -> PublishResult:
    """The outcome of one XADD's reply to ``key``."""
    if isinstance(reply, RETRYABLE):
        return retry(f"{type(reply).__name__}: {reply}")
    if isinstance(reply, Exception) and str(reply).startswith("WRONGTYPE"):
        return permanent(
            f"{type(reply).__name__}: {reply}: the key {key!r} holds something else than a "
            "stream; set ?prefix= in the broker URL (Outbox(broker=...), OUTBOX_BROKER, "
            "--broker) so that the topics' streams get keys of their own"
        )
    if isinstance(reply, Exception):  # other refusals will not change either
        return permanent(f"{type(reply).__name__}: {reply}")
    return ok(reply.decode() if isinstance(reply, bytes) else str(reply))


async def xrange_pages(
    client: aioredis.Redis, key: str, start: str = "-", end: str = "+"
) -> AsyncIterator[list[Any]]:
    """XRANGE in pages of LOG_CHUNK; the next page starts after the last id (Redis >= 6.2)."""
    while True:
        page: Any = await client.xrange(key, start, end, count=LOG_CHUNK)
        if not page:
            return
        yield page
        start = "(" + page[-1][0].decode()


FIELDS = (b"msg_id", b"payload", b"headers")  # what the relay's XADD writes, no more


def entry_of(topic: str, entry_id: bytes, fields: dict[bytes, bytes]) -> LogEntry:
    """An entry as read back; one the relay cannot have written (a stranger's XADD) is
    a malformed entry (``LogEntry.malformed``), never an exception."""
    seq = entry_id.decode()
    ts = EPOCH + timedelta(milliseconds=int(seq.split("-")[0]))
    payload = fields.get(b"payload", b"")
    try:
        msg_id, headers = read_fields(fields)
    except ValueError as exc:
        stranger = LogEntry(salvaged(fields.get(b"msg_id")), topic, seq, ts, payload, {})
        return base.malformed(stranger, str(exc), fields)
    entry = LogEntry(msg_id, topic, seq, ts, payload, headers)
    return base.vetted(entry, lambda: fields)


def read_fields(fields: dict[bytes, bytes]) -> tuple[str, dict[str, str]]:
    """The msg_id and headers of an entry's fields; ValueError says why they are not the
    relay's. Header values are checked by ``base.problem`` (JSON may hold any type)."""
    others = [name for name in fields if name not in FIELDS]
    if others:
        names = ", ".join(base.shown(name) for name in others[:3])
        raise ValueError(f"field(s) the relay does not write: {names}")
    msg_id = fields.get(b"msg_id")
    if msg_id is None or b"payload" not in fields:
        raise ValueError("no msg_id field" if msg_id is None else "no payload field")
    try:
        text = msg_id.decode()
    except UnicodeDecodeError:
        raise ValueError(f"msg_id {base.shown(msg_id)} is not UTF-8") from None
    raw = fields.get(b"headers")
    if raw is None:
        return text, {}
    try:
        headers = json.loads(raw)
    except (ValueError, RecursionError):  # JSONDecodeError, UnicodeDecodeError, deep nesting
        raise ValueError(f"headers {base.shown(raw)} are not JSON") from None
    if not isinstance(headers, dict):
        raise ValueError(f"headers are a JSON {type(headers).__name__}, not an object")
    return text, headers


def salvaged(msg_id: bytes | None) -> str | None:
    """A stranger's msg_id where it is UTF-8 text."""
    try:
        return msg_id.decode() if msg_id else None
    except UnicodeDecodeError:
        return None


def ms_at_or_after(moment: datetime) -> int:
    """The first whole millisecond at or after ``moment`` (entry ids count milliseconds)."""
    aware = moment if moment.tzinfo else moment.replace(tzinfo=UTC)
    micros = (aware - EPOCH) // timedelta(microseconds=1)
    return -(-micros // 1000)
