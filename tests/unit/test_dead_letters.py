"""DeadLetters: each message going dead is a WARNING, a flood a few lines a minute.

A bug would look like: a dead letter told twice or never (counted in no summary), a
summary before its minute is over, or a line per message in a flood."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from outbox.events import Failed
from relay.sweep.dead_letters import DeadLetters, reason

WALL_START = 1_764_300_000.0  # 2025-11-28 03:20:00 UTC


class FakeClock:
    """Monotonic and wall time that move only when told."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return WALL_START + self.now - 100.0


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


class Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def lines() -> Iterator[list[logging.LogRecord]]:
    """What the DeadLetters under test logged, at any level."""
    logger, kept = logging.getLogger("test.dead"), Kept()
    logger.addHandler(kept)
    try:
        yield kept.records
    finally:
        logger.removeHandler(kept)


def letters(clock: FakeClock) -> DeadLetters:
    return DeadLetters(
        logging.getLogger("test.dead"), burst=5, window_s=60.0,
        clock=clock.monotonic, wall=clock.wall,
    )  # fmt: skip


def dead(n: int, error: str = "permanent: too large", start: int = 0) -> list[Failed]:
    return [Failed(f"id-{i}", "orders.paid", 1, error) for i in range(start, start + n)]


def test_the_first_five_of_a_minute_are_told_one_line_each(
    clock: FakeClock, lines: list[logging.LogRecord]
) -> None:
    told = letters(clock)
    told.went_dead(dead(3), "sweeper")
    told.went_dead(dead(2, start=3), "scheduler")
    assert [r.levelno for r in lines] == [logging.WARNING] * 5
    assert lines[0].getMessage() == (
        "message went dead (sweeper): msg_id=id-0 topic=orders.paid attempts=1 "
        "reason: permanent: too large"
    )
    assert "(scheduler): msg_id=id-4 " in lines[4].getMessage()


def test_a_flood_is_one_summary_line_once_its_minute_is_over(
    clock: FakeClock, lines: list[logging.LogRecord]
) -> None:
    told = letters(clock)
    clock.now += 1
    told.went_dead(dead(5), "sweeper")  # the window opens at 101, ends at 161
    told.went_dead(dead(1200, start=5), "sweeper")
    told.went_dead(dead(34, "retry: timeout\nat line 2", start=1205), "sweeper")
    clock.now += 59.9
    told.tick()
    assert len(lines) == 5, "a summary before its minute was over"
    clock.now += 0.1
    told.tick()
    told.tick()  # said once
    assert len(lines) == 6
    assert lines[5].levelno == logging.WARNING
    assert lines[5].getMessage() == (
        "and 1,234 more message(s) went dead since 03:20:01 UTC (reasons: "
        "1,200 x permanent: too large, 34 x retry: timeout); `outbox dead` lists them"
    )
    told.went_dead(dead(1, start=9999), "sweeper")  # a new minute: told at once
    assert len(lines) == 7 and "msg_id=id-9999 " in lines[6].getMessage()


def test_the_first_dead_letter_after_a_quiet_minute_closes_the_last_one(
    clock: FakeClock, lines: list[logging.LogRecord]
) -> None:
    """No sweep ran in between (the tick never came): the summary comes first."""
    told = letters(clock)
    told.went_dead(dead(7), "sweeper")
    clock.now += 300
    told.went_dead(dead(1, start=7), "sweeper")
    messages = [r.getMessage() for r in lines]
    assert messages[5].startswith("and 2 more message(s) went dead since 03:20:00 UTC")
    assert "msg_id=id-7 " in messages[6]


def test_stop_tells_what_was_counted(clock: FakeClock, lines: list[logging.LogRecord]) -> None:
    told = letters(clock)
    told.went_dead(dead(6), "sweeper")
    told.flush()
    told.flush()
    assert len(lines) == 6 and lines[5].getMessage().startswith("and 1 more message(s)")


def test_a_summary_names_three_reasons_and_counts_the_others(
    clock: FakeClock, lines: list[logging.LogRecord]
) -> None:
    told = letters(clock)
    told.went_dead(dead(5), "sweeper")
    for i, why in enumerate(["a", "b", "b", "c", "c", "c", "d", "e"]):
        told.went_dead(dead(1, f"permanent: {why}", start=10 + i), "sweeper")
    told.flush()
    assert "(reasons: 3 x permanent: c, 2 x permanent: b, 1 x permanent: a, 2 x 2 other " in (
        lines[-1].getMessage()
    )


def test_a_reason_is_the_errors_first_line_and_the_topic_is_escaped(
    clock: FakeClock, lines: list[logging.LogRecord]
) -> None:
    """A dead line is one line, whatever the error or a planted row's topic hold."""
    told = letters(clock)
    told.went_dead(
        [Failed("id-x", "a\nb\x1b[31m", 3, "permanent: \x1b[2Jx\n  Traceback")], "sweeper"
    )
    message = lines[0].getMessage()
    assert "\n" not in message and "\x1b" not in message
    assert message.endswith("topic=a\\nb\\x1b[31m attempts=3 reason: permanent: \\x1b[2Jx")
    assert reason("   \n") == "(no error text)"
