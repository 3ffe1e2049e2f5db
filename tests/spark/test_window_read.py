"""The nightly job over a table holding a year reads the night's rows only (issue #27), and
gives what a read of the whole ledger gives."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from sqlalchemy import text

from outbox.engines import engine_from
from relay import cli
from relay.testing import scratch_schema
from spark_jobs.ledger import count_ledger, created_sql, id_bounds, read_ledger, window_sql
from spark_jobs.reconcile_job import check_inputs
from spark_jobs.reconciliation import classify, reconcile, summarise
from spark_jobs.schema import BROKER
from spark_jobs.window import Window
from tests.conftest import PG_URL
from tests.spark.nights import (
    ALL,
    EXPECTED,
    NIGHT,
    READ,
    WINDOW,
    fill_year,
    msg,
    night_broker_log,
)


@pytest.fixture(scope="module")
def year() -> Iterator[str]:
    """The year's ledger, shared by this file's tests (none writes to it)."""
    with scratch_schema(PG_URL, "year") as db:
        fill_year(db)
        yield db


@pytest.fixture(scope="module")
def exports(year: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The year exported flat and by day, and the night's broker log."""
    folder = tmp_path_factory.mktemp("exports")
    by_day, flat = folder / "ledger", folder / "ledger.parquet"
    assert cli.main(["export", "ledger", "--db", year, "--out", str(by_day), "--by-day"]) == 0
    assert cli.main(["export", "ledger", "--db", year, "--out", str(flat)]) == 0
    broker = night_broker_log(folder / "broker.parquet")
    return {"by_day": str(by_day), "flat": str(flat), "broker": broker}


def plan_of(frame: DataFrame) -> str:
    return str(frame._jdf.queryExecution().executedPlan().toString())


def test_jdbc_reads_the_window_between_its_own_ids(spark: SparkSession, year: str) -> None:
    ledger = read_ledger(spark, year, WINDOW)
    assert ledger.count() == READ == count_ledger(spark, year, ledger, WINDOW)  # not ALL
    # the partitions' range: the ids of the rows created in the span, not of those due in it
    span = (F.col("created_at") >= WINDOW.ledger_from) & (F.col("created_at") < WINDOW.ledger_until)
    created = sorted(r["id"] for r in ledger.where(span).select("id").collect())
    assert id_bounds(spark, year, WINDOW) == (created[0], created[-1])
    assert len(created) == READ - 2  # the 2 due in the span, out of that range, read too
    plan = plan_of(ledger)
    assert "WHERE (created_at >= TIMESTAMPTZ '2025-06-30T23:00:00+00:00'" in plan
    assert f"AND id >= {created[0]}) OR (deliver_at >= " in plan


def test_bounds_and_count_read_the_window_indexes(year: str) -> None:
    """Migration 0007's BRIN index on created_at and partial index on deliver_at."""
    engine = engine_from(year)
    with engine.connect() as conn:
        conn.execute(text("SET LOCAL enable_seqscan = off"))

        def plan(sql: str) -> str:
            return "\n".join(r[0] for r in conn.execute(text(f"EXPLAIN {sql}")))

        bounds = plan(f"SELECT min(id), max(id) FROM outbox_message{created_sql(WINDOW)}")
        counted = plan(f"SELECT count(*) FROM outbox_message{window_sql(WINDOW)}")
    engine.dispose()
    assert "ix_outbox_message_created_brin" in bounds, bounds
    assert "ix_outbox_message_created_brin" in counted, counted
    assert "ix_outbox_message_scheduled" in counted, counted


def test_parquet_by_day_prunes_to_the_window_days(
    spark: SparkSession, exports: dict[str, str]
) -> None:
    by_day = Path(exports["by_day"])
    assert (by_day / "day=2025-07-01").is_dir() and len(list(by_day.iterdir())) == 365
    assert [p.name for p in (by_day / "day=2025-07-01").iterdir()] == ["part-00000.parquet"]

    ledger = read_ledger(spark, str(by_day), WINDOW)
    plan = plan_of(ledger)
    assert "PartitionFilters: [isnotnull(day" in plan and "2025-06-30" in plan, plan
    # the rows due in the span, whatever their day: scheduled earlier, or committed after
    assert ledger.count() == READ == read_ledger(spark, exports["flat"], WINDOW).count()
    assert read_ledger(spark, exports["flat"]).count() == ALL  # no window: all of it


def without_window(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if k != "window"}


def test_windowed_reads_give_the_whole_ledgers_summary(
    spark: SparkSession, year: str, exports: dict[str, str], tmp_path: Path
) -> None:
    """The late deliveries (one within --lookback, one committed 2 h before the window:
    looked up by msg_id) and the long-scheduled message are no phantoms: over JDBC, flat
    and by day, as over the whole ledger."""
    assert WINDOW.lookback_s == 3600
    broker = exports["broker"]
    whole = summarise(classify(read_ledger(spark, year), spark.read.parquet(broker), WINDOW))
    jdbc = without_window(reconcile(spark, year, broker, tmp_path / "jdbc", WINDOW))
    assert jdbc == whole
    assert {k: whole["total"][k] for k in EXPECTED} == EXPECTED
    found = spark.read.parquet(str(tmp_path / "jdbc" / "discrepancies"))
    phantoms = [r["msg_id"] for r in found.where("kind = 'phantom'").collect()]
    assert sorted(phantoms) == [msg(90_000), msg(90_001)]  # not msg(20_002)
    for name in ("flat", "by_day"):
        summary = reconcile(spark, exports[name], broker, tmp_path / name, WINDOW)
        assert without_window(summary) == whole, name


def test_past_the_lookup_cap_the_results_are_the_same(
    spark: SparkSession,
    year: str,
    exports: dict[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Many phantom candidates: no broadcast, the found ones dropped by a shuffled join."""
    from spark_jobs import ledger

    broker = exports["broker"]
    whole = summarise(classify(read_ledger(spark, year), spark.read.parquet(broker), WINDOW))
    monkeypatch.setattr(ledger, "LOOKUP_CAP", 0)
    for name, source in (("jdbc", year), ("flat", exports["flat"])):
        summary = reconcile(spark, source, broker, tmp_path / name, WINDOW)
        assert without_window(summary) == whole, name


def test_an_empty_by_day_export_reconciles_to_zeros(
    spark: SparkSession, year: str, tmp_path: Path
) -> None:
    ledger, broker = tmp_path / "ledger", tmp_path / "broker.parquet"
    since, until = (NIGHT + timedelta(days=400)).isoformat(), (NIGHT + timedelta(days=401))
    flags = ["--out", str(ledger), "--by-day", "--since", since, "--until", until.isoformat()]
    assert cli.main(["export", "ledger", "--db", year, *flags]) == 0
    assert ledger.is_dir() and not any(ledger.iterdir())
    pq.write_table(pa.Table.from_pylist([], schema=BROKER), broker)
    window = Window(NIGHT + timedelta(days=400), until)
    check_inputs(str(ledger), str(broker), None, str(tmp_path / "out"))
    total = reconcile(spark, str(ledger), str(broker), tmp_path / "out", window)["total"]
    assert total["committed"] == total["phantom"] == total["lost"] == 0
    assert (tmp_path / "out" / "report.html").exists()


def test_phantom_candidates_are_found_in_the_whole_ledger(
    spark: SparkSession, year: str, exports: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """By msg_id batches, by the join past the cap (JDBC), by the semi-join (Parquet)."""
    from spark_jobs import ledger

    candidates = spark.createDataFrame([(msg(20_002),), (msg(90_000),), ("x'y",)], "msg_id string")

    def found(source: str) -> list[str]:
        frame = ledger.committed_outside(spark, source, candidates, WINDOW)
        return sorted(r["msg_id"] for r in frame.collect()) if frame is not None else []

    assert found(year) == found(exports["flat"]) == found(exports["by_day"]) == [msg(20_002)]
    monkeypatch.setattr(ledger, "LOOKUP_CAP", 1)
    assert found(year) == [msg(20_002)]
    assert ledger.committed_outside(spark, year, candidates.limit(0), WINDOW) is None
