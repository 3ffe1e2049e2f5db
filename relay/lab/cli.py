"""Model B's commands: `outbox coordinator` (the broker side), `outbox compare` (model A
against B), and its kinds of `outbox export` (records, halfop). Registered by
relay.lab.register: the product's CLI reads ``PARSERS`` and ``COMMANDS`` as its own."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
from collections.abc import Callable, Iterator

from outbox.errors import OutboxError
from outbox.secrets import mask_url
from relay.cli.common import (
    EXIT_OK,
    Commands,
    UsageError,
    add_broker_flag,
    add_debug_flag,
    required,
)
from relay.cli.progress import counting
from relay.cli.run import defer_stop_signals
from relay.cli.stopping import STOP_SIGNALS
from relay.lab import compare
from spark_jobs.flags import DAY_S, bounded_int, bounded_seconds, out_folder_problem

log = logging.getLogger("relay.cli")
PERIOD = bounded_seconds(0.01, DAY_S)  # the coordinator's intervals and timeouts
CHECKS = bounded_int(1, 1_000_000)


def add_coordinator(commands: Commands) -> None:
    coord = commands.add_parser(
        "coordinator",
        help="run model B's coordinator: end transactions and check-back (until SIGTERM)",
        description="The broker-side part of the RocketMQ half/op model, over NATS JetStream. "
        "It exists to compare model B with the outbox; see the README.",
    )
    add_broker_flag(coord)
    add_debug_flag(coord)
    coord.add_argument(
        "--check-interval", type=PERIOD, default=60.0, help=f"seconds ({PERIOD.range}, default 60)"
    )
    coord.add_argument(
        "--transaction-timeout",
        type=PERIOD,
        default=6.0,
        help=f"seconds halfs younger than this wait ({PERIOD.range}, default 6)",
    )
    coord.add_argument(
        "--check-max",
        type=CHECKS,
        default=15,
        help=f"checks before discard ({CHECKS.range}, default 15)",
    )
    coord.add_argument(
        "--max-round",
        type=PERIOD,
        default=60.0,
        help="seconds a check round may run; the next resumes where it stopped "
        f"({PERIOD.range}, default 60)",
    )


def add_compare(commands: Commands) -> None:
    cmp = commands.add_parser(
        "compare",
        help="run one workload through model A and model B, with faults; compare.html",
        description="One workload through model A (outbox) and model B (half/op), reconciled "
        "on Spark; compare.json and compare.html side by side. Exit status 3 when either "
        "model lost a message or produced a phantom, else 4 when either left one stuck. "
        "Needs the [compare] extra.",
    )
    compare.add_arguments(cmp)
    add_debug_flag(cmp)


def cmd_coordinator(args: argparse.Namespace) -> int:
    from relay.lab.halfop import Coordinator, CoordinatorSettings

    defer_stop_signals()
    settings = CoordinatorSettings(
        check_interval_s=args.check_interval,
        transaction_timeout_s=args.transaction_timeout,
        check_max=args.check_max,
        max_round_s=args.max_round,
    )
    coordinator = Coordinator(args.broker, settings)
    coordinator.start()
    log.info("coordinator started: broker=%s", mask_url(args.broker))
    signal.sigwait(STOP_SIGNALS)
    coordinator.stop()
    log.info("coordinator stopped: %s", coordinator.stats)
    return EXIT_OK


def cmd_compare(args: argparse.Namespace) -> int:
    try:
        compare.workload_of(args)
    except ValueError as exc:  # before anything starts
        raise UsageError(str(exc)) from None
    if problem := out_folder_problem(args.out):
        raise UsageError(f"--out {args.out}: {problem}")
    try:
        from relay.lab.compare import report
    except ImportError as exc:
        raise OutboxError(
            f"compare needs the [compare] extra ({exc.name} is missing): "
            "pip install 'outbox-relay[compare]'"
        ) from None
    return report.run(args, counted)


@contextlib.contextmanager
def counted(what: str, total: int) -> Iterator[Callable[[int], None]]:
    """A model's transactions done, shown as ``outbox compare: model a`` progress."""
    with counting(f"outbox compare: {what}", total, unit="tx") as shown:
        yield shown.add


def export_records(args: argparse.Namespace) -> int:
    from relay.lab import export

    db = required(args.db, "--db", "a records export (or set OUTBOX_DB)")
    with counting("export records") as shown:
        return export.export_records(db, args.out, args.since, args.until, shown.add)


def export_halfop(args: argparse.Namespace) -> int:
    from relay.lab import export

    broker = required(args.broker, "--broker", "a half/op export (or set OUTBOX_BROKER)")
    with counting("export halfop") as shown:
        return export.export_halfop_nats(broker, args.out, args.since, args.until, shown.add)


PARSERS = (add_coordinator, add_compare)
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "coordinator": cmd_coordinator,
    "compare": cmd_compare,
}
