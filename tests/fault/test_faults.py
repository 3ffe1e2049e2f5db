"""The fault suite: each fault of `outbox compare` against each model that has it.

A scenario runs a short paced workload (real PostgreSQL, the wheel's nats-server,
traffic through a TCP proxy) with one fault in the middle, waits until it settles,
and compares the model's own ledger with the real stream: lost = 0 and phantom = 0
always, and no duplicates (JetStream drops a second copy inside its dedup window).
"""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy.orm import Session

from outbox import Outbox, migrate
from relay.brokers.nats import read_stream
from relay.compare import FAULTS, ModelA, ModelB, Run, Workload
from relay.embedded import NatsServer
from tests.helpers import wait_until

SCENARIOS = [(model, fault) for fault, models in FAULTS.items() for model in models]


def outcome(run: Run, server: NatsServer) -> tuple[set[str], set[str], int]:
    """(lost, phantom, duplicates) of a finished run."""
    committed = run.committed_ids()
    stored = [m.msg_id or "" for m in asyncio.run(read_stream(server.url, run.stream))]
    return committed - set(stored), set(stored) - committed, len(stored) - len(set(stored))


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
        assert run.killer.killed > 0 and stats is not None and stats.mark_failed > 0
        print(f"  marks killed={run.killer.killed} acks left for the sweeper={stats.mark_failed}")


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
