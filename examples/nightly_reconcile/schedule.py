"""The nightly reconciliation job: export the last day, reconcile it, keep the report.

It needs only the database, the broker and a folder: the broker side is every stream
at the broker that captures a topic of the night's ledger (every such topic's stream for
Redis, the ?audit= queue for RabbitMQ); another app's streams are left alone.

`--once` runs it now and exits with its status; otherwise APScheduler runs it every
night at the given time (cron trigger) until interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

from examples.cli import add_db_and_broker
from relay import export
from relay.brokers import reader_for
from spark_jobs import reconcile_job


def run_once(db: str, broker: str, out: Path, end: datetime | None = None) -> int:
    """Reconcile the 24 hours before ``end`` (default: now) against every stream at the
    broker; returns the job's exit status. A topic no stream captures is reported as not
    audited (a warning line), never as lost."""
    end = end or datetime.now(UTC)
    start = end - timedelta(days=1)
    folder = out / end.strftime("%Y-%m-%dT%H%M%S")
    folder.mkdir(parents=True, exist_ok=True)
    since = start - export.LEDGER_LEAD  # a message committed just before the window counts
    export.export_ledger(db, folder / "ledger.parquet", since=since)
    reader = reader_for(broker)
    # every stream that captures a topic of the ledger's, with the subjects it captures
    streams = export.holding(export.log_sources(reader), export.ledger_topics(db, since))
    export.export_broker(reader, list(streams), folder / "broker.parquet", since=start,
                         captures=streams)  # fmt: skip
    return reconcile_job.main(
        ["--ledger", str(folder / "ledger.parquet"), "--broker-log", str(folder / "broker.parquet"),
         "--out", str(folder / "report"), "--start", start.isoformat(), "--end", end.isoformat(),
         "--master", "local[*]"]
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    add_db_and_broker(parser)
    parser.add_argument(
        "--out", type=Path, required=True, help="folder that keeps every night's report"
    )
    parser.add_argument("--at", default="02:30", help="local time to run every night (HH:MM)")
    parser.add_argument(
        "--once", action="store_true", help="run now, once, and exit with its status"
    )
    args = parser.parse_args(argv)
    if args.once:
        return run_once(args.db, args.broker, args.out)
    from apscheduler.schedulers.blocking import BlockingScheduler

    hour, minute = (int(part) for part in args.at.split(":"))
    scheduler = BlockingScheduler()
    scheduler.add_job(
        run_once,
        "cron",
        hour=hour,
        minute=minute,
        args=[args.db, args.broker, args.out],
    )
    with contextlib.suppress(KeyboardInterrupt, SystemExit):
        scheduler.start()
    return 0


if __name__ == "__main__":
    sys.exit(main())
