"""The ``outbox`` command line.

Exit codes: 0 success, 1 the operation failed (the message says why), 2 bad usage.
Connection strings come from flags or OUTBOX_DB / OUTBOX_BROKER; passwords are
masked in everything printed.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from sqlalchemy.exc import SQLAlchemyError

from outbox import migrate
from outbox.config import mask_url
from outbox.errors import OutboxError

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="outbox",
        description="Transactional outbox: schema, relay and operations.",
        epilog="Exit codes: 0 success, 1 failure, 2 bad usage.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    mig = commands.add_parser(
        "migrate",
        help="create or upgrade the outbox tables (idempotent)",
        description="Upgrade the outbox tables to the newest schema. Safe to run again.",
    )
    add_db_flag(mig)
    mig.add_argument("--revision", default="head", help="target revision (default: head)")
    mig.add_argument("--sql", action="store_true", help="print the SQL instead of running it")
    return parser


def add_db_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--db",
        default=os.environ.get("OUTBOX_DB"),
        help="SQLAlchemy database URL (default: $OUTBOX_DB)",
    )


def cmd_migrate(args: argparse.Namespace) -> int:
    if args.sql:
        migrate.upgrade_sql(args.db, args.revision)
        return EXIT_OK
    migrate.upgrade(args.db, args.revision)
    print(f"outbox schema at {migrate.current_revision(args.db)} in {mask_url(args.db)}")
    return EXIT_OK


COMMANDS = {"migrate": cmd_migrate}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "db", "") is None:
        parser.error("--db is required (or set OUTBOX_DB)")
    try:
        return COMMANDS[args.command](args)
    except (OutboxError, SQLAlchemyError) as exc:
        print(f"outbox {args.command}: {describe_error(exc)}", file=sys.stderr)
        return EXIT_FAILED


def describe_error(exc: Exception) -> str:
    """One line, without the SQL echo or a password."""
    if isinstance(exc, SQLAlchemyError):
        orig = getattr(exc, "orig", None)
        text = str(orig if orig is not None else exc).strip().splitlines()[0]
        return f"{type(exc).__name__}: {text}"
    return str(exc)


if __name__ == "__main__":
    sys.exit(main())
