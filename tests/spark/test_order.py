"""Out-of-order deliveries per key: found from the broker log's Outbox-Seq, counted, listed,
and failing the run as lost and phantom messages do; skipped messages are not expected."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyspark.sql import SparkSession

from outbox.message import Message, build_message
from relay import export
from relay.testing.harness import broker_under_test
from spark_jobs.reconciliation import reconcile
from spark_jobs.schema import BROKER, LEDGER
from spark_jobs.window import Window

OUTBOX = str(Path(sys.executable).with_name("outbox"))
T0 = datetime(2026, 3, 1, tzinfo=UTC)
WINDOW = Window(T0, T0 + timedelta(hours=1), sla_s=60)
Row = dict[str, Any]


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def committed(msg_id: str, when: float = 1, status: str = "sent", topic: str = "t.a") -> Row:
    return {"id": int(msg_id[1:]), "msg_id": msg_id, "topic": topic, "status": status,
            "created_at": at(when), "sent_at": None, "attempts": 1, "receipt": None}  # fmt: skip


def stored(place: str | int, msg_id: str, key: str | None = None, seq: int | None = None) -> Row:
    """A broker log row at ``place`` (its position, as the export writes it)."""
    return {"msg_id": msg_id, "topic": "t.a", "seq": str(place), "broker_ts": at(2),
            "key": key, "outbox_seq": seq}  # fmt: skip


def lane(key: str, seqs: Sequence[int], first_place: int = 8) -> list[Row]:
    """A key's deliveries in this order, msg_id m<seq>, from ``first_place`` on (8: the
    places cross 9 -> 10, where text order and number order part)."""
    return [stored(first_place + i, f"m{s}", key, s) for i, s in enumerate(seqs)]


def write(path: Path, rows: list[Row], schema: pa.Schema) -> str:
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return str(path)


def inputs(tmp_path: Path, ledger: list[Row], broker: list[Row]) -> tuple[str, str]:
    return (
        write(tmp_path / "ledger.parquet", ledger, LEDGER),
        write(tmp_path / "broker.parquet", broker, BROKER),
    )


def run(
    spark: SparkSession, tmp_path: Path, ledger: list[Row], broker: list[Row]
) -> tuple[dict[str, Any], list[Row]]:
    """The reconciliation's totals and its discrepancies, as (kind, msg_id, key, seq,
    after_seq, details) rows."""
    out = tmp_path / "out"
    summary = reconcile(spark, *inputs(tmp_path, ledger, broker), out, WINDOW)
    found = pq.read_table(out / "discrepancies").to_pylist()
    columns = ("kind", "msg_id", "key", "seq", "after_seq", "details")
    return summary["total"], sorted(({c: r[c] for c in columns} for r in found), key=str)


def test_a_lower_seq_after_a_higher_one_is_out_of_order(
    spark: SparkSession, tmp_path: Path
) -> None:
    broker = lane("K", [1, 2, 4, 3, 5])
    total, found = run(spark, tmp_path, [committed(f"m{s}") for s in range(1, 6)], broker)
    assert (total["delivered"], total["out_of_order"], total["duplicated"]) == (5, 1, 0)
    assert found == [{"kind": "out_of_order", "msg_id": "m3", "key": "K", "seq": 3,
                      "after_seq": 4, "details": "seq 3 after 4"}]  # fmt: skip
    page = (tmp_path / "out" / "report.html").read_text()
    assert (
        'id="out-of-order"' in page
        and '<td class="text">m3</td>' in page
        and "DISCREPANCIES" in page
    )


def test_a_later_copy_is_a_duplicate_not_out_of_order(spark: SparkSession, tmp_path: Path) -> None:
    broker = [*lane("K", [1, 2, 3, 4, 5]), stored(20, "m2", "K", 2)]  # m2 again after m5
    total, found = run(spark, tmp_path, [committed(f"m{s}") for s in range(1, 6)], broker)
    assert (total["delivered"], total["out_of_order"], total["duplicated"]) == (5, 0, 1)
    assert [(r["kind"], r["msg_id"], r["key"], r["seq"]) for r in found] == [
        ("duplicated", "m2", "K", 2)
    ]
    assert "OK" in (tmp_path / "out" / "report.html").read_text()


def test_keys_interleaved_in_order_are_in_order(spark: SparkSession, tmp_path: Path) -> None:
    """Redis entry ids in one millisecond: ``ms-9`` comes before ``ms-10``."""
    order = [("A", 1), ("B", 1), ("A", 2), ("B", 2), ("B", 3), ("A", 3)]
    broker = [
        stored(f"1772323200000-{8 + i}", f"m{10 * (key == 'B') + s}", key, s)
        for i, (key, s) in enumerate(order)
    ]
    ledger = [committed(r["msg_id"]) for r in broker]
    total, found = run(spark, tmp_path, ledger, broker)
    assert (total["delivered"], total["out_of_order"], found) == (6, 0, [])


def test_messages_without_outbox_seq_are_not_checked(spark: SparkSession, tmp_path: Path) -> None:
    broker = [
        stored(1, "m3", "K"), stored(2, "m2", "K"), stored(3, "m1"),  # unordered, any order
        stored(4, "m5", "K", 5), stored(5, "m4", "K"),  # an unordered message of an ordered key
        stored(6, "m7", None, 2), stored(7, "m6", None, 1),  # a seq without a key: not a lane
    ]  # fmt: skip
    total, found = run(spark, tmp_path, [committed(f"m{i}") for i in range(1, 8)], broker)
    assert (total["delivered"], total["out_of_order"], found) == (7, 0, [])


def test_earlier_deliveries_of_the_key_count_from_before_the_window(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Seq 5 committed and delivered before the window, seq 3 in it: seq 3 is late."""
    ledger = [committed("m5", when=-30), committed("m3")]
    total, found = run(spark, tmp_path, ledger, [stored(1, "m5", "K", 5), stored(2, "m3", "K", 3)])
    assert (total["committed"], total["out_of_order"]) == (1, 1)
    assert [(r["kind"], r["msg_id"], r["after_seq"]) for r in found] == [("out_of_order", "m3", 5)]


def test_a_skipped_message_is_not_expected_at_the_broker(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Seq 2 given up by an operator (`outbox skip`): 1 and 3 delivered, nothing lost."""
    ledger = [committed("m1"), committed("m2", status="skipped"), committed("m3")]
    total, found = run(spark, tmp_path, ledger, lane("K", [1, 3]))
    assert (total["committed"], total["delivered"], total["skipped"]) == (3, 2, 1)
    assert (total["lost"], total["out_of_order"]) == (0, 0)
    assert [(r["kind"], r["msg_id"], r["details"]) for r in found] == [("skipped", "m2", "skipped")]
    assert "OK" in (tmp_path / "out" / "report.html").read_text()


def test_outbox_reconcile_exits_3_on_out_of_order_alone(tmp_path: Path) -> None:
    ledger, broker = inputs(
        tmp_path, [committed(f"m{s}") for s in range(1, 6)], lane("K", [1, 2, 4, 3, 5])
    )
    out = tmp_path / "report"
    cmd = [OUTBOX, "reconcile", "--ledger", ledger, "--broker-log", broker, "--out", str(out)]
    cmd += ["--start", WINDOW.start.isoformat(), "--end", WINDOW.end.isoformat()]
    done = subprocess.run(
        [*cmd, "--master", "local[1]"], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 3, done.stdout + done.stderr[-3000:]
    total = json.loads((out / "summary.json").read_text())["total"]
    assert (total["lost"], total["phantom"], total["out_of_order"]) == (0, 0, 1)


def ordered(topic: str, key: str, seqs: Sequence[int]) -> list[Message]:
    messages = [
        build_message(topic, {"n": s}, key=key, ordered=True, max_payload_bytes=1000) for s in seqs
    ]
    return [dataclasses.replace(m, seq=s) for m, s in zip(messages, seqs, strict=True)]


@pytest.mark.parametrize("kind", ["nats", "redis", "rabbitmq"])
def test_out_of_order_found_in_a_real_broker_export(
    kind: str, spark: SparkSession, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Published through the adapter, exported, reconciled: key A in order (12 in one batch,
    Redis ids in one millisecond), key B as 1, 2, 4, 3, 5, one unordered message."""
    server = request.getfixturevalue("nats_server") if kind == "nats" else None
    with broker_under_test(kind, nats_server=server) as bt:
        topic = f"{bt.prefix}.orders"
        a, b = ordered(topic, "A", range(1, 13)), ordered(topic, "B", [1, 2, 4, 3, 5])
        loose = build_message(topic, {}, key="B", max_payload_bytes=1000)
        begun = datetime.now(UTC)

        async def publish() -> None:
            broker = bt.make()
            await broker.connect()
            try:
                for batch in (a, b, [loose]):
                    assert all(r.ok for r in await broker.publish(batch))
            finally:
                await broker.close()

        asyncio.run(publish())
        log = tmp_path / "broker.parquet"
        assert export.export_broker(bt.reader, bt.sources(), log) == 18
    held = pq.read_table(log).to_pylist()
    assert [(r["key"], r["outbox_seq"]) for r in held[12:]] == [
        ("B", 1), ("B", 2), ("B", 4), ("B", 3), ("B", 5), ("B", None)
    ]  # fmt: skip
    ledger = [
        {**committed("m1"), "id": i, "msg_id": m.msg_id, "topic": topic, "created_at": begun}
        for i, m in enumerate([*a, *b, loose])
    ]
    window = Window(begun - timedelta(minutes=1), begun + timedelta(minutes=5), sla_s=60)
    ledger_path = write(tmp_path / "ledger.parquet", ledger, LEDGER)
    summary = reconcile(spark, ledger_path, str(log), tmp_path / "out", window)
    total = summary["total"]
    assert (total["delivered"], total["lost"], total["out_of_order"]) == (18, 0, 1)
    [late] = pq.read_table(tmp_path / "out" / "discrepancies").to_pylist()
    assert (late["kind"], late["msg_id"], late["key"], late["seq"], late["after_seq"]) == (
        "out_of_order", b[3].msg_id, "B", 3, 4
    )  # fmt: skip
