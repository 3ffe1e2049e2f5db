"""Settings of an ``Outbox`` and of the relay workers, with their defaults and their rules."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from outbox.errors import ConfigError

CONNECT_TIMEOUT_S = 10.0  # a database host that does not answer fails after this
RETRY_DELAYS_MS = (0, 5, 10, 25, 50, 100, 200, 300, 500, 800, 1000, 1000, 1000)
MARK_MODES = ("keep", "delete")
INT_OPTIONS = (
    "max_payload_bytes",
    "queue_size",
    "publish_batch",
    "max_in_flight",
    "ack_batch_size",
    "sweep_batch",
    "max_attempts",
    "purge_batch",
)
TIME_OPTIONS = (
    "tick_ms",
    "ack_flush_ms",
    "handoff_limit_s",
    "sweeper_age_s",
    "sweep_interval_s",
    "backoff_base_s",
    "backoff_cap_s",
    "publish_timeout_s",
    "retention_s",
    "connect_timeout_s",
)


@dataclass(frozen=True)
class Settings:
    """Every tunable of an ``Outbox``; docs/models.md explains the defaults."""

    max_payload_bytes: int = 1024 * 1024
    # keep: mark rows sent and keep them for the reconciliation ledger; delete: remove them.
    mark_mode: str = "keep"
    # The fast path (relay.dispatcher).
    # Messages the fast path holds in memory at once, wherever they wait (queued, waiting
    # to retry, in flight, acked but not yet marked); past it, commits wait for the sweeper.
    queue_size: int = 10_000
    retry_delays_ms: tuple[float, ...] = RETRY_DELAYS_MS  # the attempts of one message
    tick_ms: float = 5.0  # time wheel resolution
    handoff_limit_s: float = 8.0  # older messages are left to the sweeper
    sweeper_age_s: float = 10.0  # the sweeper takes pending rows older than this
    publish_batch: int = 256  # messages handed to the broker adapter at once
    max_in_flight: int = 2048  # messages published and not yet answered
    ack_batch_size: int = 256  # acks marked by one statement at most
    ack_flush_ms: float = 50.0  # an ack waits at most this long to be marked
    # Re-read the rows (one SELECT per batch) before publishing: SQLAlchemy's
    # after_commit also fires when PostgreSQL turned COMMIT into ROLLBACK (an error the
    # app swallowed) or when the session joined an outer transaction that may still
    # roll back. Off trusts after_commit: one statement less, phantoms possible then.
    verify_commit: bool = True
    # The sweeper (relay.sweeper), in the app (Outbox(sweeper=True)) and in `outbox relay`.
    sweep_interval_s: float = 1.0
    sweep_batch: int = 500  # rows claimed (and locked) by one sweep
    max_attempts: int = 20  # sweeper attempts before a row is marked dead
    backoff_base_s: float = 1.0  # first backoff; doubles per attempt, with jitter
    backoff_cap_s: float = 300.0
    publish_timeout_s: float = 10.0  # a sweep waits this long for the broker's answers
    retention_s: float = 3 * 24 * 3600.0  # sent rows are kept this long (the ledger)
    purge_batch: int = 1000  # sent rows deleted per retention statement
    connect_timeout_s: float = CONNECT_TIMEOUT_S  # for the engine the outbox creates from a URL

    def __post_init__(self) -> None:
        for name in INT_OPTIONS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name}: must be a positive integer, got {value!r}")
        for name in TIME_OPTIONS:
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name}: must be a positive number, got {value!r}")
        if not isinstance(self.verify_commit, bool):
            raise ConfigError("verify_commit: must be True or False")
        if self.mark_mode not in MARK_MODES:
            raise ConfigError(f"mark_mode: must be one of {', '.join(MARK_MODES)}")
        delays = self.retry_delays_ms
        if not delays or any(not isinstance(d, int | float) or d < 0 for d in delays):
            raise ConfigError("retry_delays_ms: must be a non-empty sequence of delays >= 0")
        object.__setattr__(self, "retry_delays_ms", tuple(delays))
        if self.handoff_limit_s >= self.sweeper_age_s:
            raise ConfigError(
                "handoff_limit_s: must be below sweeper_age_s, or fast path and sweeper race"
            )

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> Settings:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(
                f"unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return cls(**options)
