"""report.html in a browser: verdict in colour, the lost msg_ids listed, fits 1280 px,
escaped, charts with axes; discrepancies.csv the easy way to every finding."""

from __future__ import annotations

import csv
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from playwright.sync_api import Page
from pyspark.sql import SparkSession

from spark_jobs.reconciliation import FINDING_COLUMNS, reconcile
from spark_jobs.schema import BROKER, LEDGER
from spark_jobs.window import Window
from tests.browser import screenshot

T0 = datetime(2026, 3, 1, tzinfo=UTC)
WINDOW = Window(T0, T0 + timedelta(hours=1), sla_s=60)
HOSTILE = '<img src=x onerror="window.pwned=1">'  # a topic and a msg_id from the data
RED = "rgb(198, 40, 40)"  # spark_jobs.report.COLOURS["alarm"]


def row(msg_id: str, second: int, status: str = "sent", topic: str = "orders") -> dict[str, Any]:
    return {"id": second, "msg_id": msg_id, "topic": topic, "status": status,
            "created_at": T0 + timedelta(seconds=second), "sent_at": None, "attempts": 2,
            "receipt": None, "deliver_at": None}  # fmt: skip


def copy(msg_id: str, second: int, topic: str = "orders") -> dict[str, Any]:
    at = T0 + timedelta(seconds=second, milliseconds=8)
    return {"msg_id": msg_id, "topic": topic, "seq": str(second), "broker_ts": at,
            "key": None, "outbox_seq": None}  # fmt: skip


@pytest.fixture(scope="module")
def night(spark: SparkSession, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One small reconciled night: 300 delivered, 25 lost, a stuck one, a duplicate and
    two phantoms, one of them named like markup; its out/ folder."""
    tmp = tmp_path_factory.mktemp("night")
    delivered = [row(f"ok-{i}", 10 + i) for i in range(300)]
    lost = [row(f"lost-{i:02}", 400 + i) for i in range(25)]
    ledger = [*delivered, *lost, row("stuck-1", 500, "pending")]
    broker = [copy(r["msg_id"], r["id"]) for r in delivered]
    broker += [copy("ok-7", 900), copy("ghost-1", 600), copy(HOSTILE, 601, topic=HOSTILE)]
    pq.write_table(pa.Table.from_pylist(ledger, schema=LEDGER), tmp / "ledger.parquet")
    pq.write_table(pa.Table.from_pylist(broker, schema=BROKER), tmp / "broker.parquet")
    out = tmp / "out"
    reconcile(spark, str(tmp / "ledger.parquet"), str(tmp / "broker.parquet"), out, WINDOW)
    return out


def test_discrepancies_csv_lists_every_finding(night: Path) -> None:
    with (night / "discrepancies.csv").open(newline="") as f:
        found = list(csv.DictReader(f))
    assert tuple(found[0]) == FINDING_COLUMNS
    kinds = sorted({r["kind"] for r in found})
    assert kinds == ["duplicated", "lost", "phantom", "stuck"]
    assert len([r for r in found if r["kind"] == "lost"]) == 25  # all, not the first 20
    assert next(r for r in found if r["msg_id"] == HOSTILE)["topic"] == HOSTILE
    lost = next(r for r in found if r["msg_id"] == "lost-00")
    assert (lost["created_at"], lost["details"], lost["attempts"], lost["copies"]) == (
        "2026-03-01 00:06:40.000Z", "sent", "3", "0")  # fmt: skip


def test_discrepancies_csv_never_starts_a_cell_with_a_formula(
    spark: SparkSession, tmp_path: Path
) -> None:
    """A phantom's msg_id and topic come from the broker: =, +, -, @ (or a tab) first would
    be run by a spreadsheet opening the CSV. They get a leading apostrophe there only."""
    from spark_jobs.reconciliation import write_csv

    hostile = ['=HYPERLINK("http://evil.example","x")', "+1+cmd", "-2", "@SUM(A1)", "\tx"]
    rows = [{"kind": "phantom", "msg_id": v, "topic": v, "details": "no ledger row"}
            for v in [*hostile, "ok-1", "a=b"]]  # fmt: skip
    spark.createDataFrame(rows).write.parquet(str(tmp_path / "found"))
    write_csv(spark, tmp_path / "found", tmp_path / "found.csv")
    with (tmp_path / "found.csv").open(newline="") as f:
        cells = {r["msg_id"]: r["topic"] for r in csv.DictReader(f)}
    assert cells == {**{f"'{v}": f"'{v}" for v in hostile}, "ok-1": "ok-1", "a=b": "a=b"}
    kept = spark.read.parquet(str(tmp_path / "found")).select("msg_id").collect()
    assert {r["msg_id"] for r in kept} == {*hostile, "ok-1", "a=b"}


def test_report_in_a_browser(night: Path, page: Page, tmp_path: Path) -> None:
    page.goto((night / "report.html").as_uri())
    screenshot(page, tmp_path, "report")
    assert page.evaluate("document.documentElement.scrollWidth") <= 1280
    verdict = page.locator("#verdict")
    assert verdict.inner_text() == "DISCREPANCIES"
    assert verdict.evaluate("e => getComputedStyle(e).backgroundColor") == RED
    # the first 20 lost msg_ids of 25, by commit time, each with what the ledger knows
    lost = page.locator("table#lost tbody tr")
    assert lost.count() == 20
    assert lost.first.locator("td").all_inner_texts()[:5] == [
        "lost-00", "orders", "2026-03-01 00:06:40.000Z", "sent", "3"]  # fmt: skip
    assert page.get_by_text("lost-19", exact=True).is_visible()
    assert page.get_by_text("lost-20", exact=True).count() == 0
    assert "the first 20 of 25" in page.locator("#heading-lost").inner_text()
    assert page.locator("table#phantom tbody tr").count() == 2
    assert page.locator("table#stuck").get_by_text("stuck-1").is_visible()
    assert page.locator("table#duplicated").get_by_text("ok-7").is_visible()
    # markup in the data is shown as text, never run
    assert page.locator("table#phantom").get_by_text(HOSTILE).first.is_visible()
    assert page.evaluate("window.pwned") is None
    # human headers; charts with titled axes, counts on a log scale
    assert "stuck (pending past SLA)" in page.locator("table#counts thead").inner_text()
    kinds = page.evaluate("document.querySelector('#kinds-chart')._fullLayout.xaxis")
    assert kinds["type"] == "log" and kinds["title"]["text"] == "messages (log scale)"
    bars = page.locator("#kinds-chart .bars path")
    widths = [b["width"] for b in (bars.nth(i).bounding_box() for i in range(bars.count()))]
    assert bars.count() >= 5 and min(widths) > 20  # 1 stuck beside 300 delivered: visible
    latency = page.evaluate("document.querySelector('#latency-chart')._fullLayout")
    assert latency["xaxis"]["title"]["text"] == "due to broker latency"
    assert "≤10 ms" in page.locator("#latency-chart .xtick text").all_text_contents()
    # the link to every finding resolves to the CSV beside the page
    href = page.locator("a#csv").evaluate("a => a.href")
    assert Path(unquote(urlparse(href).path)) == night / "discrepancies.csv"
