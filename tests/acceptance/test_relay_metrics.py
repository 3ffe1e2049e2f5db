"""`outbox relay --metrics-port`: a real worker's /metrics, scraped while it works."""

from __future__ import annotations

import os
import signal
import subprocess
import urllib.request

from sqlalchemy import create_engine, text, update
from sqlalchemy.pool import NullPool

from outbox.table import outbox_message as t
from relay.testing.embedded import NatsServer, free_port
from tests.acceptance.test_cli import OUTBOX, count, seed
from tests.helpers import wait_until

SENT = 'outbox_messages_sent_total{path="sweeper"}'


def metrics(port: int) -> dict[str, float]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as reply:
            lines = reply.read().decode().splitlines()
    except OSError:
        return {}
    pairs = (line.rsplit(" ", 1) for line in lines if line and not line.startswith("#"))
    return {name: float(value) for name, value in pairs}


def test_worker_serves_metrics_of_what_it_swept(
    pg_url: str, nats_server: NatsServer, stream: tuple[str, str]
) -> None:
    name, prefix = stream
    seed(pg_url, ["pending"] * 300 + ["dead"], topic=f"{prefix}.orders")
    engine = create_engine(pg_url, poolclass=NullPool)
    with engine.begin() as conn:  # old enough for the sweeper (10 s by default)
        conn.execute(update(t).values(created_at=t.c.created_at - text("interval '1 minute'")))
    engine.dispose()
    port = free_port()
    env = {**os.environ, "OUTBOX_DB": pg_url,
           "OUTBOX_BROKER": f"{nats_server.url}?stream={name}&subjects={prefix}.>"}  # fmt: skip
    worker = subprocess.Popen(
        [OUTBOX, "relay", "--interval", "0.2", "--metrics-port", str(port),
         "--metrics-addr", "127.0.0.1"],
        env=env, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_until(lambda: count(pg_url, "pending") == 0, timeout=60, what="the worker to drain")
        # Sent, not swept: on a loaded machine an ack may time out and its row be swept
        # again (at least once), so swept may pass 300; each row is marked sent once.
        wait_until(lambda: metrics(port).get(SENT) == 300, timeout=60,
                   what="/metrics to show the sweep")  # fmt: skip
        pending = f'outbox_pending_messages{{topic="{prefix}.orders"}}'
        wait_until(lambda: metrics(port).get(pending) == 0, timeout=30,
                   what="the backlog gauge to reach 0")  # fmt: skip
        samples = metrics(port)
    finally:
        worker.send_signal(signal.SIGTERM)
        _, log = worker.communicate(timeout=30)
    assert worker.returncode == 0, log
    assert samples["outbox_messages_swept_total"] >= 300
    assert samples["outbox_messages_dead_total"] == 0
    assert samples["outbox_backlog_up"] == 1
    assert samples[f'outbox_dead_messages{{topic="{prefix}.orders"}}'] == 1
    assert samples["outbox_sweep_batch_size_sum"] == samples["outbox_messages_swept_total"]
    assert samples["outbox_sweep_duration_seconds_count"] >= 1
    assert "outbox_queue_depth" not in samples  # a worker has no fast path
    assert f"metrics on http://127.0.0.1:{port}/metrics" in log
