"""The fault suite: each fault of `outbox compare` against each model that has it.

A scenario runs a short paced workload (real PostgreSQL, the wheel's nats-server,
traffic through a TCP proxy) with one fault in the middle, waits until it settles,
and compares the model's own ledger with the real stream: lost = 0 and phantom = 0
always, and no duplicates (JetStream drops a second copy inside its dedup window).
"""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import create_engine, func, select
from sqlalchemy.orm import Session

from outbox import Outbox, migrate
from outbox.table import outbox_message
from relay.brokers.nats import read_stream
from relay.lab.compare.run import FAULTS, POISON, ModelA, ModelB, Run, Workload
from relay.testing.embedded import NatsServer
from tests.helpers import wait_until

SCENARIOS = [(model, fault) for fault, models in FAULTS.items() for model in models]


def outcome(run: Run, server: NatsServer) -> tuple[set[str], set[str], int]:
    """(lost, phantom, duplicates) of a finished run; dead poison is not lost, any other
    dead row is."""
    committed, dead = run.committed_ids(), run.dead_ids()
    stored = [m.msg_id or "" for m in asyncio.run(read_stream(server.url, run.stream))]
    assert not dead & set(stored), "a dead-lettered message reached the broker"
    lost = committed - dead - set(stored)
    return lost, set(stored) - committed, len(stored) - len(set(stored))


@pytest.mark.parametrize(("model", "fault"), SCENARIOS)
def test_nothing_lost_nothing_phantom_under(
    model: str, fault: str, pg_url: str, nats_server: NatsServer
) -> None:
    migrate.upgrade(pg_url)
    workload = Workload(transactions=300, rate=150, faults=(fault,), fault_s=2.0)
    run: Run = (ModelA if model == "a" else ModelB)(pg_url, nats_server.url, nats_server, workload)
    result = run.run()
    lost, phantom, duplicates = outcome(run, nats_server)
    [record] = result.faults
    print(f"model {model} {fault}: committed={len(run.committed_ids())} lost={len(lost)} "
          f"phantom={len(phantom)} duplicates={duplicates} settle_s={record.settle_s}")  # fmt: skip
    assert not lost and not phantom
    assert duplicates == 0  # every redelivery fell inside JetStream's dedup window
    assert record.settle_s is not None, "everything committed before the fault's end arrived"
    assert result.committed_seen > 0
    if isinstance(run, ModelA) and fault == "db-kill":
        stats = run.ob.stats
        assert stats is not None
        print(f"  mark statements killed={run.killer.kills} acks left for the sweeper="
              f"{stats.mark_failed}")  # fmt: skip
        assert run.killer.kills > 0, "the fault struck no mark"
        assert stats.mark_failed > 0, "no mark gave up: the sweeper had nothing to resend"


def test_a_thousand_handlers_that_raise_leave_no_phantom(
    pg_url: str, nats_server: NatsServer, stream: tuple[str, str]
) -> None:
    """@transactional handlers that send and then raise: rolled back, nothing published."""
    name, prefix = stream
    migrate.upgrade(pg_url)
    ob = Outbox(pg_url, broker=f"{nats_server.url}?stream={name}&subjects={prefix}.>")
    ob.start()

    @ob.transactional
    def handler(session: Session, i: int) -> None:
        ob.send(session, f"{prefix}.orders", {"i": i})
        if i % 10:
            raise ValueError("the handler failed after sending")

    raised = 0
    try:
        for i in range(1000):
            try:
                handler(i)
            except ValueError:
                raised += 1
        wait_until(lambda: ob.stats is not None and ob.stats.marked == 100, what="100 delivered")
    finally:
        ob.stop()
    stored = asyncio.run(read_stream(nats_server.url, name))
    assert raised == 900
    assert len(stored) == 100, "only the 100 committed handlers' messages, no phantom"


@pytest.mark.parametrize("model", ["a", "b"])
def test_poison_mixed_into_healthy_traffic(
    model: str, pg_url: str, nats_server: NatsServer
) -> None:
    """One transaction in ten carries a message the broker refuses for good.

    Model A commits it and dead-letters exactly those rows while every healthy message
    is delivered once; model B's half send fails, so exactly those transactions fail.
    How much poison slows the healthy messages is measured by bench/poison.py.
    """
    migrate.upgrade(pg_url)
    workload = Workload(transactions=300, rate=150, poison_rate=0.1)
    run: Run = (ModelA if model == "a" else ModelB)(pg_url, nats_server.url, nats_server, workload)
    result = run.run()
    lost, phantom, duplicates = outcome(run, nats_server)
    print(f"model {model} poison: offered={result.poisoned} dead={result.dead} "
          f"failed={result.failed} lost={len(lost)} phantom={len(phantom)}")  # fmt: skip
    assert not lost and not phantom and duplicates == 0
    assert result.poisoned > 0
    if isinstance(run, ModelA):
        assert run.dead_ids() == poison_rows(pg_url), "exactly the poison rows are dead"
        assert result.dead == result.poisoned - poison_rolled_back(workload)
    else:
        assert result.failed == result.poisoned and result.dead == 0


def poison_rows(db: str) -> set[str]:
    engine = create_engine(db)
    query = select(outbox_message.c.msg_id).where(
        func.length(outbox_message.c.payload) == len(POISON)
    )
    try:
        with engine.connect() as conn:
            return {str(m) for m in conn.execute(query).scalars()}
    finally:
        engine.dispose()


def poison_rolled_back(w: Workload) -> int:
    return sum(w.poisoned(i) and w.rolls_back(i) for i in range(w.transactions))
