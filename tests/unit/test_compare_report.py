"""`outbox compare`'s side-by-side table: model B's own figures, "n/a" in model A's column."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from relay.compare import report
from relay.compare.run import RunResult
from relay.compare.workload import Workload

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
        assert report.cells(label[key], a, b) in text


def test_no_halfs_no_ratio() -> None:
    b = report.figures(RunResult("b", "CMP_B", T0), summary(halfs=0), 0)
    assert b["check_backs_per_transaction"] is None
    assert report.shown(b, "check_backs_per_transaction") == "-"
