"""The outbox never stalls an async app's event loop (issue #16 item 4).

The relay's database and broker work runs on its own threads, and the hand-off after
COMMIT only queues. To prove it in a way that can fail, the relay is made to block
its thread for STALL_S on publishes and on every SQL statement it runs (a stuck
broker client, a locked database): if any of that ran on the app's loop, or if the
hand-off waited for it, the loop would stall for STALL_S. Meanwhile 400 concurrent
requests commit, and a ticker measures how late the loop runs (relay.testing.LoopLag).

The bound asserted is half the injected stall, far above the lag of a healthy loop,
so a busy machine does not fail it; the figures themselves are measured by
bench/loop_lag.py (with and without the outbox, same run).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from bench.loop_lag import (
    DRIVERS,
    Run,
    async_db,
    outbox_request,
    prepare,
    serve,
    stalled_relay,
    timed_handoffs,
)
from outbox import Outbox
from relay.brokers.nats import read_stream
from relay.testing import FaultyBroker, LoopLag, MemoryBroker
from relay.testing.embedded import NatsServer

REQUESTS = 400
STALL_S = 1.5  # per stalled publish or relay SQL statement
# A few stalls of each kind in the run (every stall of one thread delays all it has queued).
PUBLISHES_EVERY, STATEMENTS_EVERY = 150, 10


@pytest.mark.parametrize("driver", list(DRIVERS.values()), ids=list(DRIVERS))
def test_a_stalled_relay_never_stalls_the_apps_loop(
    driver: str, pg_url: str, nats_server: NatsServer, stream: tuple[str, str]
) -> None:
    prepare(pg_url)
    name, prefix = stream
    broker = f"{nats_server.url}?stream={name}&subjects={prefix}.>"
    # No sweeper: every message must go by the fast path; stalls must not age it out.
    ob = Outbox(
        async_db(pg_url, driver), broker=broker, sweeper=False, handoff_limit_s=60, sweeper_age_s=99
    )
    handoffs: list[float] = []
    timed_handoffs(ob, handoffs)
    with stalled_relay(ob, STALL_S, PUBLISHES_EVERY, STATEMENTS_EVERY) as stalls:
        ob.start()
    stats = ob.stats
    assert stats is not None

    async def app() -> Run:
        try:
            request = outbox_request(ob, f"{prefix}.orders")
            return await serve(request, REQUESTS, lambda: stats.marked > REQUESTS, timeout=120)
        finally:
            await ob.stop_async()

    run = asyncio.run(app())
    print(
        f"\n{driver}: loop lag worst {run.lag.worst * 1000:.1f} ms, "
        f"p99 {run.lag.percentile(99) * 1000:.1f} ms over {len(run.lag.lateness)} ticks; "
        f"hand-off max {max(handoffs) * 1000:.1f} ms; relay stalled "
        f"{stalls.publishes} publishes and {stalls.statements.stalls} statements x {STALL_S} s"
    )
    assert stalls.publishes >= 1 and stalls.statements.stalls >= 1, "the relay did stall"
    assert run.lag.worst < STALL_S / 2, "the app's loop waited for the relay"
    assert len(handoffs) == len(run.sent) and max(handoffs) < STALL_S / 2
    at_broker = asyncio.run(read_stream(nats_server.url, name))
    assert sorted(str(m.msg_id) for m in at_broker) == sorted(run.sent)
    assert ob.handed_off == REQUESTS + 1 == stats.published, "all by the fast path"


def test_the_meter_sees_a_stall_on_the_loop() -> None:
    """The same stalled publish, run on the app's own loop, shows as a STALL_S lag."""
    stalled = FaultyBroker(MemoryBroker(), {}, stall_s=STALL_S / 4)

    async def publish_on_the_apps_loop() -> LoopLag:
        async with LoopLag() as lag:
            started = time.perf_counter()
            await stalled.publish([])
            await asyncio.sleep(0.005)  # a tick after the stall
            assert time.perf_counter() - started >= STALL_S / 4
        return lag

    lag = asyncio.run(publish_on_the_apps_loop())
    assert lag.worst >= STALL_S / 4 * 0.9
