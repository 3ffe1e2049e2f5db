"""Failures grouped by reason: what `outbox drain` and `outbox relay` print under their counts."""

from __future__ import annotations

import io
from collections import Counter

from outbox.events import Failed, SweepResult
from relay.cli.progress import Progress
from relay.cli.run import REASONS_SHOWN, reason_lines
from relay.fastpath.batches import BatchReport
from relay.sweep.sweeper import REASON_CHARS, reason, sweep_result


def test_a_reason_is_one_line_cut() -> None:
    assert reason("permanent: too large\n  Traceback ...") == "permanent: too large"
    assert reason("retry:  timed   out ") == "retry: timed out"
    long = reason("permanent: " + "x" * 500)
    assert len(long) == REASON_CHARS and long.endswith("...")
    assert reason("") == "(no error text)"


def test_a_batch_counts_its_failures_by_reason() -> None:
    report = BatchReport(
        retried=[Failed(f"r{i}", "t", 1, "retry: nacked") for i in range(2)],
        dead=[Failed(f"d{i}", "t", 3, "permanent: too large") for i in range(5)],
    )
    result = sweep_result(report)
    assert (result.claimed, result.failed, result.dead) == (7, 2, 5)
    assert result.retry_reasons == Counter({"retry: nacked": 2})
    assert result.dead_reasons == Counter({"permanent: too large": 5})
    assert reason_lines(result) == [
        "  5 x permanent: too large (dead)",
        "  2 x retry: nacked (retry later)",
    ]


def test_a_later_pass_counts_each_row_by_its_last_outcome() -> None:
    """A drain's second pass retries the rows the first left: their reasons are replaced,
    the dead ones add up."""
    shown = Progress("drain", 10, stream=io.StringIO(), tty=False)
    shown.add(SweepResult(10, 4, 6, 0, retry_reasons=Counter({"retry: nacked": 6})))
    shown.next_pass()
    again = SweepResult(
        6, 3, 1, 2,
        retry_reasons=Counter({"retry: nacked": 1}),
        dead_reasons=Counter({"permanent: refused": 2}),
    )  # fmt: skip
    shown.add(again)
    both = shown.result()
    assert (both.claimed, both.sent, both.failed, both.dead) == (10, 7, 1, 2)
    assert both.retry_reasons == Counter({"retry: nacked": 1})
    assert both.dead_reasons == Counter({"permanent: refused": 2})


def test_many_reasons_are_cut_to_the_commonest() -> None:
    result = SweepResult(
        dead_reasons=Counter({f"permanent: reason {i}": 100 - i for i in range(REASONS_SHOWN + 3)})
    )
    lines = reason_lines(result)
    assert lines[0] == "  100 x permanent: reason 0 (dead)"
    assert len(lines) == REASONS_SHOWN + 1 and "3 more reason(s)" in lines[-1]


def test_the_bar_shows_round_counts_as_numbers() -> None:
    """tqdm formats a number postfix its own way: a round 30000 came out as 3e+4."""
    stream = io.StringIO()
    shown = Progress("drain", 30_000, stream=stream, tty=True)
    shown.add(SweepResult(claimed=30_000, sent=30_000))
    shown.close()
    assert "sent=30000" in stream.getvalue() and "e+" not in stream.getvalue()
