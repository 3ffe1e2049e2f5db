"""What model B's tests share: the answers, quick coordinator settings, a started producer
and coordinator."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from relay.lab.halfop import (
    Coordinator,
    CoordinatorSettings,
    LocalTransactionState,
    TransactionListener,
    TransactionProducer,
)

QUICK = CoordinatorSettings(check_interval_s=0.2, transaction_timeout_s=0.3, check_max=15)
COMMIT, ROLLBACK, UNKNOW = (
    LocalTransactionState.COMMIT_MESSAGE,
    LocalTransactionState.ROLLBACK_MESSAGE,
    LocalTransactionState.UNKNOW,
)


def producer(
    url: str,
    listener: TransactionListener,
    started: list[TransactionProducer],
    group: str = "orders",
    **options: Any,
) -> TransactionProducer:
    """A started producer, added to ``started`` (the ``producers`` fixture stops them)."""
    p = TransactionProducer(group=group, broker=url, listener=listener, **options)
    p.start()
    started.append(p)
    return p


def running_coordinator(url: str, settings: CoordinatorSettings) -> Iterator[Coordinator]:
    """A started coordinator, stopped when the fixture that yields from this ends."""
    c = Coordinator(url, settings)
    c.start()
    yield c
    c.stop()
