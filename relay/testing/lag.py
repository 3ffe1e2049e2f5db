"""How late an asyncio loop runs its callbacks: the stall an app's requests would feel.

``LoopLag`` ticks on the running loop (``asyncio.sleep(interval)`` over and over) and
records how much later than asked each tick woke up. A callback that blocks the loop
for 300 ms shows as a 300 ms lateness; a loop that only switches between tasks shows
as a fraction of a millisecond.

    async with LoopLag() as lag:
        await serve_requests()
    print(lag.worst, lag.percentile(99))
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from types import TracebackType


class LoopLag:
    def __init__(self, interval_s: float = 0.001) -> None:
        self.interval_s = interval_s
        self.lateness: list[float] = []  # seconds, one per tick
        self._ticker: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LoopLag:
        self._ticker = asyncio.get_running_loop().create_task(self._tick())
        await asyncio.sleep(0)  # the first tick is scheduled before the block runs
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker

    async def _tick(self) -> None:
        while True:
            asked = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            self.lateness.append(max(0.0, time.perf_counter() - asked - self.interval_s))

    @property
    def worst(self) -> float:
        return max(self.lateness, default=0.0)

    def percentile(self, q: float) -> float:
        ordered = sorted(self.lateness)
        return ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))] if ordered else 0.0
