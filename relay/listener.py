"""The fan-out of the relay's hooks: ``Listeners`` calls every ``RelayListener`` added.

The hooks, their values and when they are called: ``outbox.events``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from outbox.events import Failed, Path, Reason, RelayListener, Sent, SweepResult

log = logging.getLogger("relay.listener")


class Listeners(RelayListener):
    """The listeners the relay calls, in the order added; one that raises is logged and
    the others still run. Adding one is safe while the relay is running."""

    def __init__(self, *listeners: RelayListener) -> None:
        self._all: tuple[RelayListener, ...] = ()
        self._adding = threading.Lock()
        for listener in listeners:
            self.add(listener)

    @classmethod
    def of(cls, listener: RelayListener | None) -> Listeners:
        """``listener`` itself when it is a ``Listeners`` (parts of one relay share it)."""
        if isinstance(listener, Listeners):
            return listener
        return cls() if listener is None else cls(listener)

    def __bool__(self) -> bool:
        """False when nobody listens: the relay can skip preparing a hook's arguments."""
        return bool(self._all)

    def add(self, listener: RelayListener) -> None:
        """Call ``listener`` too, from the next event on; adding it again does nothing."""
        with self._adding:
            if all(known is not listener for known in self._all):
                self._all = (*self._all, listener)  # a new tuple: hooks running now keep theirs

    def published(self, sent: Sequence[Sent], path: Path) -> None:
        self._each("published", sent, path)

    def retried(self, failed: Sequence[Failed], path: Path) -> None:
        self._each("retried", failed, path)

    def rejected(self, failed: Sequence[Failed]) -> None:
        self._each("rejected", failed)

    def left_for_sweeper(self, msg_ids: Sequence[str], reason: Reason) -> None:
        self._each("left_for_sweeper", msg_ids, reason)

    def dead(self, failed: Sequence[Failed]) -> None:
        self._each("dead", failed)

    def swept(self, result: SweepResult, seconds: float) -> None:
        self._each("swept", result, seconds)

    def _each(self, hook: str, *args: object) -> None:
        for listener in self._all:
            try:
                getattr(listener, hook)(*args)
            except Exception:
                log.exception(
                    "listener %s.%s raised; the relay goes on", type(listener).__name__, hook
                )
