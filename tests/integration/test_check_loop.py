"""Model B's check loop as RocketMQ runs it, end request validation, the coordinator's
reconnect and the payload headroom, on a real nats-server."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import nats
import pytest

from outbox.message import build_message
from relay.brokers.nats import header_size, read_stream
from relay.lab.halfop import (
    CHECK_MAX_TOPIC,
    HALF_TOPIC,
    OP_TOPIC,
    Coordinator,
    CoordinatorSettings,
    LocalTransactionState,
    SendResult,
    SendStatus,
    TransactionMessage,
    TransactionProducer,
)
from relay.lab.halfop.protocol import (
    COMMIT_OR_ROLLBACK,
    END_SUBJECT,
    HALF_OFFSET,
    HEADER_HEADROOM,
    PAYLOAD_IN_HALF,
    PGROUP,
    TRANSACTION_ID,
    UNIQ_KEY,
    half_headers,
)
from relay.testing.embedded import NatsServer
from tests.halfop import COMMIT, UNKNOW, producer, running_coordinator
from tests.helpers import wait_until
from tests.integration.test_halfop import Scripted, count, real_ids

# Rounds only when a test asks (check_now), so it can look at each one's stats.
MANUAL = CoordinatorSettings(check_interval_s=3600, transaction_timeout_s=0.3, check_max=100)


@pytest.fixture
def manual(nats_server: NatsServer) -> Iterator[Coordinator]:
    yield from running_coordinator(nats_server.url, MANUAL)


def old_enough(born_ms: int, seconds: float = 0.4) -> None:
    wait_until(lambda: time.time() - born_ms / 1000 > seconds, what="the half to age")


def stream_len(server: NatsServer, name: str) -> int:
    async def last() -> int:
        nc = await nats.connect(server.url)
        try:
            return int((await nc.jetstream().stream_info(name)).state.messages)
        finally:
            await nc.close()

    return asyncio.run(last())


def commit_request(r: SendResult) -> dict[str, str]:
    """The COMMIT end request the producer of ``r`` would send."""
    return {
        HALF_OFFSET: str(r.half_offset),
        COMMIT_OR_ROLLBACK: COMMIT.value,
        PGROUP: "orders",
        TRANSACTION_ID: r.transaction_id,
        UNIQ_KEY: r.msg_id,
    }


async def publish_end(url: str, requests: list[dict[str, str]]) -> None:
    """End requests as a producer sends them (core NATS, one-way)."""
    nc = await nats.connect(url)
    for headers in requests:
        await nc.publish(END_SUBJECT, b"", headers=headers)
    await nc.flush()
    await nc.close()


def test_ops_behind_a_stuck_half_are_read_once_not_every_round(
    nats_server: NatsServer,
    real_stream: tuple[str, str],
    manual: Coordinator,
    producers: list[TransactionProducer],
) -> None:
    _, prefix = real_stream
    listener = Scripted(lambda m: UNKNOW if m.headers.get("stuck") else COMMIT, UNKNOW)
    p = producer(nats_server.url, listener, producers)
    stuck = p.send_in_transaction(f"{prefix}.o", b"s", headers={"stuck": "1"})
    for i in range(500):
        p.send_in_transaction(f"{prefix}.o", str(i).encode())
    wait_until(lambda: manual.stats.ops_written == 500, what="500 ops")
    old_enough(int(time.time() * 1000))
    manual.check_now()
    first = (manual.stats.last_round_ops_read, manual.stats.last_round_op_requests)
    assert first[0] == 500, "the stuck half waits for every op to be read once"
    assert first[1] <= 500 // 32 + 2, f"ops read 32 to a request, got {first}"
    assert manual.stats.check_requests == 1
    for _ in range(3):
        wait_until(lambda: listener.checks[stuck.msg_id] >= manual.stats.check_requests)
        manual.check_now()
        assert manual.stats.last_round_ops_read == 0, "settled ops are not read again"
        assert manual.stats.last_round_op_requests == 1
        assert manual.stats.last_round_halfs_walked == 1, "only the stuck half's copy"
    assert manual.stats.check_requests == 4


def test_a_round_cut_short_by_max_round_s_is_resumed_by_the_next(
    nats_server: NatsServer, real_stream: tuple[str, str], producers: list[TransactionProducer]
) -> None:
    name, prefix = real_stream
    tiny = CoordinatorSettings(check_interval_s=0.05, transaction_timeout_s=0.2, max_round_s=1e-6)
    p = producer(nats_server.url, Scripted(lambda m: COMMIT, COMMIT), producers)
    p.drop_end_requests = True  # check-back settles each: a put-back and a check each
    sent = {p.send_in_transaction(f"{prefix}.o", b"x").msg_id for _ in range(30)}
    c = Coordinator(nats_server.url, tiny)
    c.start()
    try:
        wait_until(lambda: set(real_ids(nats_server, name)) == sent, what="all delivered")
        assert c.stats.rounds_cut > 0
    finally:
        c.stop()
    ids = real_ids(nats_server, name)
    assert len(ids) == len(set(ids)) == 30, "nothing lost, nothing doubled"
    # Once each, unless an answer came after the next round had put the copy back.
    assert c.stats.check_requests >= 30 and c.stats.commits == 30


class Held(Scripted):
    """Answers COMMIT to checks, but only once ``gate`` is set."""

    def __init__(self) -> None:
        super().__init__(lambda m: UNKNOW, COMMIT)
        self.gate = threading.Event()

    def check_local_transaction(self, msg: TransactionMessage) -> LocalTransactionState:
        self.gate.wait(30)
        return super().check_local_transaction(msg)


def test_answers_that_lag_behind_the_rounds_commit_the_half_once(
    nats_server: NatsServer,
    real_stream: tuple[str, str],
    manual: Coordinator,
    producers: list[TransactionProducer],
) -> None:
    """Each round puts the unanswered half back and asks again: three copies, three
    COMMIT answers arriving together. The first settles the transaction; the others only
    finish their copy (JetStream's duplicate window would hide a second publish here, so
    the coordinator's own counts are what tell)."""
    name, prefix = real_stream
    listener = Held()
    p = producer(nats_server.url, listener, producers)
    r = p.send_in_transaction(f"{prefix}.o", b"x")
    old_enough(int(time.time() * 1000))
    for _ in range(3):
        manual.check_now()
    assert manual.stats.check_requests == 3
    listener.gate.set()
    wait_until(lambda: manual.stats.ops_written == 3, what="an op for each copy")
    assert (manual.stats.commits, manual.stats.settled_by_copy) == (1, 2)
    assert real_ids(nats_server, name) == [r.msg_id]
    manual.check_now()
    assert manual.stats.check_requests == 3, "nothing left to ask about"


def test_a_late_end_request_and_the_answer_for_its_copy_commit_once(
    nats_server: NatsServer,
    real_stream: tuple[str, str],
    manual: Coordinator,
    producers: list[TransactionProducer],
) -> None:
    """The end request comes after a round put the half back and asked about the copy,
    to a coordinator started since (it has walked nothing yet)."""
    name, prefix = real_stream
    listener = Held()
    p = producer(nats_server.url, listener, producers)
    p.drop_end_requests = True
    r = p.send_in_transaction(f"{prefix}.o", b"x")
    old_enough(int(time.time() * 1000))
    manual.check_now()
    assert manual.stats.check_requests == 1
    manual.stop()
    manual = Coordinator(nats_server.url, MANUAL)
    manual.start()
    late = commit_request(r)
    asyncio.run(publish_end(nats_server.url, [late]))
    wait_until(lambda: manual.stats.ops_written == 1, what="the late end request's op")
    listener.gate.set()
    wait_until(lambda: manual.stats.ops_written == 2, what="the copy's op")
    try:
        assert (manual.stats.commits, manual.stats.settled_by_copy) == (1, 1)
    finally:
        manual.stop()
    assert real_ids(nats_server, name) == [r.msg_id]


def test_a_half_that_cannot_be_read_is_skipped_and_counted(
    nats_server: NatsServer,
    real_stream: tuple[str, str],
    manual: Coordinator,
    producers: list[TransactionProducer],
    caplog: pytest.LogCaptureFixture,
) -> None:
    name, prefix = real_stream
    p = producer(nats_server.url, Scripted(lambda m: COMMIT, COMMIT), producers)
    p.drop_end_requests = True
    first = p.send_in_transaction(f"{prefix}.o", b"1")
    gone = p.send_in_transaction(f"{prefix}.o", b"2")

    async def damage() -> None:
        nc = await nats.connect(nats_server.url)
        js = nc.jetstream()
        await js.delete_msg(HALF_TOPIC, gone.half_offset)
        await js.publish(HALF_TOPIC, b"not a half")  # offset 3
        await nc.close()

    asyncio.run(damage())
    last = p.send_in_transaction(f"{prefix}.o", b"4")
    old_enough(int(time.time() * 1000))
    manual.check_now()
    assert manual.stats.halfs_unreadable == 2
    assert "half 2 skipped: gone from the half stream" in caplog.text
    assert "half 3 skipped: no half" in caplog.text
    wait_until(lambda: set(real_ids(nats_server, name)) == {first.msg_id, last.msg_id})
    manual.check_now()
    assert manual.stats.halfs_unreadable == 2, "the half offset moved past them"


def test_end_requests_that_do_not_match_their_half_are_refused(
    nats_server: NatsServer,
    real_stream: tuple[str, str],
    manual: Coordinator,
    producers: list[TransactionProducer],
) -> None:
    name, prefix = real_stream
    p = producer(nats_server.url, Scripted(lambda m: UNKNOW, COMMIT), producers)
    r = p.send_in_transaction(f"{prefix}.o", b"x")
    good = commit_request(r)
    forged = [
        {**good, PGROUP: "other"},
        {**good, TRANSACTION_ID: "t-forged"},
        {**good, UNIQ_KEY: "m-forged", COMMIT_OR_ROLLBACK: "ROLLBACK_MESSAGE"},
        {**good, HALF_OFFSET: "999"},
        {**good, HALF_OFFSET: "x"},
    ]

    asyncio.run(publish_end(nats_server.url, forged))
    wait_until(lambda: manual.stats.ends_refused == 5, what="five refusals")
    assert (manual.stats.commits, manual.stats.rollbacks, manual.stats.ops_written) == (0, 0, 0)
    assert count(nats_server, name) == 0 and stream_len(nats_server, OP_TOPIC) == 0
    old_enough(int(time.time() * 1000))
    manual.check_now()  # check-back: the producer answers COMMIT for the put-back copy
    wait_until(lambda: real_ids(nats_server, name) == [r.msg_id], what="settled by check-back")
    assert manual.stats.ends_refused == 5


def test_the_coordinator_connects_again_after_the_server_closes_its_connection(
    nats_server: NatsServer,
    real_stream: tuple[str, str],
    manual: Coordinator,
    producers: list[TransactionProducer],
) -> None:
    name, prefix = real_stream
    p = producer(nats_server.url, Scripted(lambda m: COMMIT, COMMIT), producers)
    before = p.send_in_transaction(f"{prefix}.o", b"1")
    wait_until(lambda: manual.stats.ops_written == 1, what="the op after the real message")
    manual.check_now()
    nc, loop = manual.connection.nc, manual.loop.loop  # its own connection: the server closes it
    assert nc is not None and loop is not None
    over = nc.publish("junk", b"x" * nc.max_payload, headers={"over": "the limit"})
    asyncio.run_coroutine_threadsafe(over, loop).result(5)  # nats-py checks the payload only
    wait_until(lambda: manual.stats.reconnects == 1, what="a new connection")
    assert nc.is_closed
    after = p.send_in_transaction(f"{prefix}.o", b"2")
    wait_until(lambda: manual.stats.ops_written == 2, what="the second op")
    assert real_ids(nats_server, name) == [before.msg_id, after.msg_id]
    manual.check_now()  # the offsets are in KV: only what came after is walked
    assert (manual.stats.last_round_halfs_walked, manual.stats.last_round_ops_read) == (1, 1)


def half_sized(total: int, topic: str) -> tuple[TransactionMessage, dict[str, str]]:
    """A half whose payload and headers take ``total`` bytes."""
    sample = TransactionMessage.of(
        build_message(topic, b"", max_payload_bytes=2**21),
        transaction_id="0" * 36,
        born_timestamp_ms=int(time.time() * 1000),
    )
    headers = half_headers(sample, "orders")
    msg = TransactionMessage.of(
        build_message(topic, b"x" * (total - header_size(headers)), max_payload_bytes=2**21),
        transaction_id=sample.transaction_id,
        born_timestamp_ms=sample.born_timestamp_ms,
    )
    return msg, half_headers(msg, "orders")


def test_a_half_without_headroom_is_refused_before_anything_is_stored(
    nats_server: NatsServer, producers: list[TransactionProducer]
) -> None:
    ran: list[str] = []

    def execute(msg: TransactionMessage) -> LocalTransactionState:
        ran.append(msg.msg_id)
        return COMMIT

    p = TransactionProducer("orders", nats_server.url, Scripted(execute, COMMIT))
    p.max_payload_bytes = 2**21  # past the outbox's own check: the server's limit decides
    p.start()
    producers.append(p)
    limit = 1024 * 1024  # nats-server's default max_payload
    msg, _ = half_sized(limit - HEADER_HEADROOM // 2, "t.o")
    result = p.send_in_transaction("t.o", msg.payload)
    assert result.send_status is SendStatus.SEND_FAILED
    assert result.error and "PayloadTooLarge" in result.error and "headroom" in result.error
    assert ran == [] and count(nats_server, HALF_TOPIC) == 0
    fits = p.send_in_transaction("t.o", b"x" * (len(msg.payload) - HEADER_HEADROOM))
    assert fits.send_status is SendStatus.SEND_OK


def test_a_half_stored_without_headroom_is_discarded_once_without_its_payload(
    nats_server: NatsServer, manual: Coordinator
) -> None:
    """Stored before the producer kept the headroom: its put-back and check request
    would be over max_payload. It is discarded, payload left in the half stream."""
    assert manual.connection.nc is not None
    limit = manual.connection.nc.max_payload
    msg, headers = half_sized(limit - 10, "t.o")

    async def store() -> None:
        nc = await nats.connect(nats_server.url)
        await nc.jetstream().publish(HALF_TOPIC, msg.payload, headers=headers)
        await nc.close()

    asyncio.run(store())
    old_enough(msg.born_timestamp_ms)
    for _ in range(3):
        manual.check_now()
    assert (manual.stats.too_large, manual.stats.discarded) == (1, 1)
    assert (manual.stats.halfs_written, manual.stats.check_requests, manual.stats.reconnects) == (
        0,
        0,
        0,
    )
    [record] = asyncio.run(read_stream(nats_server.url, CHECK_MAX_TOPIC))
    assert record.data == b"" and record.headers[PAYLOAD_IN_HALF] == str(len(msg.payload))
    assert record.headers[HALF_OFFSET] == "1" and record.headers[UNIQ_KEY] == msg.msg_id
    assert count(nats_server, HALF_TOPIC) == 1, "no put-back copy: nothing to loop on"
