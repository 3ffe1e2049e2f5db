"""One contract for every broker adapter: NATS JetStream, Redis Streams, RabbitMQ,
in-memory, each set up by the one harness (relay.testing.harness) and read back through
its LogReader.

Each adapter must answer one result per message, in order, with a receipt; keep a
permanent failure to its own message; answer "retry" while the broker is down; and
publish again once it is back, without a new adapter.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

from outbox.broker import Broker, Outcome
from outbox.message import Message, build_message
from relay.testing.harness import BrokerUnderTest, broker_families, broker_under_test, kinds


def held(h: BrokerUnderTest, topic: str) -> list[dict[str, Any]]:
    """What the broker holds for ``topic``, read back through its LogReader."""
    return [
        {"msg_id": e.msg_id, "receipt": h.receipt_of(e), "headers": e.headers, "payload": e.payload}
        for e in h.read(topic)
    ]


@pytest.fixture(params=kinds())  # every registered broker (outbox.brokers_registry), memory
def harness(request: pytest.FixtureRequest) -> Iterator[BrokerUnderTest]:
    with broker_under_test(request.param) as h:
        yield h


@pytest.fixture(params=broker_families())
def restartable(request: pytest.FixtureRequest) -> Iterator[BrokerUnderTest]:
    with broker_under_test(request.param, restartable=True) as h:
        yield h


def run(broker: Broker, body: Callable[[Broker], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        await broker.connect()
        try:
            return await body(broker)
        finally:
            await broker.close()

    return asyncio.run(main())


def messages(topic: str, n: int) -> list[Message]:
    return [
        build_message(
            topic,
            {"n": i},
            key=f"k{i}",
            tags=["a", "b"],
            headers={"trace": f"t{i}"},
            max_payload_bytes=1000,
        )
        for i in range(n)
    ]


def test_results_in_order_with_receipts_and_everything_carried(harness: BrokerUnderTest) -> None:
    topic = f"{harness.prefix}.orders"
    batch = messages(topic, 50)
    broker = harness.make()
    results = run(broker, lambda b: b.publish(batch))
    assert [r.outcome for r in results] == [Outcome.OK] * 50
    assert all(r.receipt for r in results)
    if harness.unique_receipts:
        assert len({r.receipt for r in results}) == 50
    stored = held(harness, topic)
    assert [s["msg_id"] for s in stored] == [m.msg_id for m in batch], "stored in publish order"
    if harness.ordered_receipts:
        assert [s["receipt"] for s in stored] == [r.receipt for r in results]
    first = stored[0]
    assert first["payload"] == batch[0].payload
    assert first["headers"]["trace"] == "t0"
    assert first["headers"]["Outbox-Key"] == "k0" and first["headers"]["Outbox-Tags"] == "a,b"


def test_permanent_failure_stays_with_its_own_message(harness: BrokerUnderTest) -> None:
    good = messages(f"{harness.prefix}.orders", 4)
    bad = harness.poison(f"{harness.prefix}.poison")
    broker = harness.make()
    results = run(broker, lambda b: b.publish([good[0], good[1], bad, good[2], good[3]]))
    assert [r.outcome for r in results] == [Outcome.OK] * 2 + [Outcome.PERMANENT] + [Outcome.OK] * 2
    assert results[2].error
    assert [s["msg_id"] for s in held(harness, f"{harness.prefix}.orders")] == [
        m.msg_id for m in good
    ]


def test_second_copy_of_a_msg_id(harness: BrokerUnderTest) -> None:
    [message] = messages(f"{harness.prefix}.orders", 1)
    broker = harness.make()

    async def twice(b: Broker) -> list[Any]:
        return [*(await b.publish([message])), *(await b.publish([message]))]

    first, second = run(broker, twice)
    assert first.ok and second.ok
    stored = held(harness, f"{harness.prefix}.orders")
    if harness.dedup:
        assert second.duplicate and len(stored) == 1
    else:  # documented: consumers dedupe by msg_id
        assert len(stored) == 2 and stored[0]["msg_id"] == stored[1]["msg_id"]


def test_retry_while_down_and_publish_again_after_restart(restartable: BrokerUnderTest) -> None:
    h = restartable
    topic = f"{h.prefix}.orders"
    broker = h.make()

    async def scenario(b: Broker) -> dict[str, Any]:
        before = await b.publish(messages(topic, 3))
        await asyncio.to_thread(h.server.stop)
        down = await b.publish(messages(topic, 3))
        await asyncio.to_thread(h.server.start)
        deadline = time.monotonic() + 15
        after = await b.publish(messages(topic, 3))
        while not all(r.ok for r in after) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            after = await b.publish(messages(topic, 3))
        return {"before": before, "down": down, "after": after}

    out = run(broker, scenario)
    assert all(r.ok for r in out["before"])
    assert [r.outcome for r in out["down"]] == [Outcome.RETRY] * 3
    assert all(r.ok for r in out["after"]), [r.error for r in out["after"]]


def test_redis_driver_options_in_the_url_reach_the_driver() -> None:
    """``?password=`` is redis-py's option, not ours: the adapter keeps it in the URL it
    hands to redis-py (it used to drop the whole query, so the password never reached
    the server) and takes only its own options out."""
    import redis.asyncio as aioredis

    from relay.brokers.redis import RedisBroker

    broker = RedisBroker("redis://127.0.0.1:6379/0?password=pw-in-query&prefix=x:&maxlen=5")
    assert (broker.prefix, broker.maxlen) == ("x:", 5)
    options = aioredis.from_url(broker.url).connection_pool.connection_kwargs
    assert options["password"] == "pw-in-query"
    assert "prefix" not in options and "maxlen" not in options
