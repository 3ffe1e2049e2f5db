"""Settings of an ``Outbox`` with their defaults, and the URL helpers every entry point uses."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import urlsplit

from sqlalchemy import Engine, create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError

from outbox.errors import ConfigError

BROKER_SCHEMES = ("nats", "amqp", "amqps", "redis", "rediss", "memory")
MARK_MODES = ("keep", "delete")


@dataclass(frozen=True)
class Settings:
    """Every tunable of an ``Outbox``; the defaults are the ones models.md gives."""

    max_payload_bytes: int = 1024 * 1024
    # keep: mark rows sent and keep them for the reconciliation ledger; delete: remove them.
    mark_mode: str = "keep"

    def __post_init__(self) -> None:
        if not isinstance(self.max_payload_bytes, int) or self.max_payload_bytes < 1:
            raise ConfigError("max_payload_bytes: must be a positive integer")
        if self.mark_mode not in MARK_MODES:
            raise ConfigError(f"mark_mode: must be one of {', '.join(MARK_MODES)}")

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> Settings:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(
                f"unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return cls(**options)


def mask_url(url: str) -> str:
    """The URL with its password replaced, fit for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return parts._replace(netloc=netloc).geturl()


def engine_from(db: str | Engine) -> Engine:
    """An Engine for a database URL, or the app's own Engine as it is."""
    if isinstance(db, Engine):
        return db
    if not isinstance(db, str) or not db:
        raise ConfigError("db: must be a SQLAlchemy URL string or an Engine")
    try:
        return create_engine(make_url(db))
    except (ArgumentError, NoSuchModuleError, ValueError) as exc:
        raise ConfigError(f"db: cannot use {mask_url(db)!r}: {exc}") from None


def check_broker_url(broker: str | None) -> str | None:
    if broker is None:
        return None
    scheme = urlsplit(broker).scheme if isinstance(broker, str) else ""
    if scheme not in BROKER_SCHEMES:
        raise ConfigError(
            f"broker: {mask_url(str(broker))!r} has no supported scheme; "
            f"use one of {', '.join(s + '://' for s in BROKER_SCHEMES)}"
        )
    return broker
