"""relay.sweep.scheduler.Timing: when the scheduler claims, on injected clocks (no database).

The monotonic clock and the wall clock are fakes moved by hand; the database's readings
(relay.store.NextDue) are made up with an offset of their own from the wall clock.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from outbox.message import Message
from relay.store import NextDue
from relay.sweep.scheduler import TICK_S, Timing

REFRESH_S = 1.0
DB_AHEAD_S = 7.5  # the database clock runs this far ahead of the app's wall clock
WALL0 = 1_700_000_000.0


class Clocks:
    """A monotonic clock at 100.0 and a wall clock, moved together."""

    def __init__(self) -> None:
        self.mono = 100.0
        self.wall_s = WALL0

    def monotonic(self) -> float:
        return self.mono

    def wall(self) -> float:
        return self.wall_s

    def advance(self, seconds: float) -> None:
        self.mono += seconds
        self.wall_s += seconds

    def db_now(self) -> datetime:
        return datetime.fromtimestamp(self.wall_s + DB_AHEAD_S, UTC)


@pytest.fixture
def clocks() -> Clocks:
    return Clocks()


@pytest.fixture
def timing(clocks: Clocks) -> Timing:
    return Timing(REFRESH_S, clocks.monotonic, clocks.wall)


def claim(timing: Timing, clocks: Clocks, next_in_s: float | None, claimed: int = 0,
          full: bool = False) -> None:  # fmt: skip
    """One claim now, whose reading of the table finds the next row due ``next_in_s``
    after the database's now."""
    timing.claim_begins()
    now = clocks.db_now()
    due = None if next_in_s is None else now + timedelta(seconds=next_in_s)
    timing.claim_ended(NextDue(now, due), clocks.mono, clocks.wall_s, claimed, full)


def test_first_claim_at_once_then_a_refresh_per_interval(timing: Timing, clocks: Clocks) -> None:
    assert timing.wake_at() == clocks.mono
    claim(timing, clocks, None)
    assert timing.wake_at() == pytest.approx(clocks.mono + REFRESH_S)


def test_next_due_time_from_the_table_by_its_own_clock(timing: Timing, clocks: Clocks) -> None:
    """The table says 0.3 s after the database's now: 0.3 s on the monotonic clock,
    whatever the database's offset from the wall clock."""
    claim(timing, clocks, 0.3)
    assert timing.wake_at() == pytest.approx(clocks.mono + 0.3)


def test_a_sooner_hint_wakes_the_loop_a_later_one_does_not(timing: Timing, clocks: Clocks) -> None:
    claim(timing, clocks, 0.5)
    assert timing.hint(clocks.mono + 0.2) is True
    assert timing.wake_at() == pytest.approx(clocks.mono + 0.2)
    assert timing.hint(clocks.mono + 0.4) is False
    assert timing.wake_at() == pytest.approx(clocks.mono + 0.2)


def test_a_hint_during_a_claim_survives_its_reading(timing: Timing, clocks: Clocks) -> None:
    """A row committed after the claim's reading is not in it: its hint is kept."""
    timing.claim_begins()
    now = clocks.db_now()
    timing.hint(clocks.mono + 0.05)
    timing.claim_ended(NextDue(now, now + timedelta(seconds=0.8)), clocks.mono, clocks.wall_s,
                       0, False)  # fmt: skip
    assert timing.wake_at() == pytest.approx(clocks.mono + 0.05)


def test_a_hint_before_the_claim_is_replaced_by_the_table(timing: Timing, clocks: Clocks) -> None:
    """Hints before a claim are of committed rows: the table's time is the exact one
    (a delay counts from the INSERT, after send() began: the hint was early)."""
    claim(timing, clocks, None)
    timing.hint(clocks.mono + 0.1)
    clocks.advance(0.1)
    claim(timing, clocks, 0.004)  # the row is 4 ms away by the database clock
    assert timing.wake_at() == pytest.approx(clocks.mono + 0.004)


def test_an_early_wake_that_found_nothing_retries_a_tick_later(
    timing: Timing, clocks: Clocks
) -> None:
    claim(timing, clocks, 0.0001, claimed=0)
    assert timing.wake_at() == pytest.approx(clocks.mono + TICK_S)


def test_a_claim_that_took_rows_goes_on_at_the_next_due_time(
    timing: Timing, clocks: Clocks
) -> None:
    claim(timing, clocks, 0.0001, claimed=3)
    assert timing.wake_at() == pytest.approx(clocks.mono + 0.0001)


def test_a_full_batch_claims_again_at_once(timing: Timing, clocks: Clocks) -> None:
    claim(timing, clocks, 30.0, claimed=500, full=True)
    assert timing.wake_at() == clocks.mono


def test_far_rows_wait_for_the_refresh(timing: Timing, clocks: Clocks) -> None:
    """A row due in an hour: the table is read again every refresh interval meanwhile
    (other processes' rows)."""
    claim(timing, clocks, 3600.0)
    assert timing.wake_at() == pytest.approx(clocks.mono + REFRESH_S)


def test_delay_hint_counts_from_send(timing: Timing, clocks: Clocks) -> None:
    message = Message("id", "t", b"", born=clocks.mono - 0.25, delay_s=2.0)
    assert timing.due_at(message) == pytest.approx(clocks.mono + 1.75)


def test_deliver_at_hint_by_the_measured_database_offset(timing: Timing, clocks: Clocks) -> None:
    """deliver_at is a database-clock instant: the wall clock is corrected by the offset
    the last reading measured, so the hint is not DB_AHEAD_S late."""
    claim(timing, clocks, None)
    clocks.advance(0.5)
    at = clocks.db_now() + timedelta(seconds=3)
    message = Message("id", "t", b"", deliver_at=at)
    assert timing.due_at(message) == pytest.approx(clocks.mono + 3)


def test_a_failed_claim_keeps_the_hints_and_waits_for_the_refresh(
    timing: Timing, clocks: Clocks
) -> None:
    claim(timing, clocks, 0.2)
    timing.claim_begins()
    timing.hint(clocks.mono + 5.0)
    timing.failed()
    assert timing.wake_at() == pytest.approx(clocks.mono + REFRESH_S)
