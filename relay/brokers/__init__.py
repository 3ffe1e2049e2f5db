"""Broker adapters behind one pair of protocols; the URL's scheme picks the adapter.

``outbox.broker.BROKER_SCHEMES`` is the one table of schemes (the app checks URLs
against it without importing the relay); it names each scheme's family, which is
both the adapter module here and the extra that installs its client. Each adapter
class works both ways (``outbox.broker``): it publishes (``Broker``) and reads the
log back (``LogReader``, for ``outbox export broker``, the comparison and the tests).
"""

from __future__ import annotations

import importlib
from typing import Any
from urllib.parse import urlsplit

from outbox.broker import BROKER_SCHEMES, Broker, LogEntry, LogReader, Outcome, PublishResult
from outbox.engines import check_broker_url
from outbox.errors import ConfigError

__all__ = [
    "Broker",
    "LogEntry",
    "LogReader",
    "Outcome",
    "PublishResult",
    "broker_for",
    "family_of",
    "reader_for",
]

ADAPTERS = {"nats": "NatsBroker", "rabbitmq": "RabbitBroker", "redis": "RedisBroker"}


def family_of(url: str) -> str:
    """The broker family of a product URL (nats, rabbitmq, redis); ConfigError otherwise."""
    check_broker_url(url)
    return BROKER_SCHEMES[urlsplit(url).scheme]


def broker_for(url: str) -> Broker:
    """A not yet connected adapter for ``url``: nats://, tls://, redis://, amqp://, ..."""
    adapter: Broker = _adapter(url)
    return adapter


def reader_for(url: str) -> LogReader:
    """The log reader for ``url``: the same adapter class, reading the other way."""
    reader: LogReader = _adapter(url)
    return reader


def _adapter(url: str) -> Any:
    family = family_of(url)
    try:
        module = importlib.import_module(f"relay.brokers.{family}")
    except ImportError:
        raise ConfigError(
            f"broker: {urlsplit(url).scheme}:// needs the '{family}' extra: "
            f"pip install 'outbox-relay[{family}]'"
        ) from None
    return getattr(module, ADAPTERS[family])(url)
