"""The coordinator's settings (RocketMQ's names where it has them) and its counters."""

from __future__ import annotations

from dataclasses import dataclass

from outbox.errors import ConfigError


@dataclass(frozen=True)
class CoordinatorSettings:
    check_interval_s: float = 60.0
    transaction_timeout_s: float = 6.0
    check_max: int = 15
    file_reserved_time_s: float = 72 * 3600.0
    max_round_s: float = 60.0  # RocketMQ's MAX_PROCESS_TIME_LIMIT
    half_read_retries: int = 1  # RocketMQ's MAX_RETRY_COUNT_WHEN_HALF_NULL

    def __post_init__(self) -> None:
        for name in ("check_interval_s", "transaction_timeout_s", "file_reserved_time_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}: must be above 0, got {getattr(self, name)!r}")
        if not self.max_round_s > 0:
            raise ConfigError(f"max_round_s: must be above 0, got {self.max_round_s!r}")
        if self.check_max < 1:
            raise ConfigError(f"check_max: must be at least 1, got {self.check_max!r}")
        if self.half_read_retries < 0:
            raise ConfigError(
                f"half_read_retries: must be 0 or more, got {self.half_read_retries!r}"
            )


@dataclass
class CoordinatorStats:
    halfs_written: int = 0  # put back by the check service
    ops_written: int = 0
    commits: int = 0
    rollbacks: int = 0
    unknown: int = 0
    check_requests: int = 0
    discarded: int = 0
    rounds: int = 0
    ends_refused: int = 0  # end requests that did not match a half
    ends_expired: int = 0  # refused: the half is older than its settlement's record lives
    ops_skipped: int = 0  # messages of the op stream that cannot name a real half
    halfs_unreadable: int = 0  # skipped: gone from the half stream, or no half
    half_read_errors: int = 0  # rounds ended at a half whose reads kept failing
    too_large: int = 0  # halfs discarded: a copy of them would exceed max_payload
    rounds_cut: int = 0  # rounds stopped by max_round_s
    reconnects: int = 0
    settled_by_copy: int = 0  # answers for a settled transaction: another copy's, or replayed
    last_round_s: float = 0.0
    last_round_ops_read: int = 0
    last_round_op_requests: int = 0
    last_round_halfs_walked: int = 0
