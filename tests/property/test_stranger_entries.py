"""Every broker's log reader takes whatever strangers stored beside the relay's messages.

Broker streams are writable by others. Each example writes a few entries the relay did
not write, straight through the broker's own client (any bytes or text, JSON of any
shape, huge values, wrong types for Outbox-Seq and msg_id, no msg_id at all), and a
message or two through the relay's adapter, into a topic of the example's own; then
reads them back through the broker's ``LogReader`` (relay.testing.harness: the real
NATS, RabbitMQ and Redis, and the memory broker) and checks: no exception, one entry
per entry stored, each well formed or malformed (never in between), the relay's own
well formed, and every entry a row of the broker export's Parquet.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import string
import uuid
from collections.abc import Awaitable, Callable, Iterator
from datetime import datetime
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from outbox.broker import Broker, LogEntry
from outbox.message import SEQ_HEADER, Message, build_message
from relay.brokers.base import RAW_MAX, problem
from relay.export import log_row
from relay.testing.embedded import NatsServer
from relay.testing.harness import BrokerUnderTest, broker_under_test
from relay.testing.memory import MemoryBroker
from spark_jobs.schema import BROKER
from tests.property import strategies as s

STRANGERS = settings(s.PROPERTY, max_examples=50)
HUGE = 200_000  # bytes of a huge value (Redis, memory); NATS and AMQP get less

# Outbox-Seq values: digits of any length, signs, spaces, Unicode digits, words.
seq_texts = st.one_of(
    st.integers(min_value=0, max_value=2**70).map(str),
    st.sampled_from(["", "-1", " 5", "5 ", "\u0661\u0662", "\u00b2", "1e3", "0x10", "NaN"]),
    st.text(max_size=6),
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
header_names = st.one_of(
    st.sampled_from([SEQ_HEADER, "Outbox-Key", "Outbox-Tags", "content-type"]),
    st.text(min_size=1, max_size=12),
)


class Rig:
    """One broker for the module, its adapter connected once, and a writer of strangers."""

    def __init__(self, under_test: BrokerUnderTest, runner: asyncio.Runner) -> None:
        self.under_test = under_test
        self.runner = runner
        self.adapter: Broker = under_test.make()
        self.client: Any = None

    @property
    def kind(self) -> str:
        return self.under_test.kind

    def run(self, work: Awaitable[Any]) -> Any:
        return self.runner.run(work)  # type: ignore[arg-type]

    def read(self, topic: str) -> list[LogEntry]:
        return list(self.run(self.under_test.read_async(topic)))


async def publish_own(rig: Rig, topic: str, count: int) -> set[str]:
    """``count`` messages through the relay's adapter, the last ordered (Outbox-Seq)."""
    messages = [
        build_message(topic, {"n": n}, key="k", max_payload_bytes=2**20) for n in range(count)
    ]
    if messages:
        messages[-1] = dataclasses.replace(messages[-1], ordered=True, seq=7)
    results = await rig.adapter.publish(messages)
    assert [r.error for r in results if not r.ok] == []
    return {m.msg_id for m in messages}


@pytest.fixture(scope="module")
def nats_server() -> Iterator[NatsServer]:
    with NatsServer() as server:
        yield server


@pytest.fixture(scope="module", params=["nats", "rabbitmq", "redis", "memory"])
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    server = request.getfixturevalue("nats_server") if request.param == "nats" else None
    with (
        broker_under_test(request.param, nats_server=server) as under_test,
        asyncio.Runner() as runner,
    ):
        rig = Rig(under_test, runner)
        rig.run(rig.adapter.connect())
        rig.client = rig.run(stranger_client(rig))
        try:
            yield rig
        finally:
            rig.run(close_client(rig))
            rig.run(rig.adapter.close())


async def stranger_client(rig: Rig) -> Any:
    """The broker's own client, as a stranger uses it."""
    if rig.kind == "redis":
        import redis.asyncio as aioredis

        return aioredis.from_url(rig.under_test.url.partition("?")[0])  # type: ignore[union-attr]
    if rig.kind == "nats":
        import nats

        return await nats.connect(rig.under_test.url.partition("?")[0])  # type: ignore[union-attr]
    if rig.kind == "rabbitmq":
        import aio_pika

        connection = await aio_pika.connect(rig.under_test.url)  # type: ignore[arg-type]
        return connection, await connection.channel(publisher_confirms=True)
    return None


async def close_client(rig: Rig) -> None:
    if rig.kind == "redis":
        await rig.client.aclose()
    elif rig.kind == "nats":
        await rig.client.close()
    elif rig.kind == "rabbitmq":
        await rig.client[0].close()


# --- Redis: entries of any fields, with the relay's three fields or near them ---------

msg_id_bytes = st.one_of(
    st.text(max_size=40).map(str.encode),
    st.binary(max_size=20),
    st.sampled_from([b"", b"\xff\xfe", b"\xed\xa0\x80"]),  # not UTF-8; a surrogate's bytes
)
header_objects = st.dictionaries(
    header_names, st.one_of(json_values, seq_texts, st.text(max_size=30)), max_size=4
)
header_bytes = st.one_of(
    header_objects.map(lambda h: json.dumps(h).encode()),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(header_names, seq_texts, max_size=2).map(
        lambda h: json.dumps(h, ensure_ascii=False).encode()
    ),
    st.binary(max_size=30),
    st.sampled_from([
        b"{", b"[1,2]", b'{"Outbox-Seq": 5}', b'{"a": "\\ud800"}', b"[" * 100_000,
        b'{"h": "' + b"x" * HUGE + b'"}', b"1" * 5000, b'{"Outbox-Seq": "' + b"9" * 40 + b'"}',
    ]),
)  # fmt: skip
values = st.one_of(st.binary(max_size=30), header_bytes, st.just(b"v" * HUGE))
near_relay = st.fixed_dictionaries(
    {}, optional={b"msg_id": msg_id_bytes, b"payload": values, b"headers": header_bytes}
)
any_fields = st.dictionaries(
    st.one_of(
        st.sampled_from([b"msg_id", b"payload", b"headers"]), st.binary(min_size=1, max_size=8)
    ),
    values,
    max_size=4,
)
redis_entries = st.one_of(near_relay, any_fields).filter(bool)  # XADD needs a field


async def write_redis(rig: Rig, topic: str, entries: list[dict[bytes, bytes]]) -> int:
    key = f"{rig.under_test.prefix}:{topic}"
    for fields in entries:
        await rig.client.xadd(key, fields)
    return len(entries)


# --- NATS: messages of any header names and values, Nats-Msg-Id or not -------------

token = st.text(alphabet=string.ascii_letters + string.digits + "-_", min_size=1, max_size=10)
nats_values = st.one_of(
    seq_texts.filter(lambda v: "\r" not in v and "\n" not in v),
    st.text(alphabet=st.characters(exclude_characters="\r\n"), max_size=30),
    st.just("x" * 10_000),
)
nats_entries = st.tuples(
    st.dictionaries(
        st.one_of(st.sampled_from([SEQ_HEADER, "Outbox-Key", "Nats-Msg-Id"]), token),
        nats_values,
        max_size=4,
    ),
    st.one_of(st.binary(max_size=30), st.just(b"p" * 100_000)),
)


async def write_nats(rig: Rig, topic: str, entries: list[tuple[dict[str, str], bytes]]) -> int:
    """Stored as JetStream acks them: a second copy of a Nats-Msg-Id is dropped."""
    js = rig.client.jetstream()
    stored = 0
    for headers, payload in entries:
        ack = await js.publish(topic, payload, headers=headers or None)
        stored += not ack.duplicate
    return stored


# --- RabbitMQ: messages of any AMQP header values, a message_id or none --------------

amqp_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, width=32)  # AMQP's table float is single precision
    | st.text(max_size=20)
    | st.binary(max_size=20).map(bytearray)  # pamqp sends a bytearray, not bytes
    | st.datetimes(min_value=datetime(1970, 1, 2), max_value=datetime(2100, 1, 1)),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(min_size=1, max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
rabbit_entries = st.tuples(
    st.one_of(st.none(), st.text(max_size=40)),
    st.dictionaries(
        header_names, st.one_of(amqp_values, seq_texts, st.just("x" * 10_000)), max_size=4
    ),
    st.one_of(st.binary(max_size=30), st.just(b"p" * 100_000)),
)


async def write_rabbit(
    rig: Rig, topic: str, entries: list[tuple[str | None, dict[str, Any], bytes]]
) -> int:
    import aio_pika

    exchange = await rig.client[1].get_exchange("amq.topic")
    for message_id, headers, body in entries:
        message = aio_pika.Message(body, message_id=message_id, headers=headers)
        await exchange.publish(message, routing_key=topic)
    return len(entries)


# --- memory: Messages holding any values --------------------------------------------

anything = st.one_of(
    st.none(),
    st.integers(),
    st.text(max_size=10),
    st.binary(max_size=10),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
memory_entries = st.builds(
    lambda msg_id, payload, key, headers, seq: (msg_id, payload, key, headers, seq),
    st.one_of(st.text(max_size=20), st.just("\ud800"), anything),
    st.one_of(st.binary(max_size=20), anything),
    st.one_of(st.none(), st.text(max_size=5), anything),
    st.one_of(
        st.dictionaries(
            st.one_of(st.text(max_size=8), st.integers()),
            st.one_of(st.text(max_size=8), anything, seq_texts),
            max_size=3,
        ),
        anything,
    ),
    st.one_of(st.none(), st.integers(), st.integers(min_value=10**5000, max_value=10**5000)),
)


async def write_memory(rig: Rig, topic: str, entries: list[tuple[Any, ...]]) -> int:
    broker = rig.adapter
    assert isinstance(broker, MemoryBroker)
    for msg_id, payload, key, headers, seq in entries:
        broker.store_stranger(
            Message(msg_id=msg_id, topic=topic, payload=payload, key=key, headers=headers, seq=seq)
        )
    return len(entries)


WRITERS: dict[str, tuple[st.SearchStrategy[Any], Callable[..., Awaitable[int]]]] = {
    "redis": (redis_entries, write_redis),
    "nats": (nats_entries, write_nats),
    "rabbitmq": (rabbit_entries, write_rabbit),
    "memory": (memory_entries, write_memory),
}


@STRANGERS
@given(data=st.data(), own=st.integers(min_value=0, max_value=2))
def test_every_entry_is_well_formed_or_malformed_and_none_is_lost(
    rig: Rig, data: st.DataObject, own: int
) -> None:
    strategy, write = WRITERS[rig.kind]
    entries = data.draw(st.lists(strategy, min_size=1, max_size=3), label="strangers")
    topic = f"{rig.under_test.prefix}.e{uuid.uuid4().hex[:12]}"
    relays = rig.run(publish_own(rig, topic, own))
    stored = rig.run(write(rig, topic, entries)) + own

    found = rig.read(topic)

    assert len(found) == stored, "one entry per entry stored"
    malformed = [e for e in found if e.malformed is not None]
    event(f"{len(malformed)} of {len(found)} malformed")
    for entry in found:
        assert_one_or_the_other(entry)
    own_found = [e for e in found if e.msg_id in relays and e.malformed is None]
    assert len(own_found) == own, "the relay's own messages stay well formed"
    pa.Table.from_pylist([log_row(e) for e in found], schema=BROKER)  # the export's rows


def assert_one_or_the_other(entry: LogEntry) -> None:
    if entry.malformed is None:
        assert problem(entry) is None
        assert isinstance(entry.msg_id, str) and entry.msg_id
        assert entry.raw is None
        return
    assert entry.malformed and entry.malformed.isascii()
    assert entry.headers == {} and isinstance(entry.payload, bytes)
    assert entry.msg_id is None or (isinstance(entry.msg_id, str) and entry.msg_id.encode())
    raw = entry.raw or ""
    assert raw.isascii() and raw.isprintable(), raw[:80]
    assert len(raw) <= RAW_MAX + 40


def test_rabbitmq_frames_the_client_cannot_decode_are_malformed_entries() -> None:
    """A message_id or header that is not UTF-8 (a raw client's) fails pamqp's decoding
    of the frame and closes the connection: the read resumes around it, and it is a
    malformed entry at its offset. pamqp itself refuses to send one: the writer here
    encodes with surrogateescape."""
    import aio_pika
    import pamqp.encode

    def loose(encoder: Any, value: str) -> bytes:
        data = value.encode("utf-8", "surrogateescape")
        return bytes(encoder.pack(len(data)) + data)

    async def write(url: str, topic: str) -> None:
        connection = await aio_pika.connect(url)
        try:
            exchange = await (await connection.channel()).get_exchange("amq.topic")
            for message in (
                aio_pika.Message(b"a", message_id="good-1"),
                aio_pika.Message(b"b", message_id="\udcff\udcfe"),
                aio_pika.Message(b"c", message_id="good-2", headers={"h": "\udcff"}),
                aio_pika.Message(b"d", message_id="\udcff"),
                aio_pika.Message(b"e", message_id="good-3"),
            ):
                await exchange.publish(message, routing_key=topic)
        finally:
            await connection.close()

    with broker_under_test("rabbitmq") as bt:
        topic = f"{bt.prefix}.raw"
        strict = pamqp.encode._string
        pamqp.encode._string = loose  # type: ignore[assignment]
        try:
            asyncio.run(write(str(bt.url), topic))
        finally:
            pamqp.encode._string = strict
        found = bt.read()
    assert [(e.msg_id, e.seq) for e in found] == [
        ("good-1", "0"), (None, "1"), ("good-2", "2"), (None, "3"), ("good-3", "4")
    ]  # fmt: skip
    assert [e.malformed is None for e in found] == [True, False, False, False, True]
    assert "cannot decode" in (found[1].malformed or "")
    for entry in found:
        assert_one_or_the_other(entry)
