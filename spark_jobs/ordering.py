"""Out-of-order deliveries per key, from the broker log's ``Outbox-Seq``.

A key's messages sent with ``ordered=True`` carry ``Outbox-Seq`` (1, 2, 3... in commit
order) and ``Outbox-Key``. Per (topic, key), each msg_id counts once, at its first
delivery (its lowest place in the broker's log); taken in the log's order, a delivery
whose seq is below the highest seq its key delivered before it is out of order. A later
copy of a msg_id is a duplicate, not a reordering. Messages without ``Outbox-Seq`` are
not checked. The rule of ``relay.testing.order``, on Spark: one window over one row
per msg_id, no collect.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

# The broker's place of an entry, as the export writes it (``LogEntry.seq``): a stream
# sequence or offset ("42"), or a Redis entry id, milliseconds and a counter ("1700-3").
PLACE = r"^(\d{1,20})(?:-(\d{1,20}))?$"
PART = "decimal(20,0)"  # an unsigned 64-bit number, as brokers count
# Columns an older export lacks (spark_jobs.schema.BROKER_OPTIONAL), as Spark types.
OPTIONAL_TYPES = {"key": "string", "outbox_seq": "bigint"}


def with_order_columns(broker: DataFrame) -> DataFrame:
    """The broker log with ``key`` and ``outbox_seq``; null where the export had none."""
    for name, kind in OPTIONAL_TYPES.items():
        if name not in broker.columns:
            broker = broker.withColumn(name, F.lit(None).cast(kind))
    return broker


def position(place: Column) -> Column:
    """An orderable place in the log, compared within a topic (a topic's entries share
    one log: a JetStream stream, a Redis stream, the RabbitMQ audit queue); null for a
    place of another shape. Two numbers, so Redis's ``ms-n`` sorts as the server does."""
    major = F.regexp_extract(place, PLACE, 1).cast(PART)
    minor = F.regexp_extract(place, PLACE, 2)
    at = F.struct(
        major.alias("major"),
        F.when(minor == "", F.lit(0)).otherwise(minor).cast(PART).alias("minor"),
    )
    return F.when(place.rlike(PLACE), at)


def first_deliveries(broker: DataFrame) -> DataFrame:
    """One row per msg_id whose copies carry ``key`` or ``outbox_seq``: its first delivery
    (``first_delivery()``) and ``after_seq``.

    Only those entries are aggregated here: a struct's minimum is a sort-based aggregate,
    too slow for the whole log, and a msg_id's copies carry the same headers (so one
    without either has none to check).
    """
    ordered = with_order_columns(broker).where(
        F.col("key").isNotNull() | F.col("outbox_seq").isNotNull()
    )
    firsts = ordered.groupBy("msg_id").agg(first_delivery())
    return with_after_seq(firsts, "first.topic")


def first_delivery() -> Column:
    """Aggregated per msg_id: its first copy's place, key, seq (null: not checked) and
    topic."""
    at = position(F.col("seq"))
    checked = (
        F.col("msg_id").isNotNull()
        & F.col("key").isNotNull()
        & F.col("outbox_seq").isNotNull()
        & at.isNotNull()
    )
    first = F.struct(
        at.alias("at"),
        F.col("key").alias("key"),
        F.when(checked, F.col("outbox_seq")).alias("seq"),
        F.col("topic").alias("topic"),
    )
    return F.min(first).alias("first")


def with_after_seq(copies: DataFrame, topic: str) -> DataFrame:
    """``copies`` (one row per msg_id, with ``first_delivery()``) and ``after_seq``: the
    highest seq its key delivered before it when that is above its own, else null.

    Unchecked messages each get a partition of their own (their msg_id), so they neither
    meet a key's lane nor pile up in one partition.
    """
    seq = F.col("first.seq")
    lane = (
        Window.partitionBy(F.col(topic), F.col("first.key"), F.when(seq.isNull(), F.col("msg_id")))
        .orderBy(F.col("first.at"))
        .rowsBetween(Window.unboundedPreceding, -1)
    )
    highest = F.max(seq).over(lane)
    return copies.withColumn("after_seq", F.when(seq < highest, highest))
