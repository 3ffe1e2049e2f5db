"""The web examples under pre-fork servers: gunicorn --preload (Flask) and uvicorn --workers
(FastAPI), real PostgreSQL and nats-server.

Requests go on until every worker served some; every committed message must be in the
stream exactly once. The sweeper takes no row younger than an hour, so only the fast path
of the process that committed a message can have published it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from sqlalchemy import make_url

from relay.brokers.nats import read_stream
from relay.testing.embedded import NatsServer, free_port
from tests.acceptance.prefork_apps import SWEEPER_AGE_S
from tests.helpers import unsent, wait_until

pytestmark = pytest.mark.filterwarnings(
    "ignore:This process .* is multi-threaded:DeprecationWarning"  # Python 3.12+ on fork
)

ROOT = Path(__file__).resolve().parents[2]
Served = dict[str, int]  # msg_id -> pid of the worker that answered 201


def serve(command: list[str], db: str, broker: str, port: int) -> subprocess.Popen[str]:
    env = {**os.environ, "OUTBOX_DB": db, "OUTBOX_BROKER": broker,
           "OUTBOX_SWEEPER_AGE_S": str(SWEEPER_AGE_S)}  # fmt: skip
    server = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # the workers end with their server, whatever happens here
    )  # fmt: skip
    try:
        wait_until(lambda: answers(port), timeout=60, what="the server to answer")
    except AssertionError:
        stop(server)
        raise
    return server


def stop(server: subprocess.Popen[str]) -> str:
    """SIGTERM (graceful) and the output; SIGKILL to the whole group past the deadline."""
    server.terminate()
    try:
        output, _ = server.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        output, _ = server.communicate()
    return output


def answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


def post(port: int, n: int) -> tuple[str, int]:
    """One delivery; (msg_id, the answering worker's pid)."""
    body = json.dumps({"sku": f"S{n}", "quantity": 1 + n % 5, "dock": "D1"}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/inbound", data=body,
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=30) as reply:
        assert reply.status == 201
        return json.loads(reply.read())["msg_id"], int(reply.headers["X-Worker"])


def post_until(port: int, served: Served, done: Callable[[set[int]], bool]) -> None:
    """Batches of concurrent requests until ``done(pids that answered)``; at most 60 s."""
    deadline = time.monotonic() + 60
    while not done(set(served.values())):
        assert time.monotonic() < deadline, f"workers that answered: {set(served.values())}"
        first = len(served)
        with ThreadPoolExecutor(8) as pool:
            served.update(pool.map(lambda n: post(port, n), range(first, first + 24)))


def delivered_once(nats_server: NatsServer, name: str, pg_url: str, served: Served) -> None:
    wait_until(lambda: unsent(pg_url) == 0, timeout=60, what="every row marked sent")
    seen = Counter(m.msg_id for m in asyncio.run(read_stream(nats_server.url, name)))
    lost, phantom = set(served) - set(seen), set(seen) - set(served)
    duplicates = sum(n - 1 for n in seen.values())
    workers = len(set(served.values()))
    print(f"\ncommitted {len(served)} in {workers} workers, delivered {len(seen)}, "
          f"lost {len(lost)}, phantom {len(phantom)}, duplicates {duplicates}")  # fmt: skip
    assert not lost and not phantom and not duplicates


@pytest.fixture
def broker(nats_server: NatsServer, stream: tuple[str, str]) -> str:
    return f"{nats_server.url}?stream={stream[0]}&subjects=warehouse.>"


def test_gunicorn_preload_with_3_workers_delivers_every_message_once_by_the_fast_path(
    pg_url: str, nats_server: NatsServer, stream: tuple[str, str], broker: str
) -> None:
    """The app and its started relay are made in gunicorn's master, then forked. A worker
    that exits stops its own relay only: the one forked in its place delivers too, and
    the master (whose sweeper uses its pool every second) logs no error."""
    port = free_port()
    app = "tests.acceptance.prefork_apps:flask_app()"
    command = [sys.executable, "-m", "gunicorn", "--preload", "-w", "3", "-b",
               f"127.0.0.1:{port}", app]  # fmt: skip
    server = serve(command, pg_url, broker, port)
    served: Served = {}
    try:
        post_until(port, served, lambda pids: len(pids) == 3)
        wait_until(lambda: unsent(pg_url) == 0, timeout=60, what="the first rows sent")
        gone = max(set(served.values()))  # nothing of its own left to publish: all sent
        os.kill(gone, signal.SIGTERM)  # graceful: its atexit ob.stop() runs in the child
        first = set(served.values())
        post_until(port, served, lambda pids: bool(pids - first))  # its replacement answered
        delivered_once(nats_server, stream[0], pg_url, served)
    finally:
        output = stop(server)
    assert "Traceback" not in output and "closed the connection" not in output, output


def test_uvicorn_with_2_workers_delivers_every_message_once_by_the_fast_path(
    pg_url: str, nats_server: NatsServer, stream: tuple[str, str], broker: str
) -> None:
    """Each worker process runs the lifespan: a relay of its own, started and stopped there."""
    port = free_port()
    db = make_url(pg_url).set(drivername="postgresql+asyncpg").render_as_string(False)
    app = "tests.acceptance.prefork_apps:fastapi_app"
    command = [sys.executable, "-m", "uvicorn", "--workers", "2", "--factory", "--port",
               str(port), "--log-level", "warning", app]  # fmt: skip
    server = serve(command, db, broker, port)
    served: Served = {}
    try:
        post_until(port, served, lambda pids: len(pids) == 2)
        delivered_once(nats_server, stream[0], pg_url, served)
    finally:
        output = stop(server)
    assert "Traceback" not in output, output
