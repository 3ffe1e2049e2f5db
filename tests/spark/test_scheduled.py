"""Scheduled and canceled messages in the reconciliation: a message not due by the window's
end is scheduled, never lost; a canceled one is never expected; a due one is judged (SLA,
latency) from its deliver_at, not its commit. The ledger export carries deliver_at, and a
ledger exported before it still reconciles."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyspark.sql import SparkSession
from sqlalchemy import Engine

from relay import export, store
from spark_jobs.reconcile_job import check_inputs
from spark_jobs.reconciliation import reconcile
from spark_jobs.schema import BROKER, LEDGER
from tests.helpers import migrated
from tests.planting import plant
from tests.spark.test_order import WINDOW, Row, at, committed, write

END = WINDOW.end


def scheduled(msg_id: str, when: float, deliver_at: Any, status: str = "pending") -> Row:
    return {**committed(msg_id, when, status), "deliver_at": deliver_at}


def copy(msg_id: str, when: float) -> Row:
    return {
        "msg_id": msg_id,
        "topic": "t.a",
        "seq": msg_id[1:],
        "broker_ts": at(when),
        "key": None,
        "outbox_seq": None,
    }


def kinds(out: Path) -> dict[str, str]:
    return {r["msg_id"]: r["kind"] for r in pq.read_table(out / "discrepancies").to_pylist()}


def test_scheduled_canceled_and_due_messages(spark: SparkSession, tmp_path: Path) -> None:
    ledger = [
        committed("m1"),  # delivered at 2 s
        scheduled("m2", 10, END + timedelta(hours=1)),  # due after the window: scheduled
        scheduled("m3", 15, END),  # due right at the end: scheduled too
        scheduled("m4", 20, at(1800), status="canceled"),  # canceled: never expected
        scheduled("m5", 30, END - timedelta(seconds=30)),  # due 30 s before the end: pending
        scheduled("m6", 40, at(600)),  # due 50 min before the end, still pending: stuck
        scheduled("m7", 50, at(100), status="sent"),  # delivered 0.5 s after its time
        scheduled("m8", 60, at(10)),  # a deliver_at before its commit: due at its commit
    ]
    broker = [copy("m1", 2), copy("m7", 100.5)]
    out = tmp_path / "out"
    ledger_path = write(tmp_path / "ledger.parquet", ledger, LEDGER)
    summary = reconcile(
        spark, ledger_path, write(tmp_path / "b.parquet", broker, BROKER), out, WINDOW
    )
    total = summary["total"]
    names = ("committed", "delivered", "scheduled", "canceled", "pending", "stuck", "lost")
    counts = {k: total[k] for k in (*names, "phantom")}
    assert counts == {
        "committed": 8,
        "delivered": 2,
        "scheduled": 2,
        "canceled": 1,
        "pending": 1,
        "stuck": 2,
        "lost": 0,
        "phantom": 0,
    }
    assert summary["topics"]["t.a"]["scheduled"] == 2
    # m8 was due at its commit, 60 s in, and never came: stuck like m6 (both still pending)
    assert kinds(out) == {"m6": "stuck", "m8": "stuck"}
    # m7's latency counts from its deliver_at: 500 ms, not the 50 s since its commit; the
    # highest is m1's, 1 s from commit to broker
    assert total["latency_max_ms"] == pytest.approx(1000, abs=1)
    page = (out / "report.html").read_text()
    assert "<th>scheduled (due later)</th>" in page and "<th>canceled</th>" in page


def test_a_ledger_exported_before_deliver_at_still_reconciles(
    spark: SparkSession, tmp_path: Path
) -> None:
    old = pa.schema([f for f in LEDGER if f.name != "deliver_at"])
    ledger_path = write(
        tmp_path / "ledger.parquet", [committed("m1"), committed("m2", 3570, "pending")], old
    )
    broker_path = write(tmp_path / "b.parquet", [copy("m1", 2)], BROKER)
    check_inputs(ledger_path, broker_path, None, str(tmp_path / "out"))  # no missing column
    total = reconcile(spark, ledger_path, broker_path, tmp_path / "out", WINDOW)["total"]
    assert (total["delivered"], total["pending"], total["scheduled"], total["lost"]) == (1, 1, 0, 0)


@pytest.fixture
def engine(pg_url: str) -> Any:
    with migrated(pg_url) as eng:
        yield eng


def test_exported_scheduled_rows_reconcile_as_scheduled(
    engine: Engine, spark: SparkSession, tmp_path: Path
) -> None:
    """From the table: `outbox export ledger` writes deliver_at as the database holds it,
    and a reconciliation ending now counts the rows by it (nothing at the broker yet)."""
    with engine.connect() as conn:
        now = store.db_clock(conn)
    later = now + timedelta(hours=1)
    ids = {
        "scheduled": plant(engine, "sch.x", deliver_at=later),
        "canceled": plant(engine, "sch.x", deliver_at=later, status="canceled"),
        "due": plant(
            engine,
            "sch.x",
            created_at=now - timedelta(minutes=30),
            deliver_at=now - timedelta(seconds=5),
        ),
    }
    ledger_path = tmp_path / "ledger.parquet"
    assert export.export_ledger(engine, ledger_path) == 3
    held = {r["msg_id"]: r["deliver_at"] for r in pq.read_table(ledger_path).to_pylist()}
    assert held[ids["scheduled"]] == later
    assert held[ids["due"]] == now - timedelta(seconds=5)
    broker_path = write(tmp_path / "b.parquet", [], BROKER)
    window = type(WINDOW)(now - timedelta(hours=1), now + timedelta(seconds=1), sla_s=60)
    total = reconcile(spark, str(ledger_path), broker_path, tmp_path / "out", window)["total"]
    # the due row was created 30 min ago but due 5 s ago: pending within the SLA, not lost
    assert (total["scheduled"], total["canceled"], total["pending"], total["lost"]) == (1, 1, 1, 0)
