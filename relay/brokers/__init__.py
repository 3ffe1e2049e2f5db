"""Broker adapters behind one protocol; the URL's scheme picks the adapter."""

from __future__ import annotations

from urllib.parse import urlsplit

from outbox.config import mask_url
from outbox.errors import ConfigError
from relay.brokers.base import Broker, Outcome, PublishResult

__all__ = ["Broker", "Outcome", "PublishResult", "broker_for"]


def broker_for(url: str) -> Broker:
    """A not yet connected adapter for ``url``: nats://, redis://, amqp:// (memory:// in tests)."""
    scheme = urlsplit(url).scheme
    if scheme in ("nats", "tls"):
        try:
            from relay.brokers.nats import NatsBroker
        except ImportError:
            raise ConfigError(
                "broker: nats:// needs the 'nats' extra: pip install 'outbox-relay[nats]'"
            ) from None
        return NatsBroker(url)
    if scheme in ("redis", "rediss"):
        try:
            from relay.brokers.redis import RedisBroker
        except ImportError:
            raise ConfigError(
                "broker: redis:// needs the 'redis' extra: pip install 'outbox-relay[redis]'"
            ) from None
        return RedisBroker(url)
    if scheme in ("amqp", "amqps"):
        try:
            from relay.brokers.rabbitmq import RabbitBroker
        except ImportError:
            raise ConfigError(
                "broker: amqp:// needs the 'rabbitmq' extra: pip install 'outbox-relay[rabbitmq]'"
            ) from None
        return RabbitBroker(url)
    if scheme == "memory":
        from relay.brokers.memory import MemoryBroker

        return MemoryBroker()
    raise ConfigError(f"broker: no adapter for {mask_url(url)!r}")
