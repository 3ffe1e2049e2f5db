"""Brokers are registered: each declares itself in a ``BrokerRegistration``, listed in the
entry-point group ``outbox.brokers``, and every table about brokers is derived from the
registrations (outbox.brokers_registry).
"""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import EntryPoint, entry_points

import pytest

import outbox.message
from outbox import brokers_registry
from outbox.broker import BROKER_SCHEMES
from outbox.brokers_registry import BrokerRegistration, WireLimits, registrations
from outbox.engines import check_broker_url
from outbox.errors import ConfigError, InvalidHeaders, InvalidTopic
from outbox.message import build_message
from relay.brokers import ADAPTERS, LOG_SOURCE_FLAGS, broker_for, family_of, reader_for
from relay.cli import EXTRA_OF
from relay.testing.harness import (
    BrokerUnderTest,
    HarnessOptions,
    broker_families,
    broker_under_test,
    kinds,
)
from relay.testing.memory import MemoryBroker

MIB = 1024 * 1024
FAKE_BROKER = MemoryBroker()


@pytest.fixture
def restored() -> Iterator[None]:
    """The registry as loaded from the entry points, again after the test."""
    before = dict(registrations())
    yield
    registrations().clear()
    registrations().update(before)
    brokers_registry._changed()


def test_the_three_brokers_are_found_through_the_entry_point_group() -> None:
    found = {ep.name: ep.value for ep in entry_points(group=brokers_registry.GROUP)}
    assert found == brokers_registry.BUILTIN  # the checkout's fallback says the same
    for name, ep in zip(found, entry_points(group=brokers_registry.GROUP), strict=True):
        registration = ep.load()
        assert isinstance(registration, BrokerRegistration)
        assert registration.family == name
    assert list(registrations()) == ["nats", "rabbitmq", "redis"]


def test_the_derived_tables_are_what_they_were() -> None:
    assert dict(BROKER_SCHEMES) == {
        "nats": "nats",
        "tls": "nats",
        "amqp": "rabbitmq",
        "amqps": "rabbitmq",
        "redis": "redis",
        "rediss": "redis",
    }
    assert dict(ADAPTERS) == {
        "nats": "relay.brokers.nats:NatsBroker",
        "rabbitmq": "relay.brokers.rabbitmq:RabbitBroker",
        "redis": "relay.brokers.redis:RedisBroker",
    }
    assert {m: e for m, e in EXTRA_OF.items() if e in registrations()} == {
        "nats": "nats",
        "aio_pika": "rabbitmq",
        "aiormq": "rabbitmq",
        "redis": "redis",
    }
    assert EXTRA_OF["pyspark"] == "spark"  # the others' stay
    assert {r.extra for r in registrations().values()} == {"nats", "rabbitmq", "redis"}
    assert dict(LOG_SOURCE_FLAGS) == {
        "nats": ("--stream",),
        "rabbitmq": ("--queue",),
        "redis": ("--stream",),
    }
    assert kinds() == ("nats", "rabbitmq", "redis", "memory")
    assert broker_families() == ["nats", "rabbitmq", "redis"]


def test_send_checks_the_strictest_wire_limits_of_every_broker() -> None:
    """The limits moved from outbox.message to their brokers' registrations; send() holds
    each message to the strictest, as before."""
    assert outbox.message.MAX_HEADER_BYTES == 65_535  # JetStream's header block
    assert set(outbox.message.RESERVED_HEADER_PREFIXES) == {"nats-", "outbox-"}
    assert set(outbox.message.RESERVED_HEADER_NAMES) == {"cc", "bcc"}  # RabbitMQ's
    assert brokers_registry.strictest_limits().max_topic_bytes == 255  # AMQP's routing key
    assert brokers_registry.strictest_limits() is brokers_registry.strictest_limits()  # cached
    with pytest.raises(InvalidHeaders, match="reserved by the relay or a broker"):
        build_message("t", b"", headers={"CC": "x"}, max_payload_bytes=MIB)


def test_the_registrations_load_without_any_broker_client() -> None:
    """An install without the brokers' extras loads them: only making an adapter
    imports a client, and says which extra is missing."""
    blocked = ["nats", "aio_pika", "aiormq", "redis"]
    probe = f"""
import sys
for name in {blocked!r}:
    sys.modules[name] = None  # import fails as if not installed
from outbox import brokers_registry
from outbox.message import build_message
assert sorted(brokers_registry.registrations()) == ["nats", "rabbitmq", "redis"]
build_message("orders.created", b"x", max_payload_bytes=1024)
from relay.brokers import broker_for
from outbox.errors import ConfigError
try:
    broker_for("amqp://127.0.0.1")
except ConfigError as exc:
    assert "pip install 'outbox-relay[rabbitmq]'" in str(exc), exc
else:
    raise AssertionError("no ConfigError")
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def fake_harness(prefix: str, options: HarnessOptions) -> Iterator[BrokerUnderTest]:
    """A harness for the fake broker: the one MemoryBroker under a URL of its own."""
    yield BrokerUnderTest(
        "fake",
        prefix,
        "fake://local",
        lambda: FAKE_BROKER,
        FAKE_BROKER,
        lambda: sorted({m.topic for m in FAKE_BROKER.published}),
        lambda topic: build_message(topic, b"x", max_payload_bytes=MIB),
        dedup=True,
        server=None,
        receipt_of=lambda entry: entry.seq,
    )


FAKE = BrokerRegistration(
    family="fake",
    schemes=("fake", "fakes"),
    extra="fake",
    adapter=lambda url: FAKE_BROKER,
    client_modules=("fakeclient",),
    log_source_flags=("--stream",),
    limits=WireLimits(max_topic_bytes=10, reserved_header_prefixes=("fake-",)),
    harness=fake_harness,
    requirement="outbox-fake-broker",
)


def test_a_registered_broker_is_a_broker_url_scheme_end_to_end(restored: None) -> None:
    """A registration added at run time, as a package's entry point would add it, is taken
    by the app's URL check, the relay's adapter lookup, the CLI's extras, the limits
    send() checks and the test harness."""
    with pytest.raises(ConfigError, match="no supported scheme"):
        check_broker_url("fake://local")
    brokers_registry.register(FAKE)
    assert check_broker_url("fakes://local") == "fakes://local"
    assert BROKER_SCHEMES["fakes"] == "fake" and family_of("fake://local") == "fake"
    assert broker_for("fake://local") is FAKE_BROKER
    assert reader_for("fake://local") is FAKE_BROKER  # no reader of its own: the adapter
    assert EXTRA_OF["fakeclient"] == "fake"
    assert ADAPTERS["fake"] is FAKE.adapter
    with pytest.raises(InvalidTopic, match="must be at most 10 bytes in UTF-8, got 11"):
        build_message("orders.new1", b"x", max_payload_bytes=MIB)
    with pytest.raises(InvalidHeaders, match="reserved by the relay or a broker"):
        build_message("orders", b"x", headers={"Fake-Id": "1"}, max_payload_bytes=MIB)
    assert "fake" in kinds()
    with broker_under_test("fake") as h:
        assert h.url is not None and family_of(h.url) == "fake"
    brokers_registry.unregister("fake")
    assert "fake" not in BROKER_SCHEMES
    build_message("orders.new1", b"x", max_payload_bytes=MIB)  # the limit left with it


def test_a_missing_adapter_module_names_the_extra(restored: None) -> None:
    missing = BrokerRegistration("fake", ("fake",), "fake", "outbox_no_such_client:Broker")
    brokers_registry.register(missing)
    with pytest.raises(
        ConfigError, match=r"needs the 'fake' extra: pip install 'outbox-relay\[fake\]'"
    ):
        broker_for("fake://local")


def test_a_broken_entry_point_is_skipped_with_a_warning(
    restored: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    broken = [
        EntryPoint("gone", "outbox_no_such_plugin:REGISTRATION", brokers_registry.GROUP),
        EntryPoint("wrong", "outbox.message:MAX_TEXT_BYTES", brokers_registry.GROUP),
    ]
    monkeypatch.setattr(brokers_registry, "entry_points", lambda group: broken)
    monkeypatch.setattr(brokers_registry, "_loaded", None)
    assert list(registrations()) == ["nats", "rabbitmq", "redis"]  # the product's, still
    assert "gone=outbox_no_such_plugin:REGISTRATION" in caplog.text
    assert "no BrokerRegistration" in caplog.text


def test_a_filter_that_asks_for_schemes_while_a_plugin_warns_does_not_recurse(
    restored: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The CLI's secret scrubber is a logging filter that asks for BROKER_SCHEMES: a broken
    plugin's warning, logged while the registry loaded, loaded it again without end (CI)."""
    broken = [EntryPoint("gone", "outbox_no_such_plugin:REGISTRATION", brokers_registry.GROUP)]
    monkeypatch.setattr(brokers_registry, "entry_points", lambda group: broken)
    monkeypatch.setattr(brokers_registry, "_loaded", None)
    monkeypatch.setattr(brokers_registry.BROKER_SCHEMES, "_table", None)

    def asks(record: logging.LogRecord) -> bool:
        return "nats" in brokers_registry.BROKER_SCHEMES

    caplog.handler.addFilter(asks)
    try:
        assert list(registrations()) == ["nats", "rabbitmq", "redis"]
    finally:
        caplog.handler.removeFilter(asks)
    assert "gone=outbox_no_such_plugin:REGISTRATION" in caplog.text
