"""Scheduled messages through an app SIGKILL: an app with its in-process relay commits
100 scheduled messages (due 10-13 s later: time to commit them all before any is due,
however loaded the machine) and is killed at once; two `outbox relay` workers started
afterwards publish every one of them, none before its time, none twice.

Never early is judged as in test_scheduler_realtime: JetStream's stored time (the
nats-server's wall clock) against the row's deliver_at (the database's clock), through a
measured bound of the database's offset from this host's wall clock.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from sqlalchemy import create_engine
from sqlalchemy.pool import NullPool

from outbox import migrate, outbox_message
from relay.brokers.nats import read_stream
from relay.testing.embedded import NatsServer
from tests.helpers import sent_count, workers_until
from tests.scheduling import db_offset_bound_s, due_times, early

t = outbox_message
OUTBOX = str(Path(sys.executable).with_name("outbox"))
KILLED = 100
INTERVAL_S = 1.0

# The app: its relay running (the scheduler among its parts), scheduled messages sent
# with send(delay=...), then it waits in memory until killed.
_APP = textwrap.dedent(
    """
    import random, sys
    from sqlalchemy.orm import Session
    from outbox import Outbox
    db, broker, topic, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    ob = Outbox(db, broker=broker)
    ob.start()
    rng = random.Random(4)
    for first in range(0, count, 10):
        with Session(ob.engine) as session, session.begin():
            for _ in range(10):
                ob.send(session, topic, b"{}", delay=rng.uniform(10.0, 13.0))
    print("committed", flush=True)
    sys.stdin.read()
    """
)


def kill_app_after_scheduling(db: str, broker: str, topic: str) -> None:
    app = subprocess.Popen(
        [sys.executable, "-c", _APP, db, broker, topic, str(KILLED)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=Path(__file__).parents[2],
    )  # fmt: skip
    assert app.stdout is not None
    line = app.stdout.readline().strip()
    app.kill()
    _, err = app.communicate(timeout=10)
    assert line == "committed", err[-2000:]


def test_scheduled_messages_survive_an_app_sigkill(
    pg_url: str, nats_server: NatsServer, stream: tuple[str, str]
) -> None:
    name, prefix = stream
    broker = f"{nats_server.url}?stream={name}&subjects={prefix}.>"
    migrate.upgrade(pg_url)
    kill_app_after_scheduling(pg_url, broker, f"{prefix}.later")
    assert sent_count(pg_url) == 0, "killed before any was due"
    env = {**os.environ, "OUTBOX_DB": pg_url, "OUTBOX_BROKER": broker}
    command = [OUTBOX, "relay", "--interval", str(INTERVAL_S)]
    workers_until(command, env, lambda: sent_count(pg_url) == KILLED, "all published", n=2)
    engine = create_engine(pg_url, poolclass=NullPool)
    due, offset = due_times(engine), db_offset_bound_s(engine)
    engine.dispose()
    stored = asyncio.run(read_stream(nats_server.url, name))
    arrived = {m.msg_id: m.time for m in stored if m.msg_id and m.time}
    assert len(due) == KILLED and sorted(arrived) == sorted(due)
    assert len(stored) == KILLED, "none twice"
    assert early(arrived, due, offset) == []
    late_s = max((arrived[m] - due[m]).total_seconds() for m in due)
    print(f"latest: {late_s:.3f} s after its deliver_at (sweep interval {INTERVAL_S} s)")
