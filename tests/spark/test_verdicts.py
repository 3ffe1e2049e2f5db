"""Verdicts that explain: dead and blocked messages in the step line, summary and report
(a blocked row names the dead head holding it), publish attempts as the relay made them,
and topic names that wrap only at their dots, read in Chromium."""

from __future__ import annotations

import csv
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from playwright.sync_api import Page
from pyspark.sql import SparkSession

from relay import export
from spark_jobs.reconciliation import reconcile
from spark_jobs.schema import BROKER
from spark_jobs.window import Window
from tests.browser import screenshot
from tests.helpers import migrated
from tests.planting import plant

T0 = datetime(2026, 3, 1, tzinfo=UTC)
WINDOW = Window(T0, T0 + timedelta(hours=1), sla_s=60)
# A topic longer than its column: it may wrap after a dot, never inside a part.
LONG = "warehouse.inventory_stock_level_adjustments_recorded_by_the_night_shift.v2"
# Each dot-separated word of a topic cell: (word, how many line boxes its text takes).
WORD_LINES = """cell => {
  const words = [];
  const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    for (const m of node.data.matchAll(/[^.]+/g)) {
      const range = document.createRange();
      range.setStart(node, m.index);
      range.setEnd(node, m.index + m[0].length);
      words.push([m[0], range.getClientRects().length]);
    }
  }
  return words;
}"""


def at(minutes: float) -> datetime:
    return T0 + timedelta(minutes=minutes)


class Night:
    """The reconciled night: its out/ folder, the planted msg_ids by name, step lines."""

    def __init__(self, out: Path, ids: dict[str, str], steps: list[str], ledger: Path) -> None:
        self.out, self.ids, self.steps, self.ledger = out, ids, steps, ledger


@pytest.fixture(scope="module")
def night(spark: SparkSession, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Night]:
    """From the table: key k1 of LONG has seq 1 delivered, seq 2 dead, seqs 3-5 pending
    behind it (blocked, past the SLA: stuck); k2's only row is stuck, not blocked. On
    "orders": a dead unordered row, a sent row delivered twice after 2 failed attempts,
    a sent row never at the broker (lost). Exported, then reconciled."""
    tmp = tmp_path_factory.mktemp("verdicts")
    with migrated(f"sqlite:///{tmp}/outbox.sqlite") as engine:
        ids = {
            "k1-1": plant(engine, LONG, key="k1", seq=1, status="sent", created_at=at(1)),
            "k1-2": plant(
                engine, LONG, key="k1", seq=2, status="dead", attempts=3, created_at=at(2)
            ),
            **{
                f"k1-{s}": plant(engine, LONG, key="k1", seq=s, created_at=at(s)) for s in (3, 4, 5)
            },
            "k2-1": plant(engine, LONG, key="k2", seq=1, created_at=at(6)),
            "dead": plant(engine, "orders", status="dead", attempts=20, created_at=at(7)),
            "twice": plant(engine, "orders", status="sent", attempts=2, created_at=at(8)),
            "lost": plant(engine, "orders", status="sent", created_at=at(9)),
        }
        ledger = tmp / "ledger.parquet"
        assert export.export_ledger(engine, ledger) == len(ids)

    def copy(name: str, topic: str, minutes: float, key: str | None = None) -> dict[str, Any]:
        return {"msg_id": ids[name], "topic": topic, "seq": str(minutes),
                "broker_ts": at(minutes + 0.01), "key": key,
                "outbox_seq": 1 if key else None}  # fmt: skip

    broker = [copy("k1-1", LONG, 1, "k1"), copy("twice", "orders", 8), copy("twice", "orders", 9)]
    pq.write_table(pa.Table.from_pylist(broker, schema=BROKER), tmp / "broker.parquet")
    steps: list[str] = []
    out = tmp / "out"
    reconcile(spark, str(ledger), str(tmp / "broker.parquet"), out, WINDOW, step=steps.append)
    yield Night(out, ids, steps, ledger)


def head_of(night: Night) -> str:
    return f"{night.ids['k1-2']} ({LONG}/k1 seq 2)"


def test_the_ledger_export_carries_key_and_seq(night: Night) -> None:
    rows = {r["msg_id"]: r for r in pq.read_table(night.ledger).to_pylist()}
    assert (rows[night.ids["k1-4"]]["key"], rows[night.ids["k1-4"]]["seq"]) == ("k1", 4)
    assert (rows[night.ids["dead"]]["key"], rows[night.ids["dead"]]["seq"]) == (None, None)


def test_the_summary_and_step_line_count_dead_and_blocked(night: Night) -> None:
    import json

    total = json.loads((night.out / "summary.json").read_text())["total"]
    assert (total["dead"], total["blocked"], total["stuck"]) == (2, 3, 4)
    assert json.loads((night.out / "summary.json").read_text())["topics"][LONG]["blocked"] == 3
    joined = next(line for line in night.steps if line.startswith("joined"))
    assert "2 dead (3 pending behind a dead one of their key)" in joined


def test_blocked_findings_name_their_dead_head(night: Night) -> None:
    with (night.out / "discrepancies.csv").open(newline="") as f:
        found = list(csv.DictReader(f))
    blocked = sorted((r["msg_id"], r["key"], r["seq"], r["details"])
                     for r in found if r["kind"] == "blocked")  # fmt: skip
    assert blocked == [(night.ids[f"k1-{s}"], "k1", str(s), f"behind dead {head_of(night)}")
                       for s in (3, 4, 5)]  # fmt: skip
    # publish attempts: the failed ones recorded, and the acked one of a row marked sent
    attempts = {(r["kind"], r["msg_id"]): r["attempts"] for r in found}
    assert attempts[("lost", night.ids["lost"])] == "1"
    assert attempts[("duplicated", night.ids["twice"])] == "3"
    assert attempts[("dead", night.ids["k1-2"])] == "3"


def test_the_report_explains_dead_and_blocked(night: Night, page: Page, tmp_path: Path) -> None:
    page.goto((night.out / "report.html").as_uri())
    screenshot(page, tmp_path, "verdicts")
    assert page.locator("#verdict").inner_text() == "DISCREPANCIES"
    why = page.locator("#verdict-dead").inner_text()
    assert why.startswith("2 dead (given up by the relay") and "3 blocked (pending behind" in why
    # each blocked row says which dead head holds it
    blocked = page.locator("table#blocked tbody tr")
    assert blocked.count() == 3
    for i, seq in enumerate((3, 4, 5)):
        cells = blocked.nth(i).locator("td").all_inner_texts()
        assert cells[0] == night.ids[f"k1-{seq}"] and cells[2:4] == ["k1", str(seq)]
        assert cells[-1] == f"behind dead {head_of(night)}"
    dead = page.locator("table#dead tbody tr").first.locator("td").all_inner_texts()
    assert (dead[0], dead[2], dead[3], dead[-1]) == (night.ids["k1-2"], "k1", "2", "3")
    # publish attempts of sent rows: 1 for one acked at once, 3 after two failures
    assert page.locator("table#lost tbody td").all_inner_texts()[4] == "1"
    assert page.locator("table#duplicated tbody td").all_inner_texts()[4] == "3"
    headers = page.locator("table#counts thead tr").nth(1).locator("th").all_inner_texts()
    long_row = page.locator("table#counts tbody tr").filter(has_text="night_shift")
    figures = long_row.locator("td").all_inner_texts()[1:]
    assert figures[headers.index("blocked (of those, behind a dead row)")] == "3"
    assert page.evaluate("document.documentElement.scrollWidth") <= 1280


def test_topic_names_wrap_only_at_dots(night: Night, page: Page) -> None:
    page.goto((night.out / "report.html").as_uri())
    cells = [page.locator("table#counts tbody td.name").filter(has_text="night_shift"),
             page.locator("table#blocked tbody td").nth(1)]  # fmt: skip
    for cell in cells:
        assert cell.inner_text() == LONG
        words = cell.evaluate(WORD_LINES)
        assert [w for w, _ in words] == LONG.split(".")
        assert all(lines == 1 for _, lines in words), words
    # the counts' column is narrower than the name: it does wrap, after a dot
    box = cells[0].locator("span.topic").bounding_box()
    line = cells[0].locator("span.part").first.bounding_box()
    assert box is not None and line is not None and box["height"] > 1.5 * line["height"]
