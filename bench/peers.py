"""Peer comparison: the same workload through faststream-outbox, nats-outbox and this project.

Run with `make bench-peers` (or `python -m bench.peers --seconds 20 --rows 20000`); the
peers come from the `peers` extra. One row per peer and setting, one after the other in
one run, each on a scratch PostgreSQL database of its own (dropped afterwards) and a
JetStream stream of its own on one embedded nats-server:
  1. the relay starts; `--rate` commits/s for `--seconds`, one message per transaction;
     a JetStream consumer in its own process records when each message arrives;
  2. the relay stops; `--rows` messages are committed (500 per transaction);
  3. the relay starts again and drains them.
Latency is measured from just before COMMIT and from COMMIT's return to the consumer's
receipt (CLOCK_MONOTONIC is one clock for every process). Drain msg/s counts from the
first drained message's arrival to the last one's, so process start-up is left out.
The steal column is the CPU steal of the machine during that row (/proc/stat) and the
load column its 1-minute load average at the row's end (other processes on this
machine, which steal does not show): discount rows where either is high. Commits/s
below the offered rate means the app side could not keep up. The peers' APIs take an
AsyncSession (asyncpg); this project's row uses a plain Session (psycopg) from worker
threads, its documented main use. FastStream's log line per message is turned off.
A peer that cannot be installed or run gets a row saying why.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import nats
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from bench.fast_path import pct
from bench.report import print_rows
from outbox import Outbox, migrate
from relay.testing.embedded import NatsServer

PG = os.environ.get("OUTBOX_BENCH_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
OUTBOX = str(Path(sys.executable).with_name("outbox"))
SPAWN = mp.get_context("spawn")
SEED_BATCH = 500


@dataclass
class Urls:
    """One scratch database as each driver wants it, plus the NATS stream of the row."""

    sync_db: str
    async_db: str
    nats: str
    stream: str
    subject: str


@dataclass
class Adapter:
    """What the harness needs from a peer; one function per peer builds it.

    ``commit(ids)`` writes one message per id (payload ``{"id": id}``) in one transaction
    through the peer's documented API and returns (just before COMMIT, COMMIT returned)
    as ``time.monotonic()`` values. ``start_relay(drain)`` starts the peer's relay
    (``drain``: the backlog phase), ``stop_relay()`` stops it (or waits for a one-shot
    drain to finish).
    """

    commit: Callable[[Sequence[str]], Awaitable[tuple[float, float]]]
    start_relay: Callable[[bool], None]
    stop_relay: Callable[[], None]
    close: Callable[[], Awaitable[None]]


# --- this project ---------------------------------------------------------------------


async def this_project(urls: Urls, tuned: bool) -> Adapter:
    """Sync Session + send(); the in-process fast path, then `outbox drain` for the backlog."""
    engine = create_engine(urls.sync_db, pool_size=4)
    migrate.upgrade(engine)
    broker = f"{urls.nats}?stream={urls.stream}&subjects={urls.subject}"
    ob = Outbox(engine, broker=broker, sweeper=False, verify_commit=not tuned)
    drain: list[subprocess.Popen[bytes]] = []
    started: list[Outbox] = []

    def commit_sync(ids: Sequence[str]) -> tuple[float, float]:
        with Session(engine) as session:
            with session.begin():
                for i in ids:
                    ob.send(session, urls.subject, {"id": i})
                before = time.monotonic()
            return before, time.monotonic()

    async def commit(ids: Sequence[str]) -> tuple[float, float]:
        return await asyncio.to_thread(commit_sync, ids)

    def start_relay(backlog: bool) -> None:
        if not backlog:
            ob.start()
            started.append(ob)
            return
        extra = ["--concurrency", "4"] if tuned else []
        cmd = [OUTBOX, "drain", "--db", urls.sync_db, "--broker", broker, *extra]
        drain.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))

    def stop_relay() -> None:
        if drain:  # its log lines would flood the table; shown only when it failed
            proc = drain.pop()
            _, errors = proc.communicate()
            if proc.returncode:
                raise RuntimeError(f"outbox drain failed: {errors.decode()[-500:]}")
        if started:
            started.pop().stop()

    async def close() -> None:
        engine.dispose()

    return Adapter(commit, start_relay, stop_relay, close)


# --- faststream-outbox ------------------------------------------------------------------


def faststream_knobs(tuned: bool) -> dict[str, Any]:
    """The subscriber's documented knobs; the defaults LISTEN (asyncpg) and poll at 1 s."""
    return {"max_workers": 8, "fetch_batch_size": 100, "min_fetch_interval": 0.01} if tuned else {}


async def faststream_outbox(urls: Urls, tuned: bool) -> Adapter:
    """broker.publish(body, queue=..., session=...) in the app's transaction; a FastStream
    subscriber stacked with a NATS JetStream publisher relays (in its own process)."""
    from faststream_outbox import OutboxBroker, make_outbox_table
    from sqlalchemy import MetaData
    from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

    metadata = MetaData()
    table = make_outbox_table(metadata, table_name="outbox")
    engine = create_async_engine(urls.async_db)
    async with engine.begin() as conn:
        await conn.run_sync(metadata.create_all)
    broker = OutboxBroker(engine, outbox_table=table, logger=None)
    sessions = async_sessionmaker(engine, expire_on_commit=False)

    async def commit(ids: Sequence[str]) -> tuple[float, float]:
        async with sessions() as session:
            async with session.begin():
                for i in ids:
                    await broker.publish({"id": i}, queue="bench", session=session)
                before = time.monotonic()
            return before, time.monotonic()

    relay = ChildRelay(run_faststream_relay, urls, tuned)
    return Adapter(commit, relay.start, relay.stop, engine.dispose)


def run_faststream_relay(urls: Urls, tuned: bool, ready: Event, stop: Event) -> None:
    from faststream.nats import NatsBroker
    from faststream_outbox import OutboxBroker, make_outbox_table
    from sqlalchemy import MetaData
    from sqlalchemy.ext.asyncio import create_async_engine

    async def main() -> None:
        table = make_outbox_table(MetaData(), table_name="outbox")
        engine = create_async_engine(urls.async_db)
        # No log line per message (FastStream's default): the table compares relays, not
        # terminal output.
        outbox = OutboxBroker(engine, outbox_table=table, logger=None)
        downstream = NatsBroker(urls.nats, logger=None)

        @downstream.publisher(urls.subject, stream=urls.stream)
        @outbox.subscriber("bench", **faststream_knobs(tuned))
        async def relay(body: dict[str, Any]) -> dict[str, Any]:
            return body

        await downstream.start()
        await outbox.start()
        await until_stopped(ready, stop)
        await outbox.stop()
        await downstream.stop()
        await engine.dispose()

    asyncio.run(main())


# --- nats-outbox ------------------------------------------------------------------------


def nats_outbox_settings(urls: Urls, tuned: bool) -> dict[str, Any]:
    """The documented OUTBOX_* settings; polling_interval defaults to 1 s, batch_size 100."""
    tuning = {"polling_interval": 0.005, "batch_size": 1000} if tuned else {}
    return {"database_url": urls.async_db, "nats_url": urls.nats, **tuning}


async def nats_outbox(urls: Urls, tuned: bool) -> Adapter:
    """outbox_transaction(session) + tx.publish_event(); the PollingRelay in its own process."""
    from nats_outbox.core.models import create_tables
    from nats_outbox.core.outbox import outbox_transaction
    from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

    engine = create_async_engine(urls.async_db)
    await create_tables(engine)
    sessions = async_sessionmaker(engine, expire_on_commit=False)

    async def commit(ids: Sequence[str]) -> tuple[float, float]:
        async with sessions() as session:
            # outbox_transaction writes the staged events and commits on exit.
            async with outbox_transaction(session) as tx:
                for i in ids:
                    tx.publish_event(urls.subject, {"id": i})
                before = time.monotonic()
            return before, time.monotonic()

    relay = ChildRelay(run_nats_outbox_relay, urls, tuned)
    return Adapter(commit, relay.start, relay.stop, engine.dispose)


def run_nats_outbox_relay(urls: Urls, tuned: bool, ready: Event, stop: Event) -> None:
    from nats_outbox.publishers.nats_publisher import NatsPublisher
    from nats_outbox.relay.polling import PollingRelay
    from nats_outbox.settings import OutboxSettings
    from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

    async def main() -> None:
        settings = OutboxSettings(**nats_outbox_settings(urls, tuned))
        engine = create_async_engine(settings.database_url)
        nc = await nats.connect(settings.nats_url)
        publisher = await NatsPublisher.from_nats_client(nc)
        relay = PollingRelay(
            async_sessionmaker(engine, expire_on_commit=False), publisher, settings
        )
        task = asyncio.create_task(relay.start())
        await until_stopped(ready, stop)
        await relay.stop()
        await task
        await nc.close()
        await engine.dispose()

    asyncio.run(main())


# --- the rows ---------------------------------------------------------------------------

PEERS: list[tuple[str, Callable[[Urls, bool], Awaitable[Adapter]], str, str]] = [
    ("this project", this_project, "defaults", "verify_commit=False, drain --concurrency 4"),
    (
        "faststream-outbox",
        faststream_outbox,
        "defaults (LISTEN/NOTIFY, 1 worker, batch 10)",
        "8 workers, batch 100, min_fetch_interval 10 ms",
    ),
    ("nats-outbox", nats_outbox, "defaults (polling 1 s)", "polling 5 ms, batch 1000"),
]


class ChildRelay:
    """A peer's relay in a process of its own, as both peers document it."""

    def __init__(self, target: Callable[[Urls, bool, Event, Event], None], *args: Any) -> None:
        self.target, self.args = target, args
        self.proc: Any = None
        self.stop_event: Event | None = None

    def start(self, backlog: bool) -> None:
        ready, self.stop_event = SPAWN.Event(), SPAWN.Event()
        self.proc = SPAWN.Process(target=self.target, args=(*self.args, ready, self.stop_event))
        self.proc.start()
        while not ready.wait(0.1):
            if not self.proc.is_alive():
                raise RuntimeError(f"relay process exited with {self.proc.exitcode}")

    def stop(self) -> None:
        if self.proc is None or self.stop_event is None:
            return
        self.stop_event.set()
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.proc = None


async def until_stopped(ready: Event, stop: Event) -> None:
    ready.set()
    await asyncio.get_running_loop().run_in_executor(None, stop.wait)


class Consumer:
    """A JetStream consumer in its own process: (id, receive time) of every message."""

    def __init__(self, urls: Urls) -> None:
        self.unique = SPAWN.Value("i", 0)
        self.ready, self.stop_event = SPAWN.Event(), SPAWN.Event()
        self.results, child = SPAWN.Pipe(duplex=False)
        args = (urls.nats, urls.subject, self.unique, self.ready, self.stop_event, child)
        self.proc = SPAWN.Process(target=consume, args=args)

    def start(self) -> Consumer:
        self.proc.start()
        if not self.ready.wait(30):
            raise RuntimeError("the consumer did not subscribe")
        return self

    def wait_for(self, count: int, timeout: float) -> bool:
        """Poll until ``count`` distinct ids arrived; False at the deadline."""
        deadline = time.monotonic() + timeout
        while self.unique.value < count:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def finish(self) -> list[tuple[str, float]]:
        self.stop_event.set()
        received: list[tuple[str, float]] = self.results.recv() if self.results.poll(30) else []
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        return received


def consume(
    url: str, subject: str, unique: Any, ready: Event, stop: Event, out: Connection
) -> None:
    async def main() -> None:
        nc = await nats.connect(url)
        seen: list[tuple[str, float]] = []
        ids: set[str] = set()

        async def on_message(msg: Any) -> None:
            received = time.monotonic()
            msg_id = json.loads(msg.data)["id"]
            seen.append((msg_id, received))
            ids.add(msg_id)
            unique.value = len(ids)

        await nc.jetstream().subscribe(subject, cb=on_message, ordered_consumer=True)
        await until_stopped(ready, stop)
        await nc.close()
        out.send(seen)

    asyncio.run(main())


@contextmanager
def scratch_database(nats_url: str, k: int) -> Iterator[Urls]:
    """An empty database for one row (the peers' tables have fixed names), dropped after."""
    name = f"peers_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG, poolclass=NullPool, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(PG).set(database=name)
    try:
        yield Urls(
            sync_db=url.render_as_string(hide_password=False),
            async_db=url.set(drivername="postgresql+asyncpg").render_as_string(hide_password=False),
            nats=nats_url,
            stream=f"PEERS{k}",
            subject=f"peers{k}.msg",
        )
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def steal_ticks() -> tuple[int, int]:
    """(steal, total) CPU ticks of the machine so far, from /proc/stat."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return 0, 0
    return fields[7], sum(fields)


async def create_stream(urls: Urls) -> None:
    nc = await nats.connect(urls.nats)
    await nc.jetstream().add_stream(name=urls.stream, subjects=[urls.subject])
    await nc.close()


async def paced(adapter: Adapter, rate: float, seconds: float) -> dict[str, tuple[float, float]]:
    """``rate`` transactions a second, one message each, started on schedule even while
    earlier ones are still committing; (before, after COMMIT) per id."""
    timings: dict[str, tuple[float, float]] = {}

    async def one(msg_id: str) -> None:
        timings[msg_id] = await adapter.commit([msg_id])

    tasks = []
    due = time.monotonic()
    for n in range(int(rate * seconds)):
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        due += 1 / rate
        tasks.append(asyncio.create_task(one(f"l{n}")))
    await asyncio.gather(*tasks)
    return timings


async def seed(adapter: Adapter, rows: int) -> list[str]:
    ids = [f"d{n}" for n in range(rows)]
    for start in range(0, rows, SEED_BATCH):
        await adapter.commit(ids[start : start + SEED_BATCH])
    return ids


async def run_row(
    build: Callable[[Urls, bool], Awaitable[Adapter]],
    tuned: bool,
    urls: Urls,
    args: argparse.Namespace,
) -> list[str]:
    await create_stream(urls)
    consumer = Consumer(urls).start()
    try:
        adapter = await build(urls, tuned)
        try:
            timings, reached, backlog = await drive(adapter, consumer, args)
        finally:
            adapter.stop_relay()
            await adapter.close()
    finally:
        received = consumer.finish()
    return summarize(timings, reached, backlog, received)


async def drive(
    adapter: Adapter, consumer: Consumer, args: argparse.Namespace
) -> tuple[dict[str, tuple[float, float]], float, list[str]]:
    """The two phases: paced commits with the relay running, then a backlog drained."""
    adapter.start_relay(False)
    await adapter.commit(["warm-up"])  # the relay is connected before the clock runs
    consumer.wait_for(1, 30)
    started = time.monotonic()
    timings = await paced(adapter, args.rate, args.seconds)
    reached = len(timings) / (time.monotonic() - started)
    consumer.wait_for(1 + len(timings), 30)
    adapter.stop_relay()
    backlog = await seed(adapter, args.rows)
    adapter.start_relay(True)
    consumer.wait_for(1 + len(timings) + len(backlog), args.drain_timeout)
    adapter.stop_relay()
    return timings, reached, backlog


def summarize(
    timings: dict[str, tuple[float, float]],
    reached: float,
    backlog: list[str],
    received: list[tuple[str, float]],
) -> list[str]:
    first: dict[str, float] = {}
    for msg_id, at in received:
        first.setdefault(msg_id, at)
    arrived = [(first[i] - b, first[i] - a) for i, (b, a) in timings.items() if i in first]
    drained = sorted(first[i] for i in backlog if i in first)
    rate = (len(drained) - 1) / (drained[-1] - drained[0]) if len(drained) > 1 else 0.0
    expected = len(timings) + len(backlog) + 1
    return [
        f"{reached:.0f}",
        spread([before for before, _ in arrived]),
        spread([after for _, after in arrived]),
        f"{rate:,.0f}",
        str(len(received) - len(first)),
        str(expected - len(first)),
    ]


def spread(values: list[float]) -> str:
    return " / ".join(f"{pct(values, q):.1f}" for q in (50, 95, 99))


async def one_row(
    build: Callable[[Urls, bool], Awaitable[Adapter]],
    tuned: bool,
    k: int,
    server: NatsServer,
    args: argparse.Namespace,
) -> tuple[list[str], str]:
    """The figures of one peer and setting (or why there are none), with the steal."""
    steal0, total0 = steal_ticks()
    cells, why = [""] * 6, ""
    try:
        with scratch_database(server.url, k) as urls:
            cells = await run_row(build, tuned, urls, args)
    except ImportError as exc:
        why = f"not installed ({exc.name}): pip install '.[peers]'"
    except Exception as exc:
        why = f"failed: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:100]}"
    steal1, total1 = steal_ticks()
    steal = 100 * (steal1 - steal0) / max(1, total1 - total0)
    # Steal misses what other processes of this machine take; the load average shows it.
    return [*cells, f"{steal:.1f}", f"{os.getloadavg()[0]:.1f}"], why


async def main_async(args: argparse.Namespace) -> None:
    header = [
        "peer, setting",
        "commits/s",
        "from before COMMIT p50/p95/p99 ms",
        "from COMMIT's return p50/p95/p99 ms",
        "drain msg/s",
        "dup",
        "missing",
        "steal %",
        "load 1m",
    ]
    rows = [header]
    chosen = [p for p in PEERS if not args.only or any(o in p[0] for o in args.only)]
    with NatsServer() as server:
        for k, (name, build, default, tuned) in enumerate(chosen):
            for setting, is_tuned in ((default, False), (tuned, True)):
                label = f"{name}, {setting}"
                print(f"running {label} ...", file=sys.stderr, flush=True)
                cells, why = await one_row(build, is_tuned, 2 * k + is_tuned, server, args)
                rows.append([f"{label} -- {why}" if why else label, *cells])
    title = f"peers: {args.rate:.0f} commits/s for {args.seconds:.0f} s, then {args.rows:,} rows "
    title += f"drained; PostgreSQL + nats-server on loopback, {os.cpu_count()} CPUs"
    print_rows(title, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description="peer comparison (the peers extra)")
    parser.add_argument("--rate", type=float, default=200, help="commits/s (default 200)")
    parser.add_argument("--seconds", type=float, default=20, help="latency phase (default 20)")
    parser.add_argument("--rows", type=int, default=20_000, help="backlog drained (default 20,000)")
    parser.add_argument("--drain-timeout", type=float, default=300, help="seconds (default 300)")
    parser.add_argument("--only", nargs="*", help="peers whose name contains one of these")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
