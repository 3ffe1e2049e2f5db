"""The night audits what the broker's streams capture: a topic no exported stream
captures is unaudited (its own finding, never lost), and ``--topic`` narrows both sides."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql import SparkSession

from spark_jobs import reconcile_job, reconciliation, schema
from spark_jobs.topics import SOURCES_KEY, read_captures, unaudited_lines
from spark_jobs.window import Window

START = datetime(2026, 1, 1, tzinfo=UTC)
HOUR = Window(START, START + timedelta(hours=1), 60)
CAPTURES = {"SHOP": ["shop.*"], "WAREHOUSE": ["warehouse.>"]}


def inputs(tmp_path: Path) -> tuple[str, str]:
    """shop.order: 3 sent, all at the broker; warehouse.in.x: 2 sent, 1 at the broker (1
    lost); billing.invoice: 2 sent, captured by no stream (2 unaudited, not lost)."""
    sent = [("shop.order", 3, 3), ("warehouse.in.x", 2, 1), ("billing.invoice", 2, 0)]
    ledger, broker = [], []
    for topic, committed, delivered in sent:
        for n in range(committed):
            at = START + timedelta(minutes=10, seconds=len(ledger))
            msg_id = f"{topic}-{n}"
            ledger.append(
                {"id": len(ledger) + 1, "msg_id": msg_id, "topic": topic, "status": "sent",
                 "created_at": at, "sent_at": at, "attempts": 0}
            )  # fmt: skip
            if n < delivered:
                broker.append({"msg_id": msg_id, "topic": topic, "seq": str(len(broker) + 1),
                               "broker_ts": at + timedelta(milliseconds=5),
                               "stream": topic.split(".")[0].upper()})  # fmt: skip
    paths = str(tmp_path / "ledger.parquet"), str(tmp_path / "broker.parquet")
    pq.write_table(pa.Table.from_pylist(ledger, schema=schema.LEDGER), paths[0])
    sources = {SOURCES_KEY: json.dumps(CAPTURES).encode()}
    pq.write_table(pa.Table.from_pylist(broker, schema=schema.BROKER.with_metadata(sources)),
                   paths[1])  # fmt: skip
    return paths


def test_unaudited_topics_are_not_lost_and_the_filter_narrows_both_sides(
    spark: SparkSession, tmp_path: Path
) -> None:
    ledger, broker = inputs(tmp_path)
    captures = read_captures(broker)
    assert captures == CAPTURES
    out = tmp_path / "all"
    summary = reconciliation.reconcile(spark, ledger, broker, out, HOUR, captures=captures)
    total = summary["total"]
    assert (total["committed"], total["delivered"], total["lost"], total["unaudited"]) == (
        7,
        4,
        1,
        2,
    )
    assert summary["topics"]["billing.invoice"]["lost"] == 0
    assert unaudited_lines(summary) == [
        "topic billing.invoice: no stream at the broker captures it, 2 messages not audited"
    ]
    assert reconcile_job.exit_status(total) == 3  # the lost warehouse message, only
    page = (out / "report.html").read_text()
    assert "topic billing.invoice: no stream at the broker captures it, 2 messages" in page

    out = tmp_path / "shop"
    summary = reconciliation.reconcile(
        spark, ledger, broker, out, HOUR, topics=["shop.*", "billing.>"], captures=captures
    )
    total = summary["total"]
    assert (total["committed"], total["delivered"], total["lost"], total["unaudited"]) == (
        5,
        3,
        0,
        2,
    )
    assert reconcile_job.exit_status(total) == 0  # unaudited: a warning, not an alarm
    assert summary["window"]["topics"] == ["shop.*", "billing.>"]
    assert "Topics shop.*, billing.&gt; only." in (out / "report.html").read_text()
