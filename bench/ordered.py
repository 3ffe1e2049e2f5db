"""Ordered delivery benchmark: ordered messages with 1, 100 and 10,000 keys next to
unordered ones, in the same run (PostgreSQL + nats-server on loopback).

Run with `python -m bench.ordered` (`--seconds 5` per phase by default). Per workload:
The last workload's keys each got a message from another process first: every message
measured is its key's first in this process, so it waits for a look at the table.
  1. commit->ack p50 / p99 at a paced rate (one message per transaction, timed from
     COMMIT's return to the broker's ack, lane waits included);
  2. throughput: app threads commit as fast as they can (10 messages per transaction,
     each to a key drawn in turn), then the relay finishes; delivered messages divided
     by the time from the first commit to the last mark.
Ratios are against the unordered workload of the same run. Targets (issue #24): with
100 keys or more, ordered p99 within 2x of unordered, throughput at least half.
One key is the worst case by design: its messages go one at a time, one broker round
trip each, and its writers wait for each other's commit (the key's row lock).
"""

from __future__ import annotations

import argparse
import itertools
import os
import threading
import time
from typing import Any

from sqlalchemy import Engine, create_engine
from sqlalchemy.orm import Session

from bench.fast_path import bench_schema, paced, pct, throughput, verdict
from bench.report import print_rows
from outbox import Outbox, migrate
from outbox.events import Stats
from relay.testing.embedded import NatsServer

# (name, keys, warmed): a warmed workload's keys each got a message from another
# process first, so every message measured waits for a look at the table (head check).
WORKLOADS: list[tuple[str, int | None, bool]] = [
    ("unordered", None, False),
    ("ordered, 1 key", 1, False),
    ("ordered, 100 keys", 100, False),
    ("ordered, 10,000 keys", 10_000, False),
    ("ordered, 10,000 keys after another process", 10_000, True),
]
PER_TX = 10  # messages per transaction in the throughput phase


def sender(ob: Outbox, topic: str, keys: int | None, per_tx: int) -> Any:
    """A transaction of ``per_tx`` messages, each to the next key in turn."""
    counter = itertools.count()
    lock = threading.Lock()

    def work(_: int) -> None:
        with lock:
            first = next(counter) * per_tx
        with Session(ob.engine) as session, session.begin():
            for i in range(per_tx):
                n = first + i
                key = f"k{n % keys}" if keys else f"k{n}"
                ob.send(session, topic, {"n": n}, key=key, ordered=keys is not None)

    return work


def finished(stats: Stats) -> int:
    """Messages the fast path is done with: marked, or left in the table (no sweeper here)."""
    left = stats.queue_full + stats.exhausted + stats.too_old + stats.rejected
    return stats.marked + left + stats.behind_head


def delivered(ob: Outbox, expected: int, timeout: float) -> float:
    """Seconds until the fast path is done with ``expected`` messages (or the timeout)."""
    started = time.monotonic()
    while ob.stats is not None and finished(ob.stats) < expected:
        if time.monotonic() - started > timeout:
            break
        time.sleep(0.005)
    return time.monotonic() - started


def warm(engine: Engine, url: str, topic: str, keys: int) -> None:
    """One message per key from another Outbox (another process's, for the next one)."""
    ob = Outbox(engine, broker=url, sweeper=False)
    ob.start()
    with Session(ob.engine) as session, session.begin():
        for k in range(keys):
            ob.send(session, topic, {"warm": k}, key=f"k{k}", ordered=True)
    delivered(ob, keys, 120)
    ob.stop()


def latency(ob: Outbox, topic: str, keys: int | None, args: argparse.Namespace) -> list[float]:
    ob.start()
    sent = args.threads * int(args.rate / args.threads * args.seconds)
    paced(args.threads, args.rate, args.seconds, sender(ob, topic, keys, 1))
    delivered(ob, sent, 60)
    stats = ob.stats
    ob.stop()
    assert stats is not None
    return list(stats.latencies)


def drain_rate(ob: Outbox, topic: str, keys: int | None, args: argparse.Namespace) -> float:
    """Messages delivered per second, from the first commit to the last mark."""
    ob.start()
    started = time.monotonic()
    tx_per_s, _ = throughput(sender(ob, topic, keys, PER_TX), args.threads, args.seconds)
    sent = round(tx_per_s * args.seconds) * PER_TX
    stats = ob.stats
    assert stats is not None
    delivered(ob, stats.accepted + stats.queue_full, 120)  # queue_full: never accepted
    rate = stats.marked / (time.monotonic() - started)
    ob.stop()
    if stats.marked < sent:
        print(f"  ({topic}: {sent - stats.marked} of {sent} left to the sweeper)")
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description="ordered delivery benchmark")
    parser.add_argument("--seconds", type=float, default=5, help="length of each phase")
    parser.add_argument("--rate", type=float, default=1000, help="paced msg/s (latency)")
    parser.add_argument("--threads", type=int, default=4, help="app threads")
    args = parser.parse_args()
    results: dict[str, tuple[list[float], float]] = {}
    with NatsServer() as server, bench_schema() as db:
        migrate.upgrade(db)
        engine = create_engine(db, pool_size=args.threads + 4)
        url = f"{server.url}?stream=BENCH&subjects=bench.>"
        for n, (name, keys, warmed) in enumerate(WORKLOADS):
            if warmed and keys:
                warm(engine, url, f"bench.lat{n}", keys)
                warm(engine, url, f"bench.tp{n}", keys)
            ob = Outbox(engine, broker=url, sweeper=False)
            lat = latency(ob, f"bench.lat{n}", keys, args)
            rate = drain_rate(Outbox(engine, broker=url, sweeper=False), f"bench.tp{n}", keys, args)
            results[name] = (lat, rate)
        engine.dispose()
    print_rows(title(args), table(results))


def table(results: dict[str, tuple[list[float], float]]) -> list[tuple[str, ...]]:
    base_lat, base_rate = results["unordered"]
    base_p99 = pct(base_lat, 99)
    rows: list[tuple[str, ...]] = [
        ("workload", "p50 ms", "p99 ms", "p99 / unordered", "msg/s", "msg/s / unordered", "target")
    ]
    for name, (lat, rate) in results.items():
        p99_ratio, rate_ratio = pct(lat, 99) / base_p99, rate / base_rate
        target = ""
        if "100 keys" in name or "10,000 keys" in name:
            target = verdict(p99_ratio <= 2 and rate_ratio >= 0.5, "p99 <= 2x, msg/s >= 0.5x")
        rows.append((
            name, f"{pct(lat, 50):.2f}", f"{pct(lat, 99):.2f}", f"{p99_ratio:.2f}x",
            f"{rate:,.0f}", f"{rate_ratio:.2f}x", target,
        ))  # fmt: skip
    return rows


def title(args: argparse.Namespace) -> str:
    return (
        f"ordered delivery: latency at {args.rate:.0f} msg/s (1 per transaction), throughput "
        f"with {PER_TX} per transaction; {args.threads} app threads, {args.seconds:.0f} s per "
        f"phase, {os.cpu_count()} CPUs shared by app, PostgreSQL and NATS"
    )


if __name__ == "__main__":
    main()
