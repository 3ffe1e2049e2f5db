"""Broker adapters behind one pair of protocols; the URL's scheme picks the adapter.

Each broker family declares itself in a ``BrokerRegistration`` (the product's three in
relay.brokers.registrations, listed in the entry-point group ``outbox.brokers``; a
package of one's own may add more): its schemes, extra, adapter, log sources, wire
limits and test harness. ``outbox.broker.BROKER_SCHEMES`` (the app checks URLs against
it without importing the relay), ``ADAPTERS`` and ``LOG_SOURCE_FLAGS`` here are derived
from the registrations. Each adapter class works both ways (``outbox.broker``): it
publishes (``Broker``) and reads the log back (``LogReader``, for ``outbox export
broker``, the comparison and the tests).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from outbox.broker import BROKER_SCHEMES, Broker, LogEntry, LogReader, Outcome, PublishResult
from outbox.brokers_registry import BrokerRegistration, Factory, derived, registration_for, resolve
from outbox.engines import check_broker_url
from outbox.errors import ConfigError

__all__ = [
    "ADAPTERS",
    "LOG_SOURCE_FLAGS",
    "Broker",
    "LogEntry",
    "LogReader",
    "Outcome",
    "PublishResult",
    "broker_for",
    "family_of",
    "reader_for",
]

# family -> its adapter factory ("relay.brokers.nats:NatsBroker", or a callable)
ADAPTERS = derived(lambda regs: {family: r.adapter for family, r in regs.items()})
# family -> the `outbox export broker` flags that name its log sources
LOG_SOURCE_FLAGS = derived(lambda regs: {family: r.log_source_flags for family, r in regs.items()})


def family_of(url: str) -> str:
    """The broker family of a product URL (nats, rabbitmq, redis); ConfigError otherwise."""
    check_broker_url(url)
    return BROKER_SCHEMES[urlsplit(url).scheme]


def broker_for(url: str) -> Broker:
    """A not yet connected adapter for ``url``: nats://, tls://, redis://, amqp://, ..."""
    registration = registration_for(family_of(url))
    adapter: Broker = _factory(url, registration, registration.adapter)(url)
    return adapter


def reader_for(url: str) -> LogReader:
    """The log reader for ``url``: the same adapter class, reading the other way, unless
    the broker's registration names a reader of its own."""
    registration = registration_for(family_of(url))
    reader: LogReader = _factory(url, registration, registration.reader or registration.adapter)(
        url
    )
    return reader


def _factory(url: str, registration: BrokerRegistration, factory: Factory) -> Callable[..., Any]:
    """The factory, its module imported: a ConfigError naming the extra if it is missing."""
    try:
        return resolve(factory)
    except ImportError:
        raise ConfigError(
            f"broker: {urlsplit(url).scheme}:// needs the '{registration.extra}' extra: "
            f"pip install '{registration.install}'"
        ) from None
