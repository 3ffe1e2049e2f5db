"""The inbox's runner on RabbitMQ (relay.consume.rabbitmq), with PostgreSQL: effectively
once under each fault. Copies in the queue are acked unhandled; a failing handler is
retried with its backoff (the quorum queue's delivery count is the attempt) and a
poison message becomes a dead letter while its neighbours go on; two processes of one
consumer share the queue; the message of a consumer SIGKILLed inside a handler's
transaction goes back to the queue and the next one handles it once; a stranger's
message is rejected.

Each test has an exchange and a consumer (so a queue) of its own, deleted afterwards;
messages are published by the relay's own adapter (relay.brokers.rabbitmq).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import aio_pika
import pytest
from sqlalchemy import Engine, select

from outbox.inbox import Inbox, InboxMessage
from outbox.message import Message, build_message
from outbox.table import DEAD, inbox_message
from relay.brokers.rabbitmq import RabbitBroker
from relay.consume.rabbitmq import RabbitSubscription, relay_id, routing_key
from relay.consume.runner import Consumer
from tests import consume_app
from tests.consuming import (
    DEADLINE_S,
    invoices,
    orders,
    publish_through,
    run_until,
    start_consume,
    total,
    wait_for,
)
from tests.helpers import migrated

ROOT = Path(__file__).resolve().parents[2]
OUTBOX = str(Path(sys.executable).with_name("outbox"))
SERVER = "amqp://guest:guest@127.0.0.1:5672/"


class Rabbit(NamedTuple):
    url: str  # with the test's own exchange
    consumer: str  # the queue's name too


@pytest.fixture
def db(pg_url: str) -> Iterator[Engine]:
    with migrated(pg_url) as engine:
        consume_app.business.create_all(engine)
        yield engine


@pytest.fixture
def rabbit() -> Iterator[Rabbit]:
    """An exchange and a consumer of this test's own, its queue declared and bound (the
    relay's publish is refused as unroutable before); both deleted afterwards."""
    tag = uuid.uuid4().hex[:8]
    exchange, consumer = f"consume-{tag}", f"billing_{tag}"
    found = Rabbit(f"{SERVER}?exchange={exchange}", consumer)

    async def declare() -> None:
        subscription = RabbitSubscription(found.url, consumer, ["bill.*"])
        await subscription.open()
        await subscription.close()

    async def delete() -> None:
        connection = await aio_pika.connect(SERVER)
        channel = await connection.channel()
        await channel.queue_delete(consumer)
        await channel.exchange_delete(exchange)
        await connection.close()

    asyncio.run(declare())
    yield found
    asyncio.run(delete())


def inbox() -> Inbox:
    """For --app: the test's consumer (CONSUME_TEST_CONSUMER) on CONSUME_TEST_DB."""
    return consume_app.build(os.environ["CONSUME_TEST_DB"], os.environ["CONSUME_TEST_CONSUMER"])


def publish(url: str, messages: list[Message]) -> None:
    publish_through(RabbitBroker(url), messages)


async def consume_until(
    inbox: Inbox, url: str, done: Callable[[list[Consumer]], bool], processes: int = 1
) -> list[Consumer]:
    """Run ``processes`` consumers of ``inbox`` (each its own connection) until
    ``done(consumers)`` or the deadline."""
    consumers = [Consumer(inbox, RabbitSubscription(url, inbox.consumer, inbox.patterns), batch=4)
                 for _ in range(processes)]  # fmt: skip
    return await run_until(consumers, done)


def test_patterns_bind_as_amqp_routing_keys() -> None:
    assert [routing_key(p) for p in ("bill.*", "bill.>", ">", "a.b")] == [
        "bill.*",
        "bill.*.#",  # '>' takes one token or more, '#' zero or more
        "*.#",
        "a.b",
    ]


def test_only_a_message_id_in_the_relays_form_is_a_msg_id() -> None:
    msg_id = str(uuid.uuid4())
    assert relay_id(msg_id) == msg_id
    assert relay_id(uuid.UUID(msg_id).hex) is None  # what aiormq gives a message without one
    assert [relay_id(x) for x in (None, "", "order-1")] == [None, None, None]


def test_copies_in_the_queue_are_acked_without_running_the_handler(
    db: Engine, rabbit: Rabbit
) -> None:
    sent = orders(20)
    publish(rabbit.url, sent)
    publish(rabbit.url, sent[:5])  # the relay sent these twice: RabbitMQ keeps both
    inbox = consume_app.build(db, rabbit.consumer)
    seen = asyncio.run(
        consume_until(
            inbox, rabbit.url, lambda c: total(c, "handled") + total(c, "duplicate") >= 25
        )
    )
    assert (total(seen, "handled"), total(seen, "duplicate")) == (20, 5)
    assert invoices(db) == {m.msg_id: 1 for m in sent}


def test_a_failing_handler_is_retried_and_a_poison_message_is_dead_while_others_go_on(
    db: Engine, rabbit: Rabbit
) -> None:
    inbox = Inbox(db, rabbit.consumer, max_attempts=3, backoff_s=(0.05,))
    tries: dict[str, int] = {}

    @inbox.handler("bill.*")
    def flaky(session: object, message: InboxMessage) -> None:
        body = message.json()
        tries[body["name"]] = tries.get(body["name"], 0) + 1
        if body["name"] == "poison" or (body["name"] == "flaky" and tries["flaky"] < 3):
            raise RuntimeError(f"{body['name']} failed")

    sent = [build_message("bill.created", {"name": n}, max_payload_bytes=1000)
            for n in ["a", "flaky", "poison", "b"]]  # fmt: skip
    publish(rabbit.url, sent)
    seen = asyncio.run(
        consume_until(inbox, rabbit.url, lambda c: total(c, "handled") + total(c, "dead") >= 4)
    )
    assert (total(seen, "handled"), total(seen, "dead"), total(seen, "retry")) == (3, 1, 4)
    assert tries == {"a": 1, "flaky": 3, "poison": 3, "b": 1}
    with db.connect() as conn:
        dead = conn.execute(select(inbox_message).where(inbox_message.c.status == DEAD)).one()
    assert (str(dead.msg_id), dead.attempts, dead.last_error) == (
        sent[2].msg_id,
        3,
        "RuntimeError: poison failed",
    )


def test_a_retry_waits_its_delay_while_the_messages_after_it_are_handled(
    db: Engine, rabbit: Rabbit
) -> None:
    inbox = Inbox(db, rabbit.consumer, backoff_s=(1.0,))
    tries: list[tuple[str, float]] = []

    @inbox.handler("bill.*")
    def once_failing(session: object, message: InboxMessage) -> None:
        name = message.json()["name"]
        tries.append((name, time.monotonic()))
        if name == "flaky" and len([n for n, _ in tries if n == "flaky"]) == 1:
            raise RuntimeError("flaky failed")

    sent = [build_message("bill.created", {"name": n}, max_payload_bytes=1000)
            for n in ["flaky", "a", "b", "c"]]  # fmt: skip
    publish(rabbit.url, sent)
    seen = asyncio.run(consume_until(inbox, rabbit.url, lambda c: total(c, "handled") >= 4))
    assert total(seen, "handled") == 4 and total(seen, "retry") == 1
    assert [n for n, _ in tries] == ["flaky", "a", "b", "c", "flaky"]
    assert tries[-1][1] - tries[0][1] >= 1.0  # the backoff's delay, not at once


def test_two_processes_of_one_consumer_share_the_queue(db: Engine, rabbit: Rabbit) -> None:
    sent = orders(40)
    publish(rabbit.url, sent)
    inbox = consume_app.build(db, rabbit.consumer)
    seen = asyncio.run(
        consume_until(inbox, rabbit.url, lambda c: total(c, "handled") >= 40, processes=2)
    )
    assert total(seen, "handled") == 40 and total(seen, "duplicate") == 0
    assert all(c.counts["handled"] > 0 for c in seen), [c.counts for c in seen]
    assert invoices(db) == {m.msg_id: 1 for m in sent}


def test_a_consumer_killed_inside_a_handler_leaves_the_message_to_the_next_which_handles_it_once(
    db: Engine, rabbit: Rabbit, tmp_path: Path
) -> None:
    held = build_message("bill.created", {"amount": 1, "hold": True}, max_payload_bytes=1000)
    sent = [*orders(3), held, *orders(3)]
    publish(rabbit.url, sent)
    first = start_consume(
        db,
        rabbit.url,
        tmp_path,
        app=f"{__name__}:inbox",
        env={"CONSUME_TEST_CONSUMER": rabbit.consumer},
    )
    try:
        wait_for(lambda: (tmp_path / "inside").exists() or first.poll() is not None, "the handler")
        assert first.poll() is None, first.communicate()
    finally:
        first.send_signal(signal.SIGKILL)  # inside the held handler's transaction
        first.wait(DEADLINE_S)
    (tmp_path / "release").touch()
    second = start_consume(
        db,
        rabbit.url,
        tmp_path,
        app=f"{__name__}:inbox",
        env={"CONSUME_TEST_CONSUMER": rabbit.consumer},
    )
    try:
        wait_for(
            lambda: len(invoices(db)) == len(sent) or second.poll() is not None, "every invoice"
        )
    finally:
        second.send_signal(signal.SIGTERM)
        out, err = second.communicate(timeout=DEADLINE_S)
    assert second.returncode == 0, err
    assert invoices(db) == {m.msg_id: 1 for m in sent}  # the held one too, once
    assert out.startswith(f"consumer {rabbit.consumer}: handled ")


def test_a_message_the_outbox_did_not_send_is_rejected(db: Engine, rabbit: Rabbit) -> None:
    async def stranger() -> None:
        connection = await aio_pika.connect(SERVER)
        channel = await connection.channel()
        exchange = await channel.get_exchange(rabbit.url.partition("exchange=")[2])
        await exchange.publish(aio_pika.Message(b"{}"), routing_key="bill.created")  # no id
        await connection.close()

    asyncio.run(stranger())
    publish(rabbit.url, orders(1))
    seen = asyncio.run(
        consume_until(
            consume_app.build(db, rabbit.consumer), rabbit.url, lambda c: total(c, "handled") >= 1
        )
    )
    assert (total(seen, "rejected"), total(seen, "handled")) == (1, 1)


def test_the_lag_is_what_waits_in_the_queue(rabbit: Rabbit) -> None:
    publish(rabbit.url, orders(6))

    async def lag() -> int | None:
        subscription = RabbitSubscription(rabbit.url, rabbit.consumer, ["bill.*"])
        await subscription.open()
        try:
            return await subscription.lag()
        finally:
            await subscription.close()

    assert asyncio.run(lag()) == 6
