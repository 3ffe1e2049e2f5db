"""NATS JetStream adapter.

Mapping: topic -> subject; msg_id -> ``Nats-Msg-Id`` (the server drops a second
copy inside the stream's duplicate window, 2 minutes by default); key and tags ->
``Outbox-Key`` / ``Outbox-Tags`` headers; receipt -> ``<stream>:<sequence>``.

URL: ``nats://[user:pass@]host:port[?stream=NAME&subjects=a.>,b.>&timeout=1]``.
With ``stream`` and ``subjects`` the stream is created on connect if it is missing.
``timeout``: how long one ``publish`` call (a batch) waits for all its acks.

Wire: the headers go in the NATS header block (``NATS/1.0`` line, ``Name: value`` lines,
a blank line), which the server's ``max_payload`` counts with the payload. This module
alone builds it; ``outbox.message`` measures messages by the same figures.

Reading back: ``NatsBroker.read_log`` (the ``LogReader``) streams a window of one or more
streams through an ordered consumer in bounded memory (``outbox export``);
``read_entries`` is the same for several streams at once, missing ones allowed (model B's
export); ``read_stream`` fetches every stored message by sequence (exact, for checks and
the comparison's delivery tracker).
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import parse_qs, urlsplit

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import NO_RESPONDERS_STATUS, Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg

from outbox.broker import Broker, LogEntry, LogReader, PublishResult, ok, permanent, retry
from outbox.errors import ConfigError, OutboxError
from outbox.message import Message, carried_headers
from outbox.secrets import mask_url
from relay.brokers.base import (
    NOT_CONNECTED,
    BrokerRefused,
    Chunk,
    checked,
    unexpected,
    unreachable,
    utc,
)
from relay.outage import Outage

log = logging.getLogger("relay.brokers.nats")


# Failures, raised while sending, that will not go away by publishing the same message
# again. A PubAck with an API error of code 400 is one too (see ack_result).
PERMANENT_ERRORS = (
    nats.errors.MaxPayloadError,
    nats.errors.BadSubjectError,
    nats.errors.BadHeaderError,
)
_read_json = json.JSONDecoder().decode
# The msg_id travels in this header: the server drops a second copy of it (dedup window).
DEDUP_HEADER = "Nats-Msg-Id"
# The header block around the "Name: value\r\n" lines: b"NATS/1.0\r\n" ... b"\r\n".
HEADER_BLOCK_FRAME = len(b"NATS/1.0\r\n\r\n")
TIMED_OUT = f"TimeoutError: {nats.errors.TimeoutError()}"  # what js.publish's timeout said


def sent_headers(message: Message) -> dict[str, str]:
    """What the adapter sends as headers: the carried headers and the dedup id."""
    headers = carried_headers(message)  # a new dict: one copy, not two
    headers[DEDUP_HEADER] = message.msg_id
    return headers


def header_size(headers: Mapping[str, str]) -> int:
    """Bytes of the header block: 'NATS/1.0' line, 'Name: value' lines, blank line."""
    return HEADER_BLOCK_FRAME + sum(len(f"{k}: {v}\r\n".encode()) for k, v in headers.items())


def server_subject(topic: str) -> bool:
    """True for subjects of the server's own APIs ($JS, $SYS, ...) and request replies."""
    return topic.startswith("$") or topic.split(".", 1)[0].upper() == "_INBOX"


class NatsBroker(Broker, LogReader):
    """Publishes with one reply subscription for all acks, not ``js.publish``.

    ``js.publish`` is a request per message: a random inbox token, a future and a
    timer each, a PubAck dataclass. Here each message gets a counter token on one
    wildcard inbox, the ack's JSON is read in place, and a ``publish`` call (a batch)
    has one deadline for all its messages. The outcomes are those of ``js.publish``.
    """

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        query = parse_qs(parts.query)
        self.url = parts._replace(query="").geturl()
        self.stream = _one(query, "stream")
        subjects = _one(query, "subjects")
        self.subjects = subjects.split(",") if subjects else []
        if bool(self.stream) != bool(self.subjects):
            raise ConfigError(
                "broker: give both 'stream' and 'subjects' to create a stream, or neither"
            )
        try:
            self.timeout = float(_one(query, "timeout") or 1.0)
        except ValueError:
            raise ConfigError("broker: 'timeout' must be a number of seconds") from None
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._closing = False
        self.outage = Outage(f"broker {mask_url(self.url)}", log)  # the loop's too
        self._inbox = ""  # "<reply prefix>.": acks come to "<reply prefix>.<token>"
        self._tokens = itertools.count()
        self._awaited: dict[str, tuple[_Batch, int]] = {}  # token -> (batch, index in it)

    async def connect(self) -> None:
        self._closing = False  # a failed connect closed what it opened: this one is anew
        nc = await nats.connect(
            servers=[self.url],
            name="outbox-relay",
            connect_timeout=2,
            reconnect_time_wait=0.2,
            max_reconnect_attempts=-1,  # keep trying: messages wait in the time wheel meanwhile
            error_cb=self._on_error,
            disconnected_cb=self._on_disconnected,
            reconnected_cb=self._on_reconnected,
        )
        self._js = nc.jetstream(timeout=self.timeout)
        try:
            # One subscription for every ack; nats-py subscribes it again on reconnect.
            self._inbox = nc.new_inbox() + "."
            await nc.subscribe(self._inbox + "*", cb=self._on_ack)
            if self.stream:
                await self.ensure_stream(self.stream, self.subjects)
        except BaseException:
            self._nc = nc
            await self.close()  # the next connect() starts clean: no leaked connection
            raise
        # Publishes see the connection only now: one sent before its stream exists would
        # be refused for good ("no stream captures subject"), not retried.
        self._nc = nc

    async def ensure_stream(self, name: str, subjects: list[str]) -> None:
        """Create the stream if missing; an existing one is left as it is.

        A stream the server refuses (subjects another stream captures, a name it does not
        accept) is a ``BrokerRefused`` with the server's words and the URL's settings.
        """
        assert self._js is not None, "connect() first"
        try:
            try:
                await self._js.stream_info(name)
            except nats.js.errors.NotFoundError:
                await self._js.add_stream(name=name, subjects=subjects)
                log.info("created JetStream stream %s for %s", name, ",".join(subjects))
        except nats.js.errors.BadRequestError as exc:
            raise stream_refused(name, subjects, exc) from None

    async def publish(self, messages: Sequence[Message]) -> list[PublishResult]:
        nc = self._nc
        if nc is None or not nc.is_connected:
            # Fail fast while reconnecting: waiting out the timeout would stretch the
            # retry schedule past the hand-off limit.
            return [retry(NOT_CONNECTED) for _ in messages]
        batch = _Batch(messages, asyncio.get_running_loop().create_future())
        try:
            for index, message in enumerate(messages):
                if (result := await self._send(nc, batch, index, message)) is not None:
                    batch.results[index] = result
            return await self._acks(batch)
        finally:
            for token in batch.tokens:  # a late ack for any of these is ignored
                self._awaited.pop(token, None)

    async def _send(
        self, nc: Client, batch: _Batch, index: int, message: Message
    ) -> PublishResult | None:
        """Send one message with its reply token; its outcome now if it has one already."""
        if server_subject(message.topic):  # a command to the server, never a message: refuse
            return permanent(f"subject {message.topic!r:.80} is reserved by the NATS server")
        token = ""
        try:
            headers = sent_headers(message)
            if error := too_large(nc, message.payload, headers):
                return permanent(error)
            token = str(next(self._tokens))
            self._awaited[token] = (batch, index)  # before: the ack may come while sending
            batch.expect(token)
            await nc.publish(message.topic, message.payload, self._inbox + token, headers)
        except PERMANENT_ERRORS as exc:
            return self._unsent(batch, token, permanent(f"{type(exc).__name__}: {exc}"))
        except (TimeoutError, nats.errors.Error, OSError) as exc:
            return self._unsent(batch, token, retry(f"{type(exc).__name__}: {exc}"))
        except Exception as exc:  # encoding, a client library's TypeError: this message's own
            return self._unsent(batch, token, unexpected(exc))
        return None

    def _unsent(self, batch: _Batch, token: str, result: PublishResult) -> PublishResult:
        if token and self._awaited.pop(token, None) is not None:
            batch.waiting -= 1
        return result

    async def _acks(self, batch: _Batch) -> list[PublishResult]:
        """Wait for the batch's acks, up to one deadline for all; the rest time out."""
        batch.sent = True
        if batch.waiting:
            timer = asyncio.get_running_loop().call_later(self.timeout, batch.give_up)
            try:
                await batch.done
            finally:
                timer.cancel()
        return [result or retry(TIMED_OUT) for result in batch.results]

    async def _on_ack(self, msg: Msg) -> None:
        awaited = self._awaited.pop(msg.subject[len(self._inbox) :], None)
        if awaited is not None:  # else late: its batch timed out, or it is not ours
            batch, index = awaited
            batch.settle(index, ack_result(msg, batch.messages[index].topic))

    def _fail_awaited(self, error: str) -> None:
        """Every message waiting for an ack: retry now (the ack cannot come on this
        connection); a copy that was stored anyway is dropped by its msg_id."""
        awaited, self._awaited = self._awaited, {}
        for batch, index in awaited.values():
            batch.settle(index, retry(error))

    async def close(self) -> None:
        nc, self._nc, self._js = self._nc, None, None
        self._closing = True
        self._fail_awaited(NOT_CONNECTED)
        if nc is not None and not nc.is_closed:
            await nc.close()

    async def _on_error(self, exc: Exception) -> None:
        self.outage.failed(str(exc) or type(exc).__name__)  # each reconnect try: once, then 30 s

    async def _on_disconnected(self) -> None:
        self._fail_awaited(NOT_CONNECTED)
        if not self._closing:
            self.outage.failed("disconnected")

    async def _on_reconnected(self) -> None:
        self.outage.ok()

    async def read_log(
        self,
        sources: Sequence[str] = (),
        since: datetime | None = None,
        until: datetime | None = None,
    ) -> AsyncIterator[list[LogEntry]]:
        """The ``LogReader``: ``sources`` are stream names, by default the URL's ?stream=."""
        streams = list(sources) or ([self.stream] if self.stream else [])
        if not streams:
            raise ConfigError("broker: name the stream to read (--stream, or ?stream= in the URL)")
        async for _, entries in read_entries(self.url, streams, since, until):
            yield [checked(entry) for entry in entries]  # a stranger's: malformed, kept

    async def log_sources(self, names: Sequence[str] = ()) -> dict[str, list[str]]:
        """The streams an export reads, each with the subjects it captures: ``names``, or
        by default every stream at the server (JetStream's own KV and object stores
        aside). A named stream that does not exist is an OutboxError."""
        nc = await connect_reader(self.url)
        try:
            js = nc.jetstream(timeout=10)
            if names:
                return {name: await subjects_of(js, name) for name in dict.fromkeys(names)}
            found = {info.config.name or "": list(info.config.subjects or [])
                     for info in await js.streams_info()}  # fmt: skip
            return {name: found[name] for name in sorted(found) if not own_store(name)}
        finally:
            await nc.close()


class _Batch:
    """The messages of one ``publish`` call and their outcomes as they come."""

    __slots__ = ("done", "messages", "results", "sent", "tokens", "waiting")

    def __init__(self, messages: Sequence[Message], done: asyncio.Future[None]) -> None:
        self.messages = messages
        self.results: list[PublishResult | None] = [None] * len(messages)
        self.done = done  # set when the last awaited ack has come (or at the deadline)
        self.tokens: list[str] = []
        self.waiting = 0  # acks awaited
        self.sent = False  # every message handed to the client

    def expect(self, token: str) -> None:
        self.tokens.append(token)
        self.waiting += 1

    def settle(self, index: int, result: PublishResult) -> None:
        self.results[index] = result
        self.waiting -= 1
        if not self.waiting and self.sent:
            self.give_up()

    def give_up(self) -> None:
        if not self.done.done():
            self.done.set_result(None)


def ack_result(msg: Msg, topic: str) -> PublishResult:
    """The outcome a PubAck (or the server's no-responders status) tells."""
    if not msg.data and msg.headers and msg.headers.get("Status") == NO_RESPONDERS_STATUS:
        return permanent(f"no JetStream stream captures subject {topic!r}")
    try:
        ack = _read_json(msg.data.decode())  # from str: json.loads(bytes) sniffs encodings
        if "error" in ack:
            return api_error(ack["error"])
        return ok(f"{ack['stream']}:{ack['seq']}", duplicate=bool(ack.get("duplicate")))
    except Exception as exc:  # not a PubAck: as js.publish's own failure to read it
        return unexpected(exc)


def api_error(error: dict[str, Any]) -> PublishResult:
    """JetStream refused the message: code 400 is for good, anything else may pass later."""
    try:
        nats.js.errors.APIError.from_error(error)  # raises the error nats-py would raise
    except nats.js.errors.BadRequestError as exc:
        return permanent(f"{type(exc).__name__}: {exc}")
    except nats.js.errors.APIError as exc:
        return retry(f"{type(exc).__name__}: {exc}")
    raise AssertionError("APIError.from_error returned")


OVERLAP = 10065  # JetStream's err_code: "subjects overlap with an existing stream"


def stream_refused(name: str, subjects: list[str], exc: nats.js.errors.APIError) -> BrokerRefused:
    """The server's refusal of the URL's stream, in its words, with the settings to change."""
    said = exc.description or type(exc).__name__
    code = f" (err_code {exc.err_code})" if exc.err_code else ""
    cure = "set ?stream= and ?subjects= in the broker URL (Outbox(broker=...), OUTBOX_BROKER"
    cure += ", --broker) to a stream name and subjects the server accepts"
    if exc.err_code == OVERLAP:
        cure = (
            "another stream captures some of these subjects: set ?subjects= in the broker URL "
            "(Outbox(broker=...), OUTBOX_BROKER, --broker) to subjects no other stream "
            "captures, or leave ?stream= and ?subjects= out to publish into the stream that "
            "captures them"
        )
    return BrokerRefused(
        f"JetStream refused to create stream {name!r} for subjects {','.join(subjects)!r}: "
        f"{said}{code}; {cure}"
    )


def too_large(nc: Client, payload: bytes, headers: dict[str, str], headroom: int = 0) -> str | None:
    """Why the server would refuse this message for its size, or None.

    Sent anyway, the server closes the connection and every publish in flight on it
    fails: so an oversize message is refused before it is sent, alone. ``headroom``:
    bytes to leave free under the limit (for headers added to later copies of it).
    """
    # A character is at most 4 bytes in UTF-8: most messages are clear of the limit
    # without encoding their headers.
    most = HEADER_BLOCK_FRAME + sum(4 * (len(k) + len(v) + 1) for k, v in headers.items())
    if len(payload) + most + headroom <= nc.max_payload:
        return None
    size = len(payload) + header_size(headers)
    if size + headroom <= nc.max_payload:
        return None
    if headroom:
        return (
            f"MaxPayloadError: {size} bytes + {headroom} of headroom "
            f"> server max_payload {nc.max_payload}"
        )
    return f"MaxPayloadError: {size} bytes > server max_payload {nc.max_payload}"


def _one(query: dict[str, list[str]], name: str) -> str | None:
    values = query.get(name)
    return values[-1] if values else None


def create_stream(url: str, stream: str, subjects: str) -> None:
    """Create ``stream`` for ``subjects`` (comma-separated) if it is missing, and return."""

    async def create() -> None:
        broker = NatsBroker(f"{url}?stream={stream}&subjects={subjects}")
        await broker.connect()  # a URL with stream= and subjects= creates a missing stream
        await broker.close()

    asyncio.run(create())


def stream_bytes(url: str, stream: str) -> int:
    """Bytes ``stream`` stores as the server counts them (0 while it does not exist)."""

    async def size() -> int:
        nc = await connect_reader(url)
        try:
            return int((await nc.jetstream(timeout=5).stream_info(stream)).state.bytes)
        except nats.js.errors.NotFoundError:
            return 0
        finally:
            await nc.close()

    return asyncio.run(size())


async def read_stream(url: str, stream: str, first_seq: int = 1) -> list[StoredMessage]:
    """Every message the stream holds from ``first_seq`` on, in sequence order.

    Deleted sequences are skipped; any other failure to read one raises, so a
    reader never reports a message as missing because a request timed out.
    """
    nc = await connect_reader(url)
    try:
        js = nc.jetstream(timeout=5)
        state = (await js.stream_info(stream)).state
        found: list[StoredMessage] = []
        if state.messages == 0:
            return found
        for start in range(max(state.first_seq, first_seq, 1), state.last_seq + 1, 256):
            seqs = range(start, min(start + 256, state.last_seq + 1))
            chunk = await asyncio.gather(*(_get(js, stream, seq) for seq in seqs))
            found += [msg for msg in chunk if msg is not None]
        return found
    finally:
        await nc.close()


async def _get(js: JetStreamContext, stream: str, seq: int, tries: int = 3) -> StoredMessage | None:
    for attempt in range(tries):
        try:
            return StoredMessage.of(await js.get_msg(stream, seq))
        except nats.js.errors.NotFoundError:
            return None  # deleted from the stream
        except (TimeoutError, nats.errors.Error):
            if attempt == tries - 1:
                raise
            await asyncio.sleep(0.1 * (attempt + 1))
    return None


@dataclass(frozen=True, slots=True)
class StoredMessage:
    msg_id: str | None
    subject: str
    seq: int
    time: datetime | None
    headers: dict[str, str]
    data: bytes

    @classmethod
    def of(cls, raw: RawStreamMsg) -> StoredMessage:
        headers = parse_headers(base64.b64decode(raw.hdrs)) if raw.hdrs else {}
        return cls(
            headers.get(DEDUP_HEADER),
            raw.subject or "",
            raw.seq or 0,
            raw.time,
            headers,
            raw.data or b"",
        )


def parse_headers(block: bytes) -> dict[str, str]:
    """The headers of a stored message, as the server holds them (UTF-8 values too).

    nats-py's ``get_msg`` parses them as e-mail headers, which turns a non-ASCII value
    into an ``email.header.Header``: this reads the raw block instead.
    """
    headers: dict[str, str] = {}
    for line in block.split(b"\r\n")[1:]:  # the first line is "NATS/1.0"
        name, sep, value = line.partition(b":")
        if sep:  # the publisher writes "Name: value"
            headers[name.decode("ascii", "replace")] = value.lstrip(b" ").decode("utf-8", "replace")
    return headers


async def connect_reader(url: str) -> Client:
    """Two quick tries, then a one-line error: a reader has nothing to wait for."""
    errors: list[Exception] = []

    async def remember(exc: Exception) -> None:  # instead of nats.py's logged traceback
        errors.append(exc)

    try:
        return await nats.connect(
            servers=[url], name="outbox-reader", connect_timeout=2,
            max_reconnect_attempts=1, reconnect_time_wait=0.2, error_cb=remember,
        )  # fmt: skip
    except nats.errors.NoServersError:
        raise unreachable(url, errors[-1] if errors else "no server answered") from None


def own_store(stream: str) -> bool:
    """JetStream's key-value and object stores: streams of their own, never the relay's."""
    return stream.startswith(("KV_", "OBJ_"))


async def subjects_of(js: JetStreamContext, stream: str) -> list[str]:
    try:
        return list((await js.stream_info(stream)).config.subjects or [])
    except nats.js.errors.NotFoundError:
        raise OutboxError(f"no stream {stream!r} at the broker; nothing was written") from None


def entry_of(msg: Msg, ts: datetime | None) -> LogEntry:
    """A stored message as read back: the msg_id the relay sent as Nats-Msg-Id, apart
    from the carried headers."""
    headers = dict(msg.headers or {})
    msg_id = headers.pop(DEDUP_HEADER, None)
    return LogEntry(
        msg_id, msg.subject, str(msg.metadata.sequence.stream), ts, msg.data or b"", headers
    )


async def read_entries(
    url: str,
    streams: Sequence[str],
    since: datetime | None = None,
    until: datetime | None = None,
    optional: bool = False,
) -> AsyncIterator[tuple[str, list[LogEntry]]]:
    """(stream, entries) of each stream stored in [since, until), in chunks; a missing
    stream is an error unless ``optional``."""
    nc = await connect_reader(url)
    try:
        js = nc.jetstream(timeout=10)
        for stream in streams:
            async for entries in _read_one(js, stream, since, until, optional):
                yield stream, entries
    finally:
        await nc.close()


async def _read_one(
    js: JetStreamContext,
    stream: str,
    since: datetime | None,
    until: datetime | None,
    optional: bool,
) -> AsyncIterator[list[LogEntry]]:
    """One stream from ``since`` up to its last message now, via an ordered consumer."""
    from nats.js.api import ConsumerConfig, DeliverPolicy

    try:
        last = (await js.stream_info(stream)).state.last_seq
    except nats.js.errors.NotFoundError:
        if optional:
            return
        raise OutboxError(f"no stream {stream!r} at the broker; nothing was written") from None
    if last == 0:
        return
    config = (
        ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=since)
        if since
        else None
    )
    sub = await js.subscribe(">", stream=stream, ordered_consumer=True, config=config)
    chunk = Chunk()
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=5)
            except nats.errors.TimeoutError:
                break  # nothing newer than `since`, or the stream was trimmed meanwhile
            meta = msg.metadata
            ts = utc(meta.timestamp) if meta.timestamp else None
            if until is None or ts is None or ts < until:
                chunk.add(entry_of(msg, ts))
            if chunk.full:
                yield chunk.take()
            if meta.sequence.stream >= last:
                break
        if chunk.entries:
            yield chunk.take()
    finally:
        await sub.unsubscribe()
