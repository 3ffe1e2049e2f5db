"""An outage logged as an operator reads it: once when it starts, a summary at most every
``every_s`` seconds while it lasts, once when it ends.

A broker or database that is down makes every retry fail; logging each failure buried
the one line that mattered under thousands an hour (about 6 a second from a relay
worker). Each source of such failures (the broker connect loop, the sweeper, an
adapter's error callbacks, the sweep job's database errors) reports to one of these.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

SUMMARY_EVERY_S = 30.0


class Outage:
    """``failed(detail)`` after each failed attempt, ``ok()`` after each success; thread-safe."""

    def __init__(
        self,
        name: str,
        log: logging.Logger,
        every_s: float = SUMMARY_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name, self.log, self.every_s, self.clock = name, log, every_s, clock
        self.since: float | None = None  # when the outage started; None: no outage
        self.attempts = 0  # failed attempts since it started
        self._told_at = 0.0
        self._told_attempts = 0
        self._lock = threading.Lock()

    @property
    def down(self) -> bool:
        return self.since is not None

    def failed(self, detail: str) -> None:
        """One more failed attempt: the first is logged, then a summary every ``every_s``."""
        with self._lock:
            now = self.clock()
            self.attempts += 1
            if self.since is None:
                self.since = self._told_at = now
                self._told_attempts = self.attempts
                self.log.warning("%s unreachable: %s; retrying", self.name, detail)
                return
            if now - self._told_at < self.every_s:
                return
            since_told, seconds = self.attempts - self._told_attempts, now - self._told_at
            self._told_at, self._told_attempts = now, self.attempts
            self.log.warning(
                "%s still unreachable after %.0f s: %d failed attempt(s) in the last %.0f s; "
                "last: %s",
                self.name, now - self.since, since_told, seconds, detail,
            )  # fmt: skip

    def ok(self) -> None:
        """A success: ends the outage (one INFO line) if there was one; else nothing."""
        with self._lock:
            if self.since is None:
                return
            seconds, attempts = self.clock() - self.since, self.attempts
            self.since, self.attempts = None, 0
        self.log.info(
            "%s recovered after %.0f s (%d failed attempt(s))", self.name, seconds, attempts
        )
