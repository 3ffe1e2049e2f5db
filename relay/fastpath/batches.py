"""``BatchReport``: what became of one batch's messages, told to the listeners together.

The fast path (relay.fastpath.dispatcher) fills one per publish batch; the sweeper
(relay.sweep.sweeper) one per claimed batch, told only once its marks have committed.
Acks of the fast path are told by the ack batcher (relay.fastpath.acks) once marked, not here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from outbox.events import Failed, Path, Sent
from relay.listener import Listeners


@dataclass(slots=True)
class BatchReport:
    sent: list[Sent] = field(default_factory=list)  # the sweeper's: marked sent in its batch
    retried: list[Failed] = field(default_factory=list)  # another attempt is scheduled
    rejected: list[Failed] = field(default_factory=list)  # the broker refused them for good
    dead: list[Failed] = field(default_factory=list)  # attempts spent: marked dead
    exhausted: list[str] = field(default_factory=list)  # retry schedule spent: left to the sweeper
    stopped: list[str] = field(default_factory=list)  # held at stop(): left to the sweeper
    behind: list[str] = field(default_factory=list)  # behind an ordered head that left

    def left(self) -> int:
        """How many of the batch left the fast path (the retried stay)."""
        return len(self.rejected) + len(self.exhausted) + len(self.stopped) + len(self.behind)

    def tell(self, listeners: Listeners, path: Path) -> None:
        if self.sent:
            listeners.published(self.sent, path)
        if self.retried:
            listeners.retried(self.retried, path)
        if self.rejected:
            listeners.rejected(self.rejected)
        if self.dead:
            listeners.dead(self.dead)
        if self.exhausted:
            listeners.left_for_sweeper(self.exhausted, "exhausted")
        if self.stopped:
            listeners.left_for_sweeper(self.stopped, "stopped")
        if self.behind:  # after their head's news: a listener hears the head first
            listeners.left_for_sweeper(self.behind, "behind_head")
