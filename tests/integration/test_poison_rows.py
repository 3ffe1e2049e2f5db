"""Poison rows beside healthy ones, through each real broker: NATS JetStream (a server
of the test's own), RabbitMQ and Redis (names and keys of the test's own).

Rows are planted straight into the table (as a hand or an older version would write
them) and swept, by the Sweeper in process and by the real `outbox drain`. What the
broker holds afterwards is read back: exactly one copy of each healthy message, as it
was stored; no copy of a poison row, which is pending with attempts and its
last_error, or dead at the limit.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aio_pika
import pytest
import redis
from sqlalchemy import Engine, create_engine

from outbox import migrate
from outbox.config import Settings
from outbox.table import DEAD, PENDING, SENT
from relay.brokers import broker_for
from relay.brokers.base import KEY_HEADER, TAGS_HEADER
from relay.brokers.nats import DEDUP_HEADER, read_stream
from relay.embedded import NatsServer
from relay.loop import BrokerLoop
from relay.sweeper import Sweeper
from tests.planting import plant, row_of

OUTBOX = str(Path(sys.executable).with_name("outbox"))
RABBIT_URL = "amqp://guest:guest@127.0.0.1:5672/"
REDIS_URL = "redis://127.0.0.1:6379/0"
QUICK = Settings(max_attempts=3, backoff_base_s=0.001, backoff_cap_s=0.002, sweep_batch=40)


@dataclass(frozen=True)
class Carried:
    """One message as the broker holds it."""

    msg_id: str
    topic: str
    payload: bytes
    headers: dict[str, str]


@dataclass
class Target:
    """A broker namespace of the test's own: where to publish, how to read it back, and
    rows this broker cannot take (why -> plant columns, a piece of the expected error)."""

    url: str
    prefix: str  # every healthy topic starts with it
    read: Callable[[], list[Carried]]
    poisons: dict[str, tuple[dict[str, Any], str]] = field(default_factory=dict)


def nats_target(server: NatsServer, tag: str) -> Target:
    stream, prefix = f"P_{tag}", f"p{tag}"

    def read() -> list[Carried]:  # fails if the stream was deleted
        stored = asyncio.run(read_stream(server.url, stream))
        return [
            Carried(m.msg_id or "", m.subject, m.data, without(m.headers, DEDUP_HEADER))
            for m in stored
        ]

    return Target(
        f"{server.url}?stream={stream}&subjects={prefix}.>",
        prefix,
        read,
        {
            "oversize for the server's max_payload": (
                dict(topic=f"{prefix}.big", payload=b"x" * (1024 * 1024)),
                "MaxPayloadError",
            ),
            "a subject no stream captures": (
                dict(topic=f"elsewhere{tag}.x"),
                "no JetStream stream captures subject",
            ),
            "the server's API": (dict(topic=f"$JS.API.STREAM.DELETE.{stream}"), ""),
        },
    )


def rabbit_target(tag: str) -> Iterator[Target]:
    prefix, queue = f"p{tag}", f"poison-{tag}"

    async def declare() -> None:
        connection = await aio_pika.connect(RABBIT_URL)
        channel = await connection.channel()
        q = await channel.declare_queue(queue, arguments={"x-expires": 120_000})
        await q.bind("amq.topic", routing_key=f"{prefix}.#")
        await connection.close()

    async def drain() -> list[Carried]:
        connection = await aio_pika.connect(RABBIT_URL)
        channel = await connection.channel()
        q = await channel.get_queue(queue)
        found: list[Carried] = []
        while (m := await q.get(fail=False, no_ack=True)) is not None:
            headers = {k: str(v) for k, v in (m.headers or {}).items()}
            found.append(Carried(m.message_id or "", m.routing_key or "", m.body, headers))
        await connection.close()
        return found

    async def delete() -> None:
        connection = await aio_pika.connect(RABBIT_URL)
        channel = await connection.channel()
        await channel.queue_delete(queue)
        await connection.close()

    asyncio.run(declare())
    seen: list[Carried] = []

    def read() -> list[Carried]:  # a queue hands each message out once: keep what was read
        seen.extend(asyncio.run(drain()))
        return list(seen)

    yield Target(
        RABBIT_URL,
        prefix,
        read,
        {
            "a routing key over 255 bytes": (
                dict(topic=f"{prefix}.{'é' * 130}"),
                "routing key is 272 bytes",
            ),
            "a topic no queue binds": (dict(topic=f"unbound{tag}.x"), "unroutable"),
        },
    )
    asyncio.run(delete())


def redis_target(tag: str) -> Iterator[Target]:
    key_prefix, prefix = f"t{tag}:", f"p{tag}"
    client = redis.Redis.from_url(REDIS_URL)
    client.set(f"{key_prefix}{prefix}.wrong", "not a stream")  # XADD to it: WRONGTYPE

    def read() -> list[Carried]:
        found: list[Carried] = []
        for key in client.scan_iter(match=f"{key_prefix}*"):
            if client.type(key) != b"stream":
                continue
            topic = key.decode().removeprefix(key_prefix)
            for _, f in client.xrange(key):
                headers = json_object(f[b"headers"])
                found.append(Carried(f[b"msg_id"].decode(), topic, f[b"payload"], headers))
        return found

    yield Target(
        f"{REDIS_URL}?prefix={key_prefix}",
        prefix,
        read,
        {"a key of the wrong type": (dict(topic=f"{prefix}.wrong"), "WRONGTYPE")},
    )
    keys = list(client.scan_iter(match=f"{key_prefix}*"))
    if keys:
        client.delete(*keys)
    client.close()


def json_object(raw: bytes) -> dict[str, str]:
    import json

    value = json.loads(raw)
    assert isinstance(value, dict)
    return value


def without(headers: dict[str, str], name: str) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k != name}


@pytest.fixture(params=["nats", "rabbitmq", "redis"])
def target(request: pytest.FixtureRequest) -> Iterator[Target]:
    tag = uuid.uuid4().hex[:10]
    if request.param == "nats":
        with NatsServer() as server:
            yield nats_target(server, tag)
    elif request.param == "rabbitmq":
        yield from rabbit_target(tag)
    else:
        yield from redis_target(tag)


@pytest.fixture
def engine(pg_url: str) -> Iterator[Engine]:
    migrate.upgrade(pg_url)
    eng = create_engine(pg_url)
    yield eng
    eng.dispose()


# Rows that break the send() contract, whatever the broker.
COMMON_POISONS: dict[str, tuple[dict[str, Any], str]] = {
    "headers stored as a JSON list": (dict(headers=[["h", "v"]]), "invalid row: headers"),
    "a lone surrogate in a header value": (dict(headers={"h": "\ud800"}), ""),
}


def plant_all(engine: Engine, target: Target) -> tuple[dict[str, Carried], dict[str, str]]:
    """40 healthy rows with the poison rows among them; (healthy by msg_id, poison by why)."""
    healthy: dict[str, Carried] = {}

    def plant_healthy(n: int) -> None:
        for i in range(n):
            topic, payload = f"{target.prefix}.ok{i % 3}", f'{{"n":{i}}}'.encode()
            headers = {"trace": f"t{i}", "content-type": "application/json"}
            msg_id = plant(engine, topic, payload, key=f"k{i}", tags="a,b", headers=headers)
            carried = {**headers, KEY_HEADER: f"k{i}", TAGS_HEADER: "a,b"}
            healthy[msg_id] = Carried(msg_id, topic, payload, carried)

    plant_healthy(20)
    poisons: dict[str, str] = {}
    for why, (columns, _) in {**COMMON_POISONS, **target.poisons}.items():
        columns = {"topic": f"{target.prefix}.poison", **columns}
        payload = columns.pop("payload", b"{}")
        poisons[why] = plant(engine, columns.pop("topic"), payload, **columns)
    plant_healthy(20)
    return healthy, poisons


def sweep_in_process(target: Target, engine: Engine) -> None:
    relay = BrokerLoop(broker_for(target.url))
    relay.start()
    try:
        assert relay.wait_connected(10), "broker not reachable"
        sweeper = Sweeper(engine, relay, QUICK)
        for _ in range(QUICK.max_attempts):
            result = sweeper.sweep(min_age_s=0, due_only=False)
            assert not result.aborted, "a poison row was taken for a broker outage"
    finally:
        relay.stop()


def drain_by_cli(target: Target, engine: Engine) -> None:
    db = engine.url.render_as_string(hide_password=False)
    done = subprocess.run(
        [OUTBOX, "drain", "--db", db, "--broker", target.url],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 1, (done.stdout, done.stderr)  # poison rows are left: not clean
    assert "sent=40 " in done.stdout and "unreachable" not in done.stdout, done.stdout
    assert "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("sweep", [sweep_in_process, drain_by_cli], ids=["sweeper", "drain"])
def test_poison_rows_fail_alone_and_healthy_ones_arrive_once(
    target: Target, engine: Engine, sweep: Callable[[Target, Engine], None]
) -> None:
    healthy, poisons = plant_all(engine, target)
    sweep(target, engine)
    carried = target.read()
    copies = Counter(c.msg_id for c in carried)
    assert copies == Counter(list(healthy)), "each healthy message exactly once, no poison"
    for c in carried:
        assert c == healthy[c.msg_id], "carried as stored"
    assert {row_of(engine, m).status for m in healthy} == {SENT}
    expected = {**COMMON_POISONS, **target.poisons}
    for why, msg_id in poisons.items():
        row = row_of(engine, msg_id)
        if sweep is sweep_in_process:
            assert (row.status, row.attempts) == (DEAD, QUICK.max_attempts), why
        else:
            assert row.status == PENDING and row.attempts >= 1, why
        assert row.last_error and expected[why][1] in row.last_error, (why, row.last_error)
