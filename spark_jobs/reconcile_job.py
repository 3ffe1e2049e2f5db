"""Reconcile the outbox ledger against what the broker holds, on Spark.

For a window [start, end) and an SLA (default 60 s), per topic and in total:
committed (ledger rows created in the window), delivered, pending (not at the broker
yet but due for less than the SLA at the window's end: not lost; a scheduled message is
due at its deliver_at), stuck (not at the broker, due for longer than the SLA, and still
pending in the table: undelivered, the sweeper may still publish it), scheduled (still
pending, its deliver_at at or after the window's end: not expected yet), lost (marked
sent, or model B's committed, and never at the broker), dead (given up by the sweeper),
skipped (given up by an operator, `outbox skip`: not expected at the broker), canceled (a scheduled
message the app canceled, `Outbox.cancel`: never expected), duplicated (extra copies
of a msg_id at the broker), phantom (at the broker in the window, with no ledger row at
all), out_of_order (an ordered message whose first
delivery came after a later message of its key, by ``Outbox-Seq``; see
spark_jobs.ordering), malformed (ledger rows without a usable msg_id),
malformed_at_broker (entries at the broker the relay cannot have written: the export's
``malformed`` column says why), and
latency p50/p90/p99/max from when a message was due (its commit, or its deliver_at) to
the broker.

Runs locally (``outbox reconcile``) and unchanged under ``spark-submit
ship/reconcile.py ...`` (``python -m spark_jobs.bundle ship`` writes the package as a zip
for ``--py-files`` and that entry file: it imports neither outbox nor relay); tables are
never collected whole into the driver, only the aggregates (and report.html's first 20
out-of-order deliveries). Exit status 3 when lost, phantom, out_of_order or
malformed_at_broker > 0, for
schedulers; else 4 when stuck > 0 (late, not lost: the relay or the broker is stalled);
1 when the job failed (one line naming the cause: a missing input or column is found
before Spark starts, Spark's own errors are cut to their root cause); 2 bad usage
(argparse's own), as every `outbox` command.

Quiet unless ``--verbose``: a line per step on stderr with its counts, the totals on
stdout, no Spark logs or stage bars (spark_jobs.session).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spark_jobs.flags import (
    DAY_S,
    SLA_SECONDS,
    bounded_seconds,
    iso_time,
    out_folder_problem,
    spark_master,
    without_passwords,
)
from spark_jobs.topics import read_captures, unaudited_lines
from spark_jobs.window import Window

if TYPE_CHECKING:
    import pyarrow as pa

# relay.cli.common's EXIT_FAILED, EXIT_DATA and EXIT_STUCK
EXIT_FAILED, EXIT_DISCREPANCY, EXIT_STUCK = 1, 3, 4
LOOKBACK_SECONDS = bounded_seconds(0, 30 * DAY_S)  # an optimisation: a month is plenty


class JobError(Exception):
    """The job cannot finish: an input is missing or unusable, or Spark failed.

    ``detail``: what Spark said in full (its Java stack), shown with --debug or --verbose.
    """

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail


def check_inputs(ledger: str, broker_log: str, halfop_log: str | None, out: str) -> None:
    """Each local Parquet input exists and has the columns the job reads.

    Remote paths (hdfs://, s3a://) and a JDBC ledger are left to Spark to judge.
    """
    from spark_jobs.ledger import is_empty_folder
    from spark_jobs.schema import (
        BROKER,
        BROKER_OPTIONAL,
        HALFOP_LOG,
        LEDGER,
        LEDGER_OPTIONAL,
        RECORDS,
    )

    # a postgresql:// ledger is remote; an export by day of an empty range has no file
    if not is_remote(ledger) and not is_empty_folder(ledger):
        schema, optional = (LEDGER, LEDGER_OPTIONAL) if halfop_log is None else (RECORDS, ())
        require_columns("--ledger", ledger, [n for n in schema.names if n not in optional])
    if not is_remote(broker_log):
        needed = [name for name in BROKER.names if name not in BROKER_OPTIONAL]
        require_columns("--broker-log", broker_log, needed)
    if halfop_log is not None and not is_remote(halfop_log):
        require_columns("--halfop-log", halfop_log, HALFOP_LOG.names)
    if not is_remote(out) and Path(out).is_file():
        raise JobError(f"--out {out}: a file, not a folder")


def is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def require_columns(flag: str, path: str, expected: Sequence[str]) -> None:
    have = set(parquet_schema(flag, path).names)
    missing = [name for name in expected if name not in have]
    if missing:
        raise JobError(f"{flag} {path}: missing column(s) {', '.join(missing)}")


def parquet_schema(flag: str, path: str) -> pa.Schema:
    """The schema of a Parquet file, or of the first part file of a folder of them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    source = Path(path.removeprefix("file://"))
    if source.is_dir():
        parts = sorted(p for p in source.rglob("*.parquet") if not p.name.startswith(("_", ".")))
        if not parts:
            raise JobError(f"{flag} {path}: no Parquet file in the folder")
        source = parts[0]
    elif not source.exists():
        raise JobError(f"{flag} {path}: no such file or folder")
    try:
        return pq.read_schema(source)
    except (pa.ArrowException, OSError) as exc:
        raise JobError(f"{flag} {path}: not a Parquet file ({exc})") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The job's flags, declared once: for its own main() and for `outbox reconcile`."""
    parser.add_argument(
        "--ledger", required=True, help="ledger Parquet, or a postgresql:// URL read over JDBC"
    )
    parser.add_argument(
        "--broker-log", required=True, help="Parquet of the broker log (outbox export broker)"
    )
    parser.add_argument(
        "--halfop-log",
        help="model B: Parquet of the half/op streams (outbox export halfop); --ledger is "
        "then the listener's records (outbox export records)",
    )
    parser.add_argument(
        "--out", required=True, help="folder for summary.json, discrepancies/, report.html"
    )
    parser.add_argument("--start", type=iso_time, required=True, help="window start, ISO 8601")
    parser.add_argument("--end", type=iso_time, required=True, help="window end, ISO 8601")
    parser.add_argument(
        "--sla",
        type=SLA_SECONDS,
        default=60.0,
        help="seconds a message may take to reach the broker; missing for longer, it is "
        f"stuck (still pending in the table) or lost ({SLA_SECONDS.range}, default 60)",
    )
    parser.add_argument(
        "--lookback",
        type=LOOKBACK_SECONDS,
        default=3600.0,
        help="seconds before --start whose ledger rows are read with the window's; only an "
        "optimisation: a message at the broker in the window with no ledger row read is "
        "then looked up by msg_id in the whole ledger before it counts as a phantom, so "
        f"the results do not depend on it ({LOOKBACK_SECONDS.range}, default 3600)",
    )
    parser.add_argument(
        "--topic",
        dest="topics",
        action="append",
        default=[],
        metavar="PATTERN",
        help="audit only topics matching PATTERN, both sides, repeatable, in NATS wildcard "
        "syntax (* one token, > the rest); the report names the filter",
    )
    parser.add_argument(
        "--master",
        type=spark_master,
        default=None,
        help="Spark master (default: local[*], or spark-submit's)",
    )
    parser.add_argument(
        "--verbose", action="store_true", help="let Spark log and draw its stage bars"
    )


def run(args: argparse.Namespace, prog: str = "reconcile") -> int:
    """Run the job for parsed flags; prints the totals, returns the exit status."""
    try:
        check_inputs(args.ledger, args.broker_log, args.halfop_log, args.out)
        summary = run_on_spark(args, told(prog, time.monotonic()))
    except JobError as exc:  # Spark's text may echo an input's URL, credentials and all
        inputs = [args.ledger, args.broker_log, args.halfop_log]
        if exc.detail and (getattr(args, "debug", False) or args.verbose):
            print(without_passwords(exc.detail.rstrip(), inputs), file=sys.stderr)
        print(without_passwords(f"{prog}: {exc}", inputs), file=sys.stderr)
        return EXIT_FAILED
    total = summary["total"]
    print(json.dumps(total, default=str))
    for line in unaudited_lines(summary):  # not lost: they do not change the exit status
        print(f"{prog}: warning: {line}", file=sys.stderr)
    return exit_status(total)


def exit_status(total: dict[str, Any]) -> int:
    """3 for lost, phantom or out-of-order messages or malformed entries at the broker;
    else 4 for stuck ones; else 0."""
    from spark_jobs.report import alarming, late

    return EXIT_DISCREPANCY if alarming(total) else EXIT_STUCK if late(total) else 0


def window_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the parsed window, if anything (a usage error)."""
    return "--end must be after --start" if args.end <= args.start else None


def usage_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the parsed flags together, if anything: the window, or an --out
    that cannot be written (found before Spark starts)."""
    if problem := out_folder_problem(args.out):
        return f"--out {args.out}: {problem}"
    return window_error(args)


def main(argv: Sequence[str] | None = None) -> int:
    """`spark-submit spark_jobs/reconcile_job.py --ledger ...`: `outbox reconcile`'s flags."""
    parser = argparse.ArgumentParser(
        prog="reconcile", description=__doc__.splitlines()[0] if __doc__ else None
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    if error := usage_error(args):
        parser.error(error)
    return run(args)


def run_on_spark(
    args: argparse.Namespace, step: Callable[[str], None] = lambda _: None
) -> dict[str, Any]:
    """``run`` in a session of its own; what Spark raises becomes one line."""
    from py4j.protocol import Py4JError  # type: ignore[import-untyped]
    from pyspark.errors import PySparkException

    from spark_jobs import session
    from spark_jobs.ledger import is_postgres, with_jdbc_jar
    from spark_jobs.reconciliation import reconcile

    verbose = args.verbose
    small = session.small_input(args.master, [args.ledger, args.broker_log, args.halfop_log])
    builder = session.builder("outbox-reconcile", args.master, verbose, small)
    if is_postgres(args.ledger):
        try:
            builder = with_jdbc_jar(builder)
        except FileNotFoundError as exc:
            raise JobError(f"--ledger: {exc}") from None
    step("starting Spark")
    spark = None
    try:
        spark = session.started(builder, verbose, small)
        window = Window(args.start, args.end, args.sla, args.lookback)
        topics, captures = getattr(args, "topics", []), read_captures(args.broker_log)
        return reconcile(
            spark, args.ledger, args.broker_log, args.out, window, args.halfop_log, step,
            topics=topics, captures=captures,
        )  # fmt: skip
    except (Py4JError, PySparkException) as exc:
        master = spark.sparkContext.master if spark is not None else args.master
        raise JobError(spark_error(exc, master), str(exc)) from None
    finally:
        if spark is not None:
            session.stopped(spark)


def spark_error(exc: Exception, master: str | None = None) -> str:
    """One line for what Spark raised: the root cause of a Java exception (its text is
    the whole Java stack), else the first line of Python's. A context stopped under the
    job (a cluster master that never answered gives up after a minute) names the master."""
    java = getattr(exc, "java_exception", None)
    if java is None:
        return first_line(str(exc))
    while java.getCause() is not None:
        java = java.getCause()
    if "stopped SparkContext" in java.toString() and master:
        return f"Spark stopped before the job ended: is the master {master} reachable and up?"
    return first_line(java.toString())


def told(prog: str, started: float) -> Callable[[str], None]:
    """One stderr line per step, with the seconds since the job started (no bar: a Spark
    step has its counts only once done, and with --verbose Spark's logs share stderr)."""

    def step(what: str) -> None:
        print(f"{prog}: {what} ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)

    return step


def first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "Spark failed"


if __name__ == "__main__":
    sys.exit(main())
