"""The window a reconciliation judges: which commits count, when a missing one is lost, and
which ledger rows the job reads to judge it."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

# Ledger rows created this long after the window's end are read too: a database clock a
# little ahead of the broker's gives a message delivered before the end a later commit.
CLOCK_SKEW_S = 300.0


@dataclass(frozen=True)
class Window:
    start: datetime
    end: datetime
    sla_s: float = 60.0
    # How far before the window the ledger is read with it: a message committed earlier
    # and delivered inside the window (a late sweep) is found there; one committed before
    # is looked up by msg_id (reconciliation.without_earlier_commits). An optimisation only.
    lookback_s: float = 3600.0

    @property
    def pending_after(self) -> datetime:
        """Commits from here to ``end`` may not be at the broker yet: pending, not lost."""
        return self.end - timedelta(seconds=self.sla_s)

    @property
    def ledger_from(self) -> datetime:
        """The ledger rows the job reads: created (or due) from here to ``ledger_until``."""
        return self.start - timedelta(seconds=self.lookback_s)

    @property
    def ledger_until(self) -> datetime:
        return self.end + timedelta(seconds=CLOCK_SKEW_S)
