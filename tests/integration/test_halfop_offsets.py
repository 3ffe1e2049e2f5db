"""Model B's op offset on a real nats-server: a message of the op stream that cannot
name a real half is skipped, counted and passed, so it cannot pin the op offset; an op
naming a half stored after the round began is no such message."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import nats
import nats.js.errors
import pytest

from outbox.message import build_message
from relay.lab.halfop import OP_TOPIC, Coordinator, CoordinatorSettings, TransactionProducer
from relay.lab.halfop.coordinator import OFFSETS_BUCKET, TAGS_HEADER, Round
from relay.lab.halfop.protocol import HALF_TOPIC, OP_TAG, TransactionMessage, half_headers
from relay.testing.embedded import NatsServer
from tests.halfop import COMMIT, UNKNOW, producer, running_coordinator
from tests.helpers import wait_until
from tests.integration.test_halfop import Scripted, real_ids

# Rounds only when a test asks (check_now), so it can look at each one's stats.
MANUAL = CoordinatorSettings(check_interval_s=3600, transaction_timeout_s=0.3, check_max=100)


@pytest.fixture
def manual(nats_server: NatsServer) -> Iterator[Coordinator]:
    yield from running_coordinator(nats_server.url, MANUAL)


def saved_op_offset(url: str) -> int:
    async def read() -> int:
        nc = await nats.connect(url)
        try:
            kv = await nc.jetstream().key_value(OFFSETS_BUCKET)
            return int((await kv.get("op")).value or b"1")
        except nats.js.errors.KeyNotFoundError:
            return 1  # never saved: still at the start
        finally:
            await nc.close()

    return asyncio.run(read())


def write_ops(url: str, ops: list[tuple[bytes, dict[str, str]]]) -> None:
    """Messages into the op stream, as anyone allowed to publish there can write them."""

    async def write() -> None:
        nc = await nats.connect(url)
        for body, headers in ops:
            await nc.jetstream().publish(OP_TOPIC, body, headers=headers)
        await nc.close()

    asyncio.run(write())


def old_enough(seconds: float = 0.4) -> None:
    born = time.time()
    wait_until(lambda: time.time() - born > seconds, what="the halfs to age")


def test_an_op_naming_no_real_half_is_skipped_and_does_not_pin_the_op_offset(
    nats_server: NatsServer,
    real_stream: tuple[str, str],
    manual: Coordinator,
    producers: list[TransactionProducer],
    caplog: pytest.LogCaptureFixture,
) -> None:
    _, prefix = real_stream
    tagged = {TAGS_HEADER: OP_TAG}
    write_ops(
        nats_server.url,
        [(b"99999999999999999999", tagged), (b"0", tagged), (b"x", tagged), (b"1", {})],
    )
    listener = Scripted(lambda m: UNKNOW if m.headers.get("stuck") else COMMIT, UNKNOW)
    p = producer(nats_server.url, listener, producers)
    stuck = p.send_in_transaction(f"{prefix}.o", b"s", headers={"stuck": "1"})
    for i in range(100):
        p.send_in_transaction(f"{prefix}.o", str(i).encode())
    wait_until(lambda: manual.stats.ops_written == 100, what="100 ops")
    old_enough()
    manual.check_now()
    assert manual.stats.last_round_ops_read == 104
    assert saved_op_offset(nats_server.url) == 105, "past the skipped ops and the settled"
    assert manual.stats.ops_skipped == 4
    for _ in range(3):  # each round puts the stuck half back and asks again
        wait_until(lambda: listener.checks[stuck.msg_id] >= manual.stats.check_requests)
        manual.check_now()
        assert manual.stats.last_round_ops_read == 0, "no round reads the op log again"
        assert manual.stats.last_round_op_requests == 1
    assert manual.stats.ops_skipped == 4, "counted once each"
    skipped = [r.getMessage() for r in caplog.records if " skipped: " in r.getMessage()]
    assert skipped == [
        "op 1 skipped: half offset 99999999999999999999 is past the half stream's last, 101",
        "op 2 skipped: half offset 0 is below 1",
        "op 3 skipped: its body b'x' is no half offset",
        "op 4 skipped: no TAGS: d (not an op)",
    ]
    assert all(r.levelname == "WARNING" for r in caplog.records if " skipped: " in r.getMessage())


class HalfDuringTheRound(Coordinator):
    """Once armed, a half is stored and settled after its round read the half stream's
    end and before the round's first pull: that op names a half past ``last_half``. An
    op naming no half follows it."""

    armed = False
    topic = ""
    settled: TransactionMessage | None = None

    def __init__(self, url: str, settings: CoordinatorSettings) -> None:
        super().__init__(url, settings)
        pull_ops = self.checks.pull_ops

        async def store_first(rnd: Round) -> None:
            if self.armed:
                self.armed = False
                await self._store_and_commit()
            await pull_ops(rnd)

        self.checks.pull_ops = store_first  # type: ignore[method-assign]

    async def _store_and_commit(self) -> None:
        assert self.connection.nc is not None
        js = self.connection.nc.jetstream()
        message = build_message(self.topic, b"late", max_payload_bytes=1024)
        msg = TransactionMessage.of(
            message, transaction_id="t-late", born_timestamp_ms=int(time.time() * 1000)
        )
        ack = await js.publish(HALF_TOPIC, msg.payload, headers=half_headers(msg, "g"))
        done = await self.end_transaction(
            ack.seq, COMMIT.value, group="g", transaction_id=msg.transaction_id, msg_id=msg.msg_id
        )
        assert done
        self.settled = msg
        await js.publish(OP_TOPIC, b"0", headers={TAGS_HEADER: OP_TAG})


def test_the_op_of_a_half_stored_after_the_round_began_is_not_skipped(
    nats_server: NatsServer,
    real_stream: tuple[str, str],
    producers: list[TransactionProducer],
    caplog: pytest.LogCaptureFixture,
) -> None:
    name, prefix = real_stream
    coordinator = HalfDuringTheRound(nats_server.url, MANUAL)
    coordinator.topic = f"{prefix}.o"
    coordinator.start()
    try:
        p = producer(nats_server.url, Scripted(lambda m: COMMIT, COMMIT), producers)
        first = p.send_in_transaction(f"{prefix}.o", b"1")
        wait_until(lambda: coordinator.stats.ops_written == 1, what="the first op")
        coordinator.armed = True
        coordinator.check_now()
        assert coordinator.settled is not None and coordinator.stats.ops_written == 2
        assert coordinator.stats.ops_skipped == 1, "its half is stored: only op 3 names none"
        assert saved_op_offset(nats_server.url) == 2, "its half waits for the next round"
        old_enough()
        coordinator.check_now()
        assert coordinator.stats.last_round_halfs_walked == 1
        assert coordinator.stats.last_round_ops_read == 2, "ops 2 and 3 again"
        assert saved_op_offset(nats_server.url) == 4, "its op, read again, is passed"
        assert coordinator.stats.ops_skipped == 1, "op 3, read again, is not counted again"
        assert coordinator.stats.ops_written == 2, "settled by its op, not again by its record"
        assert coordinator.stats.check_requests == 0
    finally:
        coordinator.stop()
    assert real_ids(nats_server, name) == [first.msg_id, coordinator.settled.msg_id]
    assert [m for m in caplog.messages if " skipped: " in m] == [
        "op 3 skipped: half offset 0 is below 1"
    ], "logged once"
