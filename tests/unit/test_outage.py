"""relay.outage.Outage: one line when an outage starts, a summary every interval, one at the end."""

from __future__ import annotations

import asyncio
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


def test_the_acks_thread_logs_a_database_outage_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The fast path's marks fail while the database is down: one warning for the outage,
    not one per try of every batch; one line when marking works again."""
    from sqlalchemy.exc import OperationalError

    from outbox.events import Sent, Stats
    from relay.fastpath import acks

    down = [True]

    def finish(pairs: list[tuple[str, str]]) -> int:
        if down[0]:
            raise OperationalError("UPDATE", {}, Exception("connection refused"))
        return len(pairs)

    async def make() -> acks.AckBatcher:
        return acks.AckBatcher(finish, Stats())

    monkeypatch.setattr(acks, "RETRY_DELAYS_S", (0.0, 0.0, 0.0))
    batcher = asyncio.run(make())
    with caplog.at_level(logging.INFO, logger="relay.fastpath.acks"):
        for n in range(20):
            batcher._write([Sent(f"m{n}", "t", "r")])
        down[0] = False
        batcher._write([Sent("ok", "t", "r")])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["database unreachable: marking acked messages: OperationalError; retrying"]
    assert any("recovered" in r.getMessage() for r in caplog.records)
    assert batcher.stats.mark_failed == 20 and batcher.stats.marked == 1
