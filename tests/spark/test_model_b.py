"""Model B's reconciliation: the listener's records are the truth, halfs and ops add counts."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql import SparkSession

from relay.lab.compare.report import figures
from relay.lab.compare.run import RunResult
from spark_jobs.reconciliation import reconcile
from spark_jobs.schema import BROKER, HALFOP_LOG, RECORDS
from spark_jobs.window import Window

T0 = datetime(2026, 3, 1, tzinfo=UTC)
WINDOW = Window(T0, T0 + timedelta(hours=1), sla_s=60)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def half(msg_id: str, topic: str, seq: int, when: float, checks: int = 0) -> dict[str, Any]:
    return {"stream": "half", "msg_id": msg_id, "topic": topic, "seq": seq,
            "broker_ts": at(when), "check_times": checks, "half_offset": None}  # fmt: skip


def op(msg_id: str, seq: int, half_offset: int, when: float) -> dict[str, Any]:
    return {"stream": "op", "msg_id": msg_id, "topic": "", "seq": seq,
            "broker_ts": at(when), "check_times": None, "half_offset": half_offset}  # fmt: skip


def write(path: Path, rows: list[dict[str, Any]], schema: pa.Schema) -> str:
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return str(path)


def model_b_inputs(folder: Path) -> tuple[str, str, str, int]:
    """Records, broker log and half/op log Parquet of a small model B night (paths), and
    how many broker and half/op entries they hold."""
    records = [  # committed local transactions
        {"transaction_id": f"tx-{m}", "producer_group": "orders", "msg_id": m, "created_at": at(t)}
        for m, t in [("m1", 10), ("m2", 20), ("m3", 30), ("m6", 3590), ("m7", 40)]
    ]
    log = [
        half("m1", "a", 1, 10), op("m1", 1, 1, 10.01),  # committed and delivered
        half("m2", "a", 2, 20), half("m2", "a", 8, 30, 1), half("m2", "a", 9, 40, 2),
        op("m2", 2, 9, 40.01),  # checked twice, put back twice, delivered twice
        half("m3", "a", 3, 30), half("m3", "a", 10, 50, 15),  # committed, then given up
        {**half("m3", "a", 1, 60, 15), "stream": "discarded", "half_offset": 10},
        half("m4", "a", 4, 35), op("m4", 3, 4, 35.01),  # rolled back
        half("m5", "a", 5, 36), op("m5", 4, 5, 36.01),  # rolled back, yet delivered
        half("m6", "a", 6, 3590),  # committed just before the end: pending, unresolved
        half("m7", "b", 7, 40), op("m7", 5, 7, 40.01),
    ]  # fmt: skip
    broker = [
        {"msg_id": m, "topic": t, "seq": str(i), "broker_ts": at(s)}
        for i, (m, t, s) in enumerate(
            [
                ("m1", "a", 10.01),
                ("m2", "a", 40.01),
                ("m2", "a", 40.02),
                ("m5", "a", 36.01),
                ("m7", "b", 40.01),
            ]
        )
    ]
    return (
        write(folder / "records.parquet", records, RECORDS),
        write(folder / "broker.parquet", broker, BROKER),
        write(folder / "halfop.parquet", log, HALFOP_LOG),
        len(broker) + len(log),
    )


def test_model_b_counts_from_records_halfs_ops_and_broker(
    spark: SparkSession, tmp_path: Path
) -> None:
    records, broker, halfop, entries = model_b_inputs(tmp_path)
    summary = reconcile(spark, records, broker, tmp_path / "out", WINDOW, halfop)
    total = summary["total"]
    common = ("committed", "delivered", "lost", "pending", "duplicated", "phantom", "dead")
    assert {k: total[k] for k in common} == {
        "committed": 5, "delivered": 3, "lost": 1, "pending": 1, "duplicated": 1, "phantom": 1,
        "dead": 0,
    }  # fmt: skip
    only_b = ("halfs", "half_writes", "ops", "checks", "unresolved", "discarded")
    assert {k: total[k] for k in only_b} == {
        "halfs": 7, "half_writes": 10, "ops": 5, "checks": 17, "unresolved": 1, "discarded": 1,
    }  # fmt: skip
    assert summary["topics"]["b"]["halfs"] == 1 and summary["topics"]["b"]["delivered"] == 1
    assert summary["model"] == "b" and abs(total["latency_max_ms"] - 20_010) < 1  # m2, put back
    # `outbox compare` carries them to its table; 17 check requests over 7 halfs
    shown = figures(RunResult("b", "REAL", T0, check_backs=17), summary, entries)
    assert (shown["unresolved"], shown["ops"], shown["check_backs_per_transaction"]) == (1, 5, 2.43)

    out = tmp_path / "out"
    found = spark.read.parquet(str(out / "discrepancies")).collect()
    assert {(r["msg_id"], r["kind"], r["details"]) for r in found} == {
        ("m2", "duplicated", "committed"),
        ("m3", "lost", "discarded"),
        ("m5", "phantom", "no ledger row"),
    }
    page = (out / "report.html").read_text()
    assert "model B" in page and "<th>unresolved</th>" in page
    assert json.loads((out / "summary.json").read_text())["total"]["checks"] == 17
