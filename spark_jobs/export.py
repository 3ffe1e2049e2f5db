"""`outbox export`: the ledger and the broker log to Parquet, in bounded memory.

Both are streamed in chunks (a server-side cursor for the database, an ordered
consumer for JetStream) and written batch by batch, so memory does not grow with
the number of rows.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from sqlalchemy import Engine, select

from outbox.config import engine_from
from outbox.table import outbox_message as t
from spark_jobs.schema import BROKER, LEDGER

CHUNK = 50_000


def export_ledger(
    db: str | Engine, out: str | Path, since: datetime | None = None, until: datetime | None = None
) -> int:
    """Write outbox_message rows (created in [since, until)) to ``out`` (a .parquet file)."""
    engine = engine_from(db)
    query = select(
        t.c.id,
        t.c.msg_id,
        t.c.topic,
        t.c.status,
        t.c.created_at,
        t.c.sent_at,
        t.c.attempts,
        t.c.receipt,
    ).order_by(t.c.id)
    if since is not None:
        query = query.where(t.c.created_at >= since)
    if until is not None:
        query = query.where(t.c.created_at < until)
    written = 0
    with pq.ParquetWriter(str(out), LEDGER) as writer, engine.connect() as conn:
        result = conn.execution_options(yield_per=CHUNK).execute(query)
        for rows in result.partitions():
            columns = list(zip(*rows, strict=True))
            batch = {
                "id": columns[0],
                "msg_id": [str(m) if m is not None else None for m in columns[1]],
                "topic": columns[2],
                "status": columns[3],
                "created_at": [utc(v) for v in columns[4]],
                "sent_at": [utc(v) for v in columns[5]],
                "attempts": columns[6],
                "receipt": columns[7],
            }
            writer.write_table(pa.table(batch, schema=LEDGER))
            written += len(rows)
    return written


def export_broker_nats(
    url: str,
    stream: str,
    out: str | Path,
    since: datetime | None = None,
    until: datetime | None = None,
) -> int:
    """Write what a JetStream stream holds (from ``since``) to ``out``, via an ordered consumer."""
    return asyncio.run(_export_nats(url, stream, str(out), since, until))


async def _export_nats(
    url: str, stream: str, out: str, since: datetime | None, until: datetime | None
) -> int:
    import nats
    import nats.errors
    from nats.js.api import ConsumerConfig, DeliverPolicy

    nc = await nats.connect(servers=[url], name="outbox-export")
    written = 0
    try:
        js = nc.jetstream(timeout=10)
        last = (await js.stream_info(stream)).state.last_seq
        config = (
            ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=since)
            if since
            else None
        )
        with pq.ParquetWriter(out, BROKER) as writer:
            if last == 0:
                return 0
            sub = await js.subscribe(">", stream=stream, ordered_consumer=True, config=config)
            rows: list[dict[str, object]] = []
            while True:
                try:
                    msg = await sub.next_msg(timeout=5)
                except nats.errors.TimeoutError:
                    break  # nothing newer than `since`, or the stream was trimmed meanwhile
                meta = msg.metadata
                ts = meta.timestamp.astimezone(UTC) if meta.timestamp else None
                if until is None or ts is None or ts < until:
                    headers = msg.headers or {}
                    rows.append({"msg_id": headers.get("Nats-Msg-Id"), "topic": msg.subject,
                                 "seq": str(meta.sequence.stream), "broker_ts": ts})  # fmt: skip
                if len(rows) >= CHUNK:
                    writer.write_table(pa.Table.from_pylist(rows, schema=BROKER))
                    written, rows = written + len(rows), []
                if meta.sequence.stream >= last:
                    break
            if rows:
                writer.write_table(pa.Table.from_pylist(rows, schema=BROKER))
                written += len(rows)
            await sub.unsubscribe()
    finally:
        await nc.close()
    return written


def utc(value: datetime | None) -> datetime | None:
    if value is None:
        return None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
