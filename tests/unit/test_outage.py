"""relay.outage.Outage: one line when an outage starts, a summary every interval, one at the end."""

from __future__ import annotations

import logging

import pytest

from relay.outage import Outage


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_an_outage_of_a_minute_is_a_handful_of_lines(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    outage = Outage("broker", logging.getLogger("t.outage"), every_s=30, clock=clock)
    caplog.set_level(logging.INFO, "t.outage")
    for _ in range(360):  # six failures a second for a minute
        outage.failed("connect failed (ConnectionRefusedError)")
        clock.now += 1 / 6
    outage.ok()
    outage.ok()  # nothing more: the outage is over
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert lines[0] == (
        "WARNING",
        "broker unreachable: connect failed (ConnectionRefusedError); retrying",
    )
    summaries = [m for level, m in lines if "still unreachable" in m]
    assert summaries[0].startswith("broker still unreachable after 30 s: 18")  # 180 or 181
    assert "failed attempt(s) in the last 30 s; last: connect failed" in summaries[0]
    assert len(summaries) == 1  # at 30 s; the one at 60 s would come with the 361st failure
    assert lines[-1] == ("INFO", "broker recovered after 60 s (360 failed attempt(s))")
    assert len(lines) == 3


def test_a_new_outage_starts_with_its_own_line(caplog: pytest.LogCaptureFixture) -> None:
    outage = Outage("database", logging.getLogger("t.outage"), clock=Clock())
    caplog.set_level(logging.INFO, "t.outage")
    for _ in range(2):
        outage.failed("OperationalError: refused")
        outage.failed("OperationalError: refused")
        outage.ok()
    assert [r.levelname for r in caplog.records] == ["WARNING", "INFO", "WARNING", "INFO"]
