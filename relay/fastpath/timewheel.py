"""A hashed timing wheel: where failed publishes wait for their next attempt.

One slot per tick (5 ms by default), enough slots to cover the longest delay, so
``schedule`` and the expiry of one entry each cost O(1): an entry is looked at once,
when its slot comes round. Time comes from an injected clock so tests can drive it.
``Ticker`` runs a wheel on an asyncio loop.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")
EPSILON = 1e-6  # of a tick: absorbs float error in clock arithmetic


class TimeWheel(Generic[T]):
    def __init__(
        self,
        tick_ms: float = 5.0,
        span_ms: float = 1000.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if tick_ms <= 0 or span_ms < 0:
            raise ValueError("tick_ms must be positive and span_ms not negative")
        self.tick_ms = tick_ms
        self._clock = clock
        # +2: a delay of span_ms rounds up one tick, and the current slot is in use.
        self._slots: list[list[tuple[int, T]]] = [
            [] for _ in range(math.ceil(span_ms / tick_ms) + 2)
        ]
        self._cursor = self._tick_at(self._now_ms())  # last tick whose slot was emptied
        self._size = 0
        self.examined = 0  # entries looked at by advance(): one per entry when the span fits

    def __len__(self) -> int:
        return self._size

    def schedule(self, item: T, delay_ms: float) -> None:
        """Make ``item`` due ``delay_ms`` from now, rounded up to the next tick."""
        due = max(math.ceil((self._now_ms() + delay_ms) / self.tick_ms - EPSILON), self._cursor + 1)
        self._slots[due % len(self._slots)].append((due, item))
        self._size += 1

    def advance(self) -> list[T]:
        """Empty every slot up to now and return the entries that are due, oldest first."""
        now = self._tick_at(self._now_ms())
        due: list[T] = []
        if now <= self._cursor:
            return due
        first = max(self._cursor + 1, now - len(self._slots) + 1)  # after a stall, each slot once
        for tick in range(first, now + 1):
            slot = self._slots[tick % len(self._slots)]
            if not slot:
                continue
            self._slots[tick % len(self._slots)] = []
            for entry in slot:
                self.examined += 1
                if entry[0] <= now:
                    due.append(entry[1])
                else:  # longer than the span: goes round again
                    self._slots[entry[0] % len(self._slots)].append(entry)
        self._cursor = now
        self._size -= len(due)
        return due

    def clear(self) -> list[T]:
        """Remove and return everything still waiting."""
        items = [item for slot in self._slots for _, item in slot]
        for slot in self._slots:
            slot.clear()
        self._size = 0
        return items

    def next_due_in(self) -> float:
        """Seconds until the next tick boundary (the earliest anything can be due)."""
        now_ms = self._now_ms()
        return max(0.0, (self._tick_at(now_ms) + 1) * self.tick_ms - now_ms) / 1000

    def _now_ms(self) -> float:
        return self._clock() * 1000

    def _tick_at(self, ms: float) -> int:
        return math.floor(ms / self.tick_ms + EPSILON)


class Ticker(Generic[T]):
    """A ``TimeWheel`` run by a task of an asyncio loop (made on it): what falls due is
    handed to ``due``; while the wheel is empty the task sleeps until ``schedule``."""

    def __init__(self, wheel: TimeWheel[T], due: Callable[[list[T]], None]) -> None:
        self.wheel = wheel
        self._due = due
        self._busy = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())

    def __len__(self) -> int:
        return len(self.wheel)

    def schedule(self, item: T, delay_ms: float) -> None:
        self.wheel.schedule(item, delay_ms)
        self._busy.set()

    def clear(self) -> list[T]:
        return self.wheel.clear()

    def cancel(self) -> None:
        self._task.cancel()

    async def _run(self) -> None:
        while True:
            if not self.wheel:
                self._busy.clear()
                await self._busy.wait()
                continue
            await asyncio.sleep(self.wheel.next_due_in())
            if due := self.wheel.advance():
                self._due(due)
