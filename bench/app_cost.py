"""What the outbox costs the app (issue 41): one transaction four ways, in one run.

    python -m bench.app_cost [--seconds 5] [--repeat 3]
    python -m bench.app_cost profile --rate 200 --threads 1 --seconds 10   # under py-spy
    python -m bench.app_cost micro --repeat 9   # send()'s own CPU, SQLite in memory

The transaction is a business row (an INSERT into ``bench_receipt``) and, in turn:
  1. nothing more (the business row only);
  2. a bare INSERT of the outbox row send() would write (the unavoidable write: its
     msg_id, topic, headers and JSON payload, encoded by the app);
  3. ``ob.send()`` with the relay not started (an Outbox never started);
  4. ``ob.send()`` with the relay running (the fast path publishes to an embedded
     nats-server and marks the rows sent).
Each runs as fast as it can, on 1 app thread and on 4, ``--seconds`` in all, the four
taking turns of ``--slice`` seconds (the machine's load changes meet all four). Per
transaction: app-thread CPU (``time.thread_time``, summed over the app threads),
whole-process CPU (``time.process_time``: the app threads and the relay's, counted
until the relay has marked every message of the phase) and tx/s; each against the
bare INSERT of the same round. Then commit->ack latency at 200 msg/s (one app thread,
paced) against a raw JetStream publish (nats-py) of the same payload at the same rate.
Every round measures all of it; the table shows the median of ``--repeat`` rounds
(ratios are taken within a round, then their median).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import nats
from sqlalchemy import Engine, create_engine
from sqlalchemy.orm import Session
from sqlalchemy.pool import StaticPool

from bench.fast_path import (
    bench_schema,
    business,
    paced,
    pct,
    receipts,
    thread_cpu,
    throughput,
    verdict,
)
from bench.report import print_rows
from outbox import Outbox, migrate
from outbox.message import build_message
from outbox.table import outbox_message
from relay.testing.embedded import NatsServer

TOPIC = "bench.cost"
HEADERS = {"content-type": "application/json"}  # what send() adds to a JSON payload
INSERT_ROW = outbox_message.insert()
VARIANTS = ("business row only", "+ bare INSERT of the outbox row", "+ send(), relay not started",
            "+ send(), relay running")  # fmt: skip
Work = Callable[[int], None]


def payload(n: int) -> dict[str, Any]:
    return {"sku": f"SKU-{n % 100:03d}", "n": n, "qty": 1}


def business_only(engine: Engine) -> Work:
    def work(n: int) -> None:
        with Session(engine) as session, session.begin():
            session.execute(receipts.insert().values(sku=f"SKU-{n % 100:03d}"))

    return work


def bare_insert(engine: Engine) -> Work:
    """The same row as send()'s, written by the app itself: id, JSON, one INSERT."""

    def work(n: int) -> None:
        with Session(engine) as session, session.begin():
            session.execute(receipts.insert().values(sku=f"SKU-{n % 100:03d}"))
            body = json.dumps(payload(n), separators=(",", ":")).encode()
            row = {"msg_id": uuid.uuid4(), "topic": TOPIC, "tags": None, "key": None,
                   "headers": HEADERS, "payload": body}  # fmt: skip
            session.execute(INSERT_ROW, row)

    return work


def with_send(ob: Outbox) -> Work:
    def work(n: int) -> None:
        with Session(ob.engine) as session, session.begin():
            session.execute(receipts.insert().values(sku=f"SKU-{n % 100:03d}"))
            ob.send(session, TOPIC, payload(n))

    return work


@dataclass
class Phase:
    tx: int = 0
    wall_s: float = 0.0
    app_s: float = 0.0  # app-thread CPU
    process_s: float = 0.0  # whole-process CPU, until the relay marked the slice's messages

    @property
    def tx_s(self) -> float:
        return self.tx / max(1e-9, self.wall_s)

    @property
    def app_us(self) -> float:
        return self.app_s / max(1, self.tx) * 1e6

    @property
    def process_us(self) -> float:
        return self.process_s / max(1, self.tx) * 1e6


def drained(ob: Outbox | None, timeout: float = 60.0) -> None:
    """Wait until the relay holds nothing: every message of the phase marked (or left)."""
    relay = None if ob is None else ob.relay
    if relay is None or relay.dispatcher is None:
        return
    deadline = time.monotonic() + timeout
    while relay.dispatcher.held() and time.monotonic() < deadline:
        time.sleep(0.005)


def run_slice(into: Phase, work: Work, threads: int, seconds: float, ob: Outbox | None) -> None:
    started = time.process_time()
    tx_s, app_cpu = throughput(work, threads, seconds)
    drained(ob)
    tx = round(tx_s * seconds)
    into.tx += tx
    into.wall_s += seconds
    into.app_s += app_cpu * tx
    into.process_s += time.process_time() - started


def one_round(engine: Engine, idle: Outbox, running: Outbox, threads: int,
              seconds: float, slice_s: float) -> list[Phase]:  # fmt: skip
    """The four variants in turns of ``slice_s``, ``seconds`` each in all: a change of the
    machine's load meets every variant alike."""
    works: list[tuple[Work, Outbox | None]] = [
        (business_only(engine), None),
        (bare_insert(engine), None),
        (with_send(idle), None),
        (with_send(running), running),
    ]
    phases = [Phase() for _ in works]
    for _ in range(max(1, round(seconds / slice_s))):
        for into, (work, ob) in zip(phases, works, strict=True):
            run_slice(into, work, threads, slice_s, ob)
    return phases


@dataclass
class Latency:
    """One round at 200 msg/s: commit->ack against a raw publish, and CPU per message."""

    p99_ms: float
    raw_p99_ms: float
    raw_cpu_us: float  # the raw publisher's loop thread, per message
    relay_cpu_us: dict[str, float]  # the relay's threads, by name, per message


def raw_publish(url: str, rate: float, seconds: float) -> tuple[list[float], float]:
    """JetStream publishes (nats-py's js.publish) of send()'s payload and headers paced at
    ``rate``: each one's latency from call to ack, and the CPU per message of the thread."""

    async def main() -> tuple[list[float], float]:
        nc = await nats.connect(url)
        js = nc.jetstream()
        await js.add_stream(name="RAW", subjects=["raw.>"])
        body = json.dumps(payload(1), separators=(",", ":")).encode()
        latencies: list[float] = []

        async def one() -> None:
            started = time.perf_counter()
            await js.publish("raw.x", body, headers={**HEADERS, "Nats-Msg-Id": str(uuid.uuid4())})
            latencies.append(time.perf_counter() - started)

        count = int(rate * seconds)
        cpu, tasks, due = time.thread_time(), [], time.monotonic()
        for _ in range(count):
            due += 1 / rate
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
        cpu = time.thread_time() - cpu
        await nc.close()
        return latencies, cpu / max(1, count) * 1e6

    return asyncio.run(main())


def latency_round(engine: Engine, broker: str, nats_url: str, rate: float,
                  seconds: float) -> Latency:  # fmt: skip
    """The raw publish, then send() with the relay running, both paced at ``rate``."""
    raw, raw_cpu = raw_publish(nats_url, rate, seconds)
    ob = Outbox(engine, broker=broker, sweeper=False)
    ob.start()
    with_send(ob)(0)
    before = relay_cpu()
    sent = paced(1, rate, seconds, with_send(ob)) * seconds
    drained(ob)
    used = {name: (cpu - before.get(name, 0.0)) / max(1, sent) * 1e6
            for name, cpu in relay_cpu().items()}  # fmt: skip
    stats = ob.stats
    assert stats is not None
    ob.stop()
    return Latency(pct(list(stats.latencies), 99), pct(raw, 99), raw_cpu, used)


def setup(db: str) -> Engine:
    migrate.upgrade(db)
    engine = create_engine(db, pool_size=8)
    business.create_all(engine)
    return engine


def measure(args: argparse.Namespace) -> None:
    rounds: dict[int, list[list[Phase]]] = {1: [], 4: []}
    latencies: list[Latency] = []
    load: list[float] = []
    with NatsServer() as server, bench_schema() as db:
        engine = setup(db)
        broker = f"{server.url}?stream=BENCH&subjects=bench.>"
        idle = Outbox(engine, broker=broker, sweeper=False)  # never started
        running = Outbox(engine, broker=broker, sweeper=False)
        running.start()
        with_send(idle)(0)  # registers the session hooks: every variant pays their lookup
        for _ in range(args.repeat):
            for threads in (1, 4):
                rounds[threads].append(
                    one_round(engine, idle, running, threads, args.seconds, args.slice)
                )
            running.stop()  # the latency phase's relay is alone
            latencies.append(latency_round(engine, broker, server.url, 200, args.latency_seconds))
            running.start()
            load.append(os.getloadavg()[0])
        running.stop()
        engine.dispose()
    print_table(rounds, latencies, load, args)


def med(values: list[float]) -> float:
    return statistics.median(values)


def print_table(rounds: dict[int, list[list[Phase]]], latencies: list[Latency],
                load: list[float], args: argparse.Namespace) -> None:  # fmt: skip
    head = ("the transaction", "threads", "app CPU us/tx", "process CPU us/tx", "tx/s",
            "tx/s ratio", "CPU ratio")  # fmt: skip
    rows: list[tuple[str, ...]] = [head]
    ratios: dict[int, tuple[float, float]] = {}
    for threads, runs in rounds.items():
        for i, name in enumerate(VARIANTS):
            tx = med([r[i].tx_s / r[1].tx_s for r in runs])
            cpu = med([r[i].process_us / r[1].process_us for r in runs])
            ratios[threads] = (tx, cpu)  # the last variant's: the relay running
            app, process = med([r[i].app_us for r in runs]), med([r[i].process_us for r in runs])
            tx_s = med([r[i].tx_s for r in runs])
            rows.append((name, str(threads), f"{app:.0f}", f"{process:.0f}", f"{tx_s:.0f}",
                         f"{tx:.2f}x", f"{cpu:.2f}x"))  # fmt: skip
    p99 = med([r.p99_ms for r in latencies])
    raw = med([r.raw_p99_ms for r in latencies])
    lat = med([r.p99_ms / r.raw_p99_ms for r in latencies])
    title = (
        f"app cost: median of {args.repeat} round(s), {args.seconds:.0f} s per variant, "
        f"{os.cpu_count()} CPUs shared with PostgreSQL and NATS, load "
        f"{min(load):.1f}-{max(load):.1f}; ratios to the round's bare INSERT"
    )
    print_rows(title, rows)
    one_tx, one_cpu = ratios[1]
    targets = [
        ("1 thread, relay running: tx/s vs bare INSERT", f"{one_tx:.2f}x",
         verdict(one_tx >= 0.75, ">= 0.75x")),
        ("1 thread, relay running: process CPU/tx vs bare INSERT", f"{one_cpu:.2f}x",
         verdict(one_cpu <= 2.0, "<= 2x")),
        ("4 threads, relay running: tx/s vs bare INSERT", f"{ratios[4][0]:.2f}x",
         verdict(ratios[4][0] >= 0.6, ">= 0.6x")),
        ("@200/s commit->ack p99 / raw JetStream p99 (ms)", f"{p99:.2f} / {raw:.2f}", ""),
        ("@200/s commit->ack p99 vs raw", f"{lat:.2f}x", verdict(lat <= 2.0, "<= 2x")),
    ]  # fmt: skip
    print_rows("targets (issue 41)", targets)
    rounds_p99 = ", ".join(f"{r.p99_ms:.2f}/{r.raw_p99_ms:.2f}" for r in latencies)
    cpu_rows = [("@200/s p99 ms per round (commit->ack/raw)", rounds_p99),
                ("@200/s raw js.publish: its thread's CPU us/msg",
                 f"{med([r.raw_cpu_us for r in latencies]):.0f}")]  # fmt: skip
    names = sorted({name for r in latencies for name in r.relay_cpu_us})
    for name in names:
        used = med([r.relay_cpu_us.get(name, 0.0) for r in latencies])
        cpu_rows.append((f"@200/s relay thread {name}: CPU us/msg", f"{used:.0f}"))
    total = med([sum(r.relay_cpu_us.values()) for r in latencies])
    cpu_rows.append(("@200/s relay threads in all: CPU us/msg", f"{total:.0f}"))
    print_rows("CPU per message at 200 msg/s (medians)", cpu_rows)


def profile(args: argparse.Namespace) -> None:
    """The relay-running transaction at ``--rate`` tx/s (0: as fast as it goes), for py-spy."""
    with NatsServer() as server, bench_schema() as db:
        engine = setup(db)
        ob = Outbox(engine, broker=f"{server.url}?stream=BENCH&subjects=bench.>", sweeper=False)
        ob.start()
        with_send(ob)(0)
        started, threads_before = time.process_time(), relay_cpu()
        if args.rate:
            reached = paced(args.threads, args.rate, args.seconds, with_send(ob))
        else:
            reached = throughput(with_send(ob), args.threads, args.seconds)[0]
        drained(ob)
        process = time.process_time() - started
        used = {name: cpu - threads_before.get(name, 0.0)
                for name, cpu in relay_cpu().items()}  # fmt: skip
        used["app threads (the rest)"] = process - sum(used.values())
        tx = max(1, reached * args.seconds)
        print(f"reached {reached:.0f} tx/s, process CPU {process / tx * 1e6:.0f} us/tx, of it:")
        for name, cpu in sorted(used.items()):
            print(f"  {name:24} {cpu / tx * 1e6:7.1f} us/tx")
        ob.stop()
        engine.dispose()


def micro(args: argparse.Namespace) -> None:
    """send()'s own CPU, without a server: SQLite in memory, one thread, the least CPU per
    transaction over ``--repeat`` turns (a loaded machine only ever adds to it)."""
    engine = create_engine("sqlite://", poolclass=StaticPool)
    migrate.upgrade(engine)
    business.create_all(engine)
    ob = Outbox(engine, broker="nats://127.0.0.1:1")  # never started
    works: dict[str, Work] = {
        VARIANTS[0]: business_only(engine),
        VARIANTS[1]: bare_insert(engine),
        VARIANTS[2]: with_send(ob),
        "build_message() alone": build_only,
    }
    for work in works.values():
        cpu_per_call(work, 500)  # warm: statement caches, prepared forms
    least = dict.fromkeys(works, float("inf"))
    for _ in range(args.repeat):
        for name, work in works.items():
            least[name] = min(least[name], cpu_per_call(work, 2000))
    rows = [(name, f"{us:.1f}") for name, us in least.items()]
    rows.append(("send() over the bare INSERT", f"{least[VARIANTS[2]] - least[VARIANTS[1]]:.1f}"))
    print_rows(f"app-thread CPU us per call, SQLite in memory, least of {args.repeat}", rows)
    engine.dispose()


def build_only(n: int) -> None:
    build_message(TOPIC, payload(n), max_payload_bytes=1 << 20)


def cpu_per_call(work: Work, calls: int) -> float:
    started = time.thread_time()
    for n in range(calls):
        work(n)
    return (time.thread_time() - started) / calls * 1e6


def relay_cpu() -> dict[str, float]:
    """CPU seconds used so far by the relay's live threads, by name."""
    used: dict[str, float] = {}
    for thread in threading.enumerate():
        if thread.name.startswith("outbox-"):
            used[thread.name] = used.get(thread.name, 0.0) + thread_cpu(thread)
    return used


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "cmd", nargs="?", default="measure", choices=("measure", "profile", "micro")
    )
    parser.add_argument("--seconds", type=float, default=5, help="seconds per variant and round")
    parser.add_argument("--slice", type=float, default=1.0, help="variants take turns this long")
    parser.add_argument("--repeat", type=int, default=3, help="rounds (medians are shown)")
    parser.add_argument("--latency-seconds", type=float, default=10, help="the 200/s phase")
    parser.add_argument("--rate", type=float, default=0, help="profile: tx/s (0: saturate)")
    parser.add_argument("--threads", type=int, default=1, help="profile: app threads")
    args = parser.parse_args()
    if args.cmd == "profile":
        profile(args)
    elif args.cmd == "micro":
        micro(args)
    else:
        measure(args)


if __name__ == "__main__":
    threading.current_thread().name = "app-main"
    main()
