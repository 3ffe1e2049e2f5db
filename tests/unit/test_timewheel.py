"""The time wheel, driven by a fake clock: exact due times and O(1) work per entry."""

from __future__ import annotations

import itertools
import math

import pytest

from outbox.settings import RETRY_DELAYS_MS
from relay.fastpath.timewheel import TimeWheel


class FakeClock:
    """Counts whole microseconds, so stepping it adds no floating-point drift."""

    def __init__(self) -> None:
        self.us = 1_000_000_000

    @property
    def now(self) -> float:
        return self.us / 1e6

    def __call__(self) -> float:
        return self.now

    def advance_ms(self, ms: float) -> None:
        self.us += round(ms * 1000)


def due_times(wheel: TimeWheel[str], clock: FakeClock, until_ms: int) -> dict[str, float]:
    """Step the clock 1 ms at a time and note when each entry comes out."""
    start = clock.now
    seen: dict[str, float] = {}
    for _ in range(until_ms):
        clock.advance_ms(1)
        for item in wheel.advance():
            seen[item] = round((clock.now - start) * 1000, 3)
    return seen


def test_each_retry_delay_fires_at_the_next_tick_boundary() -> None:
    clock = FakeClock()
    wheel: TimeWheel[str] = TimeWheel(tick_ms=5, span_ms=1000, clock=clock)
    for i, delay in enumerate(RETRY_DELAYS_MS):
        wheel.schedule(f"d{i}", delay)
    seen = due_times(wheel, clock, 1100)
    # Scheduled on a tick boundary, a delay d comes out exactly at d (0 at the next tick).
    assert seen == {f"d{i}": float(max(d, 5)) for i, d in enumerate(RETRY_DELAYS_MS)}
    assert len(wheel) == 0


@pytest.mark.parametrize("offset_ms", [1, 2.5, 4.9])
def test_delays_round_up_never_down(offset_ms: float) -> None:
    clock = FakeClock()
    wheel: TimeWheel[str] = TimeWheel(tick_ms=5, span_ms=1000, clock=clock)
    clock.advance_ms(offset_ms)
    for delay in (5, 10, 25, 1000):
        wheel.schedule(str(delay), delay)
    seen = due_times(wheel, clock, 1100)
    for delay in (5, 10, 25, 1000):
        fired = seen[str(delay)] + offset_ms  # ms after the wheel's start
        boundary = math.ceil((offset_ms + delay) / 5) * 5
        assert boundary <= fired < boundary + 1  # the first 1 ms step at or past the boundary
        assert seen[str(delay)] >= delay, "a retry must never come early"
        assert seen[str(delay)] < delay + 5 + 1, "nor later than one tick (plus the 1 ms step)"


def test_full_schedule_of_one_message() -> None:
    """A message failing every attempt is retried at the configured gaps, 13 attempts in all."""
    clock = FakeClock()
    wheel: TimeWheel[int] = TimeWheel(tick_ms=5, span_ms=1000, clock=clock)
    attempts_at = [0.0]
    start = clock.now
    for attempt in range(1, len(RETRY_DELAYS_MS)):
        wheel.schedule(attempt, RETRY_DELAYS_MS[attempt])
        out: list[int] = []
        while not out:
            clock.advance_ms(1)
            out = wheel.advance()
        assert out == [attempt]
        attempts_at.append(round((clock.now - start) * 1000, 3))
    gaps = [b - a for a, b in itertools.pairwise(attempts_at)]
    assert gaps == [float(d) for d in RETRY_DELAYS_MS[1:]]
    assert attempts_at[-1] == sum(RETRY_DELAYS_MS) == 4990


def test_insert_and_expiry_are_constant_work_per_entry() -> None:
    """Each entry is examined exactly once, when due, however many others wait.

    A wheel that scanned its entries on every tick would examine each entry many times.
    """
    clock = FakeClock()
    wheel: TimeWheel[int] = TimeWheel(tick_ms=5, span_ms=1000, clock=clock)
    n = 20_000
    for i in range(n):
        wheel.schedule(i, RETRY_DELAYS_MS[i % len(RETRY_DELAYS_MS)])
    assert wheel.examined == 0, "schedule() must not touch other entries"
    out: list[int] = []
    for _ in range(250):
        clock.advance_ms(5)
        examined_before = wheel.examined
        due = wheel.advance()
        assert wheel.examined - examined_before == len(due)
        out += due
    assert sorted(out) == list(range(n))
    assert wheel.examined == n


def test_stalled_loop_gets_everything_due_at_once() -> None:
    clock = FakeClock()
    wheel: TimeWheel[str] = TimeWheel(tick_ms=5, span_ms=100, clock=clock)
    wheel.schedule("a", 5)
    wheel.schedule("b", 100)
    clock.advance_ms(10_000)  # far more than the wheel's span
    assert sorted(wheel.advance()) == ["a", "b"]
    assert len(wheel) == 0


def test_delays_longer_than_the_span_still_wait_their_time() -> None:
    clock = FakeClock()
    wheel: TimeWheel[str] = TimeWheel(tick_ms=5, span_ms=50, clock=clock)
    wheel.schedule("late", 200)
    seen = due_times(wheel, clock, 300)
    assert seen == {"late": 200.0}


def test_clear_returns_what_waits() -> None:
    clock = FakeClock()
    wheel: TimeWheel[str] = TimeWheel(clock=clock)
    wheel.schedule("a", 10)
    wheel.schedule("b", 500)
    assert sorted(wheel.clear()) == ["a", "b"]
    assert len(wheel) == 0
    clock.advance_ms(1000)
    assert wheel.advance() == []
