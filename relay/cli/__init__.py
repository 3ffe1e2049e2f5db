"""The ``outbox`` command line: the parser assembled from one module per command group.

- relay.cli.schema: migrate, status, requeue;
- relay.cli.run: relay, drain;
- relay.cli.retention: purge;
- relay.cli.messages: dead, show, skip;
- relay.cli.data: export, reconcile;
- relay.cli.consume: consume (an app's inbox);
- relay.cli.dashboard: dashboard;
- and the groups plugins register (relay.plugins(): model B's coordinator and compare,
  listed before dashboard).

Exit statuses mean one thing each, for every command: relay.cli.common.EXIT_STATUSES,
shown by ``outbox --help`` and in the README.
Every failure is one line on stderr; ``--debug`` adds the traceback. Connection strings
come from flags or OUTBOX_DB / OUTBOX_BROKER; passwords and tokens are masked in
everything printed or logged.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import os
import sys
import traceback
from collections.abc import Callable, Sequence

from sqlalchemy.exc import SQLAlchemyError

from outbox.brokers_registry import client_extras, derived
from outbox.engines import check_broker_url, check_db_url
from outbox.errors import ConfigError, OutboxError
from outbox.secrets import mask_url, scrub
from outbox.settings import Settings
from relay import CommandGroup, plugins
from relay.cli import consume, dashboard, data, messages, retention, run, schema
from relay.cli.app import use_app
from relay.cli.common import (
    EXIT_FAILED,
    EXIT_PIPE,
    EXIT_USAGE,
    UsageError,
    add_debug_flag,
    exit_statuses_text,
    from_environment,
    refuse_missing_sqlite,
)
from relay.cli.settings_flags import settings_from_args
from relay.display import one_line

GROUPS: tuple[CommandGroup, ...] = (schema, messages, run, retention, data, consume)
GROUPS += (*plugins().command_groups, dashboard)  # model B's before dashboard, as ever
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    name: handler for group in GROUPS for name, handler in group.COMMANDS.items()
}
URL_FLAGS = ("db", "broker", "ledger")  # flags whose secrets are scrubbed from every line
# The optional dependencies a command may import, and the extra (pyproject.toml) of each:
# the brokers' clients as their registrations name them (outbox.brokers_registry), and
# these.
OTHER_EXTRAS = {
    "pyspark": "spark",
    "pyarrow": "spark",
    "prometheus_client": "metrics",
    "opentelemetry": "otel",
    "greenlet": "async",
    "asyncpg": "async",
    "aiosqlite": "async",
    "asyncmy": "async",
    "pymysql": "mysql",
    "fastapi": "dashboard",
    "starlette": "dashboard",
    "uvicorn": "dashboard",
    "jinja2": "dashboard",
    "plotly": "dashboard",
    "multipart": "dashboard",
    "python_multipart": "dashboard",
}
EXTRA_OF = derived(lambda brokers: {**client_extras(brokers), **OTHER_EXTRAS})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="outbox",
        description="Transactional outbox: schema, relay workers and operations.",
        epilog=exit_statuses_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter,  # the table's lines as written
    )
    add_debug_flag(parser, default=False)
    parser.add_argument("--version", action="version", version=f"outbox {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in GROUPS:
        for add_parser in group.PARSERS:
            add_parser(commands)
    return parser


def package_version() -> str:
    """The installed distribution's version (what `pip show outbox-relay` says)."""
    try:
        return importlib.metadata.version("outbox-relay")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout never installed
        return "unknown (not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return run_command(argv)
    except BrokenPipeError:  # `outbox migrate --sql | head -1`: the reader has all it wants
        return stdout_closed()


def stdout_closed() -> int:
    """Exit quietly, as 128 + SIGPIPE like `cat` and `git`: no traceback, no second error
    when Python flushes stdout at exit (it goes to /dev/null now)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return EXIT_PIPE


def run_command(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        app = use_app(args)  # --app: its db, broker and settings where flags give none
    except UsageError as exc:
        return report_error(args.command, exc, [], args.debug)
    from_environment(args)
    for flag in getattr(args, "needs", []):
        if getattr(args, flag) is None:
            env = f"OUTBOX_{flag.upper()}"
            parser.error(f"--{flag} is required (or set {env})")
    urls = [getattr(args, name, None) for name in URL_FLAGS]
    setup_logging(urls)
    try:
        args.settings = command_settings(args, app)
        check_urls(args)
        return COMMANDS[args.command](args)
    except BrokenPipeError:
        raise  # not a failure: main() ends quietly
    except Exception as exc:  # one line, whatever failed; --debug for the traceback
        return report_error(args.command, exc, urls, args.debug, getattr(args, "db", None))


def command_settings(args: argparse.Namespace, app: Settings | None) -> Settings:
    """The command's Settings from its flags, the app, the environment; a bad value is bad
    usage (exit 2), named as outbox.settings names it."""
    try:
        return settings_from_args(args, app, f"--app {args.app}" if app is not None else "")
    except ConfigError as exc:
        raise UsageError(str(exc)) from None


def check_urls(args: argparse.Namespace) -> None:
    """A --db or --broker with an unknown scheme is bad usage (exit 2), found before any
    connection; an installed driver missing is found later (exit 1, naming its extra)."""
    try:
        if getattr(args, "db", None):
            check_db_url(args.db)
            if args.command != "migrate":  # the one command that may create the database
                refuse_missing_sqlite(args.db)
        if getattr(args, "broker", None):
            check_broker_url(args.broker)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None


def report_error(
    command: str, exc: Exception, urls: list[str | None], debug: bool, db: str | None = None
) -> int:
    if debug:
        print(scrub(traceback.format_exc(), urls), file=sys.stderr, end="")
    line = scrub(f"outbox {command}: {describe_error(exc, db)}", urls)
    print(line, file=sys.stderr)
    return EXIT_USAGE if isinstance(exc, UsageError) else EXIT_FAILED


def setup_logging(urls: list[str | None]) -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("apscheduler").setLevel(logging.WARNING)  # two lines a second, idle
    logging.getLogger("py4j").setLevel(logging.WARNING)  # a line after the result or error
    logging.getLogger("alembic").setLevel(logging.WARNING)  # `migrate` prints where it ended
    for handler in logging.getLogger().handlers:
        for old in [f for f in handler.filters if isinstance(f, Scrubber)]:
            handler.removeFilter(old)  # main() called again in one process: this run's URLs
        handler.addFilter(Scrubber(urls))


class Scrubber(logging.Filter):
    """Takes the URLs' secrets out of every log line, whoever wrote it (client libraries too)."""

    def __init__(self, urls: list[str | None]) -> None:
        super().__init__()
        self.urls = urls

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = scrub(record.getMessage(), self.urls), None
        if record.exc_info:
            record.exc_text = scrub(logging.Formatter().formatException(record.exc_info), self.urls)
        return True


def describe_error(exc: Exception, db: str | None = None) -> str:
    """One line, without the SQL echo or a password; a database error names the database."""
    if isinstance(exc, OutboxError):
        return one_line(str(exc), every_line=True) or type(exc).__name__
    if isinstance(exc, ImportError) and (extra := EXTRA_OF.get(top_module(exc.name))):
        return f"needs the '{extra}' extra ({exc.name} is missing): {install(extra)}"
    if isinstance(exc, SQLAlchemyError):
        orig = getattr(exc, "orig", None)
        text = one_line(str(orig if orig is not None else exc))
        where = f" (database {mask_url(db)})" if db else ""
        return f"{type(exc).__name__}: {text}{where}"
    return f"{type(exc).__name__}: {one_line(str(exc))}"


def top_module(name: str | None) -> str:
    return (name or "").partition(".")[0]


def install(extra: str) -> str:
    return f"pip install 'outbox-relay[{extra}]'"


__all__ = ["COMMANDS", "UsageError", "build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
