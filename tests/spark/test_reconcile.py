"""The reconciliation finds every injected fault and nothing else."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from spark_jobs import reconciliation
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
    assert "DISCREPANCIES" in page and page.count("<svg") == 2


def test_clean_run_passes(spark: SparkSession, tmp_path: Path) -> None:
    _, summary = reconcile(spark, tmp_path, Plan(rows=2_000, pending=3))
    assert (summary["total"]["lost"], summary["total"]["phantom"], summary["total"]["pending"]) == (
        0,
        0,
        3,
    )
    assert "OK" in (tmp_path / "out" / "report.html").read_text()
