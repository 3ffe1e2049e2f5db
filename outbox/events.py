"""What the relay tells an application: hooks that hear what happened to each message,
the values they receive, and the fast path's counters (``Outbox.stats``).

An app imports these from here (the relay imports them too: they sit below both).

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
``dead``; ``swept`` follows each batch it committed. A scheduled message (``send(delay=...)``)
is the relay's scheduler's: ``published(path="scheduler")``, ``retried`` or ``dead``, no ``swept``.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, get_args

Path = Literal["fast", "sweeper", "scheduler"]
# Why the fast path let a message go; its row stays pending for the sweeper.
# queue_full: the fast path held queue_size messages at commit; exhausted: the retry
# schedule is spent; too_old: past the hand-off limit; mark_failed: acked, but marking
# the row failed (it will be published again); stopped: still held at stop();
# behind_head: an ordered message behind its key's head, which the fast path let go
# (the sweeper takes the key over, in order).
Reason = Literal["queue_full", "exhausted", "too_old", "mark_failed", "stopped", "behind_head"]
REASONS: tuple[Reason, ...] = get_args(Reason)


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
        """The broker refused these for good on the fast path; the sweeper tries them
        again, with backoff, until they go dead (``permanent_attempts``)."""

    def left_for_sweeper(self, msg_ids: Sequence[str], reason: Reason) -> None:
        """The fast path let these go; their rows stay pending for the sweeper."""

    def dead(self, failed: Sequence[Failed]) -> None:
        """The sweeper gave up on these rows (``max_attempts``, or ``permanent_attempts``
        for a permanent failure): they are marked dead."""

    def swept(self, result: SweepResult, seconds: float) -> None:
        """A sweeper committed one batch of claimed rows (``seconds``: claim to commit)."""


@dataclass
class SweepResult:
    """What a sweep did with the rows it claimed: one batch, or the sum of several."""

    claimed: int = 0
    sent: int = 0
    failed: int = 0  # scheduled for another attempt
    dead: int = 0
    aborted: bool = False  # the broker was unreachable: the batch (or its rest) left pending
    # Why they failed: the error cut to one line -> how many (what `outbox drain` and
    # `outbox relay` print under their counts: "5 x permanent: message too large").
    retry_reasons: collections.Counter[str] = field(default_factory=collections.Counter)
    dead_reasons: collections.Counter[str] = field(default_factory=collections.Counter)

    def __iadd__(self, other: SweepResult) -> SweepResult:
        self.claimed += other.claimed
        self.sent += other.sent
        self.failed += other.failed
        self.dead += other.dead
        self.aborted = self.aborted or other.aborted
        self.retry_reasons += other.retry_reasons
        self.dead_reasons += other.dead_reasons
        return self


@dataclass
class Stats:
    """Counters of one fast path (``Outbox.stats``), plain integers; read them from any thread.

    Their writers:
    - the broker loop: most of them (``accepted``, ``published``, ``retried``, ...,
      ``latencies``); also ``marked`` when listeners want to hear ``published`` (it
      counts after telling them);
    - the acks thread: ``mark_statements``, ``mark_failed``, and ``marked`` when nobody
      listens;
    - app threads, in ``Dispatcher.submit`` under the dispatcher's lock: ``queue_full``;
    - the thread that calls ``Dispatcher.stop``: ``dropped_at_stop`` for commits a loop
      that did not answer left behind;
    - ``held`` and ``held_peak``: under ``relay.fastpath.stats.Slots``' lock, by app threads
      (take), the loop, the acks thread and ``stop`` (free).
    Prometheus metrics count through a listener, not from these.
    """

    accepted: int = 0
    queue_full: int = 0  # left in the table: the fast path held queue_size messages
    held: int = 0  # messages the fast path holds now (Slots), at most queue_size
    held_peak: int = 0  # the most it ever held at once
    published: int = 0
    first_attempt: int = 0  # acked on the first attempt
    retried: int = 0
    exhausted: int = 0  # retry schedule spent: left for the sweeper
    too_old: int = 0  # past the hand-off limit: left for the sweeper
    rejected: int = 0  # permanent broker error: left for the sweeper to dead-letter
    duplicates: int = 0  # the broker reported it already held the msg_id
    dropped_at_stop: int = 0
    not_visible: int = 0  # handed over after COMMIT but the row was not there (yet)
    key_waits: int = 0  # an ordered head found an earlier row of its key unsettled: waits
    behind_head: int = 0  # ordered messages left to the sweeper with their key's head
    marked: int = 0  # rows marked sent (or deleted) after an ack
    mark_statements: int = 0  # statements that did it: one per batch, more only on retries
    mark_failed: int = 0  # acked but not marked: the sweeper will publish them again
    latencies: collections.deque[float] = field(  # commit to ack, the latest ones
        default_factory=lambda: collections.deque(maxlen=100_000)
    )
