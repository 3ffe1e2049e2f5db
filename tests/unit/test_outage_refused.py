"""relay.outage.Outage.refused: a broker that answers with a refusal of the relay's setup
is told as that refusal (ERROR), once per outage; the failures it causes (not connected)
are counted, not told as an unreachable broker."""

from __future__ import annotations

import logging

import pytest

from relay.outage import Outage
from tests.unit.test_outage import Clock

REFUSAL = "JetStream refused to create stream 'S': subjects overlap (err_code 10065); set ..."


def test_a_refusal_is_one_line_and_its_consequences_none(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    outage = Outage("broker", logging.getLogger("t.refused"), every_s=30, clock=clock)
    caplog.set_level(logging.INFO, "t.refused")
    for _ in range(60):  # a minute of reconnects, and sweeps that find no connection
        outage.refused(REFUSAL)
        outage.failed("not connected; sweep: batch of 1 left pending")
        clock.now += 1
    outage.ok()
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert lines[0] == ("ERROR", f"broker refused the setup: {REFUSAL}; retrying")
    assert lines[1][0] == "ERROR", lines
    assert lines[1][1].startswith("broker still refusing the setup after 30 s: 60 failed")
    assert lines[1][1].endswith(f"last: {REFUSAL}"), lines
    assert lines[2] == ("INFO", "broker recovered after 60 s (120 failed attempt(s))")
    assert len(lines) == 3, lines
    assert "unreachable" not in caplog.text


def test_a_refusal_after_an_unreachable_broker_is_told_too(
    caplog: pytest.LogCaptureFixture,
) -> None:
    outage = Outage("broker", logging.getLogger("t.refused"), clock=Clock())
    caplog.set_level(logging.INFO, "t.refused")
    outage.failed("connect failed (ConnectionRefusedError)")  # down, then up but refusing
    outage.refused(REFUSAL)
    outage.refused(REFUSAL)
    outage.ok()
    outage.refused(REFUSAL)  # a new outage: its own line
    levels = [r.levelname for r in caplog.records]
    assert levels == ["WARNING", "ERROR", "INFO", "ERROR"], caplog.text
