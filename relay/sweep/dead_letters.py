"""``DeadLetters``: a message going dead, told at WARNING once, however many go dead.

Anyone who alerts on WARNING hears of each dead letter: the first ``burst`` of a window
(``window_s``, a minute) get a line each, with msg_id, topic, attempts and the reason
(the error cut to one line); the rest of the window are counted, and one summary line
says how many more went dead since when, and why, once the window is over (at the
first sweep after it, or at stop). A flood of 100,000 dead rows is then a handful of
lines a minute, not 100,000 lines, and nothing goes dead unsaid.

``outbox dead`` lists every dead message; these lines are the alarm, not the record.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

from outbox.events import Failed
from relay.display import one_line, safe

log = logging.getLogger("relay.sweep.dead_letters")

BURST = 5  # dead letters told one line each per window
WINDOW_S = 60.0
REASONS_NAMED = 3  # a summary names the most frequent reasons, and counts the others
REASON_CHARS = 120  # a reason is one line of a summary
Clock = Callable[[], float]


def reason(error: str) -> str:
    """An error as a summary groups it: its first line, spaces collapsed, cut."""
    return one_line(error, REASON_CHARS) or "(no error text)"


class DeadLetters:
    """Tells ``log`` of messages going dead (thread-safe: sweeps run side by side).

    ``clock`` (monotonic) times the windows and ``wall`` dates a summary's "since":
    both can be injected (tests).
    """

    def __init__(
        self,
        logger: logging.Logger = log,
        burst: int = BURST,
        window_s: float = WINDOW_S,
        clock: Clock = time.monotonic,
        wall: Clock = time.time,
    ) -> None:
        self.log = logger
        self.burst, self.window_s = burst, window_s
        self.clock, self.wall = clock, wall
        self._lock = threading.Lock()
        self._window_ends: float | None = None  # None: no window open
        self._told = 0  # lines of their own in the open window
        self._held = Counter[str]()  # reasons of the dead letters counted, not told
        self._held_since: float | None = None  # wall time of the first one counted

    def went_dead(self, dead: Sequence[Failed], path: str) -> None:
        """These messages were marked dead (committed) by ``path`` (sweeper, scheduler)."""
        with self._lock:
            self._close_if_over()
            for failed in dead:
                why = safe(reason(failed.error))  # one line, no terminal escapes
                if self._window_ends is None:
                    self._window_ends = self.clock() + self.window_s
                if self._told < self.burst:
                    self._told += 1
                    self.log.warning(
                        "message went dead (%s): msg_id=%s topic=%s attempts=%d reason: %s",
                        path, failed.msg_id, safe(failed.topic), failed.attempt, why,
                    )  # fmt: skip
                    continue
                if self._held_since is None:
                    self._held_since = self.wall()
                self._held[why] += 1

    def tick(self) -> None:
        """Say the summary of a window that is over (called by every sweep)."""
        with self._lock:
            self._close_if_over()

    def flush(self) -> None:
        """Say the summary of the open window now, over or not (at stop)."""
        with self._lock:
            self._close()

    def _close_if_over(self) -> None:
        if self._window_ends is not None and self.clock() >= self._window_ends:
            self._close()

    def _close(self) -> None:
        """The summary of what the window counted, if anything; the next window is new."""
        if self._held:
            assert self._held_since is not None, "set with the first one counted"
            self.log.warning("%s", summary(self._held, self._held_since))
        self._window_ends, self._told = None, 0
        self._held, self._held_since = Counter(), None


def summary(reasons: Counter[str], since: float) -> str:
    """'and 1,234 more messages went dead since 12:03:04 UTC (reasons: 1,200 x permanent:
    too large, 34 x ...)': the most frequent reasons first."""
    at = datetime.fromtimestamp(since, UTC).strftime("%H:%M:%S UTC")
    total = sum(reasons.values())
    return (
        f"and {total:,} more message(s) went dead since {at} (reasons: {named(reasons)}); "
        "`outbox dead` lists them"
    )


def named(reasons: Counter[str]) -> str:
    """'1,200 x permanent: too large, 34 x ...': the REASONS_NAMED most frequent reasons,
    then how many others (a line stays short whatever the errors)."""
    ranked = sorted(reasons.items(), key=lambda item: (-item[1], item[0]))
    shown = [f"{n:,} x {safe(why)}" for why, n in ranked[:REASONS_NAMED]]
    if len(ranked) > REASONS_NAMED:
        others = sum(n for _, n in ranked[REASONS_NAMED:])
        shown.append(f"{others:,} x {len(ranked) - REASONS_NAMED} other reason(s)")
    return ", ".join(shown)
