"""`outbox relay` (a long-running worker) and `outbox drain` (one pass over a backlog)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from outbox import migrate
from outbox.config import Settings, mask_url
from outbox.errors import OutboxError
from relay import store
from relay.brokers import broker_for
from relay.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    Commands,
    add_broker_flag,
    add_db_flag,
    database,
    positive_int,
)
from relay.loop import BrokerLoop
from relay.sweeper import Sweeper
from relay.worker import RelayJobs

DRAIN_PASSES = 3
CONNECT_WAIT_S = 10.0
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}
log = logging.getLogger("relay.cli")


def add_relay(commands: Commands) -> None:
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


def add_drain(commands: Commands) -> None:
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


def cmd_relay(args: argparse.Namespace) -> int:
    defer_stop_signals()
    settings = Settings(sweep_interval_s=args.interval, retention_s=args.retention_days * 86400)
    engine = database(args)
    migrate.require_schema(engine)
    relay = BrokerLoop(broker_for(args.broker), name="outbox-worker")
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
        from relay.metrics import serve
    except ImportError:
        raise OutboxError("--metrics-port needs prometheus_client: pip install "
                          "'outbox-relay[metrics]'") from None  # fmt: skip
    server = serve(lambda: (None, jobs), port, addr)
    log.info("metrics on http://%s:%d/metrics", addr, port)
    return server


def cmd_drain(args: argparse.Namespace) -> int:
    engine = database(args)
    try:
        migrate.require_schema(engine)
        with engine.connect() as conn:
            total = store.pending_count(conn)
    except BaseException:
        engine.dispose()
        raise
    relay = BrokerLoop(broker_for(args.broker), name="outbox-drain")
    relay.start()
    with repeats_dropped():  # the adapter retries, and warns, every 0.2 s
        connected = relay.wait_connected(CONNECT_WAIT_S)
    if not connected:
        relay.stop(2.0)
        engine.dispose()
        raise OutboxError(f"broker {mask_url(args.broker)} unreachable; nothing was touched")
    sweeper = Sweeper(engine, relay, Settings())
    progress = Progress(total) if sys.stderr.isatty() else None
    started = time.monotonic()
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
    seconds = time.monotonic() - started
    print(
        f"drained: sent={result.sent} retry_later={result.failed} dead={result.dead}",
        f"of {total} pending in {seconds:.2f} s ({result.sent / max(seconds, 1e-9):,.0f} msg/s)"
        + (" (stopped: broker unreachable)" if result.aborted else ""),
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


PARSERS = (add_relay, add_drain)
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "relay": cmd_relay,
    "drain": cmd_drain,
}
