"""Progress of the long commands on stderr, through tqdm (the one progress library kept).

On a terminal: a bar with done/total, rate and ETA; log lines are written above it
(tqdm's logging redirect), never on the bar's line. Without a terminal (cron, a pipe,
a container log): one line of running totals every ``every_s`` seconds, not one per batch.

Counts are of rows *finished*, so the bar never passes its total: a row that failed
and is tried again in a later pass of the same command is counted once.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import TextIO

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from outbox.events import SweepResult

# Seconds between the summary lines without a terminal; the environment variable is
# for tests (a short interval on a small backlog), not a documented setting.
SUMMARY_EVERY_S = float(os.environ.get("OUTBOX_PROGRESS_EVERY_S", "5"))


@contextmanager
def redirected_logging() -> Iterator[None]:
    """Log lines written above the bar (tqdm's redirect), still through the handlers'
    filters: tqdm releases before 4.68 dropped them, and one is the password Scrubber."""
    root = logging.getLogger()
    filters = [f for handler in root.handlers for f in handler.filters]
    with logging_redirect_tqdm(tqdm_class=tqdm):
        for handler in root.handlers:
            for kept in filters:
                handler.addFilter(kept)  # a no-op where tqdm kept it
        yield


class Display:
    """Where a command's running totals go: a tqdm bar on a terminal, else a line every
    ``every_s`` seconds. Shared by ``Progress`` (drain) and ``Counting`` (the others)."""

    def __init__(
        self,
        what: str,
        total: int | None,
        unit: str,
        stream: TextIO | None = None,
        every_s: float | None = None,
        tty: bool | None = None,
    ) -> None:
        self.what, self.unit = what, unit
        self.every_s = SUMMARY_EVERY_S if every_s is None else every_s  # read now: tests set it
        self.stream = stream or sys.stderr
        self.started = self._told = time.monotonic()
        self._redirect = ExitStack()
        self._bar: tqdm | None = None
        if self.stream.isatty() if tty is None else tty:
            # no total: tqdm shows the count and rate, without a bar or an ETA, and
            # writes the unit right after the count ("90 rows", not "90rows")
            shown_unit = unit if total is not None else f" {unit}"
            self._bar = tqdm(
                total=total, desc=what, unit=shown_unit, file=self.stream, dynamic_ncols=True
            )
            self._redirect.enter_context(redirected_logging())

    def show(
        self, advanced: int, done: int, total: int | None, counts: dict[str, int], rated: int
    ) -> None:
        """``advanced`` more done; ``rated`` is the count the rate is of (drain: sent)."""
        if self._bar is not None:
            if self._bar.total != total:
                self._bar.total = total
            if counts:  # as text: tqdm would show a round 30000 as "3e+4"
                self._bar.set_postfix({k: str(v) for k, v in counts.items()}, refresh=False)
            self._bar.update(advanced)
            return
        now = time.monotonic()
        if now - self._told >= self.every_s:
            self._told = now
            self.line(done, total, counts, rated, now)

    def line(
        self, done: int, total: int | None, counts: dict[str, int], rated: int, now: float
    ) -> None:
        rate = rated / max(now - self.started, 1e-9)
        shown = f"{done}/{total}" if total is not None else f"{done} {self.unit}"
        parts = [f"{self.what}: {shown}", *(f"{k}={v}" for k, v in counts.items())]
        self.stream.write(f"{' '.join(parts)} ({rate:,.0f} {self.unit}/s)\n")
        self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._redirect.close()


class Counting:
    """A plain count of one command's work (rows exported, rows requeued): ``add(n)``.

    ``total`` when it is known cheaply; without one a terminal shows the count and the
    rate, no ETA. A count past the total raises the total (rows that arrived meanwhile).
    ``visible=False`` counts without showing anything (work too small to follow).
    """

    def __init__(
        self,
        what: str,
        total: int | None = None,
        unit: str = "rows",
        stream: TextIO | None = None,
        every_s: float | None = None,
        tty: bool | None = None,
        visible: bool = True,
    ) -> None:
        self.total, self.done = total, 0
        self._lock = threading.Lock()
        self._display = Display(what, total, unit, stream, every_s, tty) if visible else None

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n
            if self.total is not None and self.done > self.total:
                self.total = self.done
            if self._display is not None:
                self._display.show(n, self.done, self.total, {}, self.done)

    def close(self) -> None:
        with self._lock:
            if self._display is not None:
                self._display.close()


class Progress:
    """Running totals of one command: ``add(batch)`` from any thread, ``close()`` once."""

    def __init__(
        self,
        what: str,
        total: int,
        stream: TextIO | None = None,
        every_s: float | None = None,
        tty: bool | None = None,
    ) -> None:
        self.what, self.total = what, total
        self.sent = self.failed = self.dead = 0
        self.retrying = 0  # failed rows of an earlier pass, not yet claimed again
        # Why rows failed (relay.sweep.sweeper.reason): the dead ones, the ones failed in this
        # pass, and the earlier passes' failures that are not claimed again yet.
        self.dead_reasons: Counter[str] = Counter()
        self.retry_reasons: Counter[str] = Counter()
        self.earlier_reasons: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._display = Display(what, total, "msg", stream, every_s, tty)

    @property
    def done(self) -> int:
        """Rows finished: sent, dead, or failed in the pass that tried them last."""
        return self.sent + self.dead + self.failed + self.retrying

    def add(self, batch: SweepResult) -> None:
        """One batch's outcomes (its rows were claimed once in this pass)."""
        with self._lock:
            before = self.done
            again = min(self.retrying, batch.claimed) if batch.claimed else 0
            self.retrying -= again
            self.sent += batch.sent
            self.failed += batch.failed
            self.dead += batch.dead
            self.dead_reasons += batch.dead_reasons
            self.retry_reasons += batch.retry_reasons
            if self.done > self.total:  # rows that arrived during the command
                self.total = self.done
            self._show(self.done - before)

    def next_pass(self) -> None:
        """The failed rows are about to be claimed again: each still counts once."""
        with self._lock:
            self.retrying += self.failed
            self.failed = 0
            self.earlier_reasons, self.retry_reasons = self.retry_reasons, Counter()

    def result(self) -> SweepResult:
        """The totals: each row in exactly one of sent, failed (retry later), dead."""
        with self._lock:
            failed = self.failed + self.retrying
            why_retry = self.retry_reasons.copy()
            if self.retrying:  # a pass stopped early: the rows it did not claim again failed
                why_retry += self.earlier_reasons  # for the earlier pass's reasons (roughly)
            return SweepResult(
                self.done, self.sent, failed, self.dead, False, why_retry, self.dead_reasons.copy()
            )

    def _show(self, advanced: int) -> None:
        self._display.show(advanced, self.done, self.total, self._postfix(), self.sent)

    def _postfix(self) -> dict[str, int]:
        return {"sent": self.sent, "retry_later": self.failed + self.retrying, "dead": self.dead}

    def close(self) -> None:
        with self._lock:
            self._display.close()


@contextmanager
def progress(what: str, total: int, **kwargs: object) -> Iterator[Progress]:
    """A Progress closed (its bar cleared from the terminal) however the block ends."""
    shown = Progress(what, total, **kwargs)  # type: ignore[arg-type]
    try:
        yield shown
    finally:
        shown.close()


@contextmanager
def counting(what: str, total: int | None = None, **kwargs: object) -> Iterator[Counting]:
    """A Counting closed (its bar cleared from the terminal) however the block ends."""
    shown = Counting(what, total, **kwargs)  # type: ignore[arg-type]
    try:
        yield shown
    finally:
        shown.close()
