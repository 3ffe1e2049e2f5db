"""Hooks into the relay: what happened to each message, as it happens.

Subclass ``RelayListener`` and override the hooks you need; the others do nothing.
Pass it to ``Outbox(..., listener=...)`` (or ``Outbox.add_listener``), or to a
``relay.runtime.Relay`` you build yourself::

    class Alarm(RelayListener):
        def dead(self, failed: Sequence[Failed]) -> None:
            for f in failed:
                pager.send(f"{f.topic} {f.msg_id} is dead: {f.error}")

Hooks are called once per batch, with every message of the batch that ended the same
way, on the relay's own threads (the fast path's loop or, for acks it could not mark,
its acks thread; a sweeper's thread), except
``left_for_sweeper(reason="queue_full")``, which runs on the app thread whose commit
found the fast path full (holding ``queue_size`` messages). Keep them cheap and
non-blocking: the relay waits for them. An exception a hook raises is logged and
swallowed; it never stops or repeats a message.

Each message handed to the fast path ends in exactly one of ``published(path="fast")``,
``rejected`` or ``left_for_sweeper``, possibly after some ``retried``. A row the
sweeper claims ends, per attempt, in ``published(path="sweeper")``, ``retried`` or
``dead``; ``swept`` follows each batch it committed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, NamedTuple

if TYPE_CHECKING:
    from relay.sweeper import SweepResult

log = logging.getLogger("relay.listener")

Path = Literal["fast", "sweeper"]
# Why the fast path let a message go; its row stays pending for the sweeper.
# queue_full: the fast path held queue_size messages at commit; exhausted: the retry
# schedule is spent; too_old: past the hand-off limit; mark_failed: acked, but marking
# the row failed (it will be published again); stopped: still held at stop().
Reason = Literal["queue_full", "exhausted", "too_old", "mark_failed", "stopped"]


class Sent(NamedTuple):
    msg_id: str
    topic: str
    receipt: str  # the broker's (stream sequence, stream entry id), "" when it gives none
    latency_s: float | None = None  # commit to ack on the fast path; None from the sweeper


class Failed(NamedTuple):
    msg_id: str
    topic: str
    attempt: int  # 1 for the first attempt on its path
    error: str


class RelayListener:
    """Do-nothing hooks; override the ones you need (see the module's docstring)."""

    def published(self, sent: Sequence[Sent], path: Path) -> None:
        """The broker acknowledged these messages and their rows are marked sent."""

    def retried(self, failed: Sequence[Failed], path: Path) -> None:
        """These attempts failed; each message is scheduled for another one."""

    def rejected(self, failed: Sequence[Failed]) -> None:
        """The broker refused these for good on the fast path; the sweeper retries them
        with backoff until they go dead."""

    def left_for_sweeper(self, msg_ids: Sequence[str], reason: Reason) -> None:
        """The fast path let these go; their rows stay pending for the sweeper."""

    def dead(self, failed: Sequence[Failed]) -> None:
        """The sweeper gave up on these rows (``max_attempts``): they are marked dead."""

    def swept(self, result: SweepResult, seconds: float) -> None:
        """A sweeper committed one batch of claimed rows (``seconds``: claim to commit)."""


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
