"""The reconciliation finds every injected fault and nothing else."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyspark.sql import SparkSession

from spark_jobs import reconcile_job, reconciliation, schema
from spark_jobs.generate import Plan, generate
from spark_jobs.window import Window


def reconcile(spark: SparkSession, tmp_path: Path, plan: Plan) -> tuple[dict, dict]:  # type: ignore[type-arg]
    expected = generate(spark, plan, tmp_path / "in")
    window = Window(
        datetime.fromisoformat(expected["window"]["start"]),
        datetime.fromisoformat(expected["window"]["end"]),
        plan.sla_s,
    )  # type: ignore[index]
    summary = reconciliation.reconcile(
        spark,
        str(tmp_path / "in" / "ledger"),
        str(tmp_path / "in" / "broker"),
        tmp_path / "out",
        window,
    )
    return expected, summary


@pytest.mark.parametrize("skew_ms", [0, 5000])
def test_every_injection_found_and_nothing_else(
    spark: SparkSession, tmp_path: Path, skew_ms: int
) -> None:
    plan = Plan(rows=20_000, lost=17, duplicated=11, phantom=5, pending=9, skew_ms=skew_ms)
    expected, summary = reconcile(spark, tmp_path, plan)
    total = summary["total"]
    for key in ("committed", "delivered", "lost", "pending", "duplicated", "phantom"):
        assert total[key] == expected[key], key
    assert total["dead"] == 0 and total["malformed"] == 0
    assert sum(t["committed"] for t in summary["topics"].values()) == 20_000


def test_outputs_summary_discrepancies_and_report(spark: SparkSession, tmp_path: Path) -> None:
    plan = Plan(rows=3_000, lost=2, duplicated=3, phantom=1, pending=4)
    reconcile(spark, tmp_path, plan)
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["total"]["lost"] == 2 and summary["total"]["latency_p99_ms"] <= 51
    kinds = spark.read.parquet(str(out / "discrepancies")).groupBy("kind").count().collect()
    assert {r["kind"]: r["count"] for r in kinds} == {"lost": 2, "duplicated": 3, "phantom": 1}
    page = (out / "report.html").read_text()
    assert "DISCREPANCIES" in page and 'id="kinds-chart"' in page and 'id="latency-chart"' in page


def test_clean_run_passes(spark: SparkSession, tmp_path: Path) -> None:
    _, summary = reconcile(spark, tmp_path, Plan(rows=2_000, pending=3))
    assert (summary["total"]["lost"], summary["total"]["phantom"], summary["total"]["pending"]) == (
        0,
        0,
        3,
    )
    assert "OK" in (tmp_path / "out" / "report.html").read_text()


def night_of(tmp_path: Path, rows: list[tuple[str, str, str, bool]]) -> tuple[str, str]:
    """Ledger and broker Parquet for (msg_id, status, created HH:MM:SS, at the broker)."""
    day = "2026-01-01T"
    ledger = pa.table(
        {
            "id": list(range(len(rows))),
            "msg_id": [r[0] for r in rows],
            "topic": ["t"] * len(rows),
            "status": [r[1] for r in rows],
            "created_at": [datetime.fromisoformat(f"{day}{r[2]}+00:00") for r in rows],
            "sent_at": [None] * len(rows),
            "attempts": [0] * len(rows),
            "receipt": [None] * len(rows),
            "deliver_at": [None] * len(rows),
            "key": [None] * len(rows),
            "seq": [None] * len(rows),
        },
        schema=schema.LEDGER,
    )
    delivered = [r for r in rows if r[3]]
    broker = pa.table(
        {
            "msg_id": [r[0] for r in delivered],
            "topic": ["t"] * len(delivered),
            "seq": [str(i) for i in range(len(delivered))],
            "broker_ts": [datetime.fromisoformat(f"{day}{r[2]}+00:00") for r in delivered],
            "key": [None] * len(delivered),
            "outbox_seq": [None] * len(delivered),
            "malformed": [None] * len(delivered),
            "raw": [None] * len(delivered),
            "stream": [None] * len(delivered),
        },
        schema=schema.BROKER,
    )
    paths = str(tmp_path / "ledger.parquet"), str(tmp_path / "broker.parquet")
    pq.write_table(ledger, paths[0])
    pq.write_table(broker, paths[1])
    return paths


HOUR = Window(datetime.fromisoformat("2026-01-01T00:00:00+00:00"),
              datetime.fromisoformat("2026-01-01T01:00:00+00:00"), 60)  # fmt: skip


def test_pending_past_the_sla_is_stuck_and_sent_but_absent_is_lost(
    spark: SparkSession, tmp_path: Path
) -> None:
    ledger, broker = night_of(tmp_path, [
        ("m-delivered", "sent", "00:10:00", True),
        ("m-stuck", "pending", "00:10:00", False),  # the sweeper may still send it
        ("m-lost", "sent", "00:10:00", False),  # marked sent, never at the broker
        ("m-pending", "pending", "00:59:30", False),  # within the SLA at the window's end
    ])  # fmt: skip
    out = tmp_path / "out"
    total = reconciliation.reconcile(spark, ledger, broker, out, HOUR)["total"]
    counts = {k: total[k] for k in ("committed", "delivered", "stuck", "lost", "pending")}
    assert counts == {"committed": 4, "delivered": 1, "stuck": 1, "lost": 1, "pending": 1}
    found = spark.read.parquet(str(out / "discrepancies")).select("msg_id", "kind").collect()
    assert sorted((r["msg_id"], r["kind"]) for r in found) == [
        ("m-lost", "lost"),
        ("m-stuck", "stuck"),
    ]
    assert reconcile_job.exit_status(total) == 3  # lost comes first
    assert 'id="verdict">DISCREPANCIES<' in (out / "report.html").read_text()


def test_stuck_alone_is_late_not_wrong(spark: SparkSession, tmp_path: Path) -> None:
    ledger, broker = night_of(tmp_path, [
        ("m-delivered", "sent", "00:10:00", True),
        ("m-stuck", "pending", "00:20:00", False),
    ])  # fmt: skip
    out = tmp_path / "out"
    total = reconciliation.reconcile(spark, ledger, broker, out, HOUR)["total"]
    assert (total["stuck"], total["lost"], total["phantom"]) == (1, 0, 0)
    assert reconcile_job.exit_status(total) == reconcile_job.EXIT_STUCK == 4
    assert 'id="verdict">STUCK<' in (out / "report.html").read_text()
