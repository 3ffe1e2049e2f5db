"""Which Redis replies are worth another try: since permanent failures go dead after
``permanent_attempts`` tries, a reply that passes (failover, memory) must say retry."""

from __future__ import annotations

import pytest
import redis.exceptions as errors

from outbox.broker import Outcome
from relay.brokers.redis import result_of


@pytest.mark.parametrize(
    "reply",
    [
        errors.ReadOnlyError("You can't write against a read only replica."),
        errors.OutOfMemoryError("command not allowed when used memory > 'maxmemory'."),
        errors.BusyLoadingError("Redis is loading the dataset in memory"),
        errors.TryAgainError("Multiple keys request during rehashing of slot"),
        errors.ClusterDownError("The cluster is down"),
        errors.MasterDownError("Link with MASTER is down"),
        errors.ConnectionError("Connection closed by server."),
    ],
    ids=type,
)
def test_a_reply_that_passes_is_retried(reply: Exception) -> None:
    assert result_of(reply).outcome is Outcome.RETRY


def test_a_refusal_that_stays_is_permanent() -> None:
    reply = errors.ResponseError("WRONGTYPE Operation against a key holding the wrong kind")
    assert result_of(reply).outcome is Outcome.PERMANENT
