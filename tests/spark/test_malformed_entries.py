"""Strangers' entries in a Redis stream: `outbox export broker` keeps them as malformed
rows (it used to exit 1 with a traceback and no Parquet), and the reconciliation over
that Parquet reports them as a discrepancy, never as delivered messages."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis
from pyspark.sql import SparkSession

from outbox.broker import Broker
from outbox.message import Message, build_message
from relay.cli import main
from relay.testing.harness import broker_under_test
from spark_jobs import reconcile_job, reconciliation, schema
from spark_jobs.window import Window

# The entries: headers that are not JSON, JSON that is not an object, an
# Outbox-Seq of the wrong type, a msg_id that is not UTF-8.
STRANGERS = [
    {b"msg_id": b"s-1", b"payload": b"x", b"headers": b"{"},
    {b"msg_id": b"s-2", b"payload": b"x", b"headers": b"[1,2]"},
    {b"msg_id": b"s-3", b"payload": b"x", b"headers": b'{"Outbox-Seq": 5}'},
    {b"msg_id": b"\xff\xfe", b"payload": b"x", b"headers": b"{}"},
]


def test_strangers_entries_are_exported_as_malformed_and_reconciled_as_a_discrepancy(
    spark: SparkSession, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    now = datetime.now(UTC)
    with broker_under_test("redis") as bt:
        topic = f"{bt.prefix}.orders"
        good = [build_message(topic, {"n": n}, max_payload_bytes=1000) for n in range(3)]
        asyncio.run(publish(bt.make(), good))
        client = redis.Redis.from_url("redis://127.0.0.1:6379/0")
        # one more stranger copies the msg_id of a late delivery (committed long before)
        copied = {b"msg_id": good[2].msg_id.encode(), b"payload": b"x", b"headers": b"5"}
        for fields in [*STRANGERS, copied]:
            client.xadd(f"{bt.prefix}:{topic}", fields)  # type: ignore[arg-type]
        client.close()
        out = tmp_path / "broker.parquet"
        args = ["export", "broker", "--broker", str(bt.url), "--topic", topic]
        assert main([*args, "--out", str(out)]) == 0

    said = capsys.readouterr().out
    assert said.startswith(f"exported 8 row(s) to {out}, 5 malformed (entries"), said
    rows = pq.read_table(out).to_pylist()
    ids = [m.msg_id for m in good]
    assert [r["msg_id"] for r in rows] == [*ids, "s-1", "s-2", "s-3", None, ids[2]]
    assert [r["malformed"] for r in rows] == [
        None,
        None,
        None,
        "headers b'{' are not JSON",
        "headers are a JSON list, not an object",
        "header 'Outbox-Seq' is int, not text",
        "msg_id b'\\xff\\xfe' is not UTF-8",
        "headers are a JSON int, not an object",
    ]
    assert json.loads(rows[6]["raw"])["msg_id"] == "\\xff\\xfe"  # escaped, printable
    assert all(r["raw"] is None for r in rows[:3]) and all(r["raw"] for r in rows[3:])

    ledger = tmp_path / "ledger.parquet"
    long_before = now - timedelta(hours=3)  # before --lookback: looked up as a phantom
    pq.write_table(ledger_of(good[:2], now - timedelta(seconds=1), good[2:], long_before), ledger)
    window = Window(now - timedelta(hours=1), now + timedelta(hours=1), 60)
    folder = tmp_path / "out"
    summary = reconciliation.reconcile(spark, str(ledger), str(out), folder, window)
    total = summary["total"]
    assert (total["committed"], total["delivered"], total["phantom"]) == (2, 2, 0)
    assert total["malformed_at_broker"] == 5 and total["malformed"] == 0
    assert summary["topics"][topic]["malformed_at_broker"] == 5
    assert reconcile_job.exit_status(total) == 3  # a discrepancy
    found = spark.read.parquet(str(folder / "discrepancies")).collect()
    assert sorted(r["details"] for r in found) == sorted(
        f"{r['malformed']} (entry {r['seq']})" for r in rows[3:]
    )
    assert {r["kind"] for r in found} == {"malformed_at_broker"}
    page = (folder / "report.html").read_text()
    assert 'id="verdict">DISCREPANCIES<' in page
    assert "5 malformed at the broker" in page
    assert "malformed_at_broker" in (folder / "discrepancies.csv").read_text()


async def publish(broker: Broker, messages: list[Message]) -> None:
    await broker.connect()
    try:
        results = await broker.publish(messages)
        assert all(r.ok for r in results)
    finally:
        await broker.close()


def ledger_of(
    messages: list[Message], created: datetime, earlier: list[Message], before: datetime
) -> pa.Table:
    """The relay's ledger: ``messages`` committed and sent at ``created``, ``earlier``
    ones at ``before``."""
    stamped = [(m, created) for m in messages] + [(m, before) for m in earlier]
    rows = [
        {"id": n, "msg_id": m.msg_id, "topic": m.topic, "status": "sent",
         "created_at": at, "sent_at": at, "attempts": 1}
        for n, (m, at) in enumerate(stamped, start=1)
    ]  # fmt: skip
    return pa.Table.from_pylist(rows, schema=schema.LEDGER)
