"""`outbox compare`: model A (the outbox) and model B (half/op) on the same workload.

- ``relay.lab.compare.workload``: what is offered (``Workload``, ``FAULTS``) and the business;
- ``relay.lab.compare.run``: driving each model, injecting the faults, tracking deliveries;
- ``relay.lab.compare.report``: exporting, reconciling on Spark, compare.json and .html.

The flags are declared here, light to import: the CLI builds its parser from them.
"""

from __future__ import annotations

import argparse
import os

from relay.lab.compare.workload import FAULTS, Workload
from spark_jobs.flags import bounded_int, bounded_number, bounded_seconds, spark_master

DEFAULT_DB = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
TRANSACTIONS = bounded_int(1, 1_000_000)
THREADS = bounded_int(1, 256)
RATE = bounded_number(0.01, 1_000_000)
SHARE = bounded_number(0, 0.99)  # a share of the transactions; all of them leaves nothing
PADDING = bounded_int(0, 1_000_000)  # the message stays below max_payload_bytes' 1 MiB
FAULT_SECONDS = bounded_seconds(0, 3600)


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
    parser.add_argument(
        "--transactions",
        type=TRANSACTIONS,
        default=2000,
        help=f"per model ({TRANSACTIONS.range}, default 2000)",
    )
    parser.add_argument(
        "--concurrency", type=THREADS, default=4, help=f"app threads ({THREADS.range}, default 4)"
    )
    parser.add_argument(
        "--rate",
        type=RATE,
        default=200.0,
        help=f"transactions/s offered ({RATE.range}, default 200)",
    )
    parser.add_argument(
        "--rollback-rate",
        type=SHARE,
        default=0.1,
        help=f"share of transactions that roll back ({SHARE.range}, default 0.1)",
    )
    parser.add_argument(
        "--poison-rate",
        type=SHARE,
        default=0.0,
        help=f"share of transactions whose message the broker refuses for good ({SHARE.range}, "
        "default 0)",
    )
    parser.add_argument(
        "--payload-size",
        type=PADDING,
        default=200,
        help=f"bytes of padding ({PADDING.range}, default 200)",
    )
    parser.add_argument(
        "--faults",
        default="",
        help=f"comma-separated, or 'all': {', '.join(FAULTS)}",
    )
    parser.add_argument(
        "--fault-seconds",
        type=FAULT_SECONDS,
        default=3.0,
        help=f"length of a fault in seconds ({FAULT_SECONDS.range}, default 3)",
    )
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
