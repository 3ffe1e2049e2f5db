"""The one start/stop contract of the relay's running parts, and of the ``Relay`` itself.

``start()`` then ``stop(timeout) -> bool``, both idempotent and safe from any thread:
a second ``start()`` or ``stop()`` does nothing, ``stop()`` before ``start()`` is fine
(the part never starts then), and a stopped part does not start again (build a new
one). ``stop`` returns True when the part finished within ``timeout``.
"""

from __future__ import annotations

import enum
import threading
from typing import Protocol

START_TIMEOUT_S = 10.0  # how long a part waits for its own thread to come up


class Part(Protocol):
    """What every running part offers (``Lifecycle`` implements it once)."""

    def start(self) -> None: ...

    def stop(self, timeout: float = 5.0) -> bool: ...


class State(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    STOPPED = "stopped"


class Lifecycle:
    """The contract's bookkeeping; a subclass writes ``_start`` and ``_stop``.

    ``_start`` runs at most once, under a lock (a ``stop()`` meanwhile waits for it);
    if it raises, the part counts as stopped and must have undone what it began.
    ``_stop`` runs at most once, only after a ``_start`` that returned, outside the lock:
    a second ``stop()`` returns at once, with the first one's answer (False while the
    first is still at work).
    """

    def __init__(self) -> None:
        self._lifecycle = threading.Lock()
        self._state = State.NEW
        self._stopped_in_time = False

    @property
    def running(self) -> bool:
        """Started and not (being) stopped."""
        return self._state is State.RUNNING

    def start(self) -> None:
        with self._lifecycle:
            if self._state is not State.NEW:
                return
            try:
                self._start()
            except BaseException:
                self._state = State.STOPPED
                raise
            self._state = State.RUNNING

    def stop(self, timeout: float = 5.0) -> bool:
        with self._lifecycle:
            state, self._state = self._state, State.STOPPED
            if state is State.NEW:
                self._stopped_in_time = True
            if state is not State.RUNNING:
                return self._stopped_in_time
        self._stopped_in_time = self._stop(timeout)
        return self._stopped_in_time

    def _start(self) -> None:
        raise NotImplementedError

    def _stop(self, timeout: float) -> bool:
        raise NotImplementedError
