"""Model B end to end: producers, the coordinator and check-back on a real nats-server."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import nats
import pytest
from sqlalchemy import Engine, create_engine, func, select

from outbox import migrate
from relay.brokers.nats import read_stream
from relay.lab.compare.workload import business, orders, place_order
from relay.lab.halfop import (
    CHECK_MAX_TOPIC,
    HALF_TOPIC,
    OP_TOPIC,
    Coordinator,
    CoordinatorSettings,
    LocalTransactionState,
    SendStatus,
    SqlTransactionListener,
    TransactionListener,
    TransactionMessage,
    TransactionProducer,
)
from relay.testing.embedded import NatsServer
from relay.testing.faults import kill_producer_after_commit
from tests.halfop import COMMIT, QUICK, ROLLBACK, UNKNOW, producer
from tests.helpers import wait_until


class Scripted(TransactionListener):
    def __init__(
        self,
        execute: Callable[[TransactionMessage], LocalTransactionState],
        check: LocalTransactionState,
    ) -> None:
        self.execute, self.check = execute, check
        self.checks: Counter[str] = Counter()

    def execute_local_transaction(self, msg: TransactionMessage, arg: Any) -> LocalTransactionState:
        return self.execute(msg)

    def check_local_transaction(self, msg: TransactionMessage) -> LocalTransactionState:
        self.checks[msg.msg_id] += 1
        return self.check


def real_ids(server: NatsServer, name: str) -> list[str | None]:
    return [m.msg_id for m in asyncio.run(read_stream(server.url, name))]


def count(server: NatsServer, name: str) -> int:
    return len(asyncio.run(read_stream(server.url, name)))


def test_commit_appears_once_only_after_end_and_rollback_never(
    nats_server: NatsServer,
    real_stream: tuple[str, str],
    coordinator: Coordinator,
    producers: list[TransactionProducer],
) -> None:
    name, prefix = real_stream
    gate = threading.Event()
    running = threading.Event()

    def execute(msg: TransactionMessage) -> LocalTransactionState:
        if msg.headers.get("wait") == "yes":
            running.set()
            gate.wait(10)
        return ROLLBACK if msg.headers.get("rollback") == "yes" else COMMIT

    p = producer(nats_server.url, Scripted(execute, UNKNOW), producers)
    results: list[Any] = []
    sender = threading.Thread(
        target=lambda: results.append(
            p.send_in_transaction(f"{prefix}.orders", b"c", headers={"wait": "yes"})
        )
    )
    sender.start()
    running.wait(5)
    assert count(nats_server, HALF_TOPIC) == 1 and count(nats_server, name) == 0, (
        "invisible before the end"
    )
    gate.set()
    sender.join()
    committed = results[0]
    rolled = p.send_in_transaction(f"{prefix}.orders", b"r", headers={"rollback": "yes"})
    assert committed.send_status is SendStatus.SEND_OK and committed.local_state is COMMIT
    assert rolled.local_state is ROLLBACK and rolled.half_offset == 2
    wait_until(lambda: coordinator.stats.ops_written == 2, what="two op messages")
    assert real_ids(nats_server, name) == [committed.msg_id]
    assert (coordinator.stats.commits, coordinator.stats.rollbacks) == (1, 1)
    ops = asyncio.run(read_stream(nats_server.url, OP_TOPIC))
    assert sorted(m.data for m in ops) == [b"1", b"2"] and all(
        m.headers["TAGS"] == "d" for m in ops
    )


def test_unknow_then_check_back_commits(
    nats_server: NatsServer,
    real_stream: tuple[str, str],
    coordinator: Coordinator,
    producers: list[TransactionProducer],
) -> None:
    name, prefix = real_stream
    listener = Scripted(lambda m: UNKNOW, COMMIT)
    p = producer(nats_server.url, listener, producers)
    result = p.send_in_transaction(f"{prefix}.orders", {"sku": "A"})
    assert result.local_state is UNKNOW
    wait_until(
        lambda: real_ids(nats_server, name) == [result.msg_id],
        timeout=60,
        what="delivery after check",
    )
    assert listener.checks[result.msg_id] >= 1 and coordinator.stats.check_requests >= 1


def test_always_unknow_is_discarded_after_check_max(
    nats_server: NatsServer, real_stream: tuple[str, str], producers: list[TransactionProducer]
) -> None:
    name, prefix = real_stream
    c = Coordinator(
        nats_server.url,
        CoordinatorSettings(check_interval_s=0.1, transaction_timeout_s=0.1, check_max=3),
    )
    c.start()
    try:
        listener = Scripted(lambda m: UNKNOW, UNKNOW)
        p = producer(nats_server.url, listener, producers)
        result = p.send_in_transaction(f"{prefix}.orders", b"x")
        wait_until(lambda: c.stats.discarded == 1, timeout=60, what="the half discarded")
    finally:
        c.stop()
    discarded = asyncio.run(read_stream(nats_server.url, CHECK_MAX_TOPIC))
    assert [m.headers["UNIQ_KEY"] for m in discarded] == [result.msg_id]
    assert listener.checks[result.msg_id] == 3
    assert count(nats_server, name) == 0


@pytest.fixture
def orders_engine(pg_url: str) -> Iterator[Engine]:
    """A migrated database with the order table, for SqlTransactionListener tests."""
    migrate.upgrade(pg_url)
    engine = create_engine(pg_url)
    business.create_all(engine)
    yield engine
    engine.dispose()


def test_dropped_end_requests_are_settled_by_check_back_once_each(
    orders_engine: Engine,
    nats_server: NatsServer,
    real_stream: tuple[str, str],
    coordinator: Coordinator,
    producers: list[TransactionProducer],
) -> None:
    name, prefix = real_stream
    listener = SqlTransactionListener(
        orders_engine, place_order, group="orders", rollback_after_s=0.5
    )
    p = producer(nats_server.url, listener, producers)
    p.drop_end_requests = True  # the fault: no end request ever reaches the coordinator
    results = [
        p.send_in_transaction(f"{prefix}.orders", b"x", {"sku": f"S{i}", "fail": i % 4 == 0})
        for i in range(40)
    ]
    committed = {r.msg_id for r in results if r.local_state is COMMIT}
    assert len(committed) == 30
    wait_until(lambda: coordinator.stats.ops_written >= 40, timeout=30, what="every half settled")
    ids = real_ids(nats_server, name)
    assert set(ids) == committed and len(ids) == len(set(ids)), "each commit delivered exactly once"
    with orders_engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(orders)).scalar_one() == 30


def test_killed_producer_is_covered_by_another_of_its_group(
    orders_engine: Engine,
    pg_url: str,
    nats_server: NatsServer,
    real_stream: tuple[str, str],
    coordinator: Coordinator,
    producers: list[TransactionProducer],
) -> None:
    name, prefix = real_stream
    listener = SqlTransactionListener(orders_engine, place_order, group="orders")
    survivor = producer(nats_server.url, listener, producers)
    msg_id, state, code = kill_producer_after_commit(pg_url, nats_server.url, f"{prefix}.orders")
    assert code == -signal.SIGKILL and state == "COMMIT_MESSAGE"
    wait_until(
        lambda: real_ids(nats_server, name) == [msg_id],
        timeout=60,
        what="the survivor's check answer",
    )
    assert survivor.checks_answered >= 1


def test_coordinator_restart_resumes_without_loss_or_duplicates(
    orders_engine: Engine,
    nats_server: NatsServer,
    real_stream: tuple[str, str],
    producers: list[TransactionProducer],
) -> None:
    name, prefix = real_stream
    listener = SqlTransactionListener(
        orders_engine, place_order, group="orders", rollback_after_s=0.5
    )
    p = producer(nats_server.url, listener, producers)
    first = Coordinator(nats_server.url, QUICK)
    first.start()
    results = [p.send_in_transaction(f"{prefix}.orders", b"x", {"sku": f"A{i}"}) for i in range(20)]
    first.stop()
    # while no coordinator runs, end requests are lost; check-back must recover them
    results += [
        p.send_in_transaction(f"{prefix}.orders", b"x", {"sku": f"B{i}"}) for i in range(20)
    ]
    second = Coordinator(nats_server.url, QUICK)
    second.start()
    try:
        committed = {r.msg_id for r in results}
        wait_until(
            lambda: set(real_ids(nats_server, name)) == committed, timeout=30, what="all delivered"
        )
        ids = real_ids(nats_server, name)
        assert len(ids) == len(set(ids)) == 40
    finally:
        second.stop()


def test_failed_half_send_does_not_run_the_local_transaction(
    nats_server: NatsServer, producers: list[TransactionProducer]
) -> None:
    ran: list[str] = []

    def execute(msg: TransactionMessage) -> LocalTransactionState:
        ran.append(msg.msg_id)
        return COMMIT

    p = producer(nats_server.url, Scripted(execute, COMMIT), producers)
    p.send_timeout_s = 0.5  # each of the three attempts waits this long for the server
    nats_server.stop()
    result = p.send_in_transaction("t.orders", b"x")
    assert result.send_status is SendStatus.SEND_FAILED and result.half_offset is None
    assert result.local_state is ROLLBACK and result.error
    assert ran == [], "the local transaction must not run when the half was not stored"


def test_late_end_request_after_a_put_back_delivers_once_without_broker_dedup(
    nats_server: NatsServer,
    stream: tuple[str, str],
    coordinator: Coordinator,
    producers: list[TransactionProducer],
) -> None:
    """The local transaction outlives the transaction timeout: the half is put back and
    checked (UNKNOW) before the COMMIT end request arrives for the old copy. The newer
    copy must then be settled, not checked again and published a second time."""
    name, prefix = stream

    async def stream_without_dedup() -> None:
        nc = await nats.connect(nats_server.url)
        await nc.jetstream().add_stream(name=name, subjects=[f"{prefix}.>"], duplicate_window=0.1)
        await nc.close()

    asyncio.run(stream_without_dedup())
    committed = threading.Event()

    def slow_commit(msg: TransactionMessage) -> LocalTransactionState:
        wait_until(lambda: coordinator.stats.check_requests >= 1, what="a check while it runs")
        committed.set()
        return COMMIT

    class AnswersFromState(Scripted):
        def check_local_transaction(self, msg: TransactionMessage) -> LocalTransactionState:
            self.checks[msg.msg_id] += 1
            return COMMIT if committed.is_set() else UNKNOW

    listener = AnswersFromState(slow_commit, UNKNOW)
    p = producer(nats_server.url, listener, producers)
    result = p.send_in_transaction(f"{prefix}.orders", b"x")
    wait_until(lambda: real_ids(nats_server, name) == [result.msg_id], what="delivered")
    rounds = coordinator.stats.rounds
    wait_until(lambda: coordinator.stats.rounds >= rounds + 5, what="more check rounds")
    assert real_ids(nats_server, name) == [result.msg_id], "delivered twice"


def test_a_malformed_half_does_not_stop_the_coordinator(
    nats_server: NatsServer,
    real_stream: tuple[str, str],
    coordinator: Coordinator,
    producers: list[TransactionProducer],
) -> None:
    name, prefix = real_stream
    p = producer(nats_server.url, Scripted(lambda m: UNKNOW, COMMIT), producers)
    bad = p.send_in_transaction(
        f"{prefix}.orders", b"x", headers={"CHECK_IMMUNITY_TIME_IN_SECONDS": "abc"}
    )
    good = p.send_in_transaction(f"{prefix}.orders", b"y")
    wait_until(
        lambda: set(real_ids(nats_server, name)) == {bad.msg_id, good.msg_id},
        timeout=60,
        what="both",
    )
