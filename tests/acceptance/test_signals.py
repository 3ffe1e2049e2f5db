"""SIGINT and SIGTERM stop `outbox drain` and `outbox relay` on a large backlog.

Real processes, PostgreSQL and a nats-server of the test's own. What must hold after
the signal: the process ends within its stop timeout (plus a margin for a loaded
machine) with the documented status and its summary, without a traceback; no row is
marked sent unless it is in the stream; rows published but still pending are allowed
(at least once: the next drain publishes them again, JetStream drops the copy) and
counted; a second drain delivers the rest.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, insert, select, text
from sqlalchemy.pool import NullPool

from outbox import migrate, outbox_message
from outbox.message import build_message
from relay.brokers.nats import read_stream
from relay.testing.embedded import NatsServer

OUTBOX = str(Path(sys.executable).with_name("outbox"))
ROWS = 30_000  # seconds of work even on a fast machine; the signal comes after the first batch
STOP_TIMEOUT = 10.0
MARGIN = 30.0  # start-up of the summary and the exit on a loaded machine, not a speed target
t = outbox_message


@pytest.fixture
def db(pg_url: str) -> Iterator[Engine]:
    migrate.upgrade(pg_url)
    engine = create_engine(pg_url, poolclass=NullPool)
    yield engine
    engine.dispose()


def seed(engine: Engine, topic: str, rows: int = ROWS) -> set[str]:
    """``rows`` pending rows, a minute old (due for a worker's sweeper too); their msg_ids."""
    ids: set[str] = set()
    with engine.begin() as conn:
        for start in range(0, rows, 5000):
            batch = [
                build_message(topic, {"n": n}, max_payload_bytes=1000)
                for n in range(start, min(rows, start + 5000))
            ]
            conn.execute(
                insert(t),
                [{"msg_id": m.msg_id, "topic": m.topic, "payload": m.payload} for m in batch],
            )
            ids.update(m.msg_id for m in batch)
        conn.execute(
            text("UPDATE outbox_message SET created_at = created_at - interval '1 minute'")
        )
    return ids


def by_status(engine: Engine) -> dict[str, set[str]]:
    with engine.connect() as conn:
        rows = conn.execute(select(t.c.msg_id, t.c.status)).all()
    found: dict[str, set[str]] = {"pending": set(), "sent": set(), "dead": set()}
    for msg_id, status in rows:
        found[status].add(str(msg_id))
    return found


def sent_count(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                text("SELECT count(*) FROM outbox_message WHERE status = 'sent'")
            ).scalar_one()
        )


def poll(condition: Callable[[], object], timeout: float, what: str) -> None:
    """Until ``condition`` holds (checked every 50 ms: each check is a query); fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def in_stream(server: NatsServer, name: str) -> list[str]:
    return [m.msg_id for m in asyncio.run(read_stream(server.url, name))]


def stop_with(proc: subprocess.Popen[str], signum: int, timeout: float) -> tuple[str, str, float]:
    """Send ``signum``; stdout, stderr and the seconds until the process ended."""
    proc.send_signal(signum)
    signalled = time.monotonic()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"still running {timeout} s after {signum!r}: {err[-2000:]}") from None
    return out, err, time.monotonic() - signalled


def started_not_done(stopped_at: int) -> None:
    assert stopped_at < ROWS, (
        f"all {ROWS} rows were sent before the signal took effect: the signal did not "
        "stop anything here; seed a larger backlog"
    )


def check_stream(
    engine: Engine, server: NatsServer, name: str, ids: set[str]
) -> tuple[dict[str, set[str]], int]:
    """No row marked sent without being in the stream; the stream holds only our rows.
    The table by status, and how many pending rows are in the stream already."""
    table = by_status(engine)
    stored = set(in_stream(server, name))
    assert table["sent"] <= stored, (
        f"{len(table['sent'] - stored)} row(s) marked sent, not in the stream"
    )
    assert stored <= ids
    assert not table["dead"]
    return table, len(stored & table["pending"])


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_a_drain_between_batches(
    db: Engine,
    pg_url: str,
    nats_server: NatsServer,
    stream: tuple[str, str],
    signum: signal.Signals,
) -> None:
    name, prefix = stream
    ids = seed(db, f"{prefix}.backlog")
    broker = f"{nats_server.url}?stream={name}&subjects={prefix}.>"
    drain = [OUTBOX, "drain", "--db", pg_url, "--broker", broker]
    proc = subprocess.Popen(
        [*drain, "--stop-timeout", str(STOP_TIMEOUT)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        poll(lambda: sent_count(db) > 0, 60, "the drain's first batch marked sent")
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    out, err, took = stop_with(proc, signum, STOP_TIMEOUT + MARGIN)

    assert proc.returncode == 128 + signum, (proc.returncode, err[-2000:])
    assert "Traceback" not in err, err[-2000:]
    summary = re.search(
        rf"drained: sent=(\d+) retry_later=\d+ dead=0 of {ROWS} pending in .* \(stopped by {signum.name}\)",
        out,
    )
    assert summary is not None, out
    table, published_pending = check_stream(db, nats_server, name, ids)
    started_not_done(len(table["sent"]))
    assert int(summary[1]) == len(table["sent"]), "the summary counts what was marked sent"
    assert len(table["sent"]) + len(table["pending"]) == ROWS, "every other row is still pending"
    print(
        f"\n{signum.name}: stopped {took:.1f} s after the signal; sent {len(table['sent'])} of {ROWS}; "
        f"pending but already in the stream (at least once): {published_pending}"
    )

    again = subprocess.run(drain, capture_output=True, text=True, timeout=300, check=False)
    assert again.returncode == 0, again.stderr[-2000:]
    table, _ = check_stream(db, nats_server, name, ids)
    assert len(table["sent"]) == ROWS
    assert set(in_stream(nats_server, name)) == ids, "every message in the stream at least once"


def test_sigterm_stops_a_relay_worker_with_its_summary(
    db: Engine, pg_url: str, nats_server: NatsServer, stream: tuple[str, str]
) -> None:
    name, prefix = stream
    ids = seed(db, f"{prefix}.backlog")
    broker = f"{nats_server.url}?stream={name}&subjects={prefix}.>"
    worker = subprocess.Popen(
        [
            OUTBOX,
            "relay",
            "--db",
            pg_url,
            "--broker",
            broker,
            "--interval",
            "0.2",
            "--stop-timeout",
            str(STOP_TIMEOUT),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        poll(lambda: sent_count(db) > 0, 60, "the worker's first batch marked sent")
    except BaseException:
        worker.kill()
        worker.communicate()
        raise
    _, err, took = stop_with(worker, signal.SIGTERM, STOP_TIMEOUT + MARGIN)

    assert worker.returncode == 0, err[-2000:]  # SIGTERM is how a worker is stopped
    assert "Traceback" not in err, err[-2000:]
    summary = re.search(
        r"relay worker stopped by SIGTERM: sent=(\d+) retry_later=0 dead=0 in \d+ s", err
    )
    assert summary is not None, err[-2000:]
    table, published_pending = check_stream(db, nats_server, name, ids)
    started_not_done(len(table["sent"]))
    assert int(summary[1]) == len(table["sent"])
    print(
        f"\nworker stopped {took:.1f} s after SIGTERM; sent {len(table['sent'])} of {ROWS}; "
        f"pending but in the stream: {published_pending}"
    )
