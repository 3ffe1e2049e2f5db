"""Poison mixed into healthy traffic: how much it slows the healthy messages (model A).

Run with `python -m bench.poison` (PostgreSQL + the wheel's nats-server). The same
paced workload as `outbox compare` runs first clean (the baseline, in the same run)
and then with a share of its transactions carrying a message the broker refuses for
good; each run has its own schema and nats-server. A poison row goes dead after
``permanent_attempts`` sweeps while the healthy ones keep flowing; the figure is the
healthy messages' commit -> ack latency (the relay's own clock: poison is never
acked), p99 against the clean run's. The target is within 2x.
"""

from __future__ import annotations

import argparse

from bench.fast_path import bench_schema, pct
from bench.report import print_rows
from outbox import migrate
from relay.lab.compare.run import ModelA, Workload
from relay.testing.embedded import NatsServer


def run(w: Workload) -> dict[str, float]:
    with NatsServer() as server, bench_schema() as db:
        migrate.upgrade(db)
        model = ModelA(db, server.url, server, w)
        result = model.run()
        stats = model.ob.stats
        assert stats is not None
        latencies = list(stats.latencies)
        ids, dead = model.committed_ids(), model.dead_ids()
        model.engine.dispose()
    return {
        "healthy": len(ids - dead),
        "poisoned": result.poisoned,
        "dead": len(dead),
        "p50": pct(latencies, 50),
        "p99": pct(latencies, 99),
        "max": pct(latencies, 100),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="poison in healthy traffic (model A)")
    parser.add_argument("--transactions", type=int, default=3000)
    parser.add_argument("--rate", type=float, default=200.0, help="transactions/s offered")
    parser.add_argument("--poison-rates", default="0.01,0.05,0.2", help="comma-separated, each < 1")
    args = parser.parse_args()
    rates = [0.0, *(float(r) for r in args.poison_rates.split(","))]
    workloads = [Workload(args.transactions, rate=args.rate, poison_rate=r) for r in rates]
    figures = [run(w) for w in workloads]
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
    w = workloads[0]
    print_rows(
        f"Healthy commit -> ack latency, {w.transactions} transactions at {w.rate:g}/s, "
        f"{w.concurrency} threads, {w.rollback_rate:.0%} rolled back",
        rows,
    )
    worst = max(f["p99"] for f in figures[1:]) / clean if len(figures) > 1 else 1.0
    verdict = "met" if worst <= 2 else "NOT met"
    print(f"\nhealthy p99 within 2x of the clean run at every poison rate: {verdict} "
          f"(worst {worst:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
