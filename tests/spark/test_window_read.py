"""The nightly job over a table holding a year reads the night's rows only (issue #27)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyspark.sql import DataFrame, SparkSession

from relay import cli
from spark_jobs.ledger import count_ledger, id_bounds, read_ledger
from spark_jobs.reconciliation import reconcile
from tests.spark.nights import EXPECTED, READ, WINDOW, fill_year, night_broker_log


@pytest.fixture
def year(pg_url: str) -> str:
    fill_year(pg_url)
    return pg_url


def plan_of(frame: DataFrame) -> str:
    return str(frame._jdf.queryExecution().executedPlan().toString())


def test_jdbc_reads_the_window_between_its_own_ids(spark: SparkSession, year: str) -> None:
    ledger = read_ledger(spark, year, WINDOW)
    ids = sorted(r["id"] for r in ledger.select("id").collect())
    assert len(ids) == READ == count_ledger(spark, year, ledger, WINDOW)  # not 1,662
    assert id_bounds(spark, year, WINDOW) == (ids[0], ids[-1])  # the partitions' range
    assert "WHERE (created_at >= TIMESTAMPTZ '2025-06-30T23:00:00+00:00'" in plan_of(ledger)


def test_parquet_by_day_prunes_to_the_window_days(
    spark: SparkSession, year: str, tmp_path: Path
) -> None:
    by_day, flat = tmp_path / "ledger", tmp_path / "ledger.parquet"
    assert cli.main(["export", "ledger", "--db", year, "--out", str(by_day), "--by-day"]) == 0
    assert cli.main(["export", "ledger", "--db", year, "--out", str(flat)]) == 0
    assert (by_day / "day=2025-07-01").is_dir() and len(list(by_day.iterdir())) == 365

    ledger = read_ledger(spark, str(by_day), WINDOW)
    plan = plan_of(ledger)
    assert "PartitionFilters: [isnotnull(day" in plan and "2025-06-30" in plan, plan
    assert ledger.count() == READ == read_ledger(spark, str(flat), WINDOW).count()
    assert read_ledger(spark, str(flat)).count() == 1_662  # no window: all of it


def test_windowed_reads_give_the_whole_tables_summary(
    spark: SparkSession, year: str, tmp_path: Path
) -> None:
    """The late delivery (lookback) and the long-scheduled one are no phantoms."""
    broker = night_broker_log(tmp_path / "broker.parquet")
    flat = tmp_path / "ledger.parquet"
    assert cli.main(["export", "ledger", "--db", year, "--out", str(flat)]) == 0
    total = reconcile(spark, year, broker, tmp_path / "jdbc", WINDOW)["total"]
    assert {k: total[k] for k in EXPECTED} == EXPECTED
    assert reconcile(spark, str(flat), broker, tmp_path / "flat", WINDOW)["total"] == total
