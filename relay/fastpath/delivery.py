"""``Delivery``: one committed message on the fast path, and what must be looked at
before it is published (``Look``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from outbox.message import Message


class Look(enum.IntFlag):
    """What the table must confirm before a delivery is published."""

    NONE = 0
    COMMIT = 1  # the row's commit is not proven: it must be visible and pending
    TURN = 2  # an ordered lane's head: no earlier row of its key may be unsettled


@dataclass(slots=True)
class Delivery:
    message: Message
    committed: float  # clock() at commit: the start of commit->ack latency
    look: Look = Look.COMMIT  # cleared once the table confirmed it
    attempt: int = 0  # index into retry_delays_ms of the attempt being made
    waits: int = 0  # times it waited for its key: index into retry_delays_ms like attempt
