"""Settings of an ``Outbox`` and of the relay workers: one place per field.

Each field carries its default, its help text and the names it is given by:
``Outbox(field=...)``, the environment variable ``OUTBOX_<FIELD>`` and the flag
``--<field>`` of ``outbox relay`` / ``outbox drain`` (relay.cli.settings_flags builds
the flags from these fields; ``start_relay``, the app's alone, has none). One function,
``check``, validates a value whichever way it came (numbers within ``MOST``), with one
error format: ``field (where it came from): rule, got value``.
docs/configuration.md is the table of them (tests/unit/test_settings_doc.py keeps it so).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import Field, InitVar, dataclass, field, fields
from typing import Any

from outbox.errors import ConfigError

CONNECT_TIMEOUT_S = 10.0  # a database host that does not answer fails after this
RETRY_DELAYS_MS = (0, 5, 10, 25, 50, 100, 200, 300, 500, 800, 1000, 1000, 1000)
MARK_MODES = ("keep", "delete")
ENV_PREFIX = "OUTBOX_"
KEYWORD = "keyword"  # the source of a value given in Python: Outbox(...) or Settings(...)
TRUE, FALSE = ("true", "1"), ("false", "0")
# A source is where a value came from: (value, "keyword" | "OUTBOX_X" | "--flag" | ...).
Source = tuple[object, str]
DAY_S = 86400
LARGEST_PAYLOAD = 2**30  # PostgreSQL's bytea holds 1 GiB at most
MOST_DELAYS = 1000  # retry_delays_ms: the fast path's attempts of one message
# Each numeric field's largest value (ints from 1, floats above 0): past any real use, and
# what the database, the drivers and the clocks still hold (an IN list's parameters,
# a timedelta, PyMySQL's connect timeout of a year at most). Every numeric field has one.
MOST: dict[str, float] = {
    "max_payload_bytes": LARGEST_PAYLOAD,
    "queue_size": 10_000_000,
    "retry_delays_ms": DAY_S * 1000,  # each delay
    "tick_ms": 60_000,
    "handoff_limit_s": 7 * DAY_S,
    "sweeper_age_s": 7 * DAY_S,
    "publish_batch": 10_000,
    "max_in_flight": 10_000_000,
    "ack_batch_size": 10_000,  # one statement: a parameter per row
    "ack_flush_ms": 60_000,
    "sweep_interval_s": DAY_S,
    "sweep_batch": 10_000,  # claimed, then marked by id: a parameter per row
    "max_attempts": 1_000_000,
    "permanent_attempts": 1_000_000,
    "backoff_base_s": 7 * DAY_S,
    "backoff_cap_s": 7 * DAY_S,
    "publish_timeout_s": DAY_S,
    "retention_s": 3650 * DAY_S,
    "purge_batch": 10_000,  # deleted by id: a parameter per row
    "connect_timeout_s": 3600,
}


def option(
    default: Any,
    help: str,
    *,
    flags: tuple[str, ...] = (),
    env: tuple[str, ...] = (),
    cli: bool = True,
) -> Any:
    """A Settings field: its default and help text, and older names it is also given by
    (``flags``, ``env``), next to the ones derived from its name. ``cli=False``: the app's
    alone, not a flag of ``outbox relay`` / ``outbox drain``."""
    return field(default=default, metadata={"help": help, "flags": flags, "env": env, "cli": cli})


@dataclass(frozen=True)
class Settings:
    """Every tunable of an ``Outbox`` and of a relay worker; docs/configuration.md and
    docs/models.md explain the defaults."""

    max_payload_bytes: int = option(
        1024 * 1024, "larger messages (payload and headers as encoded) are refused at send()"
    )
    # keep: mark rows sent and keep them for the reconciliation ledger; delete: remove them.
    mark_mode: str = option("keep", "keep: mark rows sent and keep them; delete: remove them")
    # The fast path (relay.fastpath.dispatcher).
    # Messages the fast path holds in memory at once, wherever they wait (queued, waiting
    # to retry, in flight, acked but not yet marked); past it, commits wait for the sweeper.
    queue_size: int = option(10_000, "messages the fast path holds in memory at once")
    retry_delays_ms: tuple[float, ...] = option(
        RETRY_DELAYS_MS, "the fast path's attempts of one message (a comma list of ms)"
    )
    tick_ms: float = option(5.0, "time wheel resolution")
    handoff_limit_s: float = option(
        8.0, "older messages are left to the sweeper; below sweeper_age_s"
    )
    sweeper_age_s: float = option(10.0, "the sweeper takes pending rows older than this")
    publish_batch: int = option(256, "messages handed to the broker adapter at once")
    max_in_flight: int = option(2048, "messages published and not yet answered")
    ack_batch_size: int = option(256, "acks marked by one statement at most")
    ack_flush_ms: float = option(50.0, "an ack waits at most this long to be marked")
    # Re-read the rows (one SELECT per batch) before publishing: SQLAlchemy's
    # after_commit also fires when PostgreSQL turned COMMIT into ROLLBACK (an error the
    # app swallowed) or when the session joined an outer transaction that may still
    # roll back. Off trusts after_commit: one statement less, phantoms possible then.
    verify_commit: bool = option(True, "re-read rows whose commit cannot be proven")
    # The sweeper (relay.sweep.sweeper), in the app (Outbox(sweeper=True)) and in `outbox relay`.
    sweep_interval_s: float = option(1.0, "seconds between sweeps", flags=("--interval",))
    sweep_batch: int = option(500, "rows claimed (and locked) by one sweep")
    max_attempts: int = option(20, "sweeper attempts before a row is marked dead")
    # A PERMANENT outcome (too large, refused, invalid row) will not succeed as it is:
    # no need for hours of backoff. 3, not 1: an adapter may call a passing fault
    # permanent (NATS's "no stream" while the stream is being created).
    permanent_attempts: int = option(
        3, "a permanent failure at this attempt (or later) marks the row dead"
    )
    backoff_base_s: float = option(1.0, "first backoff; doubles per attempt, with jitter")
    backoff_cap_s: float = option(300.0, "the longest backoff")
    publish_timeout_s: float = option(10.0, "a sweep waits this long for the broker's answers")
    retention_s: float = option(3 * 24 * 3600.0, "sent rows are kept this long (the ledger)")
    purge_batch: int = option(1000, "sent or canceled rows deleted per retention statement")
    connect_timeout_s: float = option(
        CONNECT_TIMEOUT_S,
        "connecting to the database gives up after this",
        flags=("--connect-timeout",),
        env=("OUTBOX_CONNECT_TIMEOUT",),
    )
    # The app's switch (not a worker's flag): false keeps Outbox.start() from starting a
    # relay where one is not wanted (CLI commands, task workers, tests), without code changes.
    start_relay: bool = option(True, "Outbox.start() starts the in-process relay", cli=False)
    # Where each value came from, for error messages: field -> "OUTBOX_X", "--x", ...
    # (absent: "keyword"). Values from the environment or a command line are text.
    sources: InitVar[Mapping[str, str] | None] = None

    def __post_init__(self, sources: Mapping[str, str] | None) -> None:
        check(self, sources or {})

    @classmethod
    def from_options(
        cls, options: Mapping[str, Any], environ: Mapping[str, str] | None = None
    ) -> Settings:
        """Settings from keywords, then the environment (OUTBOX_<FIELD>), then defaults."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(
                f"unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        keywords = {name: (value, KEYWORD) for name, value in options.items()}
        return settings_from(keywords, environment(environ))


def settings_from(*layers: Mapping[str, Source]) -> Settings:
    """Settings from layers of (value, source) per field: the first layer that has a
    field wins (e.g. flags, then the environment); a field none has keeps its default."""
    chosen: dict[str, Source] = {}
    for layer in reversed(layers):
        chosen.update(layer)
    values: dict[str, Any] = {name: value for name, (value, _) in chosen.items()}  # text too
    return Settings(**values, sources={name: source for name, (_, source) in chosen.items()})


def env_names(f: Field[Any]) -> tuple[str, ...]:
    """``OUTBOX_<FIELD>`` first, then the older names (read when the first is unset)."""
    return (ENV_PREFIX + f.name.upper(), *f.metadata["env"])


def has_flag(f: Field[Any]) -> bool:
    """Whether ``outbox relay`` / ``outbox drain`` take the field as a flag."""
    return bool(f.metadata["cli"])


def flag_names(f: Field[Any]) -> tuple[str, ...]:
    """``--<field>`` first (underscores as dashes), then the older spellings."""
    return ("--" + f.name.replace("_", "-"), *f.metadata["flags"])


def environment(environ: Mapping[str, str] | None = None) -> dict[str, Source]:
    """Every field set in the environment: field -> (text, variable)."""
    environ = os.environ if environ is None else environ
    found: dict[str, Source] = {}
    for f in fields(Settings):
        for name in env_names(f):
            if name in environ:
                found[f.name] = (environ[name], name)
                break
    return found


def environment_of(settings: Settings) -> dict[str, str]:
    """The variables that give another process (a worker) exactly ``settings``: every
    field, so that a variable of the parent's environment cannot differ."""
    return {env_names(f)[0]: as_text(getattr(settings, f.name)) for f in fields(Settings)}


def as_text(value: object) -> str:
    """A value as written in the environment or on a command line."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ",".join(as_text(v) for v in value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def type_of(f: Field[Any]) -> str:
    """The field's type as written (annotations are strings here): int, float, ..."""
    return str(f.type)


def is_text(source: str) -> bool:
    """Values from the environment or a command line are text, parsed by check."""
    return source.startswith((ENV_PREFIX, "--"))


def check(settings: Settings, sources: Mapping[str, str]) -> None:
    """The one validation of Settings, whichever way a value came (keyword, environment
    variable, flag): text is parsed into the field's type, then every rule is checked.
    A ConfigError names the field, where the value came from, the rule and the value."""

    def source(name: str) -> str:  # a value nobody gave is the default
        given = getattr(settings, name) != DEFAULTS[name]
        return sources.get(name, KEYWORD if given else "default")

    for f in fields(settings):
        value = getattr(settings, f.name)
        if is_text(source(f.name)) and isinstance(value, str):
            value = parsed(f, value, source(f.name))
        object.__setattr__(settings, f.name, checked(f, value, source(f.name)))
    if settings.handoff_limit_s >= settings.sweeper_age_s:
        rule = (
            f"must be below sweeper_age_s ({settings.sweeper_age_s:g} from "
            f"{source('sweeper_age_s')}), or fast path and sweeper race"
        )
        raise problem("handoff_limit_s", source("handoff_limit_s"), rule, settings.handoff_limit_s)


def problem(name: str, source: str, rule: str, value: object) -> ConfigError:
    """The one error format: ``field (source): rule, got value``."""
    return ConfigError(f"{name} ({source}): {rule}, got {value!r}")


def parsed(f: Field[Any], text: str, source: str) -> object:
    """``text`` (from the environment or a command line) as a value of ``f``'s type."""
    kind, word = type_of(f), text.strip()
    try:
        if not word.isascii():  # int() and float() take Unicode digits such as '١٢'
            raise ValueError(word)
        if kind == "int":
            return int(word)
        if kind == "float":
            return float(word)
        if kind == "bool":
            if word.lower() not in TRUE + FALSE:
                raise ValueError(word)
            return word.lower() in TRUE
        if kind.startswith("tuple"):
            return tuple(float(d) for d in word.split(","))
    except ValueError:
        raise problem(f.name, source, rule_of(f), text) from None
    return word


def checked(f: Field[Any], value: object, source: str) -> object:
    """``value`` if it keeps ``f``'s rule (a tuple for a sequence), else a ConfigError."""
    kind = type_of(f)
    if kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MOST[f.name]
    elif kind == "float":
        ok = is_number(value) and 0 < value <= MOST[f.name]  # type: ignore[operator]
    elif kind == "bool":
        ok = isinstance(value, bool)
    elif kind.startswith("tuple"):
        ok = (
            isinstance(value, list | tuple)
            and 0 < len(value) <= MOST_DELAYS
            and all(is_number(d) and 0 <= d <= MOST[f.name] for d in value)
        )
        value = tuple(value) if ok else value  # type: ignore[arg-type]
    else:
        ok = value in MARK_MODES
    if not ok:
        raise problem(f.name, source, rule_of(f), value)
    return value


def is_number(value: object) -> bool:
    """An int or a float, not a bool; nan is none (no comparison holds for it)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def range_of(f: Field[Any]) -> str | None:
    """A numeric field's accepted values, as its flag's help says them; else None."""
    kind, most = type_of(f), MOST.get(f.name)
    if kind == "int":
        return f"1 to {most}"
    if kind == "float":
        return f"above 0, at most {as_text(most)}"
    if kind.startswith("tuple"):
        return f"1 to {MOST_DELAYS} delays, each 0 to {as_text(most)}"
    return None


def rule_of(f: Field[Any]) -> str:
    """What ``f``'s values must be, as its error says it."""
    kind = type_of(f)
    if kind == "int":
        return f"must be a whole number from {range_of(f)}"
    if kind == "float":
        return f"must be a number {range_of(f)}"
    if kind.startswith("tuple"):
        return f"must be {range_of(f)} (a comma list as text)"
    return RULES[kind]


DEFAULTS = {f.name: f.default for f in fields(Settings)}
RULES = {
    "bool": "must be True or False (true/false/1/0 in the environment or a flag)",
    "str": f"must be one of {', '.join(MARK_MODES)}",
}
