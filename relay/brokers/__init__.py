"""Broker adapters behind one protocol; the URL's scheme picks the adapter.

``outbox.config.BROKER_SCHEMES`` is the one table of schemes (the app checks URLs
against it without importing the relay); it names each scheme's family, which is
both the adapter module here and the extra that installs its client. Each module
owns both directions for its broker: publishing (the adapter) and reading the log
back (for ``outbox export broker``, the comparison and the contract tests).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from urllib.parse import urlsplit

from outbox.config import BROKER_SCHEMES, check_broker_url
from outbox.errors import ConfigError
from relay.brokers.base import Broker, Outcome, PublishResult

__all__ = ["Broker", "Outcome", "PublishResult", "broker_for", "family_of"]

ADAPTERS = {"nats": "NatsBroker", "rabbitmq": "RabbitBroker", "redis": "RedisBroker"}


def family_of(url: str) -> str:
    """The broker family of a product URL (nats, rabbitmq, redis); ConfigError otherwise."""
    check_broker_url(url)
    return BROKER_SCHEMES[urlsplit(url).scheme]


def broker_for(url: str) -> Broker:
    """A not yet connected adapter for ``url``: nats://, tls://, redis://, amqp://, ..."""
    family = family_of(url)
    try:
        module = importlib.import_module(f"relay.brokers.{family}")
    except ImportError:
        raise ConfigError(
            f"broker: {urlsplit(url).scheme}:// needs the '{family}' extra: "
            f"pip install 'outbox-relay[{family}]'"
        ) from None
    adapter: Callable[[str], Broker] = getattr(module, ADAPTERS[family])
    return adapter(url)
