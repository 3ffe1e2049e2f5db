"""`outbox export` (ledger, records, broker logs to Parquet) and `outbox reconcile` (Spark)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path

from relay import plugins
from relay.brokers import LOG_SOURCE_FLAGS, family_of, reader_for
from relay.cli.common import EXIT_OK, Commands, UsageError, add_db_flag, required
from relay.cli.progress import counting
from spark_jobs import reconcile_job
from spark_jobs.flags import folder_problem, iso_time, out_file_problem


def add_export(commands: Commands) -> None:
    exp = commands.add_parser(
        "export",
        help="write the ledger or the broker log to Parquet (for `outbox reconcile`)",
        description="Stream the outbox ledger (any supported DB) or a broker's log to a Parquet "
        "file in bounded memory. The broker URL's scheme says what to read: nats:// every "
        "JetStream stream (or --stream), redis:// every topic's stream under the prefix (or "
        "--stream), amqp:// the relay's audit stream queue (?audit= or --queue). --topic "
        "narrows either side to the matching topics.",
    )
    kinds = plugins().export_kinds  # model B's records and halfop (relay.lab)
    helps = ["ledger: outbox_message", "broker: the broker's log"]
    exp.add_argument(
        "what",
        choices=["ledger", "broker", *kinds],
        help="; ".join(helps + [kind.help for kind in kinds.values()]),
    )
    # ledger and records read the database; a broker export, the ledger's topics
    add_db_flag(exp, required=False)
    exp.add_argument(
        "--broker", default=os.environ.get("OUTBOX_BROKER"), help="broker URL (broker export)"
    )
    exp.add_argument(
        "--stream",
        dest="streams",
        action="append",
        metavar="STREAM",
        help="broker export: a source to read, repeatable (default: every one at the broker "
        "or, with --db, every one that captures a topic of the window's ledger): a JetStream "
        "stream (nats://), a topic's stream (redis://)",
    )
    exp.add_argument(
        "--topic",
        dest="topics",
        action="append",
        metavar="PATTERN",
        help="only topics matching PATTERN, repeatable, in NATS wildcard syntax (* one "
        "token, > the rest): ledger and broker exports",
    )
    exp.add_argument(
        "--queue",
        help="audit stream queue to read, the relay's ?audit=QUEUE (amqp:// broker export; "
        "default: the URL's ?audit=)",
    )
    exp.add_argument(
        "--since",
        type=iso_time,
        help="ISO 8601 start (default: the beginning); a ledger export holds the rows created "
        "from then and, unless --by-day, the rows due from then (scheduled earlier)",
    )
    exp.add_argument("--until", type=iso_time, help="ISO 8601 end (default: now)")
    exp.add_argument("--out", required=True, help="Parquet file to write")
    exp.add_argument(
        "--by-day",
        action="store_true",
        help="ledger only: write --out as a folder of day=YYYY-MM-DD/ partitions (created_at's "
        "UTC day), so that `outbox reconcile` reads only its window's days; into an earlier "
        "export by day, the days written replace theirs and the others stay",
    )


def add_reconcile(commands: Commands) -> None:
    rec = commands.add_parser(
        "reconcile",
        help="reconcile ledger and broker log on Spark: lost, stuck, duplicated, phantom, out "
        "of order, latency",
        description="Run spark_jobs/reconcile_job.py locally (local[*]); the same file runs under "
        "spark-submit. Quiet: its steps with counts and the totals, no Spark logs (--verbose). "
        "Exit status 3 when lost, phantom or out-of-order messages or malformed broker entries "
        "(the relay cannot have written them) were found, else 4 when "
        "stuck ones were (still pending past --sla: late, not lost).",
    )
    reconcile_job.add_arguments(rec)


def cmd_export(args: argparse.Namespace) -> int:
    from relay import export

    if args.by_day and args.what != "ledger":
        raise UsageError(f"--by-day: for a ledger export only, not {args.what}")
    if problem := out_problem(args.out, args.by_day):  # before any connection
        raise UsageError(f"--out {args.out}: {problem}")
    if args.what == "ledger":
        db = required(args.db, "--db", "a ledger export (or set OUTBOX_DB)")
        topics = args.topics or ()
        total = export.ledger_count(db, args.since, args.until, args.by_day, topics)
        with counting("export ledger", total) as shown:
            count = export.export_ledger(
                db, args.out, args.since, args.until, shown.add, args.by_day, topics
            )
    elif (kind := plugins().export_kinds.get(args.what)) is not None:
        count = kind.run(args)
    else:
        strangers = Tally()
        with counting("export broker") as shown:
            count = export_broker(args, shown.add, strangers.add)
        hint = " (entries the relay cannot have written: their malformed column says why)"
        print(f"exported {count} row(s) to {args.out}, {strangers.count} malformed"
              + (hint if strangers.count else ""))  # fmt: skip
        return EXIT_OK
    print(f"exported {count} row(s) to {args.out}")
    return EXIT_OK


class Tally:
    """Counts what it is told (the broker export's malformed entries, chunk by chunk)."""

    def __init__(self) -> None:
        self.count = 0

    def add(self, n: int) -> None:
        self.count += n


def out_problem(out: str, by_day: bool) -> str | None:
    """Why the export cannot be written at ``out``: a file, or with --by-day a folder of
    days (new, or an earlier export by day)."""
    from relay import export

    if not by_day:
        return out_file_problem(out)
    folder = Path(out)  # written into when it exists, else made in its folder
    return export.day_folder_problem(out) or folder_problem(
        folder if folder.is_dir() else folder.parent
    )


def export_broker(
    args: argparse.Namespace, added: Callable[[int], None], malformed: Callable[[int], None]
) -> int:
    """The broker's log, through the reader its URL's scheme picks: the sources named
    (--stream, --queue) or every one at the broker, entries of the --topic patterns only;
    ``malformed`` is told how many entries of each chunk the relay cannot have written.
    What each source captures goes into the Parquet's metadata (see export_broker)."""
    from relay import export

    url = required(args.broker, "--broker", "a broker export (or set OUTBOX_BROKER)")
    names = [*(args.streams or []), *([args.queue] if args.queue else [])]
    if args.queue and "--queue" not in LOG_SOURCE_FLAGS[family_of(url)]:  # amqp:// only
        raise UsageError("--queue: for an amqp:// broker; name streams with --stream")
    topics = args.topics or ()
    reader = reader_for(url)
    captures = export.log_sources(reader, names, topics)
    if not names and args.db:  # every source that holds a topic of the window's ledger
        since = None if args.since is None else args.since - export.LEDGER_LEAD
        captures = export.holding(captures, export.ledger_topics(args.db, since, args.until))
    return export.export_broker(
        reader, list(captures), args.out, args.since, args.until, added, malformed, topics,
        captures,
    )  # fmt: skip


def cmd_reconcile(args: argparse.Namespace) -> int:
    if error := reconcile_job.usage_error(args):
        raise UsageError(error)
    return reconcile_job.run(args, prog="outbox reconcile")


PARSERS = (add_export, add_reconcile)
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "export": cmd_export,
    "reconcile": cmd_reconcile,
}
