"""What the night audits: the ``--topic`` filter on both sides, and the topics no
stream at the broker captures (not audited: never counted as lost).

The broker log export records, in its Parquet metadata, the subjects each stream it
read captures (spark_jobs.topics.SOURCES_KEY). A ledger message of a topic none of them
captures cannot be at the broker in that export: it is ``unaudited``, its topic a
finding of its own, never lost nor stuck. An export without that record (older, or
not a local file) audits every topic as before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from spark_jobs.topics import patterns_regex

# Kinds of a ledger message that a stream capturing its topic would have settled.
AUDITED = ("lost", "stuck", "pending")


def narrowed(frame: DataFrame, topics: Sequence[str]) -> DataFrame:
    """Only the rows whose topic matches one of ``topics`` (all rows without any)."""
    if not topics:
        return frame
    return frame.where(F.coalesce(F.col("topic"), F.lit("")).rlike(patterns_regex(topics)))


def with_unaudited(
    classified: DataFrame, captures: Mapping[str, Sequence[str]] | None
) -> DataFrame:
    """``classified`` with the lost, stuck and pending messages of topics no stream
    captures as ``unaudited`` (details: "no stream at the broker captures the topic")."""
    if captures is None:
        return classified
    subjects = [s for listed in captures.values() for s in listed]
    captured = F.col("topic").rlike(patterns_regex(subjects)) if subjects else F.lit(False)
    missed = F.col("kind").isin(*AUDITED) & F.col("topic").isNotNull() & ~captured
    return classified.withColumn(
        "details",
        F.when(missed, F.lit("no stream at the broker captures the topic")).otherwise(
            F.col("details")
        ),
    ).withColumn("kind", F.when(missed, F.lit("unaudited")).otherwise(F.col("kind")))
