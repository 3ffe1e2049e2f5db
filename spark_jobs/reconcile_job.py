"""Reconcile the outbox ledger against what the broker holds, on Spark.

For a window [start, end) and an SLA (default 60 s), per topic and in total:
committed (ledger rows created in the window), delivered, pending (not at the broker
yet but due for less than the SLA at the window's end: not lost; a scheduled message is
due at its deliver_at), scheduled (still pending, its deliver_at at or after the
window's end: not expected yet), lost, dead (given up by the sweeper), skipped (given
up by an operator, `outbox skip`: not expected at the broker), canceled (a scheduled
message the app canceled, `Outbox.cancel`: never expected), duplicated (extra copies
of a msg_id at the broker), phantom (at the broker in the window, with no ledger row at
all), out_of_order (an ordered message whose first
delivery came after a later message of its key, by ``Outbox-Seq``; see
spark_jobs.ordering), malformed (ledger rows without a usable msg_id), and
latency p50/p90/p99/max from when a message was due (its commit, or its deliver_at) to
the broker.

Runs locally (``outbox reconcile``) and unchanged under ``spark-submit
spark_jobs/reconcile_job.py ...`` (ship the spark_jobs folder alone with ``--py-files``: it
imports neither outbox nor relay); tables are never collected whole into the driver,
only the aggregates (and report.html's first 20 out-of-order deliveries). Exit status
3 when lost, phantom or out_of_order > 0, for schedulers; 1 when the job failed (a
missing input or column is found before Spark starts); 2 bad usage (argparse's own),
as every `outbox` command.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spark_jobs.flags import iso_time, without_passwords
from spark_jobs.window import Window

if TYPE_CHECKING:
    import pyarrow as pa

EXIT_FAILED, EXIT_DISCREPANCY = 1, 3  # relay.cli.common's EXIT_FAILED and EXIT_DATA


class JobError(Exception):
    """The job cannot finish: an input is missing or unusable, or Spark failed."""


def check_inputs(ledger: str, broker_log: str, halfop_log: str | None, out: str) -> None:
    """Each local Parquet input exists and has the columns the job reads.

    Remote paths (hdfs://, s3a://) and a JDBC ledger are left to Spark to judge.
    """
    from spark_jobs.schema import (
        BROKER,
        BROKER_OPTIONAL,
        HALFOP_LOG,
        LEDGER,
        LEDGER_OPTIONAL,
        RECORDS,
    )

    if not is_remote(ledger):  # also skips a postgresql:// ledger
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
        "--sla", type=float, default=60.0, help="seconds before a missing message is lost"
    )
    parser.add_argument(
        "--master", default=None, help="Spark master (default: local[*], or spark-submit's)"
    )


def run(args: argparse.Namespace, prog: str = "reconcile") -> int:
    """Run the job for parsed flags; prints the totals, returns the exit status."""
    try:
        check_inputs(args.ledger, args.broker_log, args.halfop_log, args.out)
        summary = run_on_spark(args, told(prog, time.monotonic()))
    except JobError as exc:  # Spark's text may echo an input's URL, credentials and all
        inputs = [args.ledger, args.broker_log, args.halfop_log]
        print(without_passwords(f"{prog}: {exc}", inputs), file=sys.stderr)
        return EXIT_FAILED
    from spark_jobs.report import alarming

    total = summary["total"]
    print(json.dumps(total, default=str))
    return EXIT_DISCREPANCY if alarming(total) else 0


def window_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the parsed window, if anything (a usage error)."""
    return "--end must be after --start" if args.end <= args.start else None


def main(argv: Sequence[str] | None = None) -> int:
    """`spark-submit spark_jobs/reconcile_job.py --ledger ...`: `outbox reconcile`'s flags."""
    parser = argparse.ArgumentParser(
        prog="reconcile", description=__doc__.splitlines()[0] if __doc__ else None
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    if error := window_error(args):
        parser.error(error)
    return run(args)


def run_on_spark(
    args: argparse.Namespace, step: Callable[[str], None] = lambda _: None
) -> dict[str, Any]:
    """``run`` in a session of its own; what Spark raises becomes one line."""
    from py4j.protocol import Py4JJavaError  # type: ignore[import-untyped]
    from pyspark.errors import PySparkException
    from pyspark.sql import SparkSession

    from spark_jobs.reconciliation import reconcile

    builder = SparkSession.builder.appName("outbox-reconcile").config(
        "spark.sql.session.timeZone", "UTC"
    )
    if args.master:  # spark-submit's --master otherwise, or local[*] when run alone
        builder = builder.master(args.master)
    if args.ledger.startswith("postgresql"):
        from spark_jobs.ledger import with_jdbc_jar

        builder = with_jdbc_jar(builder)
    step("starting Spark")
    spark = builder.getOrCreate()
    try:
        window = Window(args.start, args.end, args.sla)
        return reconcile(
            spark, args.ledger, args.broker_log, args.out, window, args.halfop_log, step
        )
    except Py4JJavaError as exc:  # its text is the whole Java stack
        raise JobError(first_line(exc.java_exception.toString())) from None
    except PySparkException as exc:
        raise JobError(first_line(str(exc))) from None
    finally:
        spark.stop()


def told(prog: str, started: float) -> Callable[[str], None]:
    """One stderr line per step, with the seconds since the job started (no bar: Spark's
    steps have no count to show, and its own logs share stderr)."""

    def step(what: str) -> None:
        print(f"{prog}: {what} ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)

    return step


def first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "Spark failed"


if __name__ == "__main__":
    sys.exit(main())
