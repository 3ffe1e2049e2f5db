"""Poison mixed into healthy traffic: how much it slows the healthy messages (model A).

Run with `python -m bench.poison` (PostgreSQL + the wheel's nats-server). The same
paced workload as `outbox compare` runs first clean (the baseline, in the same run)
and then with a share of its transactions carrying a message the broker refuses for
good; each run has its own schema and nats-server. A poison row goes dead after
``max_attempts`` sweeps while the healthy ones keep flowing; the figure is the
healthy messages' commit -> ack latency (the relay's own clock: poison is never
acked), p99 against the clean run's. The target is within 2x.
"""

from __future__ import annotations

import argparse
import statistics

from bench.fast_path import bench_schema
from bench.report import print_rows
from outbox import migrate
from relay.compare import ModelA, Workload
from relay.embedded import NatsServer


def run(w: Workload) -> dict[str, float]:
    with NatsServer() as server, bench_schema() as db:
        migrate.upgrade(db)
        model = ModelA(db, server.url, server, w)
        result = model.run()
        stats = model.ob.stats
        assert stats is not None
        latencies = sorted(stats.latencies)
        ids, dead = model.committed_ids(), model.dead_ids()
        model.engine.dispose()
    return {
        "healthy": len(ids - dead),
        "poisoned": result.poisoned,
        "dead": len(dead),
        "p50": statistics.median(latencies) * 1000,
        "p99": latencies[int(len(latencies) * 0.99) - 1] * 1000,
        "max": latencies[-1] * 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="poison in healthy traffic (model A)")
    parser.add_argument("--transactions", type=int, default=3000)
    parser.add_argument("--rate", type=float, default=200.0, help="transactions/s offered")
    parser.add_argument("--poison-rates", default="0.01,0.05,0.2", help="comma-separated, each < 1")
    args = parser.parse_args()
    rates = [0.0, *(float(r) for r in args.poison_rates.split(","))]
    figures = [run(Workload(args.transactions, rate=args.rate, poison_rate=r)) for r in rates]
    clean = figures[0]["p99"]
    rows = [("poison rate", "healthy", "poison", "dead", "p50 ms", "p99 ms", "max ms", "p99/clean")]
    for rate, f in zip(rates, figures, strict=True):
        rows.append(
            (
                f"{rate:g}" + (" (baseline)" if rate == 0 else ""),
                str(f["healthy"]),
                str(f["poisoned"]),
                str(f["dead"]),
                f"{f['p50']:.2f}",
                f"{f['p99']:.2f}",
                f"{f['max']:.1f}",
                f"{f['p99'] / clean:.2f}x",
            )
        )
    print_rows(
        f"Healthy commit -> ack latency, {args.transactions} transactions at "
        f"{args.rate:g}/s, 4 threads, 10 % rolled back",
        rows,
    )


if __name__ == "__main__":
    main()
