"""`outbox compare`: model A (the outbox) and model B (half/op) on the same workload.

- ``relay.compare.workload``: what is offered (``Workload``, ``FAULTS``) and the business;
- ``relay.compare.run``: driving each model, injecting the faults, tracking deliveries;
- ``relay.compare.report``: exporting, reconciling on Spark, compare.json and .html.

The flags are declared here, light to import: the CLI builds its parser from them.
"""

from __future__ import annotations

import argparse
import os

from relay.compare.workload import FAULTS, Workload
from spark_jobs.flags import spark_master

DEFAULT_DB = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The comparison's flags (`outbox compare`)."""
    parser.add_argument(
        "--db",
        default=os.environ.get("OUTBOX_DB", DEFAULT_DB),
        help="PostgreSQL URL; the run uses a scratch schema in it (default: local postgres)",
    )
    parser.add_argument(
        "--broker", help="nats:// URL of a JetStream server (default: start the wheel's own)"
    )
    parser.add_argument("--out", default="compare-out", help="folder for the results")
    parser.add_argument("--transactions", type=int, default=2000, help="per model")
    parser.add_argument("--concurrency", type=int, default=4, help="app threads")
    parser.add_argument("--rate", type=float, default=200.0, help="transactions/s offered")
    parser.add_argument("--rollback-rate", type=float, default=0.1, help="0 <= r < 1")
    parser.add_argument(
        "--poison-rate",
        type=float,
        default=0.0,
        help="0 <= r < 1: share of transactions whose message the broker refuses for good",
    )
    parser.add_argument("--payload-size", type=int, default=200, help="bytes of padding")
    parser.add_argument(
        "--faults",
        default="",
        help=f"comma-separated, or 'all': {', '.join(FAULTS)}",
    )
    parser.add_argument("--fault-seconds", type=float, default=3.0, help="length of a fault")
    parser.add_argument("--master", type=spark_master, default="local[2]", help="Spark master")
    parser.add_argument(
        "--verbose", action="store_true", help="let Spark log and draw its stage bars"
    )


def workload_of(args: argparse.Namespace) -> Workload:
    names = tuple(FAULTS) if args.faults == "all" else tuple(filter(None, args.faults.split(",")))
    return Workload(
        transactions=args.transactions,
        concurrency=args.concurrency,
        rollback_rate=args.rollback_rate,
        poison_rate=args.poison_rate,
        payload_size=args.payload_size,
        rate=args.rate,
        faults=names,
        fault_s=args.fault_seconds,
    )
