"""`outbox export`: the ledger and the broker log to Parquet, in bounded memory.

Both are streamed in chunks (a server-side cursor for the database; for a broker,
its module's log reader in relay.brokers: an ordered consumer for JetStream, XRANGE
pages for Redis, a stream-queue consumer with a prefetch limit for RabbitMQ) and
written batch by batch, so memory does not grow with the number of rows. The
Parquet schemas are spark_jobs.schema's, the reconciliation job's inputs.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from sqlalchemy import Engine, Select, select

from outbox.config import engine_from
from outbox.table import outbox_message as t
from outbox.table import transaction_record
from relay.brokers.base import LogRow, utc
from relay.halfop.protocol import (
    CHECK_MAX_TOPIC,
    CHECK_TIMES,
    HALF_OFFSET,
    HALF_TOPIC,
    OP_TOPIC,
    REAL_TOPIC,
    UNIQ_KEY,
)
from spark_jobs.schema import BROKER, HALFOP_LOG, LEDGER, RECORDS

CHUNK = 50_000


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


def cell(value: object) -> object:
    """UUIDs as text and times in UTC, as the Parquet schemas hold them."""
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, datetime):
        return utc(value)
    return value


def write_chunks(chunks: Iterable[list[LogRow]], out: str | Path, schema: pa.Schema) -> int:
    """Write a reader's chunks to ``out``; nothing appears there if the reader fails."""
    written = 0
    with parquet_file(out, schema) as writer:
        for rows in chunks:
            writer.write_table(pa.Table.from_pylist(rows, schema=schema))
            written += len(rows)
    return written


def write_async_chunks(
    chunks: AsyncIterator[list[LogRow]], out: str | Path, schema: pa.Schema
) -> int:
    async def write() -> int:
        written = 0
        with parquet_file(out, schema) as writer:
            async for rows in chunks:
                writer.write_table(pa.Table.from_pylist(rows, schema=schema))
                written += len(rows)
        return written

    return asyncio.run(write())


def export_broker_nats(
    url: str,
    stream: str,
    out: str | Path,
    since: datetime | None = None,
    until: datetime | None = None,
) -> int:
    """Write what a JetStream stream holds (from ``since``) to ``out``, via an ordered consumer."""
    from relay.brokers import nats

    chunks = nats.read_log(url, [(stream, nats.log_row)], since, until)
    return write_async_chunks(chunks, out, BROKER)


def export_halfop_nats(
    url: str, out: str | Path, since: datetime | None = None, until: datetime | None = None
) -> int:
    """Model B: the half, op and discarded streams in one file (schema HALFOP_LOG)."""
    from relay.brokers import nats

    streams = [
        (HALF_TOPIC, halfop_row("half")),
        (OP_TOPIC, halfop_row("op")),
        (CHECK_MAX_TOPIC, halfop_row("discarded")),
    ]
    # model B's streams exist only once a producer or coordinator ran
    chunks = nats.read_log(url, streams, since, until, optional=True)
    return write_async_chunks(chunks, out, HALFOP_LOG)


def halfop_row(stream: str) -> Callable[[Any, datetime | None], LogRow]:
    """A row of the half/op log; an op's body and a discarded half's header name a half."""

    def row(msg: Any, ts: datetime | None) -> LogRow:
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


def export_broker_redis(
    url: str,
    topics: list[str],
    out: str | Path,
    since: datetime | None = None,
    until: datetime | None = None,
) -> int:
    """Write the entries of each topic's Redis stream (added in [since, until)) to ``out``."""
    from relay.brokers import redis

    return write_chunks(redis.read_log(url, topics, since, until), out, BROKER)


def export_broker_rabbitmq(
    url: str,
    queue: str,
    out: str | Path,
    since: datetime | None = None,
    until: datetime | None = None,
) -> int:
    """Write what the audit stream queue ``queue`` holds (published in [since, until))."""
    from relay.brokers import rabbitmq

    return write_async_chunks(rabbitmq.read_log(url, queue, since, until), out, BROKER)
