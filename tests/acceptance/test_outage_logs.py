"""`outbox relay` with its broker down for a minute logs the outage, not each retry.

A real worker process, PostgreSQL, and a nats-server reached through a TcpProxy that is
not listening for the first 60 s (connections refused), then is.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

from sqlalchemy import create_engine, func, select
from sqlalchemy.pool import NullPool

from bench import sweeper as bench_sweeper
from outbox import migrate, outbox_message
from relay.testing.embedded import NatsServer
from relay.testing.faults import TcpProxy
from tests.acceptance.test_signals import Command
from tests.helpers import wait_until

OUTAGE_S = 60.0
ROWS = 200


def sent(db: str) -> int:
    engine = create_engine(db, poolclass=NullPool)
    with engine.connect() as conn:
        t = outbox_message
        found = conn.execute(select(func.count()).where(t.c.status == "sent")).scalar_one()
    engine.dispose()
    return int(found)


def test_a_minute_of_broker_outage_is_a_few_lines(
    pg_url: str, nats_server: NatsServer, stream: tuple[str, str], tmp_path: Path
) -> None:
    migrate.upgrade(pg_url)
    name, prefix = stream
    bench_sweeper.seed(pg_url, ROWS, f"{prefix}.backlog")
    proxy = TcpProxy(nats_server.port)  # not started: its port refuses connections
    broker = f"nats://127.0.0.1:{proxy.port}?stream={name}&subjects={prefix}.>"
    worker = Command(tmp_path, "relay", "--db", pg_url, "--broker", broker,
                     "--sweep-interval-s", "0.2")  # fmt: skip
    try:
        worker.wait_for(lambda: "unreachable: " in worker.stderr(), "the outage's first line")
        end = time.monotonic() + OUTAGE_S
        wait_until(lambda: worker.alive() and time.monotonic() > end, OUTAGE_S + 30, "a minute")
        during = [line for line in worker.stderr().splitlines() if " WARNING " in line]
        proxy.start()
        worker.wait_for(lambda: sent(pg_url) == ROWS, "every row sent once the broker is back")
        worker.wait_for(lambda: "recovered after" in worker.stderr(), "the recovery line")
        worker.stop_with(signal.SIGTERM, 30)
    finally:
        worker.kill()
        proxy.stop()
    assert worker.proc.returncode == 0, worker.stderr()[-2000:]
    starts = [line for line in during if "unreachable: " in line]
    summaries = [line for line in during if "still unreachable after" in line]
    assert len(starts) == 1, during  # the worker's one broker: one start line
    assert 1 <= len(summaries) <= 2, during  # at 30 s (and 60 s)
    assert len(during) == len(starts) + len(summaries), during  # nothing else warned
    recovered = [line for line in worker.stderr().splitlines() if "recovered after" in line]
    assert len(recovered) == 1 and " INFO " in recovered[0], recovered
