"""Publishing a claimed batch in waves, through the broker loop.

The first wave has the unordered rows and each ordered key's first row; each next wave
the next row of each key whose rows have all been acked so far. A key's row is never in
flight beside, nor before the ack of, the row before it; a failure stops its key for
this batch (the rest stay pending, unattempted). The sweep, the scheduler and the drain
all publish through ``Waves``.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

from outbox.broker import Outcome, PublishResult, permanent
from outbox.message import Message
from outbox.rows import KnownForms, StoredRow, stored_message
from outbox.settings import Settings
from outbox.tracing import publish_span
from relay import store
from relay.brokers.base import NOT_CONNECTED, publish_isolated
from relay.loop import BrokerLoop


class BrokerUnreachable(Exception):
    """Raised inside the claiming transaction to roll it back; the message says why."""


class Published(NamedTuple):
    """A batch's answers, one per row (None: not tried), and why it was cut short if it was."""

    results: list[PublishResult | None]
    cut_short: str | None
    held: int  # rows not tried: behind a failure of their key, or after a cut


class Waves:
    """Publishes a claimed batch through ``broker_loop``, key by key in seq order;
    ``stopping`` set: the broker is not asked (BrokerUnreachable)."""

    def __init__(self, broker_loop: BrokerLoop, settings: Settings, stopping: threading.Event):
        self.broker_loop = broker_loop
        self.settings = settings
        self._stopping = stopping

    def publish(
        self, rows: Sequence[store.Claimed], prepared: list[Message | PublishResult]
    ) -> Published:
        """Publish in waves (see the module). If the broker stops answering after the first
        wave, the answers so far are kept and the rest is left pending (``cut_short``); in
        the first, BrokerUnreachable."""
        results: list[PublishResult | None] = [None] * len(rows)
        chains = [deque(chain) for chain in key_chains(rows)]
        first = True
        while chains:
            wave = [chain.popleft() for chain in chains]
            try:
                answers = self._wave([prepared[i] for i in wave])
            except BrokerUnreachable as why:
                if first:
                    raise
                return Published(results, str(why), sum(map(len, chains)) + len(wave))
            for i, answer in zip(wave, answers, strict=True):
                results[i] = answer
            chains = [c for c, a in zip(chains, answers, strict=True) if c and a.ok]
            first = False
        return Published(results, None, sum(r is None for r in results))

    def _wave(self, prepared: list[Message | PublishResult]) -> list[PublishResult]:
        """One result per row (the broker's, or the row's own refusal); BrokerUnreachable
        when the broker could not be asked at all."""
        messages = [m for m in prepared if isinstance(m, Message)]
        if not messages:
            return [r for r in prepared if isinstance(r, PublishResult)]
        if self._stopping.is_set() or not self.broker_loop.running:
            raise BrokerUnreachable("stopping" if self._stopping.is_set() else "loop stopped")
        loop = self.broker_loop
        try:
            with publish_span(messages):
                answers = loop.submit(publish_isolated(loop.broker, messages))
                results = answers.result(self.settings.publish_timeout_s)
        except Exception as exc:  # timeout, loop closed: the broker was not answering
            raise BrokerUnreachable(f"publish failed: {exc!r}") from None
        if all(r.outcome is Outcome.RETRY and r.error == NOT_CONNECTED for r in results):
            raise BrokerUnreachable("not connected")
        found = iter(results)
        return [next(found) if isinstance(m, Message) else m for m in prepared]


def ordered_ids(
    rows: Sequence[store.Claimed], results: Sequence[PublishResult | None], ok: bool
) -> list[int]:
    """The ids of the ordered rows that were tried and succeeded (``ok``) or failed."""
    return [
        row.id
        for row, result in zip(rows, results, strict=True)
        if row.seq is not None and result is not None and result.ok is ok
    ]


def key_chains(rows: Sequence[store.Claimed]) -> list[list[int]]:
    """The rows' indexes as publishing chains: each unordered row alone (first), then each
    ordered (topic, key)'s rows in seq order."""
    alone: list[list[int]] = []
    keys: dict[tuple[str, str | None], list[int]] = {}
    for i, row in enumerate(rows):
        if row.seq is None:
            alone.append([i])
        else:
            keys.setdefault((row.topic, row.key), []).append(i)
    ordered = [sorted(chain, key=lambda i: (rows[i].seq, rows[i].id)) for chain in keys.values()]
    return alone + ordered


def checked_message(
    row: StoredRow, payload: bytes | None = None, known: KnownForms | None = None
) -> Message | PublishResult:
    """The row's message if it keeps the contract ``send()`` enforces, else the row's own
    PERMANENT result: it is recorded as a failed attempt and not published."""
    try:
        return stored_message(row, payload, known)
    except Exception as exc:  # whatever is wrong with a stored row is that row's fault
        return permanent(f"invalid row: {exc}"[:500])
