"""What every command module of the ``outbox`` command shares: exit codes, flags, errors."""

from __future__ import annotations

import argparse
import os
import uuid
from typing import TypeAlias, TypeVar

from sqlalchemy import Engine

from outbox.engines import engine_from
from outbox.errors import OutboxError
from relay.cli.settings_flags import add_settings_flags

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_DEAD = 0, 1, 2, 3
READ_TIMEOUT_S = 60.0  # a CLI read (status, requeue, drain's count) waits this long at most
T = TypeVar("T")
URL_ENV = ("db", "broker")  # flags whose default is $OUTBOX_<FLAG>
# A command's parsers come from one function per command: add_<command>(commands).
Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


class UsageError(OutboxError):
    """The command line is incomplete or contradictory (exit status 2)."""


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def msg_id(text: str) -> str:
    try:
        return str(uuid.UUID(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a msg_id (a UUID): {text!r}") from None


def add_debug_flag(parser: argparse.ArgumentParser, default: object = argparse.SUPPRESS) -> None:
    """--debug before or after the command (a subcommand's default must not reset it)."""
    parser.add_argument(
        "--debug", action="store_true", default=default, help="print tracebacks of errors"
    )


def add_db_flag(parser: argparse.ArgumentParser, required: bool = True) -> None:
    """--db (and its connect timeout); ``required``: main() insists on it (or OUTBOX_DB)."""
    parser.add_argument("--db", help="SQLAlchemy database URL (default: $OUTBOX_DB)")
    add_settings_flags(parser, ["connect_timeout_s"])  # --connect-timeout(-s), from Settings
    add_debug_flag(parser)
    if required:
        needs(parser, "db")


def add_broker_flag(parser: argparse.ArgumentParser, required: bool = True) -> None:
    parser.add_argument(
        "--broker",
        help="broker URL, e.g. nats://127.0.0.1:4222 (default: $OUTBOX_BROKER)",
    )
    if required:
        needs(parser, "broker")


def from_environment(args: argparse.Namespace) -> None:
    """--db and --broker not given (nor taken from --app): OUTBOX_DB and OUTBOX_BROKER."""
    for flag in URL_ENV:
        if hasattr(args, flag) and getattr(args, flag) is None:
            setattr(args, flag, os.environ.get(f"OUTBOX_{flag.upper()}"))


def needs(parser: argparse.ArgumentParser, flag: str) -> None:
    """main() refuses the command without ``--flag`` (flags may come from the environment)."""
    parser.set_defaults(needs=[*(parser.get_default("needs") or []), flag])


def database(args: argparse.Namespace, reads: bool = False) -> Engine:
    """The engine for --db, with the command line's timeouts (reads bounded when asked)."""
    timeout = args.settings.connect_timeout_s  # resolved by main(): flag, app, env, default
    return engine_from(args.db, timeout, READ_TIMEOUT_S if reads else None)


def required(value: T | None, flag: str, purpose: str) -> T:
    if not value:
        raise UsageError(f"{flag} is required for {purpose}")
    return value
