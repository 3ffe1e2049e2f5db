"""An outage logged as an operator reads it: once when it starts, a summary at most every
``every_s`` seconds while it lasts, once when it ends.

A broker or database that is down makes every retry fail; logging each failure buried
the one line that mattered under thousands an hour (about 6 a second from a relay
worker). Each source of such failures (the broker connect loop, the sweeper, an
adapter's error callbacks, the sweep job's database errors) reports to one of these.

A broker that answers but refuses the relay's setup (a stream whose subjects overlap
another's, an exchange declared with other arguments) is not unreachable: ``refused``
logs it as what it is, with the broker's own words and the setting to fix, once per
outage too (ERROR: it lasts until someone changes a setting).
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
        self.refusal: str | None = None  # the setup refusal told in this outage, if any
        self._told_at = 0.0
        self._told_attempts = 0
        self._lock = threading.Lock()

    @property
    def down(self) -> bool:
        return self.since is not None

    def failed(self, detail: str) -> None:
        """One more failed attempt: the first is logged, then a summary every ``every_s``.
        While a refusal is the outage's cause, a failure (not connected) is its consequence:
        counted, not told as an unreachable broker."""
        self._attempt(detail, refused=False)

    def refused(self, detail: str) -> None:
        """One more attempt the other end answered with a refusal of our setup: ``detail``
        says what it said and what to change. Told once (and in the summaries)."""
        self._attempt(detail, refused=True)

    def _attempt(self, detail: str, refused: bool) -> None:
        with self._lock:
            now = self.clock()
            self.attempts += 1
            if self.since is None or (refused and self.refusal is None):
                self.since = now if self.since is None else self.since
                self._told_at, self._told_attempts = now, self.attempts
                if refused:
                    self.refusal = detail
                    self.log.error("%s refused the setup: %s; retrying", self.name, detail)
                else:
                    self.log.warning("%s unreachable: %s; retrying", self.name, detail)
                return
            if refused:
                self.refusal = detail
            if now - self._told_at < self.every_s:
                return
            since_told, seconds = self.attempts - self._told_attempts, now - self._told_at
            self._told_at, self._told_attempts = now, self.attempts
            state = "unreachable" if self.refusal is None else "refusing the setup"
            self.log.log(
                logging.WARNING if self.refusal is None else logging.ERROR,
                "%s still %s after %.0f s: %d failed attempt(s) in the last %.0f s; last: %s",
                self.name, state, now - self.since, since_told, seconds, self.refusal or detail,
            )  # fmt: skip

    def ok(self) -> None:
        """A success: ends the outage (one INFO line) if there was one; else nothing."""
        with self._lock:
            if self.since is None:
                return
            seconds, attempts = self.clock() - self.since, self.attempts
            self.since, self.attempts, self.refusal = None, 0, None
        self.log.info(
            "%s recovered after %.0f s (%d failed attempt(s))", self.name, seconds, attempts
        )
