"""The Flask example for real: `python -m examples.webapp` (Flask's threaded server), real
PostgreSQL and nats-server. Its own tests (test client, MemoryBroker) are
tests/examples/test_webapp.py."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from nats.js.errors import NotFoundError
from sqlalchemy import Engine, create_engine, func, select

from examples.webapp.models import Inbound
from outbox.table import outbox_message
from relay.brokers.nats import read_stream
from relay.testing.embedded import NatsServer, free_port
from tests.acceptance.hostile import HOSTILE, bodies, expected_status, raw
from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parents[2]


def rows(pg_url: str) -> int:
    engine = create_engine(pg_url)
    with engine.connect() as conn:
        found = conn.execute(select(func.count()).select_from(Inbound)).scalar_one()
    engine.dispose()
    return int(found)


def stored(server: NatsServer, name: str) -> list[Any]:
    """The stream's messages; none while the relay has not made the stream yet (a busy CI)."""
    try:
        return asyncio.run(read_stream(server.url, name))
    except NotFoundError:
        return []


def post(port: int, body: dict[str, Any]) -> int:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/inbound",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def test_the_service_for_real_over_http(
    served: str, nats_server: NatsServer, stream: tuple[str, str]
) -> None:
    """`python -m examples.webapp` on a free port, 40 concurrent requests, 10 of them refused."""
    name, _ = stream
    port = int(served.rsplit(":", 1)[1])
    bodies = [{"sku": f"S{i}", "quantity": 1, "dock": "D9" if i % 4 == 0 else "D1"}
              for i in range(40)]  # fmt: skip
    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(lambda b: post(port, b), bodies))
    assert statuses.count(201) == 30 and statuses.count(409) == 10
    wait_until(lambda: len(stored(nats_server, name)) == 30, what="30 messages published")
    skus = {json.loads(m.data)["sku"] for m in stored(nats_server, name)}
    assert skus == {f"S{i}" for i in range(40) if i % 4}


def health(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


@pytest.fixture
def served(pg_url: str, nats_server: NatsServer, stream: tuple[str, str]) -> Iterator[str]:
    """`python -m examples.webapp` (Flask's threaded server) on a free port; its base URL."""
    port = free_port()
    broker = f"{nats_server.url}?stream={stream[0]}&subjects=warehouse.>"
    env = {**os.environ, "OUTBOX_DB": pg_url, "OUTBOX_BROKER": broker}
    server = subprocess.Popen(
        [sys.executable, "-m", "examples.webapp", "--port", str(port)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        wait_until(lambda: health(port), timeout=30, what="the service to answer")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        output, _ = server.communicate(timeout=30)
    assert "Traceback" not in output, output


@pytest.fixture
def pg_engine(pg_url: str) -> Iterator[Engine]:
    engine = create_engine(pg_url)
    yield engine
    engine.dispose()


def written(engine: Engine) -> tuple[int, int]:
    """How many business rows and outbox rows exist."""
    with engine.connect() as conn:
        rows = conn.execute(select(func.count()).select_from(Inbound)).scalar_one()
        messages = conn.execute(select(func.count()).select_from(outbox_message)).scalar_one()
    return int(rows), int(messages)


def post_raw(base: str, body: Any, client: httpx.Client | None = None) -> httpx.Response:
    headers = {"content-type": "application/json"}
    if client is not None:
        return client.post(f"{base}/inbound", content=raw(body), headers=headers)
    return httpx.post(f"{base}/inbound", content=raw(body), headers=headers, timeout=60)


def test_hostile_values_get_422_naming_the_field_and_write_nothing(
    served: str, pg_engine: Engine, nats_server: NatsServer, stream: tuple[str, str]
) -> None:
    with httpx.Client(timeout=60) as client:
        for body, field in HOSTILE:
            reply = post_raw(served, body, client)
            assert reply.status_code == 422, (repr(body)[:80], reply.text[:300])
            assert reply.json()["field"] == field, (repr(body)[:80], reply.json())
            assert reply.json()["error"].startswith(f"{field}: "), reply.json()
    assert written(pg_engine) == (0, 0)
    assert stored(nats_server, stream[0]) == []


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=bodies())
def test_any_body_gets_201_409_or_422_and_only_a_201_writes(
    served: str, pg_engine: Engine, body: dict[str, Any]
) -> None:
    """Whatever the client sends: never a 5xx, a 422 names a field, a 201 stored the values."""
    before = written(pg_engine)
    reply = post_raw(served, body)
    assert reply.status_code == expected_status(body), (body, reply.text[:300])
    event(f"answered {reply.status_code}")  # --hypothesis-show-statistics: the mix
    if reply.status_code == 201:
        stored_row = select(Inbound.sku, Inbound.quantity, Inbound.dock)
        with pg_engine.connect() as conn:
            row = conn.execute(stored_row.where(Inbound.id == reply.json()["id"])).one()
        assert tuple(row) == (body["sku"], body["quantity"], body.get("dock", "D1"))
        assert written(pg_engine) == (before[0] + 1, before[1] + 1)
    else:
        assert written(pg_engine) == before
    if reply.status_code == 422:
        assert reply.json()["field"] in {"sku", "quantity", "dock"}


def test_a_deploy_migrates_with_the_cli_and_starts_no_relay_there(
    pg_url: str, nats_server: NatsServer, stream: tuple[str, str]
) -> None:
    """A deploy's steps, as commands: `outbox migrate`, then `flask db upgrade` and `flask db
    check` with OUTBOX_START_RELAY=false (the factory runs in each, its start() starts
    nothing). The schema is at head and the app's history sees nothing to add."""
    broker = f"{nats_server.url}?stream={stream[0]}&subjects=warehouse.>"
    env = {**os.environ, "OUTBOX_DB": pg_url, "OUTBOX_BROKER": broker,
           "OUTBOX_START_RELAY": "false"}  # fmt: skip
    flask = [sys.executable, "-m", "flask", "--app", "examples.webapp.app", "db"]
    outbox = str(Path(sys.executable).with_name("outbox"))
    for command in ([outbox, "migrate"], [*flask, "upgrade"], [*flask, "check"]):
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert done.returncode == 0, (command, done.stdout, done.stderr)
        assert "Traceback" not in done.stderr, done.stderr
    assert rows(pg_url) == 0  # the app's table, made by its own history
    assert stored(nats_server, stream[0]) == []  # no relay made the stream
