"""The README's nightly line, run as written against a real deployment's shape: two
services (warehouse.* and shop.* topics) writing to one database, each family in a
JetStream stream of its own, the relay publishing; another app's stream at the same
server holds what this database never wrote. The night audits both streams and leaves the
other app's alone: no false alarm (exit 0, lost 0, phantom 0); a message deleted from a
stream is lost (exit 3, lost 1)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
from pathlib import Path

import nats
from sqlalchemy import text
from sqlalchemy.orm import Session

from outbox import Outbox, migrate
from relay.brokers.nats import create_stream
from relay.cli import main
from relay.testing.embedded import NatsServer

ROOT = Path(__file__).resolve().parents[2]
NIGHTLY = "python -m examples.nightly_reconcile.schedule"


def nightly_line(readme: Path) -> str:
    """The line of ``readme`` that runs the nightly example."""
    lines = [ln.strip() for ln in readme.read_text().splitlines()]
    [line] = [ln for ln in lines if ln.startswith(NIGHTLY) and "--once" in ln]
    return line


def test_the_readme_runs_what_the_example_readme_runs() -> None:
    line = nightly_line(ROOT / "README.md")
    assert line == nightly_line(ROOT / "examples" / "nightly_reconcile" / "README.md")
    flags = re.findall(r"--[a-z-]+", line)
    assert flags == ["--once", "--db", "--broker", "--out"], flags


def send(db: str, topic: str, count: int) -> None:
    """A service of its own (its own Outbox) commits ``count`` messages of ``topic``."""
    ob = Outbox(db)
    with Session(ob.engine) as session, session.begin():
        for n in range(count):
            ob.send(session, topic, {"n": n})
    ob.engine.dispose()


async def publish_elsewhere(url: str) -> None:
    """Another app's message, in a stream that captures none of this ledger's topics."""
    nc = await nats.connect(url)
    try:
        await nc.jetstream().publish("billing.invoice", b"{}", headers={"Nats-Msg-Id": "b-1"})
    finally:
        await nc.close()


async def delete_one(url: str, stream: str) -> None:
    nc = await nats.connect(url)
    try:
        await nc.jetstream().delete_msg(stream, 2)
    finally:
        await nc.close()


def run_nightly(db: str, broker: str, out: Path) -> tuple[int, dict[str, int], str]:
    line = nightly_line(ROOT / "README.md").replace("/tmp/outbox-nightly", str(out))
    env = {**os.environ, "OUTBOX_DB": db, "OUTBOX_BROKER": broker}
    python = Path(os.environ.get("VIRTUAL_ENV", ROOT / ".venv")) / "bin" / "python"
    line = line.replace("python ", f"{python} ", 1)
    done = subprocess.run(["bash", "-c", line], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600, check=False)  # fmt: skip
    [summary] = out.glob("*/report/summary.json")
    return done.returncode, json.loads(summary.read_text())["total"], done.stdout + done.stderr


def test_the_nightly_line_audits_two_streams_of_two_services(
    pg_url: str, nats_server: NatsServer, tmp_path: Path
) -> None:
    migrate.upgrade(pg_url)
    create_stream(nats_server.url, "WAREHOUSE", "warehouse.>")
    create_stream(nats_server.url, "SHOP", "shop.*")
    create_stream(nats_server.url, "BILLING", "billing.>")  # another app's
    asyncio.run(publish_elsewhere(nats_server.url))
    send(pg_url, "warehouse.inbound", 6)
    send(pg_url, "shop.order", 4)
    assert main(["drain", "--db", pg_url, "--broker", nats_server.url]) == 0
    engine = Outbox(pg_url).engine
    with engine.begin() as conn:  # committed ten minutes ago: past the SLA, judged
        conn.execute(
            text("UPDATE outbox_message SET created_at = created_at - INTERVAL '10 minutes'")
        )
    engine.dispose()

    code, total, said = run_nightly(pg_url, nats_server.url, tmp_path / "clean")
    assert code == 0, said
    assert (total["committed"], total["delivered"], total["lost"]) == (10, 10, 0), said
    assert total["phantom"] == 0 and total["unaudited"] == 0

    asyncio.run(delete_one(nats_server.url, "SHOP"))
    code, total, said = run_nightly(pg_url, nats_server.url, tmp_path / "deleted")
    assert code == 3, said
    assert (total["committed"], total["delivered"], total["lost"]) == (10, 9, 1), said
