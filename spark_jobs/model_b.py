"""Model B (half/op) inputs for the reconciliation.

The business truth is SqlTransactionListener's table: a transaction committed if and
only if its record exists. The records become the ledger that ``classify`` reads, with
the real topic taken from the message's half, so model B is judged by the same rules
as the outbox: a committed transaction's message missing at the broker past the SLA
is lost (a half discarded after too many checks is one way to get there), and a
message at the broker without a committed transaction is a phantom.

The half/op log (``outbox export halfop``) adds what only model B has: halfs and
their put-back copies, op messages, check-backs, unresolved and discarded halfs.
"""

from __future__ import annotations

from typing import Any

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from spark_jobs.window import Window

COUNTS = ("halfs", "half_writes", "ops", "checks", "unresolved", "discarded")


def of_stream(log: DataFrame, stream: str) -> DataFrame:
    return log.where(F.col("stream") == stream)


def halfs_per_message(log: DataFrame) -> DataFrame:
    """One row per msg_id with a half: topic, first written, copies, checks, ops, discarded."""
    halfs = (
        of_stream(log, "half")
        .groupBy("msg_id")
        .agg(
            F.first("topic").alias("topic"),
            F.min("broker_ts").alias("born"),
            F.count(F.lit(1)).alias("copies"),
            F.max("check_times").alias("checks"),
        )
    )
    ops = of_stream(log, "op").groupBy("msg_id").agg(F.count(F.lit(1)).alias("ops"))
    gone = of_stream(log, "discarded").select("msg_id").distinct().withColumn("gone", F.lit(1))
    return halfs.join(ops, "msg_id", "left").join(gone, "msg_id", "left")


def ledger_from_records(records: DataFrame, per_msg: DataFrame) -> DataFrame:
    """The listener's records in the ledger's shape (id, msg_id, topic, status, created_at)."""
    status = F.when(F.col("gone").isNotNull(), F.lit("discarded")).otherwise(F.lit("committed"))
    return records.join(per_msg.select("msg_id", "topic", "gone"), "msg_id", "left").select(
        F.lit(None).cast("long").alias("id"),
        "msg_id",
        "topic",
        status.alias("status"),
        "created_at",
    )


def halfop_counts(per_msg: DataFrame, window: Window) -> dict[str | None, dict[str, int]]:
    """Per real topic (None: in total), for the halfs first written in the window."""
    born_in_window = (F.col("born") >= F.lit(window.start)) & (F.col("born") < F.lit(window.end))
    settled = F.col("ops").isNotNull() | F.col("gone").isNotNull()
    rows = (
        per_msg.where(born_in_window)
        .withColumn("topic", F.coalesce("topic", F.lit("?")))
        .rollup("topic")
        .agg(
            F.count(F.lit(1)).alias("halfs"),
            F.sum("copies").alias("half_writes"),
            F.sum(F.coalesce("ops", F.lit(0))).alias("ops"),
            F.sum(F.coalesce("checks", F.lit(0))).alias("checks"),
            F.sum(F.when(settled, 0).otherwise(1)).alias("unresolved"),
            F.sum(F.coalesce("gone", F.lit(0))).alias("discarded"),
        )
        .collect()
    )
    return {row["topic"]: {k: int(row[k] or 0) for k in COUNTS} for row in rows}


def add_counts(summary: dict[str, Any], counts: dict[str | None, dict[str, int]]) -> None:
    """Put model B's counts beside the common ones, per topic and in total."""
    zero = dict.fromkeys(COUNTS, 0)
    summary["model"] = "b"
    summary["total"].update(counts.get(None, zero))
    for topic, data in summary["topics"].items():
        data.update(counts.get(topic, zero))
    for topic, data in counts.items():
        if topic is not None and topic not in summary["topics"]:
            summary["topics"][topic] = dict(data)  # only rolled-back transactions here
