"""The async path under load: examples/fastapi_async under uvicorn, PostgreSQL, nats-server.

Run with `make bench` (or `python -m bench.async_app --seconds 5`). Every figure is
measured in this run:
  1. requests/s of POST /inbound with the outbox (the row and send() in one transaction)
     divided by requests/s of the same endpoint without send(), with the same number of
     clients, each posting its next request when the last one answered; the two
     alternate (--rounds) so that a change in the machine's load hits both;
  2. commit->ack latency p50/p99 with requests offered at a fixed rate (500/s), taken
     from the relay's listener hook ``published`` (the fast path's commit-to-ack time).

The server runs in this process (uvicorn.Server on a thread), the clients in another
one, so the two do not share a GIL. The clients speak plain HTTP/1.1 over keep-alive
connections: httpx costs more CPU per request than the server does, and would measure
itself instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from typing import Any

import uvicorn
from sqlalchemy import make_url

from bench.fast_path import bench_schema, pct
from bench.report import print_rows
from examples.fastapi_async.app import create_app, prepare
from outbox import Outbox
from outbox.events import RelayListener, Sent
from relay.testing.embedded import NatsServer, free_port

LENGTH = re.compile(rb"content-length: *(\d+)", re.I)


class Latencies(RelayListener):
    """Commit->ack of each message the fast path delivered while ``recording``."""

    def __init__(self) -> None:
        self.recording = False
        self.seen: list[float] = []

    def published(self, sent: Sequence[Sent], path: str) -> None:
        if self.recording:
            self.seen += [s.latency_s for s in sent if s.latency_s is not None]


# --- the clients (run in their own process) -------------------------------------------


async def post(conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], n: int) -> int:
    """One POST /inbound on a keep-alive connection; the reply's status."""
    reader, writer = conn
    body = json.dumps({"sku": f"SKU-{n % 100:03d}", "quantity": 1 + n % 7}).encode()
    head = b"POST /inbound HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
    writer.write(head + b"content-length: %d\r\n\r\n" % len(body) + body)
    reply = await reader.readuntil(b"\r\n\r\n")
    found = LENGTH.search(reply)
    await reader.readexactly(int(found.group(1)) if found else 0)
    return int(reply[9:12])


async def connections(port: int, count: int) -> list[tuple[asyncio.StreamReader, Any]]:
    return [await asyncio.open_connection("127.0.0.1", port) for _ in range(count)]


def closed_loop(port: int, clients: int, seconds: float) -> dict[str, Any]:
    """``clients`` clients posting back to back for ``seconds``: requests/s answered 201."""

    async def main() -> dict[str, Any]:
        conns = await connections(port, clients)
        stop = time.monotonic() + seconds
        statuses: list[int] = []

        async def client(k: int, conn: tuple[asyncio.StreamReader, Any]) -> None:
            n = k
            while time.monotonic() < stop:
                statuses.append(await post(conn, n))
                n += clients

        started = time.monotonic()
        await asyncio.gather(*(client(k, c) for k, c in enumerate(conns)))
        elapsed = time.monotonic() - started
        for _, writer in conns:
            writer.close()
        return {"rate": statuses.count(201) / elapsed, "other": len(statuses) - statuses.count(201)}

    return asyncio.run(main())


def paced(port: int, rate: float, seconds: float, clients: int) -> dict[str, Any]:
    """Requests offered at ``rate``/s for ``seconds`` over at most ``clients`` connections."""

    async def main() -> dict[str, Any]:
        idle: asyncio.Queue[tuple[asyncio.StreamReader, Any]] = asyncio.Queue()
        for conn in await connections(port, clients):
            idle.put_nowait(conn)
        statuses: list[int] = []
        waits: list[float] = []
        started = due = time.monotonic()
        end = started + seconds

        async def one(n: int) -> None:
            offered = time.perf_counter()
            conn = await idle.get()  # all busy: the request waits, as behind a proxy
            if time.monotonic() < end + 1:  # one still waiting then is given up, not sent
                statuses.append(await post(conn, n))
                waits.append(time.perf_counter() - offered)
            idle.put_nowait(conn)

        tasks = []
        for n in range(int(rate * seconds)):
            due += 1 / rate
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            tasks.append(asyncio.create_task(one(n)))
        await asyncio.gather(*tasks)
        elapsed = time.monotonic() - started
        while not idle.empty():
            idle.get_nowait()[1].close()
        ok = statuses.count(201)
        given_up = len(tasks) - len(statuses)
        return {"rate": ok / elapsed, "ok": ok, "other": len(statuses) - ok, "waits": waits,
                "given_up": given_up}  # fmt: skip

    return asyncio.run(main())


# --- the server (this process) ---------------------------------------------------------


@contextmanager
def serving(db: str, broker: str, latencies: Latencies) -> Iterator[tuple[int, Outbox]]:
    """The example app under uvicorn on a thread, its relay started; its port and outbox."""
    app = create_app(db, broker)
    prepare()  # the example's table and the outbox's
    ob: Outbox = app.state.outbox
    ob.add_listener(latencies)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="uvicorn")
    thread.start()
    try:
        wait_for(lambda: server.started and ob.stats is not None, 30, "the server to start")
        yield port, ob
    finally:
        server.should_exit = True
        thread.join()


@contextmanager
def without_send(ob: Outbox) -> Iterator[None]:
    """The same endpoint with send() doing nothing: the row alone, in the same transaction."""
    ob.send = lambda *args, **kwargs: ""  # type: ignore[method-assign]
    try:
        yield
    finally:
        del ob.send


def wait_for(condition: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description="async path benchmark (FastAPI + uvicorn)")
    parser.add_argument("--seconds", type=float, default=5, help="length of each phase")
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients (phase 1)")
    parser.add_argument("--rate", type=float, default=500, help="offered requests/s (phase 2)")
    parser.add_argument("--driver", default="asyncpg", help="asyncpg or psycopg (async)")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of phase 1")
    args = parser.parse_args()
    span = args.seconds / args.rounds
    latencies = Latencies()
    spawn = multiprocessing.get_context("spawn")
    with (
        NatsServer() as nats,
        bench_schema() as schema,
        ProcessPoolExecutor(1, mp_context=spawn) as clients,
    ):
        db = make_url(schema).set(drivername=f"postgresql+{args.driver}")
        broker = f"{nats.url}?stream=BENCH&subjects=warehouse.>"
        with serving(db.render_as_string(hide_password=False), broker, latencies) as (port, ob):
            clients.submit(closed_loop, port, args.clients, 1.0).result()  # warm up
            base, outbox = [], []
            for _ in range(args.rounds):  # interleaved, so a drift of the machine hits both
                with without_send(ob):
                    base.append(clients.submit(closed_loop, port, args.clients, span).result())
                outbox.append(clients.submit(closed_loop, port, args.clients, span).result())
            wait_for(lambda: idle(ob), 30, "the relay to catch up")
            latencies.recording = True
            load = clients.submit(paced, port, args.rate, 2 * args.seconds, 64).result()
            wait_for(lambda: len(latencies.seen) >= load["ok"], 30, "every message acked")
            latencies.recording = False
    print_table(args, merged(base), merged(outbox), load, latencies.seen)


def merged(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Rounds of equal length: their mean rate, and the replies other than 201 in all."""
    return {"rate": sum(r["rate"] for r in rounds) / len(rounds),
            "other": sum(r["other"] for r in rounds)}  # fmt: skip


def idle(ob: Outbox) -> bool:
    stats = ob.stats
    return stats is not None and stats.marked >= ob.handed_off


def print_table(
    args: argparse.Namespace,
    base: dict[str, Any],
    outbox: dict[str, Any],
    load: dict[str, Any],
    seen: list[float],
) -> None:
    refused = base["other"] + outbox["other"] + load["other"]
    rows = [
        ("requests/s without send()", f"{base['rate']:.0f}", "baseline"),
        ("requests/s with the outbox", f"{outbox['rate']:.0f}", ""),
        ("throughput ratio", f"{outbox['rate'] / base['rate']:.2f}x", "with / without"),
        ("offered / answered requests/s", f"{args.rate:.0f} / {load['rate']:.0f}",
         f"{load['given_up']} given up"),
        ("commit->ack p50 / p99 ms", f"{pct(seen, 50):.2f} / {pct(seen, 99):.2f}",
         f"{len(seen)} messages"),
        ("request p50 / p99 ms (client)",
         f"{pct(load['waits'], 50):.2f} / {pct(load['waits'], 99):.2f}", "queueing included"),
        ("replies other than 201", f"{refused}", "must be 0"),
    ]  # fmt: skip
    title = f"async path: examples/fastapi_async under uvicorn (1 worker), {args.driver}, "
    title += f"{args.clients} clients for throughput, {args.seconds:.0f} s with and without "
    title += f"send() in {args.rounds} alternations, {2 * args.seconds:.0f} s paced, "
    title += f"{os.cpu_count()} CPUs shared by clients, app, PostgreSQL and NATS"
    print_rows(title, rows)


if __name__ == "__main__":
    main()
