"""SIGINT and SIGTERM for the long commands (`outbox drain`, `outbox relay`), CLI only.

The first signal asks the work to stop between batches: a batch is published and
marked in one transaction, so it ends either marked or rolled back (left pending).
A second signal exits at once; the database rolls back whatever transaction was
open, so nothing is marked without an ack and nothing is lost (a message published
but not yet marked stays pending and is published again: at least once).

Handlers are installed by the command's main thread only, never by library code an
app imports. A handler only notes the signal (or exits): no lock, no I/O buffer, so
it cannot deadlock on a lock the interrupted main thread holds.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_status(signum: int) -> int:
    """The shell's status for a process ended by ``signum``: 130 SIGINT, 143 SIGTERM."""
    return 128 + signum


class StopSignals:
    """Notes the first SIGINT/SIGTERM (``received``); a second exits at once."""

    def __init__(self, command: str) -> None:
        self.command = command
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received else ""

    def install(self) -> StopSignals:
        """Take SIGINT and SIGTERM (main thread only; elsewhere a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            return self
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def restore(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum
            return
        force_exit(self.command, signum)


def force_exit(command: str, signum: int) -> None:
    """Exit now: os.write and os._exit are safe in a handler (print is not)."""
    name = signal.Signals(signum).name
    line = f"outbox {command}: second {name}, exiting now; batches in flight stay pending\n"
    os.write(2, line.encode())
    os._exit(exit_status(signum))


@contextmanager
def signals_blocked() -> Iterator[None]:
    """Threads started in the block inherit a mask without SIGINT/SIGTERM, so the
    signals reach the main thread only (a signal meanwhile waits until the end)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
