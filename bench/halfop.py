"""Model B figures: broker writes per committed message, end-to-end latency, and the
time to settle a transaction whose producer was SIGKILLed before its end request.

Run with `python -m bench.halfop` (PostgreSQL + nats-server on loopback). The kill
scenario runs twice: with the test intervals and with RocketMQ's defaults (60 s check
interval, 6 s transaction timeout), so the second one takes about a minute.

`python -m bench.halfop --soak` (bench/halfop_soak.py) is the coordinator's soak
instead: 200,000 transactions, the check loop's round time, ops read per round and RSS
as the op log grows.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import threading
import time

from sqlalchemy import create_engine

from bench.fast_path import bench_schema
from bench.halfop_soak import add_soak_arguments, soak
from bench.report import print_rows
from outbox import migrate
from relay.brokers.nats import create_stream, read_stream
from relay.lab.compare.workload import business, place_order
from relay.lab.halfop import (
    HALF_TOPIC,
    OP_TOPIC,
    Coordinator,
    CoordinatorSettings,
    LocalTransactionState,
    SqlTransactionListener,
    TransactionProducer,
)
from relay.lab.halfop.protocol import BORN_TIMESTAMP, UNIQ_KEY
from relay.testing.embedded import NatsServer
from relay.testing.faults import kill_producer_after_commit

TEST_SETTINGS = CoordinatorSettings(check_interval_s=0.2, transaction_timeout_s=0.3)


def run_workload(url: str, db: str, total: int, threads: int) -> list[str]:
    engine = create_engine(db, pool_size=threads + 2)
    business.create_all(engine)
    listener = SqlTransactionListener(engine, place_order, group="bench")
    producer = TransactionProducer(group="bench", broker=url, listener=listener)
    producer.start()
    committed: list[str] = []
    lock = threading.Lock()

    def work(k: int) -> None:
        for i in range(total // threads):
            result = producer.send_in_transaction("real.orders", {"n": i}, {"sku": f"S{k}-{i}"})
            if result.local_state is LocalTransactionState.COMMIT_MESSAGE:
                with lock:
                    committed.append(result.msg_id)

    pool = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    producer.stop()
    engine.dispose()
    return committed


def settle_after_kill(url: str, db: str, settings: CoordinatorSettings) -> float:
    """Seconds from the producer's death to its committed message on the real topic."""
    coordinator = Coordinator(url, settings)
    coordinator.start()
    engine = create_engine(db)
    business.create_all(engine)
    survivor = TransactionProducer(
        group="orders",
        broker=url,
        listener=SqlTransactionListener(engine, place_order, group="orders"),
    )
    survivor.start()
    msg_id, state, _ = kill_producer_after_commit(db, url, "real.killed")
    killed_at = time.monotonic()
    assert state == "COMMIT_MESSAGE", state
    deadline = killed_at + settings.check_interval_s * 3 + settings.transaction_timeout_s + 30
    while not any(m.msg_id == msg_id for m in asyncio.run(read_stream(url, "REAL"))):
        if time.monotonic() > deadline:
            raise RuntimeError("the killed producer's message was never settled")
        time.sleep(0.05)
    settled = time.monotonic() - killed_at
    survivor.stop()
    coordinator.stop()
    engine.dispose()
    return settled


def main() -> None:
    parser = argparse.ArgumentParser(description="model B benchmark")
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument(
        "--skip-default-intervals", action="store_true", help="skip the ~1 minute run"
    )
    add_soak_arguments(parser)
    args = parser.parse_args()
    if args.soak:
        soak(args.soak_transactions, args.soak_rate, args.threads)
        return
    rows: list[tuple[str, str]] = []
    with NatsServer() as server, bench_schema() as db:
        migrate.upgrade(db)
        create_stream(server.url, "REAL", "real.>")
        coordinator = Coordinator(server.url, CoordinatorSettings())  # RocketMQ's defaults
        coordinator.start()
        started = time.monotonic()
        committed = run_workload(server.url, db, args.messages, args.threads)
        while len(asyncio.run(read_stream(server.url, "REAL"))) < len(committed):
            time.sleep(0.1)
        elapsed = time.monotonic() - started
        coordinator.stop()
        halfs = asyncio.run(read_stream(server.url, HALF_TOPIC))
        ops = asyncio.run(read_stream(server.url, OP_TOPIC))
        real = asyncio.run(read_stream(server.url, "REAL"))
        born = {m.headers[UNIQ_KEY]: int(m.headers[BORN_TIMESTAMP]) / 1000 for m in halfs}
        latencies = [
            m.time.timestamp() - born[m.msg_id] for m in real if m.time and m.msg_id in born
        ]
        writes = (len(halfs) + len(ops) + len(real)) / len(committed)
        rows += [
            ("committed messages", f"{len(committed):,} in {elapsed:.1f} s"),
            ("broker writes (half + op + real)", f"{len(halfs):,} + {len(ops):,} + {len(real):,}"),
            ("broker writes per committed message", f"{writes:.2f}"),
            ("end-to-end latency mean / p99 ms", f"{statistics.mean(latencies) * 1000:.2f} / "
             f"{sorted(latencies)[int(len(latencies) * 0.99)] * 1000:.2f}"),
        ]  # fmt: skip
    scenarios = [("test", TEST_SETTINGS)]
    if not args.skip_default_intervals:
        scenarios.append(("default", CoordinatorSettings()))
    for label, settings in scenarios:
        # A fresh broker each time, so the check service has no backlog to walk first.
        with NatsServer() as server, bench_schema() as db:
            migrate.upgrade(db)
            create_stream(server.url, "REAL", "real.>")
            settled = settle_after_kill(server.url, db, settings)
        rows.append((f"settle after producer SIGKILL, {label} intervals", f"{settled:.2f} s"))
    title = f"model B (half/op), {args.threads} producer threads, PostgreSQL + nats-server"
    print_rows(f"{title}, {os.cpu_count()} CPUs", rows)


if __name__ == "__main__":
    main()
