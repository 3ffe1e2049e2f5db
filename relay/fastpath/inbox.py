"""The fast path's inbox: where app threads hand committed messages to the broker loop.

``submit`` never blocks: messages are taken only while the dispatcher accepts and they
fit under ``queue_size`` (``relay.fastpath.stats.Slots``), all of a commit or none;
what is not taken stays in the table for the sweeper. One wake-up of the loop covers
every commit that arrives before the loop takes them.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence

from outbox.events import Stats
from outbox.message import Message
from relay.fastpath.delivery import Delivery, Look
from relay.fastpath.stats import Slots
from relay.listener import Listeners


class Inbox:
    """Submitted deliveries not yet taken by the loop (any thread)."""

    def __init__(
        self,
        slots: Slots,
        stats: Stats,
        listeners: Listeners,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._slots = slots
        self._stats = stats
        self._listeners = listeners
        self._clock = clock
        self._lock = threading.Lock()
        self._accepting = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self._on_wake: Callable[[], None] = lambda: None  # takes the inbox, on the loop
        self._items: list[Delivery] = []
        self._woken = False  # an _on_wake is scheduled on the loop

    def open(self, loop: asyncio.AbstractEventLoop, on_wake: Callable[[], None]) -> None:
        """Accept submissions; ``on_wake`` runs on ``loop`` to take them."""
        self.loop, self._on_wake = loop, on_wake
        with self._lock:
            self._accepting = True

    def close(self) -> None:
        """Take no more: later commits stay in the table for the sweeper."""
        with self._lock:
            self._accepting = False

    def submit(self, messages: Sequence[Message], look: Look) -> int:
        """Take ``messages`` if they fit (all or none); returns how many were taken."""
        loop = self.loop
        now = self._clock()
        with self._lock:
            live = self._accepting and loop is not None
            taken = len(messages) if live and self._slots.take(len(messages)) else 0
            full = taken == 0 and self._accepting
            if full:
                self._stats.queue_full += len(messages)
            if taken:
                self._items.extend(Delivery(m, now, look) for m in messages)
                wake, self._woken = not self._woken, True
        if full:
            self._listeners.left_for_sweeper([m.msg_id for m in messages], "queue_full")
        if taken == 0:
            return 0
        if wake:  # one wake-up for all the commits that arrive before the loop takes them
            assert loop is not None
            loop.call_soon_threadsafe(self._on_wake)
        return taken

    def take(self) -> list[Delivery]:
        """What was submitted, with its wake-up done or still on its way (any thread)."""
        with self._lock:
            deliveries, self._items, self._woken = self._items, [], False
        return deliveries

    def drop(self) -> None:
        """Leave what is still here to the sweeper (at stop, when the loop did not take it)."""
        self.loop = None
        if left := [d.message.msg_id for d in self.take()]:
            self._slots.free(len(left))
            self._stats.dropped_at_stop += len(left)
            self._listeners.left_for_sweeper(left, "stopped")
