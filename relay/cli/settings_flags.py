"""The flags of ``outbox relay`` / ``outbox drain``, generated from the Settings fields.

A field's name, type, default and help text are written once, in outbox.settings; here
they become ``--<field>`` flags (plus the older spellings the field lists, such as
``--interval``), but for the app's own fields (``start_relay``). A flag holds text until
``settings_from_args`` hands it, with the environment, to the one validation
(outbox.settings.check, with each field's range, which the flag's help states).
Precedence: flag, then the app's settings (``--app``), then ``OUTBOX_<FIELD>``, then the
default.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable, Mapping
from dataclasses import Field, fields
from typing import Any

from outbox.errors import ConfigError
from outbox.settings import (
    MOST,
    Settings,
    Source,
    as_text,
    env_names,
    environment,
    flag_names,
    has_flag,
    problem,
    range_of,
    settings_from,
    type_of,
)
from spark_jobs.flags import DECIMAL

# Older flags in another unit than their field: flag -> (field, how many field units one is).
SCALED = {"--retention-days": ("retention_s", 86400.0)}
# Fields only an app's own relay (its fast path) or send() reads: a worker (outbox relay,
# outbox drain) runs the sweeper and the scheduler alone. Their flags and variables are
# still taken and checked (an app and its workers often share one environment, and
# handoff_limit_s must stay below the worker's sweeper_age_s), but --help lists them not.
APP_ONLY = frozenset({"max_payload_bytes", "queue_size", "retry_delays_ms", "tick_ms",
                      "handoff_limit_s", "publish_batch", "max_in_flight", "ack_batch_size",
                      "ack_flush_ms", "verify_commit"})  # fmt: skip


def metavar(f: Field[Any]) -> str:
    kind = type_of(f)
    if kind == "bool":
        return "true|false"
    if kind.startswith("tuple"):
        return "MS,MS,..."
    if kind == "str":
        return "WORD"
    if f.name.endswith("_ms"):
        return "MS"
    if f.name.endswith("_s"):
        return "SECONDS"
    return "N"


def add_settings_flags(parser: argparse.ArgumentParser, names: Iterable[str] | None = None) -> None:
    """A flag per Settings field (``names`` only, if given) that ``parser`` lacks yet; all of
    them (a worker's command) hides the APP_ONLY ones from --help."""
    offered = list(parser.get_default("settings_fields") or [])
    group = settings_group(parser)
    wanted = None if names is None else set(names)
    for f in fields(Settings):
        if not has_flag(f) or f.name in offered or (wanted is not None and f.name not in wanted):
            continue
        env = " or ".join(f"${name}" for name in env_names(f))
        span = f"{bounds}; " if (bounds := range_of(f)) else ""
        help = f"{f.metadata['help']} ({span}default: {env} or {as_text(f.default)})"
        hidden = wanted is None and f.name in APP_ONLY
        group.add_argument(
            *flag_names(f),
            dest=f.name,
            metavar=metavar(f),
            help=argparse.SUPPRESS if hidden else help,
        )
        offered.append(f.name)
        for flag, (name, _) in SCALED.items():
            if name == f.name:
                help = f"{flag_names(f)[0]} in days (an older spelling; {scaled_range(name, flag)})"
                group.add_argument(flag, dest=dest_of(flag), metavar="DAYS", help=help)
    parser.set_defaults(settings_fields=offered)


def settings_group(parser: argparse.ArgumentParser) -> Any:
    """The parser's one "settings" section of --help (--db's connect timeout opens it)."""
    for group in parser._action_groups:  # argparse offers no lookup by title
        if group.title == "settings":
            return group
    return parser.add_argument_group(
        "settings",
        "one flag per field of outbox.settings.Settings (docs/configuration.md); "
        "a flag wins over --app, $OUTBOX_<FIELD> and the default. The fast path's fields "
        "(queue_size, tick_ms, ...), which a worker does not use, are accepted but not listed",
    )


def dest_of(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def settings_from_args(
    args: argparse.Namespace, app: Settings | None = None, app_source: str = "--app",
    environ: Mapping[str, str] | None = None,
) -> Settings:  # fmt: skip
    """The command's Settings: its flags win, then ``app``'s settings (``--app``), then
    the environment, then the defaults. Only the fields the command has flags for are
    read (``outbox status`` takes its connect timeout, not the sweeper's age)."""
    offered = set(getattr(args, "settings_fields", ()))
    flags: dict[str, Source] = {}
    for f in fields(Settings):
        if f.name in offered and getattr(args, f.name, None) is not None:
            flags[f.name] = (getattr(args, f.name), " / ".join(flag_names(f)))
    for flag, (name, unit) in SCALED.items():
        text = getattr(args, dest_of(flag), None)
        if text is not None and name in offered:
            if name in flags:
                raise ConfigError(f"{name}: give {flag} or {flags[name][1]}, not both")
            flags[name] = (scaled(name, flag, text, unit), flag)
    base = (
        {}
        if app is None
        else {f.name: (getattr(app, f.name), app_source) for f in fields(Settings)}
    )
    env = {name: given for name, given in environment(environ).items() if name in offered}
    return settings_from(flags, base, env)


def scaled_range(name: str, flag: str) -> str:
    """The accepted values of an older flag in another unit: the field's, in its unit."""
    return f"above 0, at most {as_text(MOST[name] / SCALED[flag][1])}"


def scaled(name: str, flag: str, text: str, unit: float) -> float:
    """``text``, in ``flag``'s unit, in the field's unit, if in the field's range."""
    word = text.strip()
    value = float(word) * unit if DECIMAL.fullmatch(word) else math.nan  # ASCII, finite
    if not 0 < value <= MOST[name]:  # nan included: no comparison holds for it
        raise problem(name, flag, f"must be a number {scaled_range(name, flag)}", text)
    return value
