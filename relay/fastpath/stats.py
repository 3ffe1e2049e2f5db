"""The relay's counting: ``Slots``, the one count the fast path bounds its memory with
(``queue_size``), and the histograms Prometheus metrics are kept in.

The fast path's counters an app reads (``Stats``) are ``outbox.events``'.
"""

from __future__ import annotations

import bisect
import logging
import threading

from outbox.events import Stats

log = logging.getLogger("relay.fastpath.stats")

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_SIZE_BUCKETS = (1, 10, 50, 100, 250, 500, 1000, 5000)
SWEEP_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Histogram:
    """Bucket counters and a sum, Prometheus style; one writer, read from any thread."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, float]]:
        """(upper bound, count of values <= it), the +Inf bucket last."""
        counts = list(self.counts)  # one copy, so the buckets agree with each other
        running, out = 0, []
        for bound, count in zip([*map(str, self.bounds), "+Inf"], counts, strict=True):
            running += count
            out.append((bound, float(running)))
        return out


class Slots:
    """The one count of messages the fast path holds in memory, bounded by ``size``.

    A message takes its slot at commit (``take``, all of a commit's messages or none)
    and frees it when it leaves the fast path: marked after its ack, or given up to
    the sweeper (rejected, exhausted, too old, mark failed, stopped). In between it is
    in the inbox, msgQueue, a publish in flight, the time wheel or the acks waiting to
    be marked: all of it counts, so ``size`` bounds the fast path's memory however long
    the broker is away; past it, commits stay in the table for the sweeper. Any
    thread: app threads take, the broker loop and the acks thread free. The count is
    mirrored in ``stats.held`` / ``stats.held_peak`` for readers.
    """

    def __init__(self, size: int, stats: Stats) -> None:
        self.size = size
        self.stats = stats
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        return self.stats.held

    def take(self, n: int) -> bool:
        """Hold ``n`` more messages if they fit under ``size``; False (nothing held) if not."""
        with self._lock:
            held = self.stats.held + n
            if held > self.size:
                return False
            self.stats.held = held
            self.stats.held_peak = max(self.stats.held_peak, held)
            return True

    def free(self, n: int) -> None:
        """``n`` messages left the fast path."""
        if n <= 0:
            return
        with self._lock:
            held = self.stats.held - n
            self.stats.held = max(0, held)
        if held < 0:  # a slot freed twice: a bug, but never a negative bound
            log.error("freed %d slot(s) more than were held", -held)
