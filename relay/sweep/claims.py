"""What a sweep takes: due rows and ordered heads with their followers, locked.

``Claimer`` builds the sweep's claim (relay.store claim_due_stmt, SKIP LOCKED; a drain's
also claim_heads_stmt; where the database finds heads key by key, relay.store.heads,
the ordered heads and the unordered rows by age apart) and adds the followers of each
ordered head it locked; ``Cursor``
keeps a drain pass's place, so that each row is claimed at most once per pass. The
scheduler brings a claim of its own (``Claim``): the sweeper publishes either the same way.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterable
from datetime import datetime, timedelta

from sqlalchemy import Connection

from outbox.settings import Settings
from relay import store

Claim = Callable[[Connection], list[store.Claimed]]  # locks a batch in the given transaction


class Claimer:
    """The sweep's claim: due rows older than an age, and ordered heads' followers."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.keys = KeyPlace()

    def claim(
        self, conn: Connection, age: float, due_only: bool, cursor: Cursor | None
    ) -> list[store.Claimed]:
        """Due rows and ordered heads, then the heads' followers, all locked."""
        now = store.db_clock(conn)
        cutoff, limit = now - timedelta(seconds=age), self.settings.sweep_batch
        if cursor is not None:
            rows = self._drain_claim(conn, cutoff, now, cursor)
        elif store.scans_heads(conn):
            rows = self._sweep_claim(conn, cutoff, now, due_only)
        else:
            rows = store.claim(conn, store.claim_due_stmt(cutoff, now, limit, due_only))
        return rows + store.followers(conn, rows, cutoff, limit - len(rows), limit)

    def _sweep_claim(
        self, conn: Connection, cutoff: datetime, now: datetime, due_only: bool
    ) -> list[store.Claimed]:
        """A sweep's batch where heads are found key by key: the ordered heads (half the
        batch at most: unordered rows keep their share under many keys), the unordered
        rows tried before and due (older), then those never tried, by age, to fill it.
        Each claim on its own index: rows blocked behind a dead head (or a few keys'
        many rows) and rows backing off are read by none."""
        limit = self.settings.sweep_batch
        rows = self._heads(conn, cutoff, now, max(1, limit // 2), due_only, ())
        if len(rows) < limit:
            retries = store.claim_retries_stmt(cutoff, now, limit - len(rows), due_only)
            rows += store.claim(conn, retries)
        if len(rows) < limit:
            rows += store.claim(conn, store.claim_aged_stmt(cutoff, limit - len(rows)))
        return sorted(rows, key=lambda row: row.id)

    def _heads(
        self,
        conn: Connection,
        cutoff: datetime,
        now: datetime,
        limit: int,
        due_only: bool,
        failed: Collection[int],
    ) -> list[store.Claimed]:
        """Ordered heads, at most ``limit``: key by key from the place the last claim
        left (round to the first key if need be) where the database can, else by id."""
        if not store.scans_heads(conn):
            return store.claim(conn, store.claim_heads_stmt(cutoff, limit, failed))
        after = self.keys.place()
        stmt = store.key_heads_stmt(cutoff, now, limit, due_only, failed, after=after)
        heads = store.claim(conn, stmt)
        last = heads
        if len(heads) < limit and after is not None:  # round to the keys before the place
            stmt = store.key_heads_stmt(
                cutoff, now, limit - len(heads), due_only, failed, upto=after
            )
            more = store.claim(conn, stmt)
            heads, last = heads + more, more or heads
        self.keys.passed(last if len(heads) >= limit else [])
        return heads

    def _drain_claim(
        self, conn: Connection, cutoff: datetime, now: datetime, cursor: Cursor
    ) -> list[store.Claimed]:
        """A drain's batch: the ordered heads (by key, whatever their id), then unordered
        rows past the cursor to fill it. Two claims, each on its own index range: one
        statement with both could bound neither, and read the whole backlog per batch."""
        limit = self.settings.sweep_batch
        heads = cursor.not_failed(self._heads(conn, cutoff, now, limit, False, cursor.failed_ids()))
        room = limit - len(heads)
        if room <= 0:
            return heads
        claim = store.claim_due_stmt(cutoff, now, room, False, after_id=cursor.claimed_up_to)
        unordered = store.claim(conn, claim)
        if unordered:
            # The unordered rows' only: heads and their followers leave the ids between.
            cursor.advance(max(row.id for row in unordered))
        return sorted(heads + unordered, key=lambda row: row.id)


class Cursor:
    """Where the sweeps of one drain pass are (thread-safe): the highest row id claimed
    (unordered rows are taken past it only, each once) and the ordered rows that failed
    (a key's next head may sit below that id: ordered heads are taken by key, not by id,
    but a failed one is not taken again in the pass). The followers claimed with their
    head do not move the id: the rows between stay to be taken."""

    def __init__(self) -> None:
        self.claimed_up_to = 0
        self.failed: set[int] = set()
        self._lock = threading.Lock()

    def advance(self, row_id: int) -> None:
        with self._lock:
            self.claimed_up_to = max(self.claimed_up_to, row_id)

    def failed_ordered(self, row_ids: Iterable[int]) -> None:
        with self._lock:
            self.failed.update(row_ids)

    def failed_ids(self) -> list[int]:
        with self._lock:
            return list(self.failed)

    def not_failed(self, rows: list[store.Claimed]) -> list[store.Claimed]:
        """``rows`` less those that failed in this pass, asked again once they are locked:
        a sweep that failed one may have committed after the claim's statement was built
        (its failure is recorded before its commit, so it is seen here)."""
        with self._lock:
            return [row for row in rows if row.id not in self.failed]


class KeyPlace:
    """Where the ordered heads' claims are among the keys (thread-safe): the next claim
    starts past the last key a full one took, so that with more heads than a batch
    holds each key has its turn; None: from the first key."""

    def __init__(self) -> None:
        self._after: store.KeyAt | None = None
        self._lock = threading.Lock()

    def place(self) -> store.KeyAt | None:
        with self._lock:
            return self._after

    def passed(self, heads: list[store.Claimed]) -> None:
        """A full claim's last statement took ``heads``: the next claim starts past the
        last of their keys. None taken (a claim that was not full): from the first key."""
        keys = [(row.topic, row.key) for row in heads if row.key is not None]
        with self._lock:
            self._after = max(keys) if keys else None
