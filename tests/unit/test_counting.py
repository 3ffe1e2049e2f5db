"""relay.cli.progress.Counting: the running totals of export and requeue, without a terminal."""

from __future__ import annotations

import io
import re

import pytest

from outbox.events import SweepResult
from relay.cli.progress import Counting, Progress


def lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_a_count_with_a_total_prints_running_totals() -> None:
    out = io.StringIO()
    shown = Counting("export ledger", 250, stream=out, every_s=0, tty=False)
    for n in (100, 100, 50):
        shown.add(n)
    shown.close()
    found = [re.fullmatch(r"export ledger: (\d+)/250 \(.* rows/s\)", line) for line in lines(out)]
    assert all(found), lines(out)
    assert [int(m[1]) for m in found if m] == [100, 200, 250]


def test_a_count_without_a_total_shows_count_and_unit() -> None:
    out = io.StringIO()
    shown = Counting("export broker", stream=out, every_s=0, tty=False)
    shown.add(7)
    shown.add(3)
    shown.close()
    assert [line.partition(" (")[0] for line in lines(out)] == [
        "export broker: 7 rows",
        "export broker: 10 rows",
    ]


def test_a_count_past_its_total_raises_the_total() -> None:
    out = io.StringIO()
    shown = Counting("requeue", 5, stream=out, every_s=0, tty=False)
    shown.add(8)
    assert shown.total == 8 and lines(out)[0].startswith("requeue: 8/8 ")


def test_lines_come_at_most_every_interval() -> None:
    out = io.StringIO()
    shown = Counting("export ledger", 1000, stream=out, every_s=3600, tty=False)
    for _ in range(10):
        shown.add(100)
    assert out.getvalue() == ""  # the first line is due after an hour
    assert shown.done == 1000


def test_drain_keeps_its_line() -> None:
    out = io.StringIO()
    shown = Progress("drain", 10, stream=out, every_s=0, tty=False)
    shown.add(SweepResult(4, 3, 1, 0))
    assert re.fullmatch(r"drain: 4/10 sent=3 retry_later=1 dead=0 \(.* msg/s\)\n", out.getvalue())


def test_a_terminal_without_a_total_shows_count_and_rate() -> None:
    out = io.StringIO()
    shown = Counting("export broker", stream=out, tty=True)
    shown.add(40)
    shown.add(50)
    shown.close()
    assert re.search(r"export broker: 90 rows \[.* rows/s\]", out.getvalue()), out.getvalue()


def test_log_lines_under_the_bar_keep_the_handlers_filters(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The CLI's Scrubber is a filter on the stderr handler: a line logged while the bar
    shows must still go through it (tqdm's redirect swaps the handler). A guard: tqdm
    4.70 keeps the filters itself, releases before 4.68 dropped them."""
    import logging
    import sys

    from relay.cli.progress import Display

    class Hide(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            record.msg = str(record.msg).replace("s3cret", "***")
            return True

    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(Hide())
    root.addHandler(handler)
    try:
        display = Display("drain", 10, "msg", stream=io.StringIO(), tty=True)
        logging.getLogger("relay.cli").warning("password s3cret refused")
        display.close()
    finally:
        root.removeHandler(handler)
    err = capsys.readouterr().err
    assert "password *** refused" in err and "s3cret" not in err
