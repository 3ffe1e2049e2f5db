"""`outbox export`'s progress without a terminal: running totals per chunk, exact counts.

In process (relay.cli.main), with small chunks and a zero interval so a small export
has several lines; against PostgreSQL and a NATS stream of the test's own.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from sqlalchemy import create_engine
from sqlalchemy.pool import NullPool

from outbox import migrate
from outbox.message import build_message
from relay import export
from relay.brokers import base
from relay.cli import main, progress
from relay.testing.embedded import NatsServer
from relay.testing.harness import broker_under_test
from tests.planting import plant


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(export, "CHUNK", 40)
    monkeypatch.setattr(base, "LOG_CHUNK", 40)
    monkeypatch.setattr(progress, "SUMMARY_EVERY_S", 0.0)  # a line after every chunk


def totals(err: str, what: str) -> list[str]:
    pattern = re.compile(rf"^{what}: (.+) \([\d,]+ rows/s\)$")
    return [m[1] for line in err.splitlines() if (m := pattern.match(line))]


def test_ledger_export_counts_up_to_the_ledgers_rows(
    pg_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    migrate.upgrade(pg_url)
    engine = create_engine(pg_url, poolclass=NullPool)
    for _ in range(100):
        plant(engine, "orders.placed")
    engine.dispose()
    out = tmp_path / "ledger.parquet"
    assert main(["export", "ledger", "--db", pg_url, "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert totals(captured.err, "export ledger") == ["40/100", "80/100", "100/100"], captured.err
    assert captured.out == f"exported 100 row(s) to {out}\n"


def test_broker_export_counts_without_a_total(
    nats_server: NatsServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with broker_under_test("nats", nats_server=nats_server) as nats:
        messages = [
            build_message(f"{nats.prefix}.x", {"n": i}, max_payload_bytes=1000) for i in range(90)
        ]

        async def publish() -> None:
            broker = nats.make()
            await broker.connect()
            try:
                assert all(r.ok for r in await broker.publish(messages))
            finally:
                await broker.close()

        asyncio.run(publish())
        out = tmp_path / "broker.parquet"
        args = ["export", "broker", "--broker", str(nats.url), "--stream", nats.sources()[0]]
        assert main([*args, "--out", str(out)]) == 0
    captured = capsys.readouterr()
    shown = totals(captured.err, "export broker")
    assert shown[-1] == "90 rows" and len(shown) >= 3, captured.err  # chunks of 40 at most
    assert captured.out == f"exported 90 row(s) to {out}, 0 malformed\n"
