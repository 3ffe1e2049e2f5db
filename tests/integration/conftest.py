"""Fixtures of model B's integration tests (test_halfop*, test_check_loop)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from relay.brokers.nats import create_stream
from relay.lab.halfop import Coordinator, TransactionProducer
from relay.testing.embedded import NatsServer
from tests.halfop import QUICK, running_coordinator


@pytest.fixture
def real_stream(nats_server: NatsServer, stream: tuple[str, str]) -> tuple[str, str]:
    """A stream consumers read for the real topics of this test."""
    name, prefix = stream
    create_stream(nats_server.url, name, f"{prefix}.>")
    return name, prefix


@pytest.fixture
def coordinator(nats_server: NatsServer) -> Iterator[Coordinator]:
    yield from running_coordinator(nats_server.url, QUICK)


@pytest.fixture
def producers() -> Iterator[list[TransactionProducer]]:
    """Producers a test started (``tests.halfop.producer``); stopped afterwards."""
    started: list[TransactionProducer] = []
    yield started
    for p in started:
        p.stop()
