"""Scheduled rows for the scheduler's tests and bench, written as send(delay=...) does:
``deliver_at`` = the database's now + the delay, in the writing transaction."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine, insert, select

from outbox import outbox_message
from outbox.message import Message, build_message
from outbox.rows import row_values
from relay import store

t = outbox_message


def schedule(conn: Connection, topic: str, delays_s: Sequence[float]) -> list[Message]:
    """One row per delay in ``conn``'s transaction; the messages as the app's commit hands
    them to a relay (``delay_s`` and ``born`` set: born before the database's now is read,
    so a hint from it is never late)."""
    born = time.monotonic()
    now = store.db_clock(conn)
    messages, values = [], []
    for delay in delays_s:
        message = build_message(topic, b"{}", max_payload_bytes=1 << 20)
        messages.append(replace(message, born=born, delay_s=delay))
        values.append(row_values(message) | {"deliver_at": now + timedelta(seconds=delay)})
    for chunk in range(0, len(values), 1000):
        conn.execute(insert(t), values[chunk : chunk + 1000])
    return messages


def schedule_rows(engine: Engine, topic: str, delays_s: Sequence[float]) -> list[Message]:
    with engine.begin() as conn:
        return schedule(conn, topic, delays_s)


def due_times(engine: Engine) -> dict[str, datetime]:
    """Each scheduled row's deliver_at by msg_id."""
    with engine.connect() as conn:
        rows = conn.execute(select(t.c.msg_id, t.c.deliver_at).where(t.c.deliver_at.is_not(None)))
        return {str(msg_id): at for msg_id, at in rows}


def statuses(engine: Engine) -> dict[str, str]:
    with engine.connect() as conn:
        return {str(m): s for m, s in conn.execute(select(t.c.msg_id, t.c.status))}


def db_offset_bound_s(engine: Engine, samples: int = 20) -> float:
    """An upper bound of (database clock - this host's wall clock), in seconds: each
    reading of the database clock happened after the wall time taken before it, so
    db - wall_before bounds the offset from above; the least of the samples is kept."""
    bound = float("inf")
    with engine.connect() as conn:
        for _ in range(samples):
            before = time.time()
            now = store.db_clock(conn)
            bound = min(bound, now.timestamp() - before)
    return bound


def early(arrivals: dict[str, datetime], due: dict[str, datetime], offset_s: float) -> list[Any]:
    """The messages that reached the broker before their deliver_at by the database
    clock: arrival (wall clock of this host) + the offset bound < deliver_at."""
    bound = timedelta(seconds=offset_s)
    return [(m, at, due[m]) for m, at in arrivals.items() if at + bound < due[m]]
