"""The async FastAPI example for real: uvicorn on a free port, httpx, PostgreSQL and nats-server.

Its own tests (AsyncClient, MemoryBroker) are tests/examples/test_fastapi_async.py."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from sqlalchemy import Engine, create_engine, func, make_url, select

from examples.fastapi_async.models import Inbound
from outbox.table import outbox_message
from relay.brokers.nats import read_stream
from relay.testing.embedded import NatsServer, free_port
from tests.acceptance.hostile import HOSTILE, bodies, expected_status, raw
from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parents[2]
REQUESTS = 1000


@pytest.fixture
def service(pg_url: str, nats_server: NatsServer, stream: tuple[str, str]) -> Iterator[str]:
    """`python -m examples.fastapi_async` on asyncpg and a free port; its base URL."""
    port = free_port()
    db = make_url(pg_url).set(drivername="postgresql+asyncpg")
    broker = f"{nats_server.url}?stream={stream[0]}&subjects=warehouse.>"
    env = {**os.environ, "OUTBOX_DB": db.render_as_string(hide_password=False),
           "OUTBOX_BROKER": broker}  # fmt: skip
    server = subprocess.Popen(
        [sys.executable, "-m", "examples.fastapi_async", "--port", str(port)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: answers(base), timeout=30, what="the service to answer")
        yield base
    finally:
        server.terminate()
        output, _ = server.communicate(timeout=30)
    # uvicorn shuts down gracefully on SIGTERM, then re-raises it: -15.
    assert server.returncode in (0, -15) and "Traceback" not in output, output
    assert f"Uvicorn running on {base}" in output  # it says where it listens
    assert "POST /inbound" not in output  # and logs no line per request


def answers(base: str) -> bool:
    try:
        return bool(httpx.get(f"{base}/health", timeout=1).json() == {"relay": "up"})
    except httpx.HTTPError:
        return False


def body(i: int) -> dict[str, Any]:
    """Every tenth delivery goes to a closed dock: the rule fails inside the transaction."""
    return {"sku": f"S{i}", "quantity": 1 + i % 7, "dock": "D9" if i % 10 == 0 else "D1"}


async def post_all(base: str, bodies: list[dict[str, Any]], connections: int = 20) -> list[Any]:
    """All requests started at once as tasks, over ``connections`` keep-alive connections.

    The semaphore keeps httpx's own pool queue short: with hundreds of requests waiting
    inside it, httpcore's pool spends its time rescanning them and times out.
    """
    gate = asyncio.Semaphore(connections)
    limits = httpx.Limits(max_connections=connections)
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as client:

        async def post(sent: dict[str, Any]) -> httpx.Response:
            async with gate:
                return await client.post("/inbound", json=sent)

        return list(await asyncio.gather(*(post(b) for b in bodies)))


def sent_and_pending(pg_url: str) -> tuple[set[int], int]:
    """The business rows' ids, and how many outbox rows are not yet marked sent."""
    engine = create_engine(pg_url)
    with engine.connect() as conn:
        ids = set(conn.execute(select(Inbound.id)).scalars())
        pending = conn.execute(
            select(func.count()).where(outbox_message.c.status != "sent")
        ).scalar_one()
    engine.dispose()
    return ids, int(pending)


def test_1000_concurrent_requests_lose_nothing_and_publish_no_rolled_back_message(
    service: str, pg_url: str, nats_server: NatsServer, stream: tuple[str, str]
) -> None:
    replies = asyncio.run(post_all(service, [body(i) for i in range(REQUESTS)]))
    statuses = Counter(reply.status_code for reply in replies)
    assert statuses == {201: REQUESTS * 9 // 10, 409: REQUESTS // 10}, statuses
    created = {r.json()["msg_id"]: r.json()["id"] for r in replies if r.status_code == 201}
    wait_until(lambda: sent_and_pending(pg_url)[1] == 0, timeout=30, what="every row sent")
    ids, _ = sent_and_pending(pg_url)
    assert ids == set(created.values())  # every 201 row is there, and no rolled-back one

    delivered = asyncio.run(read_stream(nats_server.url, stream[0]))
    seen = Counter(m.msg_id for m in delivered)
    lost = set(created) - set(seen)
    phantom = set(seen) - set(created)
    duplicates = sum(n - 1 for n in seen.values())
    print(f"\ncommitted {len(created)}, delivered {len(seen)}, lost {len(lost)}, "
          f"phantom {len(phantom)}, duplicates {duplicates}")  # fmt: skip
    assert not lost and not phantom
    closed = {b["sku"] for b in map(body, range(REQUESTS)) if b["dock"] == "D9"}
    assert not closed & {json.loads(m.data)["sku"] for m in delivered}


REFUSED = [
    ({"sku": "", "quantity": 1}, 422, "sku"),
    ({"sku": "A-1", "quantity": 0}, 422, "quantity"),
    ({"sku": "A-1", "quantity": True}, 422, "quantity"),
    ({"sku": "A-1"}, 422, "quantity"),
    ({"sku": "A-1", "quantity": 1, "tags": ["two words"]}, 400, "tags"),
    ({"sku": "A-1\n", "quantity": 1}, 422, "sku"),
    ({"sku": "A-1", "quantity": 5, "dock": "D9"}, 409, "closed"),
]


def test_refused_and_rolled_back_requests_leave_no_row_and_no_message(
    service: str, pg_url: str, nats_server: NatsServer, stream: tuple[str, str]
) -> None:
    for sent, status, error in REFUSED:
        reply = httpx.post(f"{service}/inbound", json=sent, timeout=10)
        assert reply.status_code == status, (sent, reply.json())
        assert error in json.dumps(reply.json()), (sent, reply.json())
    # A good request after them: only its own row and message exist.
    good = httpx.post(f"{service}/inbound", json={"sku": "OK", "quantity": 1, "tags": ["a"]})
    assert good.status_code == 201, good.json()
    wait_until(lambda: sent_and_pending(pg_url)[1] == 0, what="the good message sent")
    [message] = asyncio.run(read_stream(nats_server.url, stream[0]))
    assert message.msg_id == good.json()["msg_id"] and json.loads(message.data)["sku"] == "OK"
    assert message.headers["Outbox-Tags"] == "a"
    assert sent_and_pending(pg_url)[0] == {good.json()["id"]}


def written(engine: Engine) -> tuple[int, int]:
    """How many business rows and outbox rows exist."""
    with engine.connect() as conn:
        rows = conn.execute(select(func.count()).select_from(Inbound)).scalar_one()
        messages = conn.execute(select(func.count()).select_from(outbox_message)).scalar_one()
    return int(rows), int(messages)


@pytest.fixture
def pg_engine(pg_url: str) -> Iterator[Engine]:
    engine = create_engine(pg_url)
    yield engine
    engine.dispose()


def named_fields(reply: httpx.Response) -> set[str]:
    """The body fields FastAPI's 422 detail names (``loc`` is ["body", field, ...])."""
    return {str(error["loc"][1]) for error in reply.json()["detail"] if len(error["loc"]) > 1}


def test_hostile_values_get_422_naming_the_field_and_write_nothing(
    service: str, pg_engine: Engine, nats_server: NatsServer, stream: tuple[str, str]
) -> None:
    with httpx.Client(base_url=service, timeout=60) as client:
        for body, field in HOSTILE:
            reply = client.post("/inbound", content=raw(body),
                                headers={"content-type": "application/json"})  # fmt: skip
            assert reply.status_code == 422, (repr(body)[:80], reply.text[:300])
            assert named_fields(reply) == {field}, (repr(body)[:80], reply.text[:300])
    assert written(pg_engine) == (0, 0)
    assert asyncio.run(read_stream(nats_server.url, stream[0])) == []


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=bodies())
def test_any_body_gets_201_409_or_422_and_only_a_201_writes(
    service: str, pg_engine: Engine, body: dict[str, Any]
) -> None:
    """Whatever the client sends: never a 5xx, a 422 names a field, a 201 stored the values."""
    before = written(pg_engine)
    reply = httpx.post(f"{service}/inbound", content=raw(body),
                       headers={"content-type": "application/json"}, timeout=60)  # fmt: skip
    assert reply.status_code == expected_status(body), (body, reply.text[:300])
    event(f"answered {reply.status_code}")  # --hypothesis-show-statistics: the mix
    if reply.status_code == 201:
        stored = select(Inbound.sku, Inbound.quantity, Inbound.dock)
        with pg_engine.connect() as conn:
            row = conn.execute(stored.where(Inbound.id == reply.json()["id"])).one()
        assert tuple(row) == (body["sku"], body["quantity"], body.get("dock", "D1"))
        assert written(pg_engine) == (before[0] + 1, before[1] + 1)
    else:
        assert written(pg_engine) == before
    if reply.status_code == 422:
        assert named_fields(reply) <= {"sku", "quantity", "dock"} and named_fields(reply)
