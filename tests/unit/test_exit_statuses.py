"""Exit statuses mean one thing each: one table, shown by `outbox --help` and the README."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from outbox.events import SweepResult
from relay.cli import build_parser
from relay.cli.common import (
    EXIT_DATA,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_STATUSES,
    EXIT_STUCK,
    EXIT_USAGE,
    exit_statuses_text,
)
from relay.cli.run import drain_status
from spark_jobs import reconcile_job

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_five_codes_are_distinct() -> None:
    assert len({EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_DATA, EXIT_STUCK}) == 5
    assert EXIT_USAGE == 2  # argparse's own, for the errors it finds itself


def test_help_ends_with_the_table() -> None:
    help_text = build_parser().format_help()
    assert help_text.rstrip().endswith(exit_statuses_text())
    for code, _ in EXIT_STATUSES:
        assert f"\n  {code} " in help_text


def test_readme_lists_the_same_table() -> None:
    rows = re.findall(r"^\| ([0-9, ]+) \| (.+) \|$", README.read_text(), flags=re.M)
    assert tuple(rows) == EXIT_STATUSES


def test_the_spark_job_alerts_with_the_data_code() -> None:
    # The job imports neither outbox nor relay (spark-submit ships it alone): same number.
    assert reconcile_job.EXIT_DISCREPANCY == EXIT_DATA
    assert reconcile_job.EXIT_STUCK == EXIT_STUCK
    assert reconcile_job.EXIT_FAILED == EXIT_FAILED


@pytest.mark.parametrize(
    ("result", "status"),
    [
        (SweepResult(claimed=5, sent=5), EXIT_OK),
        (SweepResult(claimed=5, sent=3, failed=2), EXIT_FAILED),
        (SweepResult(claimed=5, sent=5, aborted=True), EXIT_FAILED),
        (SweepResult(claimed=5, sent=4, dead=1), EXIT_DATA),
        (SweepResult(claimed=5, sent=2, failed=2, dead=1), EXIT_DATA),
    ],
    ids=["all-sent", "failing", "broker-gone", "dead", "dead-and-failing"],
)
def test_drain_status(result: SweepResult, status: int) -> None:
    assert drain_status(result) == status
