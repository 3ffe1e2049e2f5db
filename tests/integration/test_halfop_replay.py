"""A replayed end request never settles its transaction again, on a real nats-server
whose real stream forgets a msg id (its duplicate window) sooner than the replay comes."""

from __future__ import annotations

import asyncio
import contextlib
import time

import nats
import pytest

from relay.brokers.nats import DEDUP_HEADER
from relay.lab.halfop import Coordinator, CoordinatorSettings, SendResult, TransactionProducer
from relay.lab.halfop.protocol import (
    COMMIT_OR_ROLLBACK,
    END_SUBJECT,
    HALF_OFFSET,
    PGROUP,
    TRANSACTION_ID,
    UNIQ_KEY,
)
from relay.testing.embedded import NatsServer
from tests.halfop import COMMIT, ROLLBACK, producer, running_coordinator
from tests.helpers import wait_until
from tests.integration.test_halfop import Scripted, real_ids

coordinating = contextlib.contextmanager(running_coordinator)
WINDOW_S = 0.5  # the real stream's duplicate window
REPLAY_AFTER_S = 1.0  # past it


@pytest.fixture
def forgetful(nats_server: NatsServer, stream: tuple[str, str]) -> tuple[str, str]:
    """A real stream whose duplicate window is shorter than the replay delay."""
    name, prefix = stream

    async def create() -> None:
        nc = await nats.connect(nats_server.url)
        await nc.jetstream().add_stream(
            name=name, subjects=[f"{prefix}.>"], duplicate_window=WINDOW_S
        )
        await nc.close()

    asyncio.run(create())
    return name, prefix


def end_request(r: SendResult, state: str = COMMIT.value) -> dict[str, str]:
    """The end request the producer of ``r`` sent (relay.lab.halfop.link._send_end)."""
    return {
        HALF_OFFSET: str(r.half_offset),
        COMMIT_OR_ROLLBACK: state,
        TRANSACTION_ID: r.transaction_id,
        UNIQ_KEY: r.msg_id,
        PGROUP: "orders",
    }


def replay(url: str, headers: dict[str, str]) -> None:
    """The same end request again, as a producer sends one (core NATS, one-way)."""

    async def send() -> None:
        nc = await nats.connect(url)
        await nc.publish(END_SUBJECT, b"", headers=headers)
        await nc.flush()
        await nc.close()

    asyncio.run(send())


def settled_then_forgotten(
    url: str, coordinator: Coordinator, producers: list[TransactionProducer], prefix: str
) -> SendResult:
    """A transaction settled by its end request, once the real stream's window passed."""
    p = producer(url, Scripted(lambda m: COMMIT, COMMIT), producers)
    r = p.send_in_transaction(f"{prefix}.o", b"x")
    wait_until(lambda: coordinator.stats.ops_written == 1, what="the end request's op")
    settled = time.monotonic()
    wait_until(lambda: time.monotonic() - settled > REPLAY_AFTER_S, what="the window to pass")
    return r


def publish_again(url: str, subject: str, msg_id: str) -> None:
    async def publish() -> None:
        nc = await nats.connect(url)
        await nc.jetstream().publish(subject, b"x", headers={DEDUP_HEADER: msg_id})
        await nc.close()

    asyncio.run(publish())


@pytest.mark.parametrize(
    "timeout_s",
    [0.3, 30.0],
    ids=["replayed-after-the-transaction-timeout", "replayed-within-it"],
)
def test_a_replayed_commit_past_the_duplicate_window_publishes_nothing(
    nats_server: NatsServer,
    forgetful: tuple[str, str],
    producers: list[TransactionProducer],
    timeout_s: float,
) -> None:
    name, prefix = forgetful
    settings = CoordinatorSettings(check_interval_s=3600, transaction_timeout_s=timeout_s)
    with coordinating(nats_server.url, settings) as coordinator:
        r = settled_then_forgotten(nats_server.url, coordinator, producers, prefix)
        replay(nats_server.url, end_request(r))
        wait_until(lambda: coordinator.stats.ops_written == 2, what="the replay's op")
        assert (coordinator.stats.commits, coordinator.stats.settled_by_copy) == (1, 1)
    assert real_ids(nats_server, name) == [r.msg_id]
    publish_again(nats_server.url, f"{prefix}.o", r.msg_id)
    assert real_ids(nats_server, name) == [r.msg_id] * 2, "the broker no longer deduplicates"


def test_a_commit_for_a_rolled_back_transaction_publishes_nothing(
    nats_server: NatsServer, forgetful: tuple[str, str], producers: list[TransactionProducer]
) -> None:
    name, prefix = forgetful
    settings = CoordinatorSettings(check_interval_s=3600, transaction_timeout_s=30.0)
    with coordinating(nats_server.url, settings) as coordinator:
        p = producer(nats_server.url, Scripted(lambda m: ROLLBACK, ROLLBACK), producers)
        r = p.send_in_transaction(f"{prefix}.o", b"x")
        wait_until(lambda: coordinator.stats.rollbacks == 1, what="the rollback")
        replay(nats_server.url, end_request(r, COMMIT.value))
        wait_until(lambda: coordinator.stats.ops_written == 2, what="the late COMMIT's op")
        assert (coordinator.stats.commits, coordinator.stats.settled_by_copy) == (0, 1)
    assert real_ids(nats_server, name) == []


def test_an_end_request_older_than_its_record_lives_is_refused(
    nats_server: NatsServer,
    forgetful: tuple[str, str],
    producers: list[TransactionProducer],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A settlement's record lives file_reserved_time_s (the SETTLED bucket's TTL): past
    that, nothing could tell a replay from a first answer."""
    name, prefix = forgetful
    settings = CoordinatorSettings(
        check_interval_s=3600, transaction_timeout_s=0.3, file_reserved_time_s=REPLAY_AFTER_S
    )
    with coordinating(nats_server.url, settings) as coordinator:
        r = settled_then_forgotten(nats_server.url, coordinator, producers, prefix)
        replay(nats_server.url, end_request(r))
        wait_until(lambda: coordinator.stats.ends_expired == 1, what="the refusal")
        assert (coordinator.stats.commits, coordinator.stats.ops_written) == (1, 1)
    assert real_ids(nats_server, name) == [r.msg_id]
    [refusal] = [m for m in caplog.messages if "is on record for" in m]
    assert refusal.startswith(f"end request (COMMIT_MESSAGE) for half {r.half_offset} refused")
