"""The web example: Flask's test client and a real server, real PostgreSQL and nats-server."""

from __future__ import annotations

import asyncio
import json
import os
import re
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
from flask import Flask
from hypothesis import HealthCheck, event, given, settings
from nats.js.errors import NotFoundError
from sqlalchemy import Engine, create_engine, func, select

from examples.webapp.app import create_app, inbound
from outbox.table import outbox_message
from relay.brokers.nats import read_stream
from relay.testing.embedded import NatsServer, free_port
from tests.acceptance.hostile import HOSTILE, bodies, expected_status, raw
from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def app(pg_url: str, nats_server: NatsServer, stream: tuple[str, str]) -> Iterator[Flask]:
    name, _ = stream
    app = create_app(pg_url, f"{nats_server.url}?stream={name}&subjects=warehouse.>")
    yield app
    app.extensions["outbox"].stop()


def rows(pg_url: str) -> int:
    engine = create_engine(pg_url)
    with engine.connect() as conn:
        found = conn.execute(select(func.count()).select_from(inbound)).scalar_one()
    engine.dispose()
    return int(found)


def stored(server: NatsServer, name: str) -> list[Any]:
    """The stream's messages; none while the relay has not made the stream yet (a busy CI)."""
    try:
        return asyncio.run(read_stream(server.url, name))
    except NotFoundError:
        return []


def test_a_delivery_is_recorded_and_announced_once(
    app: Flask, pg_url: str, nats_server: NatsServer, stream: tuple[str, str]
) -> None:
    reply = app.test_client().post("/inbound", json={"sku": "A-100", "quantity": 12, "dock": "D1"})
    assert reply.status_code == 201, reply.get_json()
    body = reply.get_json()
    wait_until(lambda: len(stored(nats_server, stream[0])) == 1, what="the message published")
    [message] = stored(nats_server, stream[0])
    assert message.msg_id == body["msg_id"] and message.subject == "warehouse.inbound"
    assert json.loads(message.data) == {"id": body["id"], "sku": "A-100", "quantity": 12}
    assert message.headers["Outbox-Key"] == "A-100" and rows(pg_url) == 1


def test_metrics_show_what_the_apps_own_relay_published(app: Flask) -> None:
    """The README's example: right after a request, /metrics counts the fast path's send."""
    client = app.test_client()
    assert client.post("/inbound", json={"sku": "A-7", "quantity": 3}).status_code == 201

    def sent_fast() -> float:
        text = client.get("/metrics").get_data(as_text=True)
        found = re.search(r'^outbox_messages_sent_total\{path="fast"\} (\S+)$', text, re.M)
        return float(found.group(1)) if found else 0.0

    wait_until(lambda: sent_fast() == 1.0, what="sent_total{path=fast} 1.0")


@pytest.mark.parametrize(
    ("body", "status", "error"),
    [
        ({"sku": "", "quantity": 1}, 422, "sku"),
        ({"sku": "A-1", "quantity": 0}, 422, "quantity"),
        ({"sku": "A-1", "quantity": True}, 422, "quantity"),
        ([1, 2], 422, "body"),
        ({"sku": "A-1\x00", "quantity": 1}, 422, "sku"),
        ({"sku": "A-1", "quantity": 2**31}, 422, "quantity"),
        ({"sku": "A-1", "quantity": 5, "dock": "D9"}, 409, "closed"),
    ],
)
def test_refused_and_rolled_back_requests_leave_no_row_and_no_message(
    app: Flask,
    pg_url: str,
    nats_server: NatsServer,
    stream: tuple[str, str],
    body: Any,
    status: int,
    error: str,
) -> None:
    client = app.test_client()
    reply = client.post("/inbound", json=body)
    assert reply.status_code == status and error in reply.get_json()["error"]
    # A good request after it: only its own row and message exist.
    assert client.post("/inbound", json={"sku": "OK", "quantity": 1}).status_code == 201
    wait_until(lambda: len(stored(nats_server, stream[0])) >= 1, what="the good message")
    assert [json.loads(m.data)["sku"] for m in stored(nats_server, stream[0])] == ["OK"]
    assert rows(pg_url) == 1


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
        rows = conn.execute(select(func.count()).select_from(inbound)).scalar_one()
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
        stored_row = select(inbound.c.sku, inbound.c.quantity, inbound.c.dock)
        with pg_engine.connect() as conn:
            row = conn.execute(stored_row.where(inbound.c.id == reply.json()["id"])).one()
        assert tuple(row) == (body["sku"], body["quantity"], body.get("dock", "D1"))
        assert written(pg_engine) == (before[0] + 1, before[1] + 1)
    else:
        assert written(pg_engine) == before
    if reply.status_code == 422:
        assert reply.json()["field"] in {"sku", "quantity", "dock"}


def test_a_database_error_past_the_validation_is_a_422_not_a_500(
    pg_url: str, nats_server: NatsServer, stream: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last resort: with the validation switched off, PostgreSQL's refusal of a NUL
    and of 2**31 is answered 422 (logged as a validation bug), never a 500."""
    import examples.webapp.app as webapp

    app = create_app(pg_url, f"{nats_server.url}?stream={stream[0]}&subjects=warehouse.>")
    try:
        monkeypatch.setattr(webapp, "parse", lambda body: webapp.Delivery(**body))
        client = app.test_client()
        for body in ({"sku": "A\x00", "quantity": 1, "dock": "D1"},
                     {"sku": "A", "quantity": 2**31, "dock": "D1"}):  # fmt: skip
            reply = client.post("/inbound", json=body)
            assert reply.status_code == 422, reply.get_data(as_text=True)
            assert "database refused" in reply.get_json()["error"]
            assert "\x00" not in reply.get_data(as_text=True)  # nothing of the SQL echoed
        assert rows(pg_url) == 0
    finally:
        app.extensions["outbox"].stop()
