"""Real traffic through the outbox, then tampering at the broker, export and reconcile."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import nats
from sqlalchemy.orm import Session

from outbox import Outbox, migrate
from relay.embedded import NatsServer
from tests.helpers import wait_until

OUTBOX = str(Path(sys.executable).with_name("outbox"))


def test_deleted_and_extra_broker_messages_are_counted_exactly(
    pg_url: str, nats_server: NatsServer, stream: tuple[str, str], tmp_path: Path
) -> None:
    name, prefix = stream
    migrate.upgrade(pg_url)
    start = datetime.now(UTC) - timedelta(seconds=1)
    ob = Outbox(
        pg_url, broker=f"{nats_server.url}?stream={name}&subjects={prefix}.>", sweeper=False
    )
    ob.start()
    with Session(ob.engine) as session, session.begin():
        for i in range(300):
            ob.send(session, f"{prefix}.orders", {"n": i})
    wait_until(lambda: ob.stats is not None and ob.stats.marked == 300, what="all delivered")
    ob.stop()

    async def tamper() -> None:
        nc = await nats.connect(nats_server.url)
        js = nc.jetstream()
        for seq in (5, 50, 150, 299):  # lost at the broker
            await js.delete_msg(name, seq)
        for i in range(3):  # published by nobody's transaction
            await js.publish(f"{prefix}.orders", b"{}", headers={"Nats-Msg-Id": f"phantom-{i}"})
        await nc.close()

    asyncio.run(tamper())
    end = datetime.now(UTC) + timedelta(seconds=120)  # the SLA has passed for every message
    ledger, broker, out = (
        tmp_path / "ledger.parquet",
        tmp_path / "broker.parquet",
        tmp_path / "report",
    )
    for args in (
        ["export", "ledger", "--db", pg_url, "--out", str(ledger)],
        ["export", "broker", "--broker", nats_server.url, "--stream", name, "--out", str(broker)],
    ):
        done = subprocess.run(
            [OUTBOX, *args], capture_output=True, text=True, timeout=120, check=False
        )
        assert done.returncode == 0, done.stderr
    reconcile = [OUTBOX, "reconcile", "--ledger", str(ledger), "--broker-log", str(broker)]
    reconcile += ["--out", str(out), "--start", start.isoformat(), "--end", end.isoformat()]
    reconcile += ["--sla", "60", "--master", "local[2]"]
    done = subprocess.run(reconcile, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 2, done.stdout + done.stderr  # lost and phantom found: alert
    total = json.loads((out / "summary.json").read_text())["total"]
    assert (total["committed"], total["delivered"], total["lost"]) == (300, 296, 4)
    assert (total["phantom"], total["duplicated"], total["pending"]) == (3, 0, 0)
    assert total["latency_p50_ms"] is not None and total["latency_p50_ms"] >= 0

    # The same ledger read straight from PostgreSQL over JDBC, in id ranges.
    by_jdbc = [arg if arg != str(ledger) else pg_url for arg in reconcile]
    by_jdbc[by_jdbc.index(str(out))] = str(tmp_path / "report-jdbc")
    done = subprocess.run(by_jdbc, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    jdbc_total = json.loads((tmp_path / "report-jdbc" / "summary.json").read_text())["total"]
    assert jdbc_total == total
