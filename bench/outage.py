"""Memory in a broker outage: process RSS while the app commits at full speed, broker down.

Run with `make bench` (or `python -m bench.outage --seconds 20`). Each row is a fresh
process (its own PostgreSQL schema and nats-server), so no run inherits another's heap:
  - baseline: the same commit loop, send() included, with the relay never started
    (nothing is held in memory: every row waits in the table);
  - queue_size=N: the relay started and connected, then the broker stopped for the
    whole run; the fast path holds at most N messages, the rest stay in the table.
RSS is VmRSS from /proc/self/status, sampled every 50 ms; "peak" is the highest sample.
The ratio is the row's peak against the baseline's peak, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from typing import Any

from sqlalchemy.orm import Session

# Imported by every row alike (the baseline never starts the relay): RSS compares heaps.
import relay.brokers.nats
import relay.runtime  # noqa: F401
from bench.fast_path import bench_schema
from bench.report import print_rows
from outbox import Outbox, migrate
from outbox.settings import Settings
from relay.testing.embedded import NatsServer

MIB = 1024 * 1024
SAMPLE_S = 0.05


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class Sampler:
    """RSS and the fast path's held count, sampled from a thread of its own."""

    def __init__(self, ob: Outbox) -> None:
        self.ob = ob
        self.rss_peak = rss_bytes()
        self.held_max = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self._sample()

    def _run(self) -> None:
        while not self._done.wait(SAMPLE_S):
            self._sample()

    def _sample(self) -> None:
        self.rss_peak = max(self.rss_peak, rss_bytes())
        dispatcher = self.ob.relay.dispatcher if self.ob.relay is not None else None
        if dispatcher is not None:
            self.held_max = max(self.held_max, dispatcher.held())


def commit_loop(ob: Outbox, threads: int, seconds: float, payload_bytes: int) -> int:
    """Transactions of one message each, from ``threads`` threads as fast as they go."""
    pad = "x" * payload_bytes
    counts = [0] * threads
    stop = time.monotonic() + seconds

    def run(k: int) -> None:
        while time.monotonic() < stop:
            with Session(ob.engine) as session, session.begin():
                ob.send(session, "outage.orders", {"n": counts[k], "pad": pad})
            counts[k] += 1

    pool = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    return sum(counts)


def one_row(queue_size: int | None, seconds: float, threads: int, payload: int) -> dict[str, Any]:
    """One measurement in this process; ``queue_size`` None is the baseline."""
    with NatsServer() as server, bench_schema() as db:
        migrate.upgrade(db)
        options: dict[str, Any] = {} if queue_size is None else {"queue_size": queue_size}
        broker = f"{server.url}?stream=OUTAGE&subjects=outage.>"
        ob = Outbox(db, broker=broker, sweeper=False, **options)
        if queue_size is not None:
            ob.start()
            assert ob.stats is not None
            commit_loop_once(ob, payload)
            wait_for(lambda: ob.stats is not None and ob.stats.marked >= 1, "the relay connected")
            server.stop()  # the outage: for the whole run
        else:
            commit_loop_once(ob, payload)
        try:
            start = rss_bytes()
            started = time.monotonic()
            with Sampler(ob) as sampler:
                commits = commit_loop(ob, threads, seconds, payload)
            elapsed = time.monotonic() - started
            end = rss_bytes()
            stats = ob.stats
        finally:
            ob.stop(timeout=2)
    return {
        "commits": commits,
        "rate": commits / elapsed,
        "held_max": sampler.held_max,
        "held_peak": stats.held_peak if stats is not None else 0,
        "queue_full": stats.queue_full if stats is not None else 0,
        "rss_start": start,
        "rss_peak": sampler.rss_peak,
        "rss_end": end,
    }


def commit_loop_once(ob: Outbox, payload: int) -> None:
    """One warm-up commit: connections and the ORM's caches ready before RSS start."""
    with Session(ob.engine) as session, session.begin():
        ob.send(session, "outage.orders", {"n": -1, "pad": "x" * payload})


def wait_for(condition: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.01)


def in_child(queue_size: int | None, args: argparse.Namespace) -> dict[str, Any]:
    """``one_row`` in a fresh interpreter: its RSS is that row's alone."""
    command = [
        sys.executable, "-m", "bench.outage", "--child", str(queue_size or 0),
        "--seconds", str(args.seconds), "--threads", str(args.threads),
        "--payload-bytes", str(args.payload_bytes),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"row queue_size={queue_size} failed: {done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description="process RSS during a broker outage")
    parser.add_argument("--seconds", type=float, default=60.0, help="length of the outage")
    parser.add_argument("--threads", type=int, default=4, help="app threads committing")
    parser.add_argument("--payload-bytes", type=int, default=1024)
    parser.add_argument("--small", type=int, default=100, help="the small queue_size")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        row = one_row(args.child or None, args.seconds, args.threads, args.payload_bytes)
        print(json.dumps(row))
        return
    sizes: list[int | None] = [None, Settings().queue_size, args.small]
    rows = [in_child(size, args) for size in sizes]
    base = rows[0]["rss_peak"]
    table = [
        ("run", "commits", "commits/s", "held max", "queue_full", "RSS start MiB",
         "RSS peak MiB", "RSS end MiB", "peak/baseline"),
    ]  # fmt: skip
    for size, row in zip(sizes, rows, strict=True):
        table.append(
            (
                "baseline (relay not started)" if size is None else f"queue_size={size}",
                str(row["commits"]),
                f"{row['rate']:.0f}",
                "-" if size is None else str(row["held_max"]),
                "-" if size is None else str(row["queue_full"]),
                f"{row['rss_start'] / MIB:.1f}",
                f"{row['rss_peak'] / MIB:.1f}",
                f"{row['rss_end'] / MIB:.1f}",
                f"{row['rss_peak'] / base:.2f}x",
            )
        )
    print_rows(
        f"Broker down for {args.seconds:g} s, {args.threads} app threads committing one "
        f"{args.payload_bytes}-byte message per transaction at full speed (PostgreSQL)",
        table,
    )
    bounded = all(r["held_max"] <= s for s, r in zip(sizes[1:], rows[1:], strict=True))
    print(f"\nheld never above queue_size: {'met' if bounded else 'NOT met'}")


if __name__ == "__main__":
    main()
