"""`outbox compare`'s side-by-side table: model B's own figures, "n/a" in model A's column;
compare.html in a browser."""

from __future__ import annotations

from datetime import UTC, datetime
from itertools import pairwise
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
from playwright.sync_api import FloatRect, Page

from relay.lab.compare import report
from relay.lab.compare.run import RunResult
from relay.lab.compare.workload import Workload
from spark_jobs.reconciliation import histogram_labels
from spark_jobs.report import write_report
from tests.browser import screenshot

T0 = datetime(2026, 3, 1, tzinfo=UTC)


def summary(**total: int) -> dict[str, object]:
    return {"total": {"committed": 100, "delivered": 100, **total}, "latency_histogram": []}


def both_models() -> dict[str, dict[str, object]]:
    a = RunResult("a", "CMP_A", T0, statements=300)
    b = RunResult("b", "CMP_B", T0, check_backs=37, op_log_bytes=20_480, half_retries=4)
    counts = {"halfs": 30, "ops": 28, "unresolved": 2, "discarded": 0, "checks": 37}
    return {
        "a": report.figures(a, summary(), 100),
        "b": report.figures(b, summary(**counts), 160),
    }


def test_model_b_figures_are_carried_from_the_reconciliation_and_the_run() -> None:
    models = both_models()
    b = models["b"]
    assert (b["unresolved"], b["ops"], b["op_log_bytes"]) == (2, 28, 20_480)
    assert b["check_backs_per_transaction"] == 1.23  # 37 check requests / 30 halfs
    assert b["half_retries"] == 4
    assert not {"unresolved", "check_backs_per_transaction", "op_log_bytes", "half_retries"} & set(
        models["a"]
    )


def test_the_terminal_table_shows_them_and_n_a_for_model_a(
    capsys: pytest.CaptureFixture[str],
) -> None:
    report.print_table(both_models(), Workload(transactions=30))
    lines = capsys.readouterr().out.splitlines()
    expected = [
        "| check-backs (B) | n/a | 37 |",
        "| check-backs per transaction (B: check requests / halfs) | n/a | 1.23 |",
        "| unresolved halfs (B: neither an op nor a discard at the end) | n/a | 2 |",
        "| op messages (B) | n/a | 28 |",
        "| op log bytes (B) | n/a | 20480 |",
        "| half sends retried (B) | n/a | 4 |",
        "| lost | - | - |",  # not in these summaries: "-", not "n/a"
    ]
    assert set(expected) <= set(lines), lines


def test_the_page_shows_them_and_n_a_for_model_a(tmp_path: Path) -> None:
    page = tmp_path / "compare.html"
    report.write_html(page, both_models(), Workload(transactions=30))
    text = page.read_text()
    label = dict(report.ROWS)
    for key, a, b in [
        ("unresolved", "n/a", "2"),
        ("check_backs_per_transaction", "n/a", "1.23"),
        ("op_log_bytes", "n/a", "20480"),
    ]:
        assert f'<td class="text">{label[key]}</td><td>{a}</td><td>{b}</td>' in text


def histogram(**counts: int) -> list[tuple[str, int]]:
    """Every latency bucket, the named ones (``le_10`` for "<=10") with these counts."""
    return [(label, counts.get(label.replace("<=", "le_").replace(">", "gt_"), 0))
            for label in histogram_labels()]  # fmt: skip


def test_compare_page_in_a_browser(page: Page, tmp_path: Path) -> None:
    """Both histograms on one scale, readable x labels, the models' reports linked both
    ways, the verdicts in colour, 1280 px wide."""
    models = both_models()
    models["a"]["latency_histogram"] = histogram(le_10=73, le_20=5)
    models["b"]["latency_histogram"] = histogram(le_10=119, le_50=3, gt_60000=1)
    models["b"]["lost"] = 1  # model B lost one: DISCREPANCIES in red beside A's OK
    for m in ("a", "b"):
        folder = tmp_path / m / "report"
        folder.mkdir(parents=True)
        summary = {"total": models[m], "topics": {}, "latency_histogram": []}
        write_report(folder / "report.html", summary, links=[report.BACK])
    report.write_html(tmp_path / "compare.html", models, Workload(transactions=30))

    page.goto((tmp_path / "compare.html").as_uri())
    screenshot(page, tmp_path, "compare")
    assert page.evaluate("document.documentElement.scrollWidth") <= 1280
    colour = "e => getComputedStyle(e).backgroundColor"
    assert page.locator("#verdict-a").evaluate(colour) == "rgb(26, 127, 55)"  # OK: green
    assert page.locator("#verdict-b").evaluate(colour) == "rgb(198, 40, 40)"  # red
    ranges = [
        page.evaluate(f"document.querySelector('#chart-{m}')._fullLayout.yaxis.range")
        for m in ("a", "b")
    ]
    assert ranges[0] == ranges[1]
    tallest = [bar_heights(page, m)[3] for m in ("a", "b")]  # the "≤10 ms" bars, 73 and 119
    assert 0 < tallest[0] < tallest[1]
    for m in ("a", "b"):
        ticks = page.locator(f"#chart-{m} .xtick text")
        assert ticks.all_text_contents()[3] == "≤10 ms"
        boxes = [ticks.nth(i).bounding_box() for i in range(ticks.count())]
        assert all(not overlap(one, two) for one, two in pairwise(boxes)), boxes
    # each model's report is linked, and links back: every link resolves to a file
    assert page_links(page) == {tmp_path / m / "report" / "report.html" for m in ("a", "b")}
    page.goto((tmp_path / "a" / "report" / "report.html").as_uri())
    assert page_links(page) == {tmp_path / "compare.html"}


def bar_heights(page: Page, model: str) -> list[float]:
    bars = page.locator(f"#chart-{model} .bars .point path")
    return [(bars.nth(i).bounding_box() or {"height": 0.0})["height"] for i in range(bars.count())]


def overlap(one: FloatRect | None, two: FloatRect | None) -> bool:
    assert one and two
    apart_x = one["x"] + one["width"] <= two["x"] or two["x"] + two["width"] <= one["x"]
    apart_y = one["y"] + one["height"] <= two["y"] or two["y"] + two["height"] <= one["y"]
    return not (apart_x or apart_y)


def page_links(page: Page) -> set[Path]:
    """The files a page's links point at, each checked to exist."""
    hrefs = page.evaluate("[...document.querySelectorAll('a[href]')].map(a => a.href)")
    files = {Path(unquote(urlparse(href).path)).resolve() for href in hrefs}
    assert all(f.is_file() for f in files), files
    return files


def test_no_halfs_no_ratio() -> None:
    b = report.figures(RunResult("b", "CMP_B", T0), summary(halfs=0), 0)
    assert b["check_backs_per_transaction"] is None
    assert report.shown(b, "check_backs_per_transaction") == "-"
