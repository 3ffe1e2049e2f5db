"""A ledger in PostgreSQL spread over a year, and one night's broker log, with known faults.

The night is ``WINDOW``; the rest of the year is there to prove the job reads the night
only. Shared by the window-read tests and the cluster tests.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from sqlalchemy import insert

from outbox import migrate
from outbox.engines import engine_from
from outbox.table import outbox_message
from spark_jobs.schema import BROKER
from spark_jobs.window import Window

NIGHT = datetime(2025, 7, 1, tzinfo=UTC)
WINDOW = Window(NIGHT, NIGHT + timedelta(days=1), sla_s=60)
YEAR = datetime(2025, 1, 1, tzinfo=UTC)


def msg(n: int) -> str:
    return str(uuid.UUID(int=(7 << 76) | n))


def row(n: int, created: datetime, status: str = "sent", due: datetime | None = None) -> dict:  # type: ignore[type-arg]
    return {"msg_id": uuid.UUID(msg(n)), "topic": f"t.{n % 2}", "payload": b"{}",
            "created_at": created, "status": status, "sent_at": created, "attempts": 1,
            "deliver_at": due}  # fmt: skip


def year_of_rows() -> list[dict[str, Any]]:
    """Every 6 hours (03:00, 09:00, 15:00, 21:00) from January to December: 4 in the night."""
    return [row(n, YEAR + timedelta(hours=3 + 6 * n)) for n in range(4 * 365)]


def fill_year(db: str) -> None:
    """The year, the night's extra commits and the faults, in commit order (ids rise)."""
    migrate.upgrade(db)
    rows = year_of_rows()
    night = NIGHT + timedelta(hours=1)
    rows += [row(10_000 + n, night + timedelta(seconds=n)) for n in range(200)]
    rows += [row(20_000, NIGHT - timedelta(minutes=30))]  # delivered late, in the night
    rows += [row(20_001, YEAR + timedelta(days=60), "pending", due=NIGHT + timedelta(hours=10))]
    rows += [row(20_002, NIGHT - timedelta(hours=2))]  # older than --lookback, delivered late
    # committed long after the night with a past deliver_at (due at once): in the span by it
    rows += [row(20_003, NIGHT + timedelta(days=2), due=NIGHT + timedelta(hours=3))]
    rows.sort(key=lambda r: r["created_at"])
    engine = engine_from(db)
    with engine.begin() as conn:
        conn.execute(insert(outbox_message), rows)
    engine.dispose()


def night_broker_log(path: Path) -> str:
    """The broker log of the night: 200 + 4 commits, 3 lost, 2 duplicated, 2 phantoms, and
    the two late and the scheduled message of earlier commits (none is a phantom; one is
    older than the default --lookback)."""
    delivered = [n for n in range(10_000, 10_200) if n not in (10_007, 10_070, 10_150)]
    year = [n for n in range(4 * 365) if NIGHT <= YEAR + timedelta(hours=3 + 6 * n) < WINDOW.end]
    entries = [*year, *delivered, 10_011, 10_012, 20_000, 20_001, 20_002, 90_000, 90_001]
    start = NIGHT + timedelta(hours=2)
    rows = [{"msg_id": msg(n), "topic": f"t.{n % 2}", "seq": str(i),
             "broker_ts": start + timedelta(seconds=i)} for i, n in enumerate(entries)]  # fmt: skip
    for entry, n in zip(rows[: len(year)], year, strict=True):
        entry["broker_ts"] = YEAR + timedelta(hours=3 + 6 * n, milliseconds=20)
    pq.write_table(pa.Table.from_pylist(rows, schema=BROKER), path)
    return str(path)


# What the night holds: 204 commits (200 + the year's 4), 3 lost, 2 duplicated, 2 phantoms
EXPECTED = {"committed": 204, "delivered": 201, "lost": 3, "duplicated": 2, "phantom": 2,
            "pending": 0, "stuck": 0}  # fmt: skip
# The rows the job reads: the night's 204, the late one in the lookback, the scheduled one,
# the one committed after the night and due in it
READ = 207
ALL = 4 * 365 + 200 + 4  # the whole table
