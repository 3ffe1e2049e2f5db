"""The ``outbox`` command line.

Exit codes: 0 success, 1 the operation failed (the message says why), 2 bad usage,
3 (status only) dead messages exist. Every failure is one line on stderr; ``--debug``
adds the traceback. Connection strings come from flags or OUTBOX_DB / OUTBOX_BROKER;
passwords and tokens are masked in everything printed or logged.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import traceback
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from outbox import migrate
from outbox.config import (
    CONNECT_TIMEOUT_S,
    Settings,
    check_broker_url,
    engine_from,
    iso_time,
    mask_url,
    scrub,
)
from outbox.errors import OutboxError

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_DEAD = 0, 1, 2, 3
DRAIN_PASSES = 3
CONNECT_WAIT_S = 10.0
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}
READ_TIMEOUT_S = 60.0  # a CLI read (status, requeue, drain's count) waits this long at most
log = logging.getLogger("outbox.cli")
T = TypeVar("T")


class UsageError(OutboxError):
    """The command line is incomplete or contradictory (exit status 2)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="outbox",
        description="Transactional outbox: schema, relay workers and operations.",
        epilog="Exit codes: 0 success, 1 failure, 2 bad usage, 3 dead messages (status).",
    )
    add_debug_flag(parser, default=False)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    mig = commands.add_parser(
        "migrate",
        help="create or upgrade the outbox tables (idempotent)",
        description="Upgrade the outbox tables to the newest schema. Safe to run again.",
    )
    add_db_flag(mig)
    mig.add_argument("--revision", default="head", help="target revision (default: head)")
    mig.add_argument("--sql", action="store_true", help="print the SQL instead of running it")

    rel = commands.add_parser(
        "relay",
        help="run a relay worker: sweeper and retention (until SIGTERM/SIGINT)",
        description="Publish pending messages older than the sweeper age and purge old sent "
        "rows. Run any number of workers, on any number of machines, against one database.",
    )
    add_db_flag(rel)
    add_broker_flag(rel)
    rel.add_argument(
        "--concurrency", type=positive_int, default=1, help="sweeps side by side (default 1)"
    )
    rel.add_argument(
        "--interval", type=float, default=1.0, help="seconds between sweeps (default 1)"
    )
    rel.add_argument(
        "--retention-days", type=float, default=3.0, help="keep sent rows this long (default 3)"
    )
    rel.add_argument(
        "--stop-timeout", type=float, default=10.0, help="graceful stop deadline, s (default 10)"
    )
    rel.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus /metrics on this port (needs the [metrics] extra)",
    )
    rel.add_argument(
        "--metrics-addr", default="0.0.0.0", help="address for /metrics (default 0.0.0.0)"
    )

    st = commands.add_parser(
        "status",
        help="pending, oldest pending age, dead and recently sent, per topic",
        description="Show the outbox's state per topic. Exit status 3 when dead messages exist.",
    )
    add_db_flag(st)
    st.add_argument("--json", action="store_true", help="machine-readable output")

    req = commands.add_parser(
        "requeue",
        help="put dead (or selected) messages back to pending, attempts reset",
        description="Requeue messages for the sweeper. Give at least one of --dead, --topic, --id. "
        "Only dead rows are requeued, except rows named by --id (sent ones are then republished).",
    )
    add_db_flag(req)
    req.add_argument("--dead", action="store_true", help="only dead messages")
    req.add_argument("--topic", help="only this topic")
    req.add_argument(
        "--id",
        dest="ids",
        nargs="+",
        type=msg_id,
        default=[],
        metavar="MSG_ID",
        help="these msg_ids",
    )

    drn = commands.add_parser(
        "drain",
        help="publish everything pending now, once, with progress",
        description="One-shot sweep of every pending message regardless of age and backoff, "
        "for recovering a large backlog.",
    )
    add_db_flag(drn)
    add_broker_flag(drn)
    drn.add_argument(
        "--concurrency", type=positive_int, default=2, help="sweeps side by side (default 2)"
    )
    exp = commands.add_parser(
        "export",
        help="write the ledger or the broker log to Parquet (for `outbox reconcile`)",
        description="Stream the outbox ledger (any supported DB) or a broker's log to a Parquet "
        "file in bounded memory. The broker URL's scheme says what to read: nats:// a "
        "JetStream stream (--stream), redis:// topics' streams (--topic), amqp:// the "
        "relay's audit stream queue (--queue).",
    )
    exp.add_argument(
        "what",
        choices=["ledger", "broker", "records", "halfop"],
        help="ledger: outbox_message; broker: the broker's log; model B: records (the "
        "listener's table) and halfop (the half, op and discarded streams, nats:// only)",
    )
    add_db_flag(exp)
    exp.add_argument(
        "--broker", default=os.environ.get("OUTBOX_BROKER"), help="broker URL (broker export)"
    )
    exp.add_argument("--stream", help="JetStream stream to read (nats:// broker export)")
    exp.add_argument(
        "--topic",
        dest="topics",
        action="append",
        metavar="TOPIC",
        help="topic whose stream to read, repeatable (redis:// broker export)",
    )
    exp.add_argument(
        "--queue",
        help="audit stream queue to read, the relay's ?audit=QUEUE (amqp:// broker export)",
    )
    exp.add_argument("--since", type=iso_time, help="ISO 8601 start (default: the beginning)")
    exp.add_argument("--until", type=iso_time, help="ISO 8601 end (default: now)")
    exp.add_argument("--out", required=True, help="Parquet file to write")

    rec = commands.add_parser(
        "reconcile",
        help="reconcile ledger and broker log on Spark: lost, duplicated, phantom, latency",
        description="Run spark_jobs/reconcile.py locally (local[*]); the same file runs under "
        "spark-submit. Exit status 2 when lost or phantom messages were found.",
    )
    rec.add_argument(
        "--ledger", required=True, help="ledger Parquet, or a postgresql:// URL (JDBC, by id range)"
    )
    rec.add_argument("--broker-log", required=True, help="broker Parquet (outbox export broker)")
    rec.add_argument(
        "--halfop-log",
        help="model B: half/op Parquet (outbox export halfop); --ledger is then the records",
    )
    rec.add_argument(
        "--out", required=True, help="folder for summary.json, discrepancies/, report.html"
    )
    rec.add_argument("--start", required=True, help="window start, ISO 8601")
    rec.add_argument("--end", required=True, help="window end, ISO 8601")
    rec.add_argument("--sla", default="60", help="seconds before a missing message counts as lost")
    rec.add_argument("--master", default="local[*]", help="Spark master (default local[*])")

    commands.add_parser(
        "compare",
        help="run one workload through model A and model B, with faults; compare.html",
        description="See `outbox compare --help` for its options.",
        add_help=False,
    )

    coord = commands.add_parser(
        "coordinator",
        help="run model B's coordinator: end transactions and check-back (until SIGTERM)",
        description="The broker-side part of the RocketMQ half/op model, over NATS JetStream. "
        "It exists to compare model B with the outbox; see the README.",
    )
    add_broker_flag(coord)
    add_debug_flag(coord)
    coord.add_argument("--check-interval", type=float, default=60.0, help="seconds (default 60)")
    coord.add_argument(
        "--transaction-timeout",
        type=float,
        default=6.0,
        help="halfs younger than this wait (default 6)",
    )
    coord.add_argument(
        "--check-max", type=positive_int, default=15, help="checks before discard (default 15)"
    )
    return parser


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


def add_db_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--db",
        default=os.environ.get("OUTBOX_DB"),
        help="SQLAlchemy database URL (default: $OUTBOX_DB)",
    )
    parser.add_argument(
        "--connect-timeout",
        type=positive_float,
        default=os.environ.get("OUTBOX_CONNECT_TIMEOUT", CONNECT_TIMEOUT_S),
        metavar="SECONDS",
        help="give up connecting to the database after this long "
        f"(default: $OUTBOX_CONNECT_TIMEOUT or {CONNECT_TIMEOUT_S:.0f})",
    )
    add_debug_flag(parser)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text!r}")
    return value


def database(args: argparse.Namespace, reads: bool = False) -> Engine:
    """The engine for --db, with the command line's timeouts (reads bounded when asked)."""
    return engine_from(args.db, args.connect_timeout, READ_TIMEOUT_S if reads else None)


def add_broker_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--broker",
        default=os.environ.get("OUTBOX_BROKER"),
        help="broker URL, e.g. nats://127.0.0.1:4222 (default: $OUTBOX_BROKER)",
    )


def cmd_migrate(args: argparse.Namespace) -> int:
    if args.sql:
        migrate.upgrade_sql(args.db, args.revision)
        return EXIT_OK
    engine = database(args)
    try:
        migrate.upgrade(engine, args.revision)
        if args.revision == "head":
            migrate.require_schema(engine)  # at head, yet columns missing: say so
        revision = migrate.current_revision(engine)
    finally:
        engine.dispose()
    print(f"outbox schema at {revision} in {mask_url(args.db)}")
    return EXIT_OK


def cmd_relay(args: argparse.Namespace) -> int:
    from relay.brokers import broker_for
    from relay.loop import BrokerLoop
    from relay.worker import RelayJobs

    defer_stop_signals()
    settings = Settings(sweep_interval_s=args.interval, retention_s=args.retention_days * 86400)
    engine = database(args)
    migrate.require_schema(engine)
    relay = BrokerLoop(broker_for(check_broker_url(args.broker) or ""), name="outbox-worker")
    jobs = RelayJobs(engine, relay, settings, concurrency=args.concurrency)
    metrics = serve_metrics(jobs, args.metrics_port, args.metrics_addr)  # fails before starting
    relay.start()
    jobs.start()
    log.info("relay worker started: db=%s broker=%s", mask_url(args.db), mask_url(args.broker))
    signal.sigwait(STOP_SIGNALS)
    if metrics is not None:
        metrics.shutdown()
    log.info("stopping (deadline %.0f s)", args.stop_timeout)
    jobs.stop(args.stop_timeout)
    relay.stop(2.0)
    engine.dispose()
    totals = jobs.sweeper.totals
    log.info("relay worker stopped: sent=%d dead=%d", totals.sent, totals.dead)
    return EXIT_OK


def defer_stop_signals() -> None:
    """SIGTERM and SIGINT wait for ``signal.sigwait``: called before any thread starts
    (threads inherit the mask). A Python handler that sets an Event can deadlock on the
    Event's own lock when it interrupts the main thread inside ``Event.wait``."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def serve_metrics(jobs: Any, port: int | None, addr: str) -> Any:
    if port is None:
        return None
    try:
        from outbox.metrics import serve
    except ImportError:
        raise OutboxError("--metrics-port needs prometheus_client: pip install "
                          "'outbox-relay[metrics]'") from None  # fmt: skip
    server = serve(lambda: (None, jobs), port, addr)
    log.info("metrics on http://%s:%d/metrics", addr, port)
    return server


def cmd_status(args: argparse.Namespace) -> int:
    from relay import store

    engine = database(args, reads=True)
    try:
        migrate.require_schema(engine)
        with engine.connect() as conn:
            now = store.db_clock(conn)
            topics = store.status_by_topic(conn, now)
    finally:
        engine.dispose()
    for row in topics:
        oldest = row.pop("oldest_pending")
        row["oldest_pending_age_s"] = round(age_seconds(now, oldest), 3) if oldest else None
    totals: dict[str, Any] = {
        k: sum(int(r[k]) for r in topics) for k in ("pending", "dead", "sent_1m", "sent_1h")
    }
    ages = [r["oldest_pending_age_s"] for r in topics if r["oldest_pending_age_s"] is not None]
    totals["oldest_pending_age_s"] = max(ages) if ages else None
    if args.json:
        print(json.dumps({"now": now.isoformat(), "total": totals, "topics": topics}, default=str))
    else:
        print_status(topics, totals)
    return EXIT_DEAD if totals["dead"] else EXIT_OK


def age_seconds(now: datetime, then: datetime) -> float:
    if then.tzinfo is None:
        then = then.replace(tzinfo=now.tzinfo)
    return (now - then).total_seconds()


def print_status(topics: list[dict[str, Any]], totals: dict[str, Any]) -> None:
    header = ("topic", "pending", "oldest_pending_age_s", "dead", "sent_1m", "sent_1h")
    rows = [[str(r.get(h, "")) if r.get(h) is not None else "-" for h in header] for r in topics]
    rows.append(["TOTAL", *[str(totals[h]) if totals[h] is not None else "-" for h in header[1:]]])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    for row in rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))


def cmd_requeue(args: argparse.Namespace) -> int:
    from relay import store

    if not (args.dead or args.topic or args.ids):
        raise UsageError("give --dead, --topic or --id (refusing to requeue everything)")
    engine = database(args, reads=True)
    try:
        migrate.require_schema(engine)
        with engine.begin() as conn:
            count = conn.execute(store.requeue_stmt(args.dead, args.topic, args.ids)).rowcount
    finally:
        engine.dispose()
    print(f"requeued {count} message(s)")
    return EXIT_OK


def cmd_drain(args: argparse.Namespace) -> int:
    from relay import store
    from relay.brokers import broker_for
    from relay.loop import BrokerLoop
    from relay.sweeper import Sweeper

    engine = database(args)
    try:
        migrate.require_schema(engine)
        with engine.connect() as conn:
            total = store.pending_count(conn)
    except BaseException:
        engine.dispose()
        raise
    relay = BrokerLoop(broker_for(check_broker_url(args.broker) or ""), name="outbox-drain")
    relay.start()
    with repeats_dropped():  # the adapter retries, and warns, every 0.2 s
        connected = relay.wait_connected(CONNECT_WAIT_S)
    if not connected:
        relay.stop(2.0)
        engine.dispose()
        raise OutboxError(f"broker {mask_url(args.broker)} unreachable; nothing was touched")
    sweeper = Sweeper(engine, relay, Settings())
    progress = Progress(total) if sys.stderr.isatty() else None
    try:
        result = sweeper.sweep(args.concurrency, min_age_s=0, due_only=False, on_batch=progress)
        for _ in range(DRAIN_PASSES - 1):  # failed rows are pending again: give them more tries
            if result.failed == 0:
                break
            again = sweeper.sweep(args.concurrency, min_age_s=0, due_only=False, on_batch=progress)
            result.sent += again.sent
            result.dead += again.dead
            result.failed = again.failed
    finally:
        relay.stop(2.0)
        engine.dispose()
        if progress:
            progress.close()
    print(
        f"drained: sent={result.sent} retry_later={result.failed} dead={result.dead}",
        f"of {total} pending" + (" (stopped: broker unreachable)" if result.aborted else ""),
    )
    ok = result.failed == 0 and result.dead == 0 and not result.aborted
    return EXIT_OK if ok else EXIT_FAILED


@contextmanager
def repeats_dropped() -> Iterator[None]:
    """Within the block, each distinct log line is shown once."""
    seen: set[str] = set()

    def first_time(record: logging.LogRecord) -> bool:
        line = f"{record.name}: {record.getMessage()}"
        new = line not in seen
        seen.add(line)
        return new

    handlers = logging.getLogger().handlers
    for handler in handlers:
        handler.addFilter(first_time)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(first_time)


class Progress:
    """A one-line progress bar on stderr, for terminals only."""

    def __init__(self, total: int) -> None:
        self.total, self.done = max(total, 1), 0
        self.lock = threading.Lock()

    def __call__(self, claimed: int) -> None:
        with self.lock:
            self.done += claimed
            share = min(1.0, self.done / self.total)
            bar = "#" * int(share * 40)
            sys.stderr.write(f"\r[{bar:<40}] {self.done}/{self.total}")
            sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")


def cmd_export(args: argparse.Namespace) -> int:
    from spark_jobs import export

    folder = Path(args.out).parent
    if not folder.is_dir():  # before any connection: nothing to undo then
        raise OutboxError(f"--out {args.out}: no folder {folder}")
    if args.what == "ledger":
        db = required(args.db, "--db", "a ledger export (or set OUTBOX_DB)")
        count = export.export_ledger(db, args.out, args.since, args.until)
    elif args.what == "records":
        db = required(args.db, "--db", "a records export (or set OUTBOX_DB)")
        count = export.export_records(db, args.out, args.since, args.until)
    elif args.what == "halfop":
        broker = required(args.broker, "--broker", "a half/op export (or set OUTBOX_BROKER)")
        count = export.export_halfop_nats(broker, args.out, args.since, args.until)
    else:
        count = export_broker(args)
    print(f"exported {count} row(s) to {args.out}")
    return EXIT_OK


def export_broker(args: argparse.Namespace) -> int:
    """The broker's log, read the way its URL's scheme says."""
    from spark_jobs import export

    required(args.broker, "--broker", "a broker export (or set OUTBOX_BROKER)")
    scheme = urlsplit(args.broker).scheme
    window = (args.out, args.since, args.until)
    if scheme == "nats":
        stream = required(args.stream, "--stream", f"a broker export from {scheme}://")
        return export.export_broker_nats(args.broker, stream, *window)
    if scheme in ("redis", "rediss"):
        topics = required(args.topics, "--topic", f"a broker export from {scheme}://")
        return export.export_broker_redis(args.broker, topics, *window)
    if scheme in ("amqp", "amqps"):
        queue = required(args.queue, "--queue", f"a broker export from {scheme}://")
        return export.export_broker_rabbitmq(args.broker, queue, *window)
    raise OutboxError(f"broker export: {scheme}:// keeps no log to export")


def required(value: T | None, flag: str, purpose: str) -> T:
    if not value:
        raise UsageError(f"{flag} is required for {purpose}")
    return value


def cmd_reconcile(args: argparse.Namespace) -> int:
    from spark_jobs import reconcile

    flags = ("ledger", "broker_log", "out", "start", "end", "sla", "master", "halfop_log")
    argv = [
        item
        for flag in flags
        if getattr(args, flag) is not None
        for item in (f"--{flag.replace('_', '-')}", getattr(args, flag))
    ]
    return reconcile.main(argv, prog="outbox reconcile")


def cmd_coordinator(args: argparse.Namespace) -> int:
    from relay.coordinator import Coordinator, CoordinatorSettings

    defer_stop_signals()
    settings = CoordinatorSettings(
        check_interval_s=args.check_interval,
        transaction_timeout_s=args.transaction_timeout,
        check_max=args.check_max,
    )
    coordinator = Coordinator(args.broker, settings)
    coordinator.start()
    log.info("coordinator started: broker=%s", mask_url(args.broker))
    signal.sigwait(STOP_SIGNALS)
    coordinator.stop()
    log.info("coordinator stopped: %s", coordinator.stats)
    return EXIT_OK


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "migrate": cmd_migrate,
    "relay": cmd_relay,
    "status": cmd_status,
    "requeue": cmd_requeue,
    "drain": cmd_drain,
    "coordinator": cmd_coordinator,
    "export": cmd_export,
    "reconcile": cmd_reconcile,
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["compare"]:  # its own parser: spark_jobs/compare.py runs unchanged alone
        return run_compare(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "db", "") is None and args.command != "export":
        parser.error("--db is required (or set OUTBOX_DB)")
    if getattr(args, "broker", "") is None and args.command != "export":
        parser.error("--broker is required (or set OUTBOX_BROKER)")
    urls = [getattr(args, name, None) for name in ("db", "broker", "ledger")]
    setup_logging(urls)
    try:
        if getattr(args, "broker", None):
            check_broker_url(args.broker)  # a bad broker URL fails before any DB work
        return COMMANDS[args.command](args)
    except Exception as exc:  # one line, whatever failed; --debug for the traceback
        return report_error(args.command, exc, urls, args.debug, getattr(args, "db", None))


def run_compare(argv: list[str]) -> int:
    from spark_jobs import compare

    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    try:
        return compare.main(argv)
    except Exception as exc:
        return report_error("compare", exc, [os.environ.get("OUTBOX_DB")], debug)


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
        return " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, SQLAlchemyError):
        orig = getattr(exc, "orig", None)
        text = first_line(str(orig if orig is not None else exc))
        where = f" (database {mask_url(db)})" if db else ""
        return f"{type(exc).__name__}: {text}{where}"
    return f"{type(exc).__name__}: {first_line(str(exc))}"


def first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return " ".join(lines[0].split()) if lines else ""


if __name__ == "__main__":
    sys.exit(main())
