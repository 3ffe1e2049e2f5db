"""What failed and why, from the command line: drain's reasons, `outbox dead`, `outbox show`.

Real processes against PostgreSQL and MariaDB, nats-server for the broker's refusals.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from sqlalchemy import create_engine
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from outbox import Outbox, migrate
from relay.testing.embedded import NatsServer

OUTBOX = str(Path(sys.executable).with_name("outbox"))
BIG = b"x" * (1024 * 1024)  # with its headers, over nats-server's 1 MiB max_payload


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([OUTBOX, *args], capture_output=True, text=True, timeout=120, check=False)


def commit(db: str, topic: str, payloads: list[bytes], **extra: object) -> list[str]:
    """Messages committed as an app that raised its size limit commits them."""
    migrate.upgrade(db)
    engine = create_engine(db, poolclass=NullPool)
    ob = Outbox(engine, max_payload_bytes=2 * 1024 * 1024)
    with Session(engine) as session, session.begin():
        ids = [ob.send(session, topic, p, **extra) for p in payloads]  # type: ignore[arg-type]
    engine.dispose()
    return ids


def test_drain_groups_its_failures_by_reason(
    pg_url: str, nats_server: NatsServer, stream: tuple[str, str]
) -> None:
    name, prefix = stream
    commit(pg_url, f"{prefix}.ok", [b"{}"] * 3)
    commit(pg_url, f"{prefix}.big", [BIG] * 5)
    commit(pg_url, "elsewhere.x", [b"{}"] * 2)  # no stream captures it: refused for good
    broker = f"{nats_server.url}?stream={name}&subjects={prefix}.>"
    done = cli("drain", "--db", pg_url, "--broker", broker)
    assert done.returncode == 1, done.stderr  # failures left: not clean
    lines = done.stdout.splitlines()
    assert lines[0].startswith("drained: sent=3 retry_later=0 dead=7 of 10 pending"), lines
    assert re.fullmatch(r"  5 x permanent: .*MaxPayload.* \(dead\)", lines[1]), lines
    refused = r"  2 x permanent: no JetStream stream captures .* \(dead\)"
    assert re.fullmatch(refused, lines[2]), lines
    assert len(lines) == 3, lines
