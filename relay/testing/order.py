"""Per-key order as a consumer sees it, checked over what a broker holds.

Works on ``outbox.broker.LogEntry`` (a ``LogReader``'s chunks, ``outbox export``'s
rows turned back into entries) or anything with ``msg_id``, ``topic`` and ``headers``,
listed in the broker's order. Only messages sent with ``ordered=True`` carry
``Outbox-Seq``; the others are not checked. A later copy of a msg_id already seen is a
duplicate (at least once), not a reordering: it is left out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from outbox.message import KEY_HEADER, SEQ_HEADER

Key = tuple[str, str]  # (topic, key)


class Held(Protocol):
    @property
    def msg_id(self) -> str | None: ...
    @property
    def topic(self) -> str: ...
    @property
    def headers(self) -> dict[str, str]: ...


@dataclass(frozen=True)
class OutOfOrder:
    """A key's message that arrived after a later one of the same key."""

    topic: str
    key: str
    msg_id: str
    seq: int
    after_seq: int  # the highest seq of the key delivered before it


def key_sequences(entries: Iterable[Held]) -> dict[Key, list[tuple[int, str]]]:
    """Per (topic, key), the (seq, msg_id) of each message's first copy, in broker order."""
    seen: set[str] = set()
    keys: dict[Key, list[tuple[int, str]]] = {}
    for entry in entries:
        seq, key = entry.headers.get(SEQ_HEADER), entry.headers.get(KEY_HEADER)
        if seq is None or key is None or entry.msg_id is None or entry.msg_id in seen:
            continue
        seen.add(entry.msg_id)
        keys.setdefault((entry.topic, key), []).append((int(seq), entry.msg_id))
    return keys


def out_of_order(entries: Iterable[Held]) -> list[OutOfOrder]:
    """Every first copy whose seq is below one its key delivered before it."""
    found: list[OutOfOrder] = []
    for (topic, key), sequence in key_sequences(entries).items():
        highest = 0
        for seq, msg_id in sequence:
            if seq < highest:
                found.append(OutOfOrder(topic, key, msg_id, seq, highest))
            highest = max(highest, seq)
    return found


def gaps(entries: Iterable[Held]) -> dict[Key, list[int]]:
    """Per key, the seqs missing between 1 and its highest (a key's numbers have no gap
    in the table: a missing one was not delivered, or not yet)."""
    missing: dict[Key, list[int]] = {}
    for key, sequence in key_sequences(entries).items():
        have = {seq for seq, _ in sequence}
        if lost := sorted(set(range(1, max(have) + 1)) - have):
            missing[key] = lost
    return missing
