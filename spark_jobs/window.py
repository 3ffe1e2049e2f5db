"""The window a reconciliation judges: which commits count, and when a missing one is lost."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta


@dataclass(frozen=True)
class Window:
    start: datetime
    end: datetime
    sla_s: float = 60.0

    @property
    def pending_after(self) -> datetime:
        """Commits from here to ``end`` may not be at the broker yet: pending, not lost."""
        return self.end - timedelta(seconds=self.sla_s)
