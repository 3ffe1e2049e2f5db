"""`outbox export broker` for Redis Streams and RabbitMQ, against real servers: one
export path (relay.export.export_broker) over each adapter's LogReader. Redis keys come
from the one broker harness (relay.testing.harness); RabbitMQ uses the relay's own
``?audit=`` stream queue, which is what this export is for.

Each export is read back from Parquet and compared row by row with what the relay's
adapter published: a row too many or too few is what a bug looks like (a page boundary
read twice or skipped, a window bound off by one, a marker left in the output).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aio_pika
import pyarrow.parquet as pq
import pytest

from outbox.broker import Broker, PublishResult
from outbox.errors import OutboxError
from outbox.message import Message, build_message
from relay import export
from relay.brokers import base, reader_for
from relay.brokers.rabbitmq import RabbitBroker
from relay.brokers.redis import ms_at_or_after
from relay.cli import main
from relay.testing.harness import BrokerUnderTest, broker_under_test

RABBIT_URL = "amqp://guest:guest@127.0.0.1:5672/"


def messages(topic: str, n: int) -> list[Message]:
    return [build_message(topic, {"n": i}, key=f"k{i}", max_payload_bytes=1000) for i in range(n)]


def publish(broker: Broker, *batches: Sequence[Message]) -> list[PublishResult]:
    async def main() -> list[PublishResult]:
        await broker.connect()
        try:
            return [r for batch in batches for r in await broker.publish(batch)]
        finally:
            await broker.close()

    results = asyncio.run(main())
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    return results


def rows(path: Path) -> list[dict[str, Any]]:
    return list(pq.read_table(path).to_pylist())


def next_second() -> None:
    """Sleep into the next whole second (AMQP timestamps have one-second resolution)."""
    time.sleep(1.05 - time.time() % 1)


# Redis Streams


@pytest.fixture
def redis_keys() -> Iterator[BrokerUnderTest]:
    """The machine's Redis, with keys of this test's own (the URL's ?prefix=)."""
    with broker_under_test("redis") as under_test:
        yield under_test


def test_redis_export_pages_through_every_entry(
    redis_keys: BrokerUnderTest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(base, "LOG_CHUNK", 50)  # 61 entries in one stream: two pages and one
    orders, refunds = messages("orders", 60), messages("refunds", 60)
    started = datetime.now(UTC).replace(microsecond=0)
    results = publish(redis_keys.make(), orders, refunds, orders[:1])  # orders[0] twice
    finished = datetime.now(UTC)
    receipts = [r.receipt for r in results]

    out = tmp_path / "broker.parquet"
    assert export.export_broker(redis_keys.reader, ["orders", "refunds"], out) == 121

    got = rows(out)
    expected = [
        *(("orders", m.msg_id, seq) for m, seq in zip(orders, receipts[:60], strict=True)),
        ("orders", orders[0].msg_id, receipts[120]),
        *(("refunds", m.msg_id, seq) for m, seq in zip(refunds, receipts[60:120], strict=True)),
    ]
    assert [(r["topic"], r["msg_id"], r["seq"]) for r in got] == expected
    assert Counter(r["msg_id"] for r in got)[orders[0].msg_id] == 2
    for r in got:
        assert started <= r["broker_ts"] <= finished
        assert r["broker_ts"] == datetime.fromtimestamp(int(r["seq"].split("-")[0]) / 1000, UTC)


def test_redis_export_keeps_to_the_window(redis_keys: BrokerUnderTest, tmp_path: Path) -> None:
    first, second = messages("orders", 5), messages("orders", 5)
    publish(redis_keys.make(), first)
    time.sleep(0.01)  # entry ids count milliseconds: keep the batches apart
    mark = datetime.now(UTC)
    time.sleep(0.01)
    publish(redis_keys.make(), second)

    after, before = tmp_path / "after.parquet", tmp_path / "before.parquet"
    export.export_broker(redis_keys.reader, ["orders"], after, since=mark)
    export.export_broker(redis_keys.reader, ["orders"], before, until=mark)
    assert [r["msg_id"] for r in rows(after)] == [m.msg_id for m in second]
    assert [r["msg_id"] for r in rows(before)] == [m.msg_id for m in first]


# RabbitMQ (the machine's server) with an audit stream queue


@pytest.fixture
def rabbit_audit() -> Iterator[tuple[str, str]]:
    """A broker URL with an exchange and an audit queue of this test's own, deleted after."""
    tag = uuid.uuid4().hex[:10]
    exchange, audit = f"export-{tag}", f"export-audit-{tag}"
    yield f"{RABBIT_URL}?exchange={exchange}&audit={audit}", audit

    async def delete() -> None:
        connection = await aio_pika.connect(RABBIT_URL)
        channel = await connection.channel()
        await channel.queue_delete(audit)
        await channel.exchange_delete(exchange)
        await connection.close()

    asyncio.run(delete())


def test_rabbitmq_export_reads_the_audit_stream(
    rabbit_audit: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(base, "LOG_CHUNK", 7)  # several Parquet batches
    url, audit = rabbit_audit
    orders, refunds = messages("orders", 20), messages("refunds", 10)
    started = datetime.now(UTC).replace(microsecond=0)
    publish(RabbitBroker(url), orders, refunds, orders[:1])  # orders[0] twice
    finished = datetime.now(UTC)

    out = tmp_path / "broker.parquet"
    assert export.export_broker(reader_for(url), [audit], out) == 31
    got = rows(out)
    expected = Counter(
        [("orders", m.msg_id) for m in orders]
        + [("refunds", m.msg_id) for m in refunds]
        + [("orders", orders[0].msg_id)]
    )
    assert Counter((r["topic"], r["msg_id"]) for r in got) == expected
    assert sorted(int(r["seq"]) for r in got) == list(range(31)), "stream offsets, each once"
    assert all(started <= r["broker_ts"] <= finished for r in got)

    again = tmp_path / "again.parquet"  # the first export's end marker is not a row
    assert export.export_broker(reader_for(url), [audit], again) == 31
    assert rows(again) == got


def test_rabbitmq_export_keeps_to_the_window(rabbit_audit: tuple[str, str], tmp_path: Path) -> None:
    url, audit = rabbit_audit
    first, second = messages("orders", 5), messages("orders", 5)
    publish(RabbitBroker(url), first)
    next_second()
    mark = datetime.now(UTC)
    publish(RabbitBroker(url), second)

    out = tmp_path / "broker.parquet"
    export.export_broker(reader_for(url), [audit], out, since=mark)
    assert sorted(r["msg_id"] for r in rows(out)) == sorted(m.msg_id for m in second)
    later = mark + timedelta(hours=1)  # the consumer attaches at the end and still stops
    assert (
        export.export_broker(reader_for(url), [audit], tmp_path / "none.parquet", since=later) == 0
    )


def test_rabbitmq_export_names_the_missing_audit_queue(tmp_path: Path) -> None:
    missing = f"export-missing-{uuid.uuid4().hex[:10]}"
    with pytest.raises(OutboxError, match=r"\?audit="):
        export.export_broker(reader_for(RABBIT_URL), [missing], tmp_path / "x.parquet")


# The command line: a missing flag is one line naming it


@pytest.mark.parametrize(("broker", "flag"), [(RABBIT_URL, "--queue")])  # others: every stream
def test_cli_broker_export_names_the_missing_flag(
    broker: str, flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "broker.parquet"
    code = main(["export", "broker", "--broker", broker, "--out", str(out)])
    err = capsys.readouterr().err
    assert code != 0
    assert len(err.strip().splitlines()) == 1 and flag in err, err
    assert not out.exists()


def test_window_bounds_in_whole_milliseconds() -> None:
    moment = datetime(2026, 1, 1, tzinfo=UTC)
    assert ms_at_or_after(moment) == int(moment.timestamp() * 1000)
    assert ms_at_or_after(moment + timedelta(microseconds=1)) == ms_at_or_after(moment) + 1
