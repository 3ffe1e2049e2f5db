"""The inbox's runner on NATS JetStream (relay.consume), with PostgreSQL: effectively once
under each fault. Copies at the broker are acked unhandled; a failing handler is retried
with its backoff and a poison message becomes a dead letter while its neighbours go on;
two processes of one consumer share the messages; a consumer SIGKILLed inside a
handler's transaction leaves that message to the next one, which handles it once;
SIGTERM lets the handler in hand finish and exits 0.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from sqlalchemy import Engine, select

from outbox.inbox import Inbox, InboxMessage
from outbox.message import uuid7
from outbox.table import DEAD, inbox_message
from relay.consume.nats import NatsSubscription
from relay.consume.runner import Consumer
from relay.testing.embedded import NatsServer, free_port
from tests import consume_app
from tests.consuming import DEADLINE_S, invoices, run_until, scrape, start_consume, total, wait_for
from tests.helpers import migrated

Sent = list[tuple[str, dict[str, Any]]]
ROOT = Path(__file__).resolve().parents[2]
OUTBOX = str(Path(sys.executable).with_name("outbox"))


@pytest.fixture
def db(pg_url: str) -> Iterator[Engine]:
    with migrated(pg_url) as engine:
        consume_app.business.create_all(engine)
        yield engine


@pytest.fixture
def topic(nats_server: NatsServer) -> str:
    """A stream of this test's own capturing ``bill.>``, deduplicating for 0.2 s only (so
    that a copy can be stored again soon): the topic prefix ``bill``."""

    async def create() -> None:
        nc = await nats.connect(nats_server.url)
        js = nc.jetstream()
        await js.add_stream(
            name=f"B_{uuid.uuid4().hex[:8]}", subjects=["bill.>"], duplicate_window=0.2
        )
        await nc.close()

    asyncio.run(create())
    return "bill.created"


async def publish(
    url: str, messages: list[tuple[str, dict[str, object]]], again: bool = False
) -> None:
    """Publish (msg_id, body) as the relay does; ``again``: until the stream stores each
    as a new copy (past its duplicate window)."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    deadline = time.monotonic() + DEADLINE_S
    for msg_id, body in messages:
        while True:
            ack = await js.publish(
                "bill.created", json.dumps(body).encode(), headers={"Nats-Msg-Id": msg_id}
            )
            if not (again and ack.duplicate) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
    await nc.close()


def orders(n: int, **extra: object) -> Sent:
    return [(str(uuid7()), {"amount": i, **extra}) for i in range(n)]


async def consume_until(
    inbox: Inbox, url: str, done: Callable[[list[Consumer]], bool], processes: int = 1
) -> list[Consumer]:
    """Run ``processes`` consumers of ``inbox`` (each its own subscription) until
    ``done(consumers)`` or the deadline."""
    consumers = [Consumer(inbox, NatsSubscription(url, inbox.consumer, inbox.patterns), batch=4)
                 for _ in range(processes)]  # fmt: skip
    return await run_until(consumers, done)


def test_copies_at_the_broker_are_acked_without_running_the_handler(
    db: Engine, nats_server: NatsServer, topic: str
) -> None:
    sent = orders(20)
    asyncio.run(publish(nats_server.url, sent))
    asyncio.run(publish(nats_server.url, sent[:5], again=True))  # the relay sent these twice
    inbox = consume_app.build(db)
    seen = asyncio.run(
        consume_until(
            inbox, nats_server.url, lambda c: total(c, "handled") + total(c, "duplicate") >= 25
        )
    )
    assert (total(seen, "handled"), total(seen, "duplicate")) == (20, 5)
    assert invoices(db) == {m: 1 for m, _ in sent}


def test_a_failing_handler_is_retried_and_a_poison_message_is_dead_while_others_go_on(
    db: Engine, nats_server: NatsServer, topic: str
) -> None:
    inbox = Inbox(db, "billing", max_attempts=3, backoff_s=(0.05,))
    tries: dict[str, int] = {}

    @inbox.handler("bill.*")
    def flaky(session: object, message: InboxMessage) -> None:
        body = message.json()
        tries[body["name"]] = tries.get(body["name"], 0) + 1
        if body["name"] == "poison" or (body["name"] == "flaky" and tries["flaky"] < 3):
            raise RuntimeError(f"{body['name']} failed")

    names = ["a", "flaky", "poison", "b"]
    sent: Sent = [(str(uuid7()), {"name": n}) for n in names]
    asyncio.run(publish(nats_server.url, sent))
    seen = asyncio.run(
        consume_until(inbox, nats_server.url, lambda c: total(c, "handled") + total(c, "dead") >= 4)
    )
    assert (total(seen, "handled"), total(seen, "dead"), total(seen, "retry")) == (3, 1, 4)
    assert tries == {"a": 1, "flaky": 3, "poison": 3, "b": 1}
    with db.connect() as conn:
        dead = conn.execute(select(inbox_message).where(inbox_message.c.status == DEAD)).one()
    assert (str(dead.msg_id), dead.attempts, dead.last_error) == (
        sent[2][0],
        3,
        "RuntimeError: poison failed",
    )


def test_two_processes_of_one_consumer_share_the_messages(
    db: Engine, nats_server: NatsServer, topic: str
) -> None:
    sent = orders(40)
    asyncio.run(publish(nats_server.url, sent))
    inbox = consume_app.build(db)
    seen = asyncio.run(
        consume_until(inbox, nats_server.url, lambda c: total(c, "handled") >= 40, processes=2)
    )
    assert total(seen, "handled") == 40 and total(seen, "duplicate") == 0
    assert all(c.counts["handled"] > 0 for c in seen), [c.counts for c in seen]
    assert invoices(db) == {m: 1 for m, _ in sent}


def test_a_consumer_killed_inside_a_handler_leaves_the_message_to_the_next_which_handles_it_once(
    db: Engine, nats_server: NatsServer, topic: str, tmp_path: Path
) -> None:
    held: tuple[str, dict[str, Any]] = (str(uuid7()), {"amount": 1, "hold": True})
    sent = [*orders(3), held, *orders(3)]
    asyncio.run(publish(nats_server.url, sent))
    first = start_consume(db, f"{nats_server.url}?ack_wait=1", tmp_path)
    try:
        wait_for(lambda: (tmp_path / "inside").exists() or first.poll() is not None, "the handler")
        assert first.poll() is None, first.communicate()
    finally:
        first.send_signal(signal.SIGKILL)  # inside the held handler's transaction
        first.wait(DEADLINE_S)
    (tmp_path / "release").touch()
    port = free_port()
    second = start_consume(
        db, f"{nats_server.url}?ack_wait=1", tmp_path, "--metrics-port", str(port)
    )
    try:
        wait_for(
            lambda: len(invoices(db)) == len(sent) or second.poll() is not None, "every invoice"
        )
        # Its metrics: what it handled, and nothing left at the broker once it acked all.
        wait_for(lambda: 'outbox_consumer_lag_messages{consumer="billing"} 0.0' in scrape(port),
                 "no lag in its metrics")  # fmt: skip
        handled = 'outbox_consumer_messages_total{consumer="billing",outcome="handled"}'
        assert handled in scrape(port)
    finally:
        second.send_signal(signal.SIGTERM)
        out, err = second.communicate(timeout=DEADLINE_S)
    assert second.returncode == 0, err
    assert invoices(db) == {m: 1 for m, _ in sent}  # the held one too, once
    assert out.startswith("consumer billing: handled ")


def test_a_message_the_outbox_did_not_send_is_rejected(
    db: Engine, nats_server: NatsServer, topic: str
) -> None:
    async def stranger() -> None:
        nc = await nats.connect(nats_server.url)
        await nc.jetstream().publish("bill.created", b"{}")  # no Nats-Msg-Id
        await nc.close()

    asyncio.run(stranger())
    asyncio.run(publish(nats_server.url, orders(1)))
    seen = asyncio.run(
        consume_until(consume_app.build(db), nats_server.url, lambda c: total(c, "handled") >= 1)
    )
    assert (total(seen, "rejected"), total(seen, "handled")) == (1, 1)


def test_an_app_embeds_the_runner_with_run_async(
    db: Engine, nats_server: NatsServer, topic: str
) -> None:
    sent = orders(3)
    asyncio.run(publish(nats_server.url, sent))
    inbox = consume_app.build(db)

    async def embedded() -> dict[str, int]:
        stopping = asyncio.Event()
        task = asyncio.create_task(inbox.run_async(nats_server.url, stopping))
        deadline = time.monotonic() + DEADLINE_S
        while len(invoices(db)) < len(sent) and not task.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        stopping.set()
        return await task

    assert asyncio.run(embedded()) == {"handled": 3}
    assert invoices(db) == {m: 1 for m, _ in sent}
