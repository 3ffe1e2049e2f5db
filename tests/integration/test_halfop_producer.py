"""Model B's producer on a real nats-server: half-send retries, the idempotent half, and
the link coming back after the server closed its connection or restarted."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
from nats.aio.client import Client

from outbox.errors import ConfigError
from relay.brokers.nats import DEDUP_HEADER, read_stream
from relay.lab.halfop import (
    HALF_TOPIC,
    Coordinator,
    LocalTransactionState,
    SendResult,
    SendStatus,
    TransactionListener,
    TransactionMessage,
    TransactionProducer,
)
from relay.testing.embedded import NatsServer
from relay.testing.faults import TcpProxy
from tests.halfop import COMMIT, ROLLBACK, UNKNOW, producer
from tests.helpers import wait_until


class Recording(TransactionListener):
    """Commits (or answers ``execute``), and answers a check by what really ran."""

    def __init__(self, execute: LocalTransactionState = COMMIT) -> None:
        self.execute = execute
        self.ran: dict[str, LocalTransactionState] = {}  # transaction id -> outcome
        self.checks = 0
        self._lock = threading.Lock()

    def execute_local_transaction(self, msg: TransactionMessage, arg: Any) -> LocalTransactionState:
        outcome = ROLLBACK if arg == "rollback" else COMMIT
        with self._lock:
            self.ran[msg.transaction_id] = outcome
        return outcome if self.execute is COMMIT else self.execute

    def check_local_transaction(self, msg: TransactionMessage) -> LocalTransactionState:
        with self._lock:
            self.checks += 1
            return self.ran.get(msg.transaction_id, UNKNOW)  # not run (yet): ask again


def stored(server: NatsServer, stream: str) -> list[Any]:
    return asyncio.run(read_stream(server.url, stream))


def in_thread(p: TransactionProducer, topic: str) -> tuple[threading.Thread, list[SendResult]]:
    results: list[SendResult] = []
    sender = threading.Thread(target=lambda: results.append(p.send_in_transaction(topic, b"x")))
    sender.start()
    return sender, results


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2", None])
def test_retry_times_when_send_failed_must_be_a_whole_number(bad: object) -> None:
    with pytest.raises(ConfigError, match="retry_times_when_send_failed: must be a whole"):
        TransactionProducer(
            "g", "nats://127.0.0.1:1", Recording(), retry_times_when_send_failed=bad
        )  # type: ignore[arg-type]


def test_a_send_is_retried_after_the_server_came_back(
    nats_server: NatsServer, producers: list[TransactionProducer]
) -> None:
    listener = Recording()
    p = producer(nats_server.url, listener, producers, send_timeout_s=1.0,
                retry_times_when_send_failed=8)  # fmt: skip
    nats_server.stop()
    sender, results = in_thread(p, "t.orders")
    wait_until(lambda: p.half_retries >= 1, timeout=30, what="a failed first attempt")
    nats_server.start()
    sender.join(60)
    [result] = results
    assert result.send_status is SendStatus.SEND_OK and result.local_state is COMMIT
    assert list(listener.ran) == [result.transaction_id], "the local transaction ran once"
    assert [m.headers["UNIQ_KEY"] for m in stored(nats_server, HALF_TOPIC)] == [result.msg_id]


def test_a_half_whose_ack_was_lost_is_stored_once(
    nats_server: NatsServer, producers: list[TransactionProducer]
) -> None:
    proxy = TcpProxy(nats_server.port).start()
    try:
        listener = Recording()
        p = producer(f"nats://127.0.0.1:{proxy.port}", listener, producers,
                    send_timeout_s=1.0, retry_times_when_send_failed=8)  # fmt: skip
        proxy.dropping_replies = True  # the half arrives, its ack does not
        sender, results = in_thread(p, "t.orders")
        wait_until(lambda: len(stored(nats_server, HALF_TOPIC)) == 1, what="the first copy")
        wait_until(lambda: p.half_retries >= 1, what="the first attempt timed out")
        proxy.dropping_replies = False
        proxy.stop()  # cut the connection: the client connects again
        proxy.start()
        sender.join(60)
    finally:
        proxy.stop()
    [result] = results
    assert result.send_status is SendStatus.SEND_OK and result.half_offset == 1
    assert p.halfs_deduplicated == 1, "the server said the later attempt was a duplicate"
    [half] = stored(nats_server, HALF_TOPIC)
    assert half.headers[DEDUP_HEADER] == result.transaction_id
    assert list(listener.ran) == [result.transaction_id]


def test_a_put_back_half_is_not_dropped_as_a_duplicate(
    nats_server: NatsServer,
    real_stream: tuple[str, str],
    coordinator: Coordinator,
    producers: list[TransactionProducer],
) -> None:
    """The coordinator's copies of a half must not carry the producer's Nats-Msg-Id."""
    name, prefix = real_stream
    p = producer(nats_server.url, Recording(execute=UNKNOW), producers)
    result = p.send_in_transaction(f"{prefix}.orders", b"x")
    wait_until(lambda: len(stored(nats_server, name)) == 1, what="delivery after a check")
    halfs = stored(nats_server, HALF_TOPIC)
    assert len(halfs) == 1 + coordinator.stats.halfs_written >= 2, "the put-back copy is stored"
    assert [DEDUP_HEADER in h.headers for h in halfs] == [True] + [False] * (len(halfs) - 1)
    assert [m.msg_id for m in stored(nats_server, name)] == [result.msg_id]


def test_payload_too_large_for_the_server_is_not_retried(
    nats_server: NatsServer, producers: list[TransactionProducer]
) -> None:
    listener = Recording()
    # The producer's own limit lets it through; the server's (1 MB) does not.
    p = producer(nats_server.url, listener, producers, max_payload_bytes=4 * 1024 * 1024)
    result = p.send_in_transaction("t.orders", b"x" * (1024 * 1024 + 1))
    assert result.send_status is SendStatus.SEND_FAILED and "PayloadTooLarge" in (
        result.error or ""
    )
    assert p.half_retries == 0 and listener.ran == {} and p.reconnects == 0
    assert p.send_in_transaction("t.orders", b"small").send_status is SendStatus.SEND_OK


def test_the_local_transaction_does_not_run_when_every_attempt_failed(
    nats_server: NatsServer, producers: list[TransactionProducer]
) -> None:
    listener = Recording()
    p = producer(nats_server.url, listener, producers, send_timeout_s=0.3,
                retry_times_when_send_failed=2)  # fmt: skip
    nats_server.stop()
    began = time.monotonic()
    result = p.send_in_transaction("t.orders", b"x")
    assert time.monotonic() - began >= 0.9, "three attempts, each waiting for the connection"
    assert result.send_status is SendStatus.SEND_FAILED and result.half_offset is None
    assert result.local_state is ROLLBACK and "not connected" in (result.error or "")
    assert p.half_retries == 2 and listener.ran == {}


async def _over_max_payload(nc: Client) -> None:
    """A raw publish over the server's max_payload, past the client's own check: the
    server answers -ERR 'Maximum Payload Violation' and nats-py closes for good."""
    nc._max_payload = nc.max_payload * 4
    await nc.publish("t.too.big", b"x" * (nc.max_payload // 4 + 1))


def test_the_link_comes_back_after_the_server_closed_it(
    nats_server: NatsServer,
    real_stream: tuple[str, str],
    coordinator: Coordinator,
    producers: list[TransactionProducer],
) -> None:
    name, prefix = real_stream
    listener = Recording(execute=UNKNOW)  # settled only by a check answer
    p = producer(nats_server.url, listener, producers)
    nc = p._link._conn.nc
    assert nc is not None
    p._link._loop.submit(_over_max_payload(nc)).result(10)
    wait_until(lambda: nc.is_closed, what="the server closing the link's connection")
    result = p.send_in_transaction(f"{prefix}.orders", b"x")
    assert result.send_status is SendStatus.SEND_OK and p.reconnects == 1
    wait_until(
        lambda: [m.msg_id for m in stored(nats_server, name)] == [result.msg_id],
        what="delivery by a check answer on the new connection",
    )
    assert listener.checks >= 1


def test_a_server_restart_during_sends_loses_nothing(
    nats_server: NatsServer,
    real_stream: tuple[str, str],
    coordinator: Coordinator,
    producers: list[TransactionProducer],
) -> None:
    name, prefix = real_stream
    listener = Recording()
    p = producer(nats_server.url, listener, producers, send_timeout_s=2.0)
    results: list[SendResult] = []
    done = threading.Event()

    def send() -> None:
        i = 0
        while not done.is_set():
            arg = "rollback" if i % 5 == 0 else None
            results.append(p.send_in_transaction(f"{prefix}.orders", b"x", arg))
            i += 1

    sender = threading.Thread(target=send)
    sender.start()
    try:
        wait_until(lambda: len(results) >= 20, what="sends before the restart")
        nats_server.stop()
        nats_server.start()
        after = len(results)
        wait_until(lambda: len(results) >= after + 20, what="sends after the restart")
    finally:
        done.set()
        sender.join(60)
    assert [r.error for r in results if r.send_status is not SendStatus.SEND_OK] == [], (
        "the retries cover the restart"
    )
    committed = {r.msg_id for r in results if r.local_state is COMMIT}

    def delivered() -> list[str | None]:
        return [m.msg_id for m in stored(nats_server, name)]

    wait_until(lambda: set(delivered()) >= committed, what="every commit delivered")
    ids = delivered()
    assert set(ids) == committed and len(ids) == len(set(ids)), "each commit exactly once"
