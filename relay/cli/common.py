"""What every command module of the ``outbox`` command shares: exit codes, flags, errors."""

from __future__ import annotations

import argparse
import os
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeAlias, TypeVar

from sqlalchemy import Engine, make_url

from outbox import migrate
from outbox.dialects import dialect_for
from outbox.engines import engine_from
from outbox.errors import InvalidMsgId, OutboxError, UnknownMessage
from relay.cli.settings_flags import add_settings_flags
from relay.operator import READ_TIMEOUT_S, Operator, parse_msg_id
from spark_jobs.flags import bounded_int

# Exit statuses: one meaning each, the same for every command (README, `outbox --help`).
EXIT_OK = 0  # it did what was asked
EXIT_FAILED = 1  # a runtime error: database or broker unreachable, a schema problem, ...
EXIT_USAGE = 2  # argparse's own code: a bad flag or value, an unknown msg_id
EXIT_DATA = 3  # the data is wrong: dead, lost, phantom, out-of-order messages, malformed entries
EXIT_DEAD = EXIT_DATA  # dead messages: one case of EXIT_DATA
EXIT_STUCK = 4  # it ran, nothing is lost, but messages are late: stuck past the SLA
EXIT_PIPE = 141  # 128 + SIGPIPE: stdout closed by its reader (`| head`), as cat and git do
EXIT_STATUSES = (
    ("0", "success (reconcile: a topic no stream at the broker captures is not audited, a "
     "warning line each, neither lost nor a status of its own)"),
    ("1", "runtime error: database or broker unreachable, schema not at head, extra missing; "
     "drain left messages failing (run it again later)"),
    ("2", "usage error: a bad or missing flag or value (a number outside the range its "
     "--help gives, an --out that cannot be written), a msg_id that does not exist"),
    ("3", "the data is wrong: dead messages (status, dead listed some; drain made some "
     "dead or left some blocked behind one), lost, phantom or out-of-order messages or "
     "malformed entries at the broker (reconcile, compare)"),
    ("4", "the data is late: stuck messages, committed and still pending past the SLA, none "
     "lost, phantom or out of order (reconcile, compare); the sweeper may still deliver them"),
    ("130, 143", "stopped by SIGINT (Ctrl-C) or SIGTERM (drain; relay on a second signal)"),
    ("141", "stdout closed by its reader (`outbox migrate --sql` piped to `head`): quietly"),
)  # fmt: skip
PORT = bounded_int(1, 65535)  # --port, --metrics-port
# Every numeric flag's type is one of spark_jobs.flags' bounded_int, bounded_number and
# bounded_seconds (a documented range, exit status 2 outside it); settings flags are
# checked by outbox.settings.check, with the field's bounds.
T = TypeVar("T")
URL_ENV = ("db", "broker")  # flags whose default is $OUTBOX_<FLAG>
# A command's parsers come from one function per command: add_<command>(commands).
Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


class UsageError(OutboxError):
    """The command line is incomplete or contradictory (exit status 2)."""


def exit_statuses_text() -> str:
    """The table of exit statuses, as `outbox --help` ends."""
    width = max(len(code) for code, _ in EXIT_STATUSES)
    indent = " " * (width + 4)
    lines = [
        textwrap.fill(meaning, 88, initial_indent=f"  {code:<{width}}  ", subsequent_indent=indent)
        for code, meaning in EXIT_STATUSES
    ]
    return "exit statuses:\n" + "\n".join(lines)


def msg_id(text: str) -> str:
    """A MSG_ID argument's type (argparse names the flag in its error)."""
    try:
        return parse_msg_id(text, "MSG_ID")
    except InvalidMsgId as exc:
        raise argparse.ArgumentTypeError(exc.said) from None


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


@contextmanager
def operator_on(args: argparse.Namespace) -> Iterator[Operator]:
    """The operator service on --db (reads bounded by READ_TIMEOUT_S), once the schema is
    checked; disposed of after. A msg_id with no row is bad usage (exit status 2)."""
    engine = database(args, reads=True)
    try:
        migrate.require_schema(engine)
        yield Operator(engine)
    except UnknownMessage as exc:
        raise UsageError(str(exc)) from None
    finally:
        engine.dispose()


def refuse_missing_sqlite(url: str) -> None:
    """A SQLite --db whose file does not exist is bad usage (exit 2) naming the path: SQLite
    would create an empty file on connect, so a typo left a new database behind. Only
    ``outbox migrate`` creates one (its caller skips this check)."""
    parsed = make_url(url)
    name = parsed.database
    if not dialect_for(parsed).file_database or not name or name == ":memory:":
        return
    if name.startswith("file:"):  # a URI filename (?uri=true): its mode= decides
        return
    if not Path(name).exists():
        raise UsageError(f"--db: no SQLite database at {Path(name).resolve()} "
                         "(only `outbox migrate` creates one)")  # fmt: skip


def required(value: T | None, flag: str, purpose: str) -> T:
    if not value:
        raise UsageError(f"{flag} is required for {purpose}")
    return value
