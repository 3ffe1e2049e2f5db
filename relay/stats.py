"""Counters of the relay, kept as plain integers (one writer: the relay loop)."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field


@dataclass
class Stats:
    """Counters of one dispatcher; read them from any thread."""

    accepted: int = 0
    queue_full: int = 0  # left in the table because msgQueue was full
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
    latencies: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=100_000)
    )
