"""Which half-send failures model B's producer tries again (relay.lab.halfop.link)."""

from __future__ import annotations

import nats.errors
import nats.js.errors
import pytest

from outbox.errors import PayloadTooLarge
from relay.lab.halfop.link import worth_retrying


@pytest.mark.parametrize(
    "exc",
    [
        nats.errors.TimeoutError(),
        TimeoutError(),
        ConnectionError("not connected to NATS JetStream within 3 s"),
        nats.errors.ConnectionClosedError(),
        nats.errors.NoRespondersError(),
        nats.js.errors.NoStreamResponseError(),
        nats.js.errors.ServiceUnavailableError(code=503, description="JetStream not ready"),
    ],
)
def test_what_another_attempt_may_fix_is_retried(exc: BaseException) -> None:
    assert worth_retrying(exc)


@pytest.mark.parametrize(
    "exc",
    [
        PayloadTooLarge("payload", "MaxPayloadError: 2000000 bytes > server max_payload"),
        nats.errors.MaxPayloadError(),
        nats.errors.BadSubjectError(),
        nats.js.errors.BadRequestError(code=400, description="bad request"),
        ValueError("a bug of ours"),
    ],
)
def test_bad_input_is_not_retried(exc: BaseException) -> None:
    assert not worth_retrying(exc)
