"""The fast path's look at the table before publishing, on a thread of its own.

Two questions, one trip to the verifier's thread: which rows are committed and still
pending (``verify``: a delivery marked ``Look.COMMIT``), then which ordered heads must
wait for an earlier row of their key (``heads``: ``Look.TURN``), by a statement of its
own, a newer snapshot. A failed look keeps every delivery back: none is visible, every
head's key is blocked.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from relay.fastpath.acks import Heads, Verify
from relay.fastpath.delivery import Delivery, Look

log = logging.getLogger("relay.fastpath.dispatcher")


class Sorted(NamedTuple):
    """A checked batch: what may be published, and what is held back, in batch order: a
    row not visible (still ``Look.COMMIT``) or a head that waits for its key (``Look.TURN``)."""

    kept: list[Delivery]
    held: list[Delivery]


class Checks:
    """Looks at the table for the dispatcher; made on the broker loop, shut at stop."""

    def __init__(self, verify: Verify | None, heads: Heads | None) -> None:
        self._verify = verify
        self._heads = heads
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="outbox-verify")

    async def sort(self, batch: list[Delivery]) -> Sorted:
        """Sort ``batch`` by what the table says; the ones with nothing to look at are kept.

        A row not visible yet belongs to a transaction that has not really committed (or
        never will); a head whose key has an earlier row pending or dead waits for it.
        A delivery seen committed, or whose turn is confirmed, needs no new look.
        """
        to_check = [d for d in batch if d.look]
        if not to_check:
            return Sorted(batch, [])
        loop = asyncio.get_running_loop()
        try:
            found, blocked = await loop.run_in_executor(self._thread, self._look, to_check)
        except Exception as exc:
            log.warning("verifying %d message(s) failed: %s", len(to_check), exc.__class__.__name__)
            found, blocked = set(), {(d.message.topic, d.message.key or "") for d in to_check}
        done = Sorted([], [])
        for delivery in batch:
            message = delivery.message
            if delivery.look & Look.COMMIT and message.msg_id not in found:
                done.held.append(delivery)
            elif delivery.look & Look.TURN and (message.topic, message.key) in blocked:
                delivery.look = Look.TURN  # seen committed once: retries need no new look
                done.held.append(delivery)
            else:
                delivery.look = Look.NONE
                done.kept.append(delivery)
        return done

    def _look(self, to_check: list[Delivery]) -> tuple[set[str], set[tuple[str, str]]]:
        """On the verifier's thread: the commit check, then the head check (if any)."""
        ids = [d.message.msg_id for d in to_check if d.look & Look.COMMIT]
        found = self._verify(ids) if ids and self._verify is not None else set()
        heads = [
            (d.message.topic, d.message.key or "", d.message.seq or 0)
            for d in to_check
            if d.look & Look.TURN and (not d.look & Look.COMMIT or d.message.msg_id in found)
        ]
        blocked = self._heads(heads) if heads and self._heads is not None else set()
        return found, blocked

    def shutdown(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
