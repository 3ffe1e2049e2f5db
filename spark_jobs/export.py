"""`outbox export`: the ledger and the broker log to Parquet, in bounded memory.

Both are streamed in chunks (a server-side cursor for the database, an ordered
consumer for JetStream, XRANGE pages for Redis, a stream-queue consumer with a
prefetch limit for RabbitMQ) and written batch by batch, so memory does not grow
with the number of rows.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from sqlalchemy import Engine, Select, select

from outbox.config import engine_from, mask_url
from outbox.errors import OutboxError
from outbox.table import outbox_message as t
from outbox.table import transaction_record
from spark_jobs.schema import BROKER, HALFOP_LOG, LEDGER, RECORDS

CHUNK = 50_000
PREFETCH = 1_000  # RabbitMQ: unacked deliveries in flight (AMQP caps it at 65535)
READ_TIMEOUT_S = 30.0  # a broker silent this long is stuck, not done
MARKER_TYPE = "outbox.export-marker"
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
RowOf = Callable[[Any, datetime | None], dict[str, object]]


def export_ledger(
    db: str | Engine, out: str | Path, since: datetime | None = None, until: datetime | None = None
) -> int:
    """Write outbox_message rows (created in [since, until)) to ``out`` (a .parquet file)."""
    columns = [t.c[name] for name in LEDGER.names]
    query = select(*columns).order_by(t.c.id)
    return export_rows(db, windowed(query, t.c.created_at, since, until), out, LEDGER)


def export_records(
    db: str | Engine, out: str | Path, since: datetime | None = None, until: datetime | None = None
) -> int:
    """Model B: SqlTransactionListener's records (the committed transactions) to ``out``."""
    columns = [transaction_record.c[name] for name in RECORDS.names]
    query = select(*columns).order_by(transaction_record.c.created_at)
    return export_rows(
        db, windowed(query, transaction_record.c.created_at, since, until), out, RECORDS
    )


def windowed(
    query: Select[Any], column: Any, since: datetime | None, until: datetime | None
) -> Select[Any]:
    if since is not None:
        query = query.where(column >= since)
    if until is not None:
        query = query.where(column < until)
    return query


def export_rows(db: str | Engine, query: Select[Any], out: str | Path, schema: pa.Schema) -> int:
    """Stream a query's rows (columns in the schema's order) to Parquet via a server-side cursor."""
    written = 0
    with parquet_file(out, schema) as writer, engine_from(db).connect() as conn:
        result = conn.execution_options(yield_per=CHUNK).execute(query)
        for rows in result.partitions():
            columns = zip(*rows, strict=True)
            batch = {
                name: [cell(v) for v in column]
                for name, column in zip(schema.names, columns, strict=True)
            }
            writer.write_table(pa.table(batch, schema=schema))
            written += len(rows)
    return written


@contextmanager
def parquet_file(out: str | Path, schema: pa.Schema) -> Iterator[pq.ParquetWriter]:
    """A writer whose file appears at ``out`` only once the export succeeded.

    It writes ``.NAME.part`` beside ``out`` and renames it at the end, so a failed
    export leaves no half-written file, and an older ``out`` stays as it was.
    """
    out = Path(out)
    part = out.with_name(f".{out.name}.part")
    try:
        with pq.ParquetWriter(str(part), schema) as writer:
            yield writer
        part.replace(out)
    finally:
        part.unlink(missing_ok=True)


def unreachable(url: str, reason: object) -> OutboxError:
    return OutboxError(f"broker {mask_url(url)} unreachable ({reason}); nothing was written")


def cell(value: object) -> object:
    """UUIDs as text and times in UTC, as the Parquet schemas hold them."""
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, datetime):
        return utc(value)
    return value


def export_broker_nats(
    url: str,
    stream: str,
    out: str | Path,
    since: datetime | None = None,
    until: datetime | None = None,
) -> int:
    """Write what a JetStream stream holds (from ``since``) to ``out``, via an ordered consumer."""
    streams: list[tuple[str, RowOf]] = [(stream, broker_row)]
    return asyncio.run(_export_nats(url, streams, BROKER, str(out), since, until, optional=False))


def export_halfop_nats(
    url: str, out: str | Path, since: datetime | None = None, until: datetime | None = None
) -> int:
    """Model B: the half, op and discarded streams in one file (schema HALFOP_LOG)."""
    from outbox.halfop import CHECK_MAX_TOPIC, HALF_TOPIC, OP_TOPIC

    streams = [
        (HALF_TOPIC, halfop_row("half")),
        (OP_TOPIC, halfop_row("op")),
        (CHECK_MAX_TOPIC, halfop_row("discarded")),
    ]
    # model B's streams exist only once a producer or coordinator ran
    return asyncio.run(
        _export_nats(url, streams, HALFOP_LOG, str(out), since, until, optional=True)
    )


def broker_row(msg: Any, ts: datetime | None) -> dict[str, object]:
    headers = msg.headers or {}
    return {"msg_id": headers.get("Nats-Msg-Id"), "topic": msg.subject,
            "seq": str(msg.metadata.sequence.stream), "broker_ts": ts}  # fmt: skip


def halfop_row(stream: str) -> RowOf:
    """A row of the half/op log; an op's body and a discarded half's header name a half."""
    from outbox.halfop import CHECK_TIMES, HALF_OFFSET, REAL_TOPIC, UNIQ_KEY

    def row(msg: Any, ts: datetime | None) -> dict[str, object]:
        headers = msg.headers or {}
        offset = msg.data.decode() if stream == "op" else headers.get(HALF_OFFSET)
        checks = headers.get(CHECK_TIMES)
        return {
            "stream": stream,
            "msg_id": headers.get(UNIQ_KEY),
            "topic": headers.get(REAL_TOPIC, ""),
            "seq": msg.metadata.sequence.stream,
            "broker_ts": ts,
            "check_times": int(checks) if checks else None,
            "half_offset": int(offset) if offset else None,
        }

    return row


async def _export_nats(
    url: str,
    streams: list[tuple[str, RowOf]],
    schema: pa.Schema,
    out: str,
    since: datetime | None,
    until: datetime | None,
    optional: bool,
) -> int:
    nc = await connect_nats(url)
    try:
        js = nc.jetstream(timeout=10)
        with parquet_file(out, schema) as writer:
            written = 0
            for stream, row_of in streams:
                async for rows in _read_stream(js, stream, row_of, since, until, optional):
                    writer.write_table(pa.Table.from_pylist(rows, schema=schema))
                    written += len(rows)
            return written
    finally:
        await nc.close()


async def connect_nats(url: str) -> Any:
    """Two quick tries, then a one-line error: an export has nothing to wait for."""
    import nats
    import nats.errors

    errors: list[Exception] = []

    async def remember(exc: Exception) -> None:  # instead of nats.py's logged traceback
        errors.append(exc)

    try:
        return await nats.connect(
            servers=[url], name="outbox-export", connect_timeout=2,
            max_reconnect_attempts=1, reconnect_time_wait=0.2, error_cb=remember,
        )  # fmt: skip
    except nats.errors.NoServersError:
        raise unreachable(url, errors[-1] if errors else "no server answered") from None


async def _read_stream(
    js: Any,
    stream: str,
    row_of: RowOf,
    since: datetime | None,
    until: datetime | None,
    optional: bool,
) -> AsyncIterator[list[dict[str, object]]]:
    """Rows of one stream in chunks of CHUNK, from ``since`` up to its last message now."""
    import nats.errors
    import nats.js.errors
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
    rows: list[dict[str, object]] = []
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=5)
            except nats.errors.TimeoutError:
                break  # nothing newer than `since`, or the stream was trimmed meanwhile
            meta = msg.metadata
            ts = meta.timestamp.astimezone(UTC) if meta.timestamp else None
            if until is None or ts is None or ts < until:
                rows.append(row_of(msg, ts))
            if len(rows) >= CHUNK:
                yield rows
                rows = []
            if meta.sequence.stream >= last:
                break
        if rows:
            yield rows
    finally:
        await sub.unsubscribe()


def export_broker_redis(
    url: str,
    topics: list[str],
    out: str | Path,
    since: datetime | None = None,
    until: datetime | None = None,
) -> int:
    """Write the entries of each topic's Redis stream (added in [since, until)) to ``out``.

    Entry ids are ``<ms>-<seq>``, so the window is an XRANGE range and broker_ts is the
    id's milliseconds (the time Redis added the entry).
    """
    import redis

    from relay.brokers.redis import RedisBroker

    broker = RedisBroker(url)  # for its URL parsing: prefix, and the URL without it
    client = redis.Redis.from_url(
        broker.url, socket_timeout=READ_TIMEOUT_S, socket_connect_timeout=broker.timeout
    )
    start = f"{ms_at_or_after(since)}-0" if since else "-"
    end = f"({ms_at_or_after(until)}-0" if until else "+"
    written = 0
    try:
        ping(client, url)
        with parquet_file(out, BROKER) as writer:
            for topic in topics:
                for page in xrange_pages(client, broker.prefix + topic, start, end):
                    rows = [redis_row(topic, entry_id, fields) for entry_id, fields in page]
                    writer.write_table(pa.Table.from_pylist(rows, schema=BROKER))
                    written += len(rows)
    finally:
        client.close()
    return written


def ping(client: Any, url: str) -> None:
    import redis

    try:
        client.ping()
    except redis.exceptions.RedisError as exc:
        raise unreachable(url, exc) from None


def xrange_pages(client: Any, key: str, start: str, end: str) -> Iterator[list[Any]]:
    """XRANGE in pages of CHUNK; the next page starts after the last id (Redis >= 6.2)."""
    while page := client.xrange(key, start, end, count=CHUNK):
        yield page
        start = "(" + page[-1][0].decode()


def redis_row(topic: str, entry_id: bytes, fields: dict[bytes, bytes]) -> dict[str, object]:
    seq = entry_id.decode()
    msg_id = fields.get(b"msg_id")
    return {
        "msg_id": msg_id.decode() if msg_id is not None else None,
        "topic": topic,
        "seq": seq,
        "broker_ts": EPOCH + timedelta(milliseconds=int(seq.split("-")[0])),
    }


def ms_at_or_after(moment: datetime) -> int:
    """The first whole millisecond at or after ``moment`` (entry ids count milliseconds)."""
    aware = moment if moment.tzinfo else moment.replace(tzinfo=UTC)
    micros = (aware - EPOCH) // timedelta(microseconds=1)
    return -(-micros // 1000)


def export_broker_rabbitmq(
    url: str,
    queue: str,
    out: str | Path,
    since: datetime | None = None,
    until: datetime | None = None,
) -> int:
    """Write what the audit stream queue ``queue`` holds (published in [since, until)) to ``out``.

    The queue is the one the relay's ``?audit=QUEUE`` declares. broker_ts is the
    relay's publish time (the AMQP ``timestamp``, in whole seconds: RabbitMQ stores no
    arrival time per message), so the window is widened to whole seconds; extra rows
    at its edges do no harm, since reconciliation matches by msg_id.
    """
    return asyncio.run(_export_rabbitmq(url, queue, str(out), since, until))


async def _export_rabbitmq(
    url: str, queue_name: str, out: str, since: datetime | None, until: datetime | None
) -> int:
    import aio_pika
    import aio_pika.exceptions

    from relay.brokers.rabbitmq import RabbitBroker

    try:
        connection = await aio_pika.connect(RabbitBroker(url).url, timeout=READ_TIMEOUT_S)
    except (OSError, TimeoutError) as exc:  # aio_pika's connection errors are OSErrors
        raise unreachable(url, exc) from None
    try:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=PREFETCH)  # stream queues refuse consumers without
        try:
            queue = await channel.get_queue(queue_name, ensure=True)
        except aio_pika.exceptions.ChannelNotFoundEntity:
            raise OutboxError(
                f"no queue {queue_name!r}: set ?audit={queue_name} on the relay's broker URL"
            ) from None
        inbox: asyncio.Queue[Any] = asyncio.Queue()  # holds at most PREFETCH messages
        # pamqp sends a datetime as an AMQP timestamp (whole seconds): attach by time.
        offset: datetime | str = since if since else "first"
        await queue.consume(inbox.put, arguments={"x-stream-offset": offset})
        marker = await publish_marker(channel, queue_name)
        with parquet_file(out, BROKER) as writer:
            return await read_until_marker(inbox, marker, writer, since, until)
    finally:
        await connection.close()


async def publish_marker(channel: Any, queue_name: str) -> str:
    """Append a marker to the stream; reading up to it is reading everything there now.

    Streams over AMQP 0-9-1 report no message count or last offset, and waiting for
    silence never ends while the relay keeps publishing, so the export marks the end
    itself: one small message per run (exports skip markers, theirs and earlier ones).
    """
    import aio_pika

    marker = f"outbox-export-{uuid.uuid4()}"
    message = aio_pika.Message(b"", message_id=marker, type=MARKER_TYPE)
    await channel.default_exchange.publish(message, routing_key=queue_name)
    return marker


async def read_until_marker(
    inbox: asyncio.Queue[Any],
    marker: str,
    writer: pq.ParquetWriter,
    since: datetime | None,
    until: datetime | None,
) -> int:
    first = whole_second(since)  # attaching by time starts at a chunk: filter here too
    rows: list[dict[str, object]] = []
    written = 0
    while True:
        try:
            message = await asyncio.wait_for(inbox.get(), READ_TIMEOUT_S)
        except TimeoutError:
            raise OutboxError(
                f"broker export: no delivery for {READ_TIMEOUT_S:.0f} s before the end marker"
            ) from None
        await message.ack()  # a stream queue sends more only as deliveries are acked
        if message.message_id == marker:
            break
        ts = utc(message.timestamp)
        if message.type != MARKER_TYPE and in_window(ts, first, until):
            headers = message.headers or {}
            rows.append({"msg_id": message.message_id, "topic": message.routing_key,
                         "seq": str(headers.get("x-stream-offset")), "broker_ts": ts})  # fmt: skip
        if len(rows) >= CHUNK:
            writer.write_table(pa.Table.from_pylist(rows, schema=BROKER))
            written, rows = written + len(rows), []
    if rows:
        writer.write_table(pa.Table.from_pylist(rows, schema=BROKER))
        written += len(rows)
    return written


def in_window(ts: datetime | None, since: datetime | None, until: datetime | None) -> bool:
    if ts is None:  # published before the adapter set timestamps: keep it
        return True
    return (since is None or ts >= since) and (until is None or ts < until)


def whole_second(moment: datetime | None) -> datetime | None:
    value = utc(moment)
    return value.replace(microsecond=0) if value is not None else None


def utc(value: datetime | None) -> datetime | None:
    if value is None:
        return None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
