"""Model B's exports (``outbox export records`` and ``outbox export halfop``), on
relay.export's writers: the listener's records and the half, op and discarded streams."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path

from sqlalchemy import Engine, select

from outbox.broker import LogEntry
from outbox.table import transaction_record
from relay.export import Added, LogRow, export_rows, in_range, nothing, write_async_chunks
from relay.lab.halfop.protocol import (
    CHECK_MAX_TOPIC,
    CHECK_TIMES,
    HALF_OFFSET,
    HALF_TOPIC,
    OP_TOPIC,
    REAL_TOPIC,
    UNIQ_KEY,
)
from spark_jobs.schema import HALFOP_LOG, RECORDS


def export_records(
    db: str | Engine,
    out: str | Path,
    since: datetime | None = None,
    until: datetime | None = None,
    added: Added = nothing,
) -> int:
    """Model B: SqlTransactionListener's records (the committed transactions) to ``out``."""
    columns = [transaction_record.c[name] for name in RECORDS.names]
    created = in_range(transaction_record.c.created_at, since, until)
    query = select(*columns).where(created).order_by(transaction_record.c.created_at)
    return export_rows(db, query, out, RECORDS, added)


def export_halfop_nats(
    url: str,
    out: str | Path,
    since: datetime | None = None,
    until: datetime | None = None,
    added: Added = nothing,
) -> int:
    """Model B: the half, op and discarded streams in one file (schema HALFOP_LOG).

    Its own path: three NATS streams of model B's, read together, each row saying which
    stream it came from, and the streams may not exist yet.
    """
    from relay.brokers import nats

    kinds = {HALF_TOPIC: "half", OP_TOPIC: "op", CHECK_MAX_TOPIC: "discarded"}

    async def rows() -> AsyncIterator[list[LogRow]]:
        # model B's streams exist only once a producer or coordinator ran
        async for stream, entries in nats.read_entries(url, list(kinds), since, until, True):
            yield [halfop_row(kinds[stream], entry) for entry in entries]

    return write_async_chunks(rows(), out, HALFOP_LOG, added)


def halfop_row(kind: str, entry: LogEntry) -> LogRow:
    """A row of the half/op log; an op's body and a discarded half's header name a half."""
    headers = entry.headers
    offset = entry.payload.decode() if kind == "op" else headers.get(HALF_OFFSET)
    checks = headers.get(CHECK_TIMES)
    return {
        "stream": kind,
        "msg_id": headers.get(UNIQ_KEY),
        "topic": headers.get(REAL_TOPIC, ""),
        "seq": int(entry.seq),
        "broker_ts": entry.broker_ts,
        "check_times": int(checks) if checks else None,
        "half_offset": int(offset) if offset else None,
    }
