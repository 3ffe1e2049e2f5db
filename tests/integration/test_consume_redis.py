"""The inbox's runner on Redis Streams (relay.consume.redis), with PostgreSQL: effectively
once under each fault. Copies in the stream are acked unhandled; a failing handler is
retried with its backoff and a poison message becomes a dead letter while its
neighbours go on; two processes of one consumer share the entries; an entry a consumer
SIGKILLed inside a handler's transaction left pending is claimed by the next one
(XAUTOCLAIM after ``ack_wait``), which handles it once; a stranger's entry is rejected.

Each test has keys of its own (``?prefix=``), deleted afterwards; messages are written
by the relay's own adapter (relay.brokers.redis).
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from sqlalchemy import Engine, select

from outbox.inbox import Inbox, InboxMessage
from outbox.message import Message, build_message
from outbox.table import DEAD, inbox_message
from relay.brokers.redis import RedisBroker
from relay.consume import redis as redis_consume
from relay.consume.redis import RedisSubscription
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
SERVER = "redis://127.0.0.1:6379/0"


@pytest.fixture
def db(pg_url: str) -> Iterator[Engine]:
    with migrated(pg_url) as engine:
        consume_app.business.create_all(engine)
        yield engine


@pytest.fixture
def url() -> Iterator[str]:
    """The broker URL with keys of this test's own (``?prefix=``), deleted afterwards."""
    prefix = f"consume-{uuid.uuid4().hex[:8]}:"
    yield f"{SERVER}?prefix={prefix}"
    client = redis.Redis.from_url(SERVER)
    if keys := list(client.scan_iter(match=f"{prefix}*")):
        client.delete(*keys)
    client.close()


def publish(url: str, messages: list[Message]) -> None:
    publish_through(RedisBroker(url), messages)


async def consume_until(
    inbox: Inbox, url: str, done: Callable[[list[Consumer]], bool], processes: int = 1
) -> list[Consumer]:
    """Run ``processes`` consumers of ``inbox``, each a group consumer of its own name,
    until ``done(consumers)`` or the deadline."""
    consumers = []
    for i in range(processes):
        subscription = RedisSubscription(url, inbox.consumer, inbox.patterns)
        subscription.name += f"-{i}"  # as if each were a process of its own
        consumers.append(Consumer(inbox, subscription, batch=4))
    return await run_until(consumers, done)


def test_copies_in_the_stream_are_acked_without_running_the_handler(db: Engine, url: str) -> None:
    sent = orders(20)
    publish(url, sent)
    publish(url, sent[:5])  # the relay sent these twice: Redis keeps both
    inbox = consume_app.build(db)
    seen = asyncio.run(
        consume_until(inbox, url, lambda c: total(c, "handled") + total(c, "duplicate") >= 25)
    )
    assert (total(seen, "handled"), total(seen, "duplicate")) == (20, 5)
    assert invoices(db) == {m.msg_id: 1 for m in sent}


def test_a_failing_handler_is_retried_and_a_poison_message_is_dead_while_others_go_on(
    db: Engine, url: str
) -> None:
    inbox = Inbox(db, "billing", max_attempts=3, backoff_s=(0.05,))
    tries: dict[str, int] = {}

    @inbox.handler("bill.*")
    def flaky(session: object, message: InboxMessage) -> None:
        body = message.json()
        tries[body["name"]] = tries.get(body["name"], 0) + 1
        if body["name"] == "poison" or (body["name"] == "flaky" and tries["flaky"] < 3):
            raise RuntimeError(f"{body['name']} failed")

    sent = [build_message("bill.created", {"name": n}, max_payload_bytes=1000)
            for n in ["a", "flaky", "poison", "b"]]  # fmt: skip
    publish(url, sent)
    seen = asyncio.run(
        consume_until(inbox, url, lambda c: total(c, "handled") + total(c, "dead") >= 4)
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
    client = redis.Redis.from_url(url.partition("?")[0])
    prefix = url.partition("prefix=")[2]
    assert client.xpending(f"{prefix}bill.created", "billing")["pending"] == 0  # all acked
    client.close()


def test_a_retry_waits_its_delay_while_the_messages_after_it_are_handled(
    db: Engine, url: str
) -> None:
    inbox = Inbox(db, "billing", backoff_s=(1.0,))
    tries: list[tuple[str, float]] = []

    @inbox.handler("bill.*")
    def once_failing(session: object, message: InboxMessage) -> None:
        name = message.json()["name"]
        tries.append((name, time.monotonic()))
        if name == "flaky" and len([n for n, _ in tries if n == "flaky"]) == 1:
            raise RuntimeError("flaky failed")

    sent = [build_message("bill.created", {"name": n}, max_payload_bytes=1000)
            for n in ["flaky", "a", "b", "c"]]  # fmt: skip
    publish(url, sent)
    seen = asyncio.run(consume_until(inbox, url, lambda c: total(c, "handled") >= 4))
    assert total(seen, "handled") == 4 and total(seen, "retry") == 1
    assert [n for n, _ in tries] == ["flaky", "a", "b", "c", "flaky"]
    assert tries[-1][1] - tries[0][1] >= 1.0  # the backoff's delay, not at once


def test_two_processes_of_one_consumer_share_the_entries(db: Engine, url: str) -> None:
    sent = orders(40)
    publish(url, sent)
    inbox = consume_app.build(db)
    seen = asyncio.run(consume_until(inbox, url, lambda c: total(c, "handled") >= 40, processes=2))
    assert total(seen, "handled") == 40 and total(seen, "duplicate") == 0
    assert all(c.counts["handled"] > 0 for c in seen), [c.counts for c in seen]
    assert invoices(db) == {m.msg_id: 1 for m in sent}


def test_a_consumer_killed_inside_a_handler_leaves_the_entry_to_the_next_which_handles_it_once(
    db: Engine, url: str, tmp_path: Path
) -> None:
    held = build_message("bill.created", {"amount": 1, "hold": True}, max_payload_bytes=1000)
    sent = [*orders(3), held, *orders(3)]
    publish(url, sent)
    first = start_consume(db, f"{url}&ack_wait=1", tmp_path)
    try:
        wait_for(lambda: (tmp_path / "inside").exists() or first.poll() is not None, "the handler")
        assert first.poll() is None, first.communicate()
    finally:
        first.send_signal(signal.SIGKILL)  # inside the held handler's transaction
        first.wait(DEADLINE_S)
    (tmp_path / "release").touch()
    second = start_consume(db, f"{url}&ack_wait=1", tmp_path)
    try:
        wait_for(
            lambda: len(invoices(db)) == len(sent) or second.poll() is not None, "every invoice"
        )
    finally:
        second.send_signal(signal.SIGTERM)
        out, err = second.communicate(timeout=DEADLINE_S)
    assert second.returncode == 0, err
    assert invoices(db) == {m.msg_id: 1 for m in sent}  # the held one too, once
    assert out.startswith("consumer billing: handled ")


def test_streams_of_topics_that_appear_later_are_joined_and_others_left_alone(
    db: Engine, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(redis_consume, "RESCAN_S", 0.1)
    inbox = consume_app.build(db)
    later = [build_message(t, {"amount": 1}, max_payload_bytes=1000)
             for t in ("bill.created", "bill.paid", "bill.paid.late", "billing.x")]  # fmt: skip

    async def main() -> list[Consumer]:
        consuming = asyncio.create_task(
            consume_until(inbox, url, lambda c: total(c, "handled") >= 2)
        )
        await asyncio.sleep(0.3)  # open, with no stream yet
        await asyncio.to_thread(publish, url, later)
        return await consuming

    seen = asyncio.run(main())
    assert total(seen, "handled") == 2
    assert invoices(db) == {m.msg_id: 1 for m in later[:2]}
    client = redis.Redis.from_url(SERVER)
    prefix = url.partition("prefix=")[2]
    joined = [bool(client.xinfo_groups(prefix + m.topic)) for m in later]
    client.close()
    assert joined == [True, True, False, False]  # bill.* only


def test_an_entry_the_relay_did_not_write_is_rejected(db: Engine, url: str) -> None:
    client = redis.Redis.from_url(url.partition("?")[0])
    client.xadd(f"{url.partition('prefix=')[2]}bill.created", {"body": "{}"})  # no msg_id
    client.close()
    publish(url, orders(1))
    seen = asyncio.run(
        consume_until(consume_app.build(db), url, lambda c: total(c, "handled") >= 1)
    )
    assert (total(seen, "rejected"), total(seen, "handled")) == (1, 1)


def test_the_lag_is_what_the_group_has_not_settled(url: str) -> None:
    publish(url, orders(6))

    async def lag() -> tuple[int | None, int | None]:
        subscription = RedisSubscription(url, "billing", ["bill.*"])
        await subscription.open()
        try:
            before = await subscription.lag()
            taken = await subscription.fetch(2, 1.0)
            for delivery in taken:
                await delivery.ack()
            return before, await subscription.lag()
        finally:
            await subscription.close()

    assert asyncio.run(lag()) == (6, 4)
