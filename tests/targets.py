"""Broker namespaces of a test's own for the poison-row tests: the one broker harness
(relay.testing.harness) with, per broker, the rows it cannot take."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from relay.testing.harness import BrokerUnderTest, broker_families, broker_under_test


@dataclass(frozen=True)
class Carried:
    """One message as the broker holds it."""

    msg_id: str
    topic: str
    payload: bytes
    headers: dict[str, str]


@dataclass
class Target:
    """A broker namespace of the test's own: where to publish, how to read it back, and
    rows this broker cannot take (why -> plant columns, a piece of the expected error)."""

    url: str
    prefix: str  # every healthy topic starts with it
    read: Callable[[], list[Carried]]
    poisons: dict[str, tuple[dict[str, Any], str]] = field(default_factory=dict)


def poisons_of(h: BrokerUnderTest) -> dict[str, tuple[dict[str, Any], str]]:
    """The rows ``h``'s broker cannot take; none known for a broker not listed here."""
    known = {"nats": nats_poisons, "rabbitmq": rabbitmq_poisons, "redis": redis_poisons}
    return known[h.kind](h) if h.kind in known else {}


def nats_poisons(h: BrokerUnderTest) -> dict[str, tuple[dict[str, Any], str]]:
    prefix, tag = h.prefix, h.prefix[1:]
    [stream] = h.sources()
    return {
        "oversize for the server's max_payload": (
            dict(topic=f"{prefix}.big", payload=b"x" * (1024 * 1024)),
            "MaxPayloadError",
        ),
        "a subject no stream captures": (
            dict(topic=f"elsewhere{tag}.x"),
            "no JetStream stream captures subject",
        ),
        "the server's API": (dict(topic=f"$JS.API.STREAM.DELETE.{stream}"), ""),
    }


def rabbitmq_poisons(h: BrokerUnderTest) -> dict[str, tuple[dict[str, Any], str]]:
    prefix, tag = h.prefix, h.prefix[1:]
    return {
        "a routing key over 255 bytes": (
            dict(topic=f"{prefix}.{'é' * 130}"),
            "272",  # the contract refuses the row; the fast path's adapter, the message
        ),
        "a topic no queue binds": (dict(topic=f"unbound{tag}.x"), "unroutable"),
    }


def redis_poisons(h: BrokerUnderTest) -> dict[str, tuple[dict[str, Any], str]]:
    prefix = h.prefix
    h.poison(f"{prefix}.wrong")  # makes the key of the topic a string: XADD to it fails
    return {"a key of the wrong type": (dict(topic=f"{prefix}.wrong"), "WRONGTYPE")}


@pytest.fixture(params=broker_families())
def target(request: pytest.FixtureRequest) -> Iterator[Target]:
    with broker_under_test(request.param) as h:
        assert h.url is not None

        def read() -> list[Carried]:  # fails if a NATS stream was deleted
            return [Carried(e.msg_id or "", e.topic, e.payload, e.headers) for e in h.read()]

        yield Target(h.url, h.prefix, read, poisons_of(h))
