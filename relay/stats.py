"""Counters of the fast path, kept as plain integers, read from any thread.

Who writes them:
- the broker loop: most of them (``accepted``, ``published``, ``retried``, ...,
  ``latencies``); also ``marked`` when listeners want to hear ``published`` (it counts
  after telling them);
- the acks thread: ``mark_statements``, ``mark_failed``, and ``marked`` when nobody
  listens;
- app threads, in ``Dispatcher.submit`` under the dispatcher's lock: ``queue_full``;
- the thread that calls ``Dispatcher.stop``: ``dropped_at_stop`` for commits a loop
  that did not answer left behind (the loop writes the other ones);
- ``held`` and ``held_peak``: under ``Slots``' lock, by app threads (take), the loop,
  the acks thread and ``stop`` (free).

Prometheus metrics count through a listener (relay.listener), not from these.
``Slots`` is the one count the fast path bounds its memory with (``queue_size``).
"""

from __future__ import annotations

import bisect
import collections
import logging
import threading
from dataclasses import dataclass, field

log = logging.getLogger("relay.stats")

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


@dataclass
class Stats:
    """Counters of one dispatcher; read them from any thread."""

    accepted: int = 0
    queue_full: int = 0  # left in the table: the fast path held queue_size messages
    held: int = 0  # messages the fast path holds now (Slots), at most queue_size
    held_peak: int = 0  # the most it ever held at once
    published: int = 0
    first_attempt: int = 0  # acked on the first attempt
    retried: int = 0
    exhausted: int = 0  # retry schedule spent: left for the sweeper
    too_old: int = 0  # past the hand-off limit: left for the sweeper
    rejected: int = 0  # permanent broker error: left for the sweeper to dead-letter
    duplicates: int = 0  # the broker reported it already held the msg_id
    dropped_at_stop: int = 0
    not_visible: int = 0  # handed over after COMMIT but the row was not there (yet)
    marked: int = 0  # rows marked sent (or deleted) after an ack
    mark_statements: int = 0  # statements that did it: one per batch, more only on retries
    mark_failed: int = 0  # acked but not marked: the sweeper will publish them again
    latencies: collections.deque[float] = field(  # commit to ack, the latest ones
        default_factory=lambda: collections.deque(maxlen=100_000)
    )


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
