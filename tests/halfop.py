"""What model B's tests share: the answers, quick coordinator settings, a started producer."""

from __future__ import annotations

from typing import Any

from relay.halfop import (
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
