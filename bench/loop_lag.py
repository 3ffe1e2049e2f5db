"""Loop-lag benchmark: how long an async app's event loop stalls because of the outbox.

Run with `python -m bench.loop_lag` (PostgreSQL + an embedded nats-server). For each
async PostgreSQL driver, 400 concurrent requests (an INSERT of the app's own each, and
one send()) run while ``relay.testing.LoopLag`` ticks on the app's loop every 1 ms;
the ticks' lateness is the stall a request would feel. Rows, same run:
  no outbox        the same requests without send() and without a relay (the baseline);
  outbox           send() in every request, the in-process relay publishing to NATS;
  outbox, stalled  the same, but every 40th publish and every relay SQL statement blocks
                   its thread for 300 ms (a stuck broker client, a locked database).
The outbox rows measure until every message is marked sent, the relay's work included.
tests/integration/test_event_loop.py asserts the property behind the last row.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from unittest import mock

from sqlalchemy import Column, Integer, MetaData, Table, create_engine, insert, make_url
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from bench.report import print_rows
from outbox import Outbox, migrate
from outbox.message import Message
from relay.brokers import broker_for
from relay.testing import FaultyBroker, LoopLag, StalledStatements, scratch_schema
from relay.testing.embedded import NatsServer

PG = os.environ.get("OUTBOX_BENCH_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
DRIVERS = {"psycopg async": "postgresql+psycopg_async", "asyncpg": "postgresql+asyncpg"}
STALL_S = 0.3
ARRIVING = 10  # requests that start in one loop iteration
# The fast path publishes what each COMMIT handed off at once; with 400 requests that is
# hundreds of publish calls. Stalling each would age messages past the hand-off limit.
STALL_EVERY = 40

business = MetaData()
orders = Table("lag_order", business, Column("id", Integer, primary_key=True), Column("n", Integer))


@dataclass
class Run:
    lag: LoopLag
    sent: list[str] = field(default_factory=list)
    handoffs_s: list[float] = field(default_factory=list)  # each Outbox._on_commit call


def prepare(db: str) -> None:
    """The outbox's table and the app's own, in the (scratch) database ``db``."""
    migrate.upgrade(db)
    engine = create_engine(db)
    business.create_all(engine)
    engine.dispose()


def async_db(db: str, driver: str) -> str:
    return make_url(db).set(drivername=driver).render_as_string(hide_password=False)


@dataclass
class Stalls:
    """The relay's stalls: its brokers' publishes, its SQL statements."""

    statements: StalledStatements
    brokers: list[FaultyBroker] = field(default_factory=list)

    @property
    def publishes(self) -> int:
        return sum(broker.stalls for broker in self.brokers)


@contextlib.contextmanager
def stalled_relay(
    outbox: Outbox, stall_s: float, publishes: int = STALL_EVERY, statements: int = 1
) -> Iterator[Stalls]:
    """While in the block, a relay started by ``outbox`` blocks its thread ``stall_s`` on
    every ``publishes``-th publish and every ``statements``-th SQL statement."""
    stalls = Stalls(StalledStatements(outbox.engine, stall_s, statements))

    def stalled_broker(url: str) -> FaultyBroker:
        stalls.brokers.append(FaultyBroker(broker_for(url), {}, stall_s, publishes))
        return stalls.brokers[-1]

    with mock.patch("relay.runtime.broker_for", stalled_broker):
        yield stalls


def timed_handoffs(outbox: Outbox, durations: list[float]) -> None:
    """Time each hand-off after COMMIT (what runs on the app's loop for the outbox)."""
    handoff = outbox._on_commit

    def timed(messages: list[Message], certain: bool) -> None:
        started = time.perf_counter()
        try:
            handoff(messages, certain)
        finally:
            durations.append(time.perf_counter() - started)

    outbox._on_commit = timed  # type: ignore[method-assign]  # an instance's own


async def serve(
    request: Callable[[int], Awaitable[str]],
    count: int,
    settled: Callable[[], bool] = lambda: True,
    timeout: float = 60.0,
) -> Run:
    """``count`` concurrent requests under a LoopLag, measured until ``settled()``.

    Requests arrive ``ARRIVING`` per loop iteration, as from a server's accept loop:
    400 requests started in one iteration would run their first steps back to back,
    and that burst of the app's own work would hide anything the outbox does.
    """
    first = await request(-1)  # the first connection and compile, outside the measure
    async with LoopLag() as lag:
        started: list[asyncio.Task[str]] = []
        for n in range(count):
            started.append(asyncio.ensure_future(request(n)))
            if n % ARRIVING == 0:
                await asyncio.sleep(0)
        sent = await asyncio.gather(*started)
        deadline = time.monotonic() + timeout
        while not settled():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the relay did not settle within {timeout} s")
            await asyncio.sleep(0.002)
    return Run(lag, [first, *sent])


def outbox_request(outbox: Outbox, topic: str) -> Callable[[int], Awaitable[str]]:
    @outbox.transactional
    async def order(session: AsyncSession, n: int) -> str:
        await session.execute(insert(orders).values(n=n))
        return outbox.send(session, topic, {"n": n}, key=str(n))

    return order


async def without_outbox(db: str, count: int) -> Run:
    outbox = Outbox(db)  # only for its async engine: no send(), no relay
    factory = async_sessionmaker(outbox.async_engine)

    async def order(n: int) -> str:
        async with factory() as session, session.begin():
            await session.execute(insert(orders).values(n=n))
        return ""

    try:
        return await serve(order, count)
    finally:
        await outbox.stop_async()


async def with_outbox(db: str, broker: str, count: int, stall_s: float) -> Run:
    outbox = Outbox(db, broker=broker, sweeper=False)
    handoffs: list[float] = []
    timed_handoffs(outbox, handoffs)
    with stalled_relay(outbox, stall_s) if stall_s else contextlib.nullcontext():
        outbox.start()
    try:
        stats = outbox.stats
        assert stats is not None
        request = outbox_request(outbox, "lag.orders")
        run = await serve(request, count, lambda: stats.marked > count)  # and the warm-up
    finally:
        await outbox.stop_async()
    run.handoffs_s = handoffs
    return run


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f}"


def row(name: str, run: Run) -> list[str]:
    handoff = max(run.handoffs_s, default=0.0)
    return [name, ms(run.lag.worst), ms(run.lag.percentile(99)), ms(run.lag.percentile(50)),
            ms(handoff) if run.handoffs_s else "-"]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description="app event-loop lag with and without the outbox")
    parser.add_argument("--requests", type=int, default=400, help="concurrent requests")
    args = parser.parse_args()
    rows = [["", "worst ms", "p99 ms", "p50 ms", "hand-off max ms"]]
    with NatsServer() as nats:
        broker = f"{nats.url}?stream=LAG_{uuid.uuid4().hex[:8]}&subjects=lag.>"
        for name, driver in DRIVERS.items():
            with scratch_schema(PG, "bench") as db:
                prepare(db)
                url = async_db(db, driver)
                runs = {
                    "no outbox": asyncio.run(without_outbox(url, args.requests)),
                    "outbox": asyncio.run(with_outbox(url, broker, args.requests, 0.0)),
                    f"outbox, relay stalled {STALL_S * 1000:.0f} ms": asyncio.run(
                        with_outbox(url, broker, args.requests, STALL_S)
                    ),
                }
            rows += [row(f"{name}: {label}", run) for label, run in runs.items()]
    print_rows(f"app loop lag, {args.requests} concurrent requests (1 ms ticks, same run)", rows)


if __name__ == "__main__":
    main()
