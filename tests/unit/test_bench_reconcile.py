"""bench/reconcile.py's table: rates per core, the ratio to local[2], the exactness check."""

from __future__ import annotations

from bench.reconcile import HEADER, Run, exact, table

FOUND = {"committed": 10, "delivered": 7, "lost": 2, "pending": 1, "duplicated": 1, "phantom": 1}
EXPECTED: dict[str, object] = {**FOUND, "window": {}}


def test_rows_per_core_and_the_ratio_to_local_2() -> None:
    runs = [
        Run("local[1]", 1, 50.0, True, cpu_s=49.6, driver_jvm_mib=700.4),
        Run("local[2]", 2, 25.0, True),
        Run("cluster", 2, 30.0, False, executor_mib=900.0),
    ]
    header, one, two, cluster = table(1_000_000, runs)
    assert header == HEADER
    assert one == ("local[1]", "1", "50.0", "20,000", "20,000", "50", "700", "-", "-",
                   "2.00x", "yes")  # fmt: skip
    assert two[3:5] == ("40,000", "20,000") and two[9] == "1.00x"
    assert cluster[8:] == ("900", "1.20x", "NO")


def test_no_ratio_without_local_2() -> None:
    (_, row) = table(100, [Run("duckdb", 2, 2.0, True)])
    assert row[9] == "-"


def test_exact_means_every_injected_count_found() -> None:
    assert exact(FOUND, EXPECTED)
    assert not exact({**FOUND, "lost": 3}, EXPECTED)
    assert not exact({**FOUND, "phantom": 0}, EXPECTED)


def test_a_failed_run_shows_no_figures() -> None:
    (_, failed, two) = table(100, [Run("local[2]", 2, 9.0, False, failed=True),
                                   Run("cluster", 2, 3.0, True)])  # fmt: skip
    assert failed == ("local[2]", "2", *["-"] * 8, "FAILED")
    assert two[9] == "-"  # no ratio to a failed run
