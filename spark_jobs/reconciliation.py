"""The reconciliation on Spark: classify every msg_id of the window, sum it up, report.

``spark_jobs.reconcile_job`` is the job's entry (its flags, ``main`` for spark-submit and
``run`` for `outbox reconcile`); this module is what it runs.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import StructField, StructType

from spark_jobs import ordering
from spark_jobs.cells import safe_columns
from spark_jobs.window import Window

LATENCY_BUCKETS_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 60000)
# The latency sketches' size: the percentiles' rank error is about 0.07% (KLL's bound),
# near enough to the 0.01% of percentile_approx's default, at a fraction of its cost.
KLL_K = 4000
PERCENTILES = (("latency_p50_ms", 0.5), ("latency_p90_ms", 0.9), ("latency_p99_ms", 0.99))
KINDS = ("delivered", "pending", "stuck", "scheduled", "lost", "dead", "skipped", "canceled",
         "phantom", "malformed", "malformed_at_broker", "unaudited")  # fmt: skip
# kinds discrepancies/ lists
FOUND = ("lost", "stuck", "phantom", "dead", "skipped", "malformed", "malformed_at_broker")
# Kinds of the broker's side alone: no ledger row, not counted as committed.
BROKER_ONLY = ("phantom", "malformed_at_broker")
LISTED = 20  # findings of each kind report.html shows; discrepancies/ has them all
# discrepancies/ and discrepancies.csv: one row per finding, in this column order.
FINDING_COLUMNS = ("kind", "msg_id", "topic", "created_at", "details", "attempts", "copies",
                   "first_at_broker", "key", "seq", "after_seq")  # fmt: skip


def classify(ledger: DataFrame, broker: DataFrame, window: Window) -> DataFrame:
    """One row per msg_id in question, with its kind and details (the discrepancies and more).

    One full outer join of the ledger with the broker's copies per msg_id gives both
    the committed side (delivered, pending, stuck, scheduled, lost, dead, skipped,
    canceled) and the phantoms. Missing at the broker past the SLA, a row still pending
    in the table is stuck (undelivered: the sweeper may still publish it), any other
    (marked sent, or model B's committed record) is lost. A scheduled message is judged
    from its due time (``due_at``): not expected before it, so pending within the SLA
    after it and scheduled while it is at or after the window's end, never late for
    waiting; canceled ones are never expected. Each
    msg_id's first copy, in its key's lane, says whether it came out of order
    (``after_seq``, spark_jobs.ordering): judged over the whole log, so a key's earlier
    deliveries count even when they are older than the window. A ledger row without a
    usable msg_id is malformed, counted in the window of its commit. A broker entry the
    relay cannot have written (its ``malformed`` column set by the export) is
    malformed_at_broker, counted in the window of its broker_ts (or always, without
    one); it matches no ledger row, so it is never delivered nor a phantom.
    """
    ledger = with_ledger_columns(ledger)
    valid = ledger.where(F.col("msg_id").isNotNull() & (F.length("msg_id") > 0))
    broker = with_broker_columns(broker)
    strangers = broker.where(F.col("malformed").isNotNull())
    broker = broker.where(F.col("malformed").isNull())
    copies = broker_copies(broker, window).join(ordering.first_deliveries(broker), "msg_id", "left")
    in_ledger = F.col("created_at").isNotNull()
    in_window = (F.col("created_at") >= F.lit(window.start)) & (
        F.col("created_at") < F.lit(window.end)
    )
    phantom = ~in_ledger & (F.col("copies_in_window") > 0)
    kind = (
        F.when(~in_ledger, F.lit("phantom"))
        .when(F.col("copies").isNotNull(), F.lit("delivered"))
        .when(F.col("status") == "dead", F.lit("dead"))
        .when(F.col("status") == "skipped", F.lit("skipped"))  # given up: not expected
        .when(F.col("status") == "canceled", F.lit("canceled"))  # by the app: never expected
        .when(still_scheduled(window), F.lit("scheduled"))
        .when(due_at() >= F.lit(window.pending_after), F.lit("pending"))
        .when(F.col("status") == "pending", F.lit("stuck"))  # the sweeper's to deliver
        .otherwise(F.lit("lost"))
    )
    ledger_order = (F.col("key").alias("ledger_key"), F.col("seq").alias("ledger_seq"))
    judged = (
        valid.select(
            "msg_id", "topic", "status", "created_at", "deliver_at", "attempts", *ledger_order
        )
        .join(copies, "msg_id", "full_outer")
        .where((in_ledger & in_window) | phantom)
        .select(
            "msg_id",
            F.when(in_ledger, F.col("topic")).otherwise(F.col("broker_topic")).alias("topic"),
            kind.alias("kind"),
            F.when(in_ledger, F.coalesce("copies", F.lit(0)))
            .otherwise(F.col("copies_in_window"))
            .alias("copies"),
            latency_ms(F.col("first_ts"), due_at()).alias("latency_ms"),
            F.when(in_ledger, F.col("status")).otherwise(F.lit("no ledger row")).alias("details"),
            F.coalesce(F.col("first.key"), F.col("ledger_key")).alias("key"),
            F.coalesce(F.col("first.seq"), F.col("ledger_seq")).alias("seq"),
            "after_seq",
            "created_at",
            publish_attempts().alias("attempts"),
            F.col("first_ts").alias("first_at_broker"),
        )
    )
    judged = with_held_by(judged, dead_heads(valid))
    unusable = F.col("msg_id").isNull() | (F.length("msg_id") == 0)
    malformed = ledger.where(unusable & in_window).select(
        "msg_id", "topic", F.lit(0).alias("copies"), "id", "created_at", "attempts"
    )
    malformed = labelled(
        malformed, "malformed", F.concat(F.lit("ledger id "), F.col("id").cast("string"))
    )
    strangers = malformed_entries(strangers, window)
    return judged.unionByName(malformed, allowMissingColumns=True).unionByName(
        strangers, allowMissingColumns=True
    )


def publish_attempts() -> Column:
    """The publishes of a ledger row: the table's ``attempts`` counts the failed ones the
    relay recorded (the sweeper's; the fast path's retries in memory leave no trace), so a
    row marked sent had one more, the one the broker acked."""
    return F.col("attempts") + F.when(F.col("status") == "sent", 1).otherwise(0)


def dead_heads(ledger: DataFrame) -> DataFrame:
    """Per ordered (topic, key) with a dead row: its first dead row, ``head`` (seq,
    msg_id). The relay publishes a key's rows in seq order, so its pending rows after
    that one wait for an operator (`outbox requeue` or `outbox skip`)."""
    dead = F.col("seq").isNotNull() & (F.col("status") == "dead")
    return (
        ledger.where(dead)
        .groupBy("topic", "key")
        .agg(F.min(F.struct("seq", "msg_id")).alias("head"))
    )


def with_held_by(judged: DataFrame, heads: DataFrame) -> DataFrame:
    """``judged`` with ``held_by``: for a row still pending in the table (pending or stuck)
    behind its key's dead head, that head as "<msg_id> (<topic>/<key> seq <seq>)"; else null.
    Such a row is blocked: counted as such besides its kind."""
    waiting = F.col("kind").isin("pending", "stuck") & (F.col("details") == "pending")
    behind = waiting & (F.col("seq") > F.col("head.seq"))
    head = F.format_string("%s (%s/%s seq %d)", "head.msg_id", "topic", "key", "head.seq")
    joined = judged.join(F.broadcast(heads), ["topic", "key"], "left")
    return joined.withColumn("held_by", F.when(behind, head)).drop("head")


def with_broker_columns(broker: DataFrame) -> DataFrame:
    """The broker log with ``malformed`` (and ``seq`` as text): null where the export
    had none (an export made before malformed entries were kept)."""
    if "malformed" not in broker.columns:
        broker = broker.withColumn("malformed", F.lit(None).cast("string"))
    return broker


def malformed_entries(strangers: DataFrame, window: Window) -> DataFrame:
    """One malformed_at_broker row per entry the relay cannot have written, stored in the
    window (or without a broker time): its salvaged msg_id (or null), topic, and why and
    where in ``details`` ("<reason> (entry <seq>)"); the rest of its fields are in the
    broker log's ``raw`` column."""
    in_window = F.col("broker_ts").isNull() | (
        (F.col("broker_ts") >= F.lit(window.start)) & (F.col("broker_ts") < F.lit(window.end))
    )
    where = F.concat(F.lit(" (entry "), F.coalesce(F.col("seq").cast("string"), F.lit("?")))
    return strangers.where(in_window).select(
        "msg_id",
        "topic",
        F.lit("malformed_at_broker").alias("kind"),
        F.lit(1).cast("long").alias("copies"),
        F.lit(None).cast("double").alias("latency_ms"),
        F.concat(F.col("malformed"), where, F.lit(")")).alias("details"),
        F.lit(None).cast("string").alias("key"),
        F.lit(None).cast("bigint").alias("seq"),
        F.lit(None).cast("bigint").alias("after_seq"),
        F.lit(None).cast("timestamp").alias("created_at"),
        F.lit(None).cast("int").alias("attempts"),
        F.col("broker_ts").alias("first_at_broker"),
    )


def broker_copies(broker: DataFrame, window: Window) -> DataFrame:
    """Per msg_id: its ``copies``, ``copies_in_window``, ``first_ts`` and ``broker_topic``.

    Every buffer is a number, so Spark aggregates by hash: a text one (first(topic))
    would sort the whole log twice. The topic is aggregated as its hash (the least, when
    copies disagree) and looked up again among the log's few topics.
    """
    in_broker_window = (F.col("broker_ts") >= F.lit(window.start)) & (
        F.col("broker_ts") < F.lit(window.end)
    )
    topic_hash = F.when(F.col("topic").isNotNull(), F.xxhash64("topic"))
    topics = (
        broker.select("topic")
        .distinct()
        .select(F.col("topic").alias("broker_topic"), topic_hash.alias("topic_hash"))
    )
    counted = broker.groupBy("msg_id").agg(
        F.count(F.lit(1)).alias("copies"),  # entries without a msg_id group together: a phantom
        F.sum(F.when(in_broker_window, 1).otherwise(0)).alias("copies_in_window"),
        F.min("broker_ts").alias("first_ts"),
        F.min(topic_hash).alias("topic_hash"),
    )
    return counted.join(F.broadcast(topics), "topic_hash", "left").drop("topic_hash")


def without_earlier_commits(
    spark: SparkSession, ledger_path: str, classified: DataFrame, window: Window
) -> DataFrame:
    """``classified`` without the phantoms that have a ledger row outside the span read
    (a commit older than --lookback, delivered in the window): the whole ledger would
    have matched them, and a ledger row committed outside the window counts nowhere. So
    the results are those of a read of the whole ledger; --lookback only spares lookups."""
    from spark_jobs.ledger import LOOKUP_CAP, committed_outside

    usable = F.col("msg_id").isNotNull() & (F.length("msg_id") > 0)  # as classify's join
    phantoms = classified.where((F.col("kind") == "phantom") & usable)
    found = committed_outside(spark, ledger_path, phantoms.select("msg_id"), window)
    if found is None:
        return classified
    found = found.cache()
    count = found.count()
    if not count:
        found.unpersist()
        return classified
    # left_anti: a row with a null msg_id (malformed, the null phantom) matches nothing,
    # and only phantoms go: a stranger's entry may carry a real msg_id, it stays reported.
    ids = found.select(F.col("msg_id").alias("found_id"))
    match = (F.col("msg_id") == F.col("found_id")) & (F.col("kind") == "phantom")
    if count <= LOOKUP_CAP:  # the usual case: broadcast, the classification stays put
        return classified.join(F.broadcast(ids), match, "left_anti")
    return classified.join(ids, match, "left_anti").cache()  # a shuffle: done once


def with_ledger_columns(ledger: DataFrame) -> DataFrame:
    """The ledger with ``deliver_at``: null where the export had none (older exports,
    model B's records): every message then is due at its commit. And ``attempts``, null
    where there are none (model B's records), and an ordered message's ``key`` and ``seq``,
    null where the export had none."""
    if "deliver_at" not in ledger.columns:
        ledger = ledger.withColumn("deliver_at", F.lit(None).cast("timestamp"))
    if "attempts" not in ledger.columns:
        ledger = ledger.withColumn("attempts", F.lit(None).cast("int"))
    for name, kind in (("key", "string"), ("seq", "bigint")):  # exported before them
        if name not in ledger.columns:
            ledger = ledger.withColumn(name, F.lit(None).cast(kind))
    return ledger


def due_at() -> Column:
    """When a message was due: its deliver_at if later than its commit, else its commit
    (a past deliver_at given at send means now). Its latency and SLA count from here."""
    later = F.col("deliver_at") > F.col("created_at")
    return F.when(later, F.col("deliver_at")).otherwise(F.col("created_at"))


def still_scheduled(window: Window) -> Column:
    """Still pending and not due before the window's end: not expected at the broker yet."""
    return (F.col("status") == "pending") & (F.col("deliver_at") >= F.lit(window.end))


def labelled(frame: DataFrame, kind: str, details: Column) -> DataFrame:
    return frame.select(
        "msg_id",
        "topic",
        F.lit(kind).alias("kind"),
        "copies",
        F.lit(None).cast("double").alias("latency_ms"),
        details.alias("details"),
        F.lit(None).cast("string").alias("key"),
        F.lit(None).cast("bigint").alias("seq"),
        F.lit(None).cast("bigint").alias("after_seq"),
        "created_at",
        "attempts",
        F.lit(None).cast("timestamp").alias("first_at_broker"),
    )


def latency_ms(broker_ts: Column, created_at: Column) -> Column:
    return (broker_ts.cast("double") - created_at.cast("double")) * 1000


def summarise(classified: DataFrame) -> dict[str, Any]:
    """Counts per topic and in total, and latency percentiles of delivered messages.

    One grouped pass over the classification: per topic, numeric counts and a KLL sketch of
    the latencies (DataSketches, built into Spark); the totals then come from the few
    topic rows, the sketches merged. ``out_of_order`` counts the messages whose first
    delivery came after a later one of their key; they are counted among delivered (or
    phantom) too. ``blocked`` counts the pending and stuck ones held by a dead row of
    their key (``held_by``).
    """
    delivered = F.col("kind") == "delivered"
    counts = [F.sum(F.when(F.col("kind") == k, 1).otherwise(0)).alias(k) for k in KINDS]
    counts += [
        F.sum(F.when(~F.col("kind").isin(*BROKER_ONLY), 1).otherwise(0)).alias("committed"),
        F.sum(F.when(F.col("copies") > 1, F.col("copies") - 1).otherwise(0)).alias("duplicated"),
        F.sum(F.when(F.col("after_seq").isNotNull(), 1).otherwise(0)).alias("out_of_order"),
        F.sum(F.when(F.col("held_by").isNotNull(), 1).otherwise(0)).alias("blocked"),
    ]
    per_topic = (
        classified.withColumn("topic", F.coalesce("topic", F.lit("?")))
        .groupBy("topic")
        .agg(
            *counts,
            F.max(F.when(delivered, F.col("latency_ms"))).alias("latency_max_ms"),
            *histogram_aggs(),
            F.kll_sketch_agg_double(F.when(delivered, F.col("latency_ms")), F.lit(KLL_K)).alias(
                "sketch"
            ),
        )
        .cache()  # a row per topic: read twice, for the topics and for the totals
    )
    names = [c for c in per_topic.columns if c not in ("topic", "sketch")]
    topics = per_topic.select("topic", *names, *quantiles(F.col("sketch"))).collect()
    summed = [(F.max if n == "latency_max_ms" else F.sum)(n).alias(n) for n in names]
    merged = F.kll_merge_agg_double("sketch", F.lit(KLL_K))
    totals = per_topic.agg(*summed, *quantiles(merged)).collect()
    per_topic.unpersist()
    if not topics:  # no message at all (an empty range): zeros, not nulls
        summary: dict[str, Any] = {"topics": {}, "total": empty_total()}
        summary["latency_histogram"] = [(label, 0) for label in histogram_labels()]
        return summary
    summary = {"topics": {}}
    for row in topics:
        data = row.asDict()
        topic = data.pop("topic")
        summary["topics"][topic] = summary_row(data)[0]
    summary["total"], summary["latency_histogram"] = summary_row(totals[0].asDict())
    return summary


def quantiles(sketch: Column) -> list[Column]:
    """The percentiles of a KLL sketch; null for one without a value (no delivery)."""
    empty = F.kll_sketch_get_n_double(sketch) == 0
    return [
        F.when(~empty, F.kll_sketch_get_quantile_double(sketch, F.lit(q))).alias(name)
        for name, q in PERCENTILES
    ]


def summary_row(data: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[str, int]]]:
    """A topic's or the totals' figures (committed without malformed rows) and its latency
    histogram."""
    buckets = [(label, int(data.pop(label) or 0)) for label in histogram_labels()]
    data["committed"] -= data["malformed"]
    return {k: (int(v) if isinstance(v, int) else v) for k, v in data.items()}, buckets


def empty_total() -> dict[str, Any]:
    """The totals of a window without a message, keys in the order summarise gives them."""
    counts = dict.fromkeys([*KINDS, "committed", "duplicated", "out_of_order", "blocked"], 0)
    latencies = ("latency_max_ms", "latency_p50_ms", "latency_p90_ms", "latency_p99_ms")
    return {**counts, **dict.fromkeys(latencies)}


def histogram_aggs() -> list[Column]:
    """One count per latency bucket of delivered messages, computed in the summary's pass."""
    delivered = F.col("kind") == "delivered"
    edges = [float("-inf"), *LATENCY_BUCKETS_MS, float("inf")]
    return [
        F.sum(
            F.when(
                delivered & (F.col("latency_ms") > lo) & (F.col("latency_ms") <= hi), 1
            ).otherwise(0)
        ).alias(label)
        for (lo, hi), label in zip(pairwise(edges), histogram_labels(), strict=True)
    ]


def histogram_labels() -> list[str]:
    return [f"<={e}" for e in LATENCY_BUCKETS_MS] + [f">{LATENCY_BUCKETS_MS[-1]}"]


def reconcile(
    spark: SparkSession,
    ledger_path: str,
    broker_path: str,
    out: str | Path,
    window: Window,
    halfop_path: str | None = None,
    step: Callable[[str], None] = lambda _: None,
    links: list[tuple[str, str]] | None = None,
    topics: Sequence[str] = (),
    captures: Mapping[str, Sequence[str]] | None = None,
) -> dict[str, Any]:
    """Read the inputs, write summary.json, discrepancies/ (Parquet), discrepancies.csv
    and report.html (``links``: its links to related pages, (label, relative href)).
    ``topics``: patterns both sides are narrowed to; ``captures``: the subjects of each
    stream the broker log was read from, for the unaudited topics (spark_jobs.audit).

    With ``halfop_path`` the run is for model B: ``ledger_path`` then holds the
    SqlTransactionListener's records, and the half/op log adds model B's counts.
    ``step`` is told each step once done, with its counts (rows read, joined, written).
    """
    from spark_jobs import model_b
    from spark_jobs.audit import narrowed, with_unaudited
    from spark_jobs.ledger import count_ledger, is_postgres, read_ledger
    from spark_jobs.report import write_report
    from spark_jobs.session import input_bytes, size_shuffles

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    size_shuffles(spark, input_bytes(spark, sized_inputs(ledger_path, broker_path, halfop_path)))
    broker = narrowed(spark.read.parquet(broker_path), topics)
    if halfop_path is None:
        ledger = narrowed(read_ledger(spark, ledger_path, window), topics)
        if is_postgres(ledger_path):
            read = f"read {count_ledger(spark, ledger_path, ledger, window)} ledger rows"
            entries = broker.count()
        else:
            rows, entries = both_counted(ledger, broker)
            read = f"read {rows} ledger rows"
    else:
        # read by the ledger and by model B's counts: grouped once
        halfop, records = spark.read.parquet(halfop_path), spark.read.parquet(ledger_path)
        per_msg = model_b.halfs_per_message(halfop).cache()
        ledger = model_b.ledger_from_records(records, per_msg)
        read = f"read {records.count()} records, {halfop.count()} half/op entries"
        entries = broker.count()
    step(f"{read}, {entries} broker log entries")
    classified = first = classify(ledger, broker, window).cache()
    if halfop_path is None:  # model B reads every record: it has no span
        classified = without_earlier_commits(spark, ledger_path, classified, window)
    classified = with_unaudited(classified, captures)
    summary = summarise(classified)  # Spark joins here: the long step
    total = summary["total"]
    step(f"joined {total['committed'] + total['phantom']} messages: " + outcome(total))
    if halfop_path is not None:
        model_b.add_counts(summary, model_b.halfop_counts(per_msg, window))
        per_msg.unpersist()
    summary["window"] = {
        "start": window.start.isoformat(),
        "end": window.end.isoformat(),
        "sla_s": window.sla_s,
        **({"topics": list(topics)} if topics else {}),
    }
    written, found = write_discrepancies(classified, out / "discrepancies")
    listed = first_out_of_order(classified) if summary["total"].get("out_of_order") else []
    classified.unpersist()
    first.unpersist()
    write_csv(spark, out / "discrepancies", out / "discrepancies.csv", found)
    findings = first_findings(spark, out / "discrepancies", found) if written else {}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    write_report(out / "report.html", summary, out_of_order=listed, findings=findings, links=links)
    step(f"wrote {written} discrepancies, summary.json and report.html to {out}")
    return summary


def both_counted(ledger: DataFrame, broker: DataFrame) -> tuple[int, int]:
    """The rows of ``ledger`` and of ``broker``, in one Spark job (two counts are two)."""
    side = F.col("side")
    sides = ledger.select(F.lit(0).alias("side")).unionByName(broker.select(F.lit(1).alias("side")))
    row = sides.agg(F.count(F.when(side == 0, 1)), F.count(F.when(side == 1, 1))).first()
    return (int(row[0]), int(row[1])) if row else (0, 0)


def sized_inputs(ledger_path: str, broker_path: str, halfop_path: str | None) -> list[str]:
    """The Parquet inputs whose bytes size the shuffles; a ledger read over JDBC counts
    as big as the broker log (about one row per message each)."""
    from spark_jobs.ledger import is_postgres

    ledger = broker_path if is_postgres(ledger_path) else ledger_path
    return [ledger, broker_path, *([halfop_path] if halfop_path else [])]


def outcome(total: dict[str, Any]) -> str:
    """The counts a reader looks for first, in a step line; dead ones (and the pending
    ones they block) and malformed entries at the broker when there are any."""
    names = ("delivered", "pending", "stuck", "lost", "phantom")
    said = ", ".join(f"{total.get(name) or 0} {name}" for name in names)
    if dead := total.get("dead"):
        said += f", {dead} dead"
    if blocked := total.get("blocked"):
        said += f" ({blocked} pending behind a dead one of their key)"
    strangers = total.get("malformed_at_broker") or 0
    return said + (f", {strangers} malformed at the broker" if strangers else "")


def write_discrepancies(classified: DataFrame, path: Path) -> tuple[int, StructType]:
    """One row per finding (FINDING_COLUMNS: what is known of the message: its ledger
    row's commit time, status and attempts, its copies at the broker and the first
    one's time, its key and seq) for every message that is not a clean delivery: lost,
    stuck, phantom, dead, skipped, malformed or duplicated, and out of order or blocked
    besides (then a row more each: a blocked row's details name its dead head); returns
    how many, and their schema (read back with it, Spark need not open a file to infer
    it: a job less each time)."""
    kind = F.when(F.col("kind").isin(*FOUND), F.col("kind")).when(
        F.col("copies") > 1, F.lit("duplicated")
    )
    late = F.when(F.col("after_seq").isNotNull(), F.lit("out_of_order"))
    blocked = F.when(F.col("held_by").isNotNull(), F.lit("blocked"))
    found = classified.withColumn(
        "kind", F.explode(F.filter(F.array(kind, late, blocked), lambda k: k.isNotNull()))
    )
    came_after = F.format_string("seq %d after %d", F.col("seq"), F.col("after_seq"))
    held = F.concat(F.lit("behind dead "), F.col("held_by"))
    details = (
        F.when(F.col("kind") == "out_of_order", came_after)
        .when(F.col("kind") == "blocked", held)
        .otherwise(F.col("details"))
    )
    columns = [details.alias("details") if c == "details" else c for c in FINDING_COLUMNS]
    written = found.select(*columns)
    written.write.mode("overwrite").parquet(str(path))
    schema = nullable(written.schema)  # as Parquet files give it back
    spark = classified.sparkSession
    return findings_at(spark, path, schema).count(), schema  # Parquet's footers: cheap


def nullable(schema: StructType) -> StructType:
    return StructType([StructField(f.name, f.dataType, True, f.metadata) for f in schema])


def findings_at(spark: SparkSession, parquet: Path, schema: StructType | None) -> DataFrame:
    """discrepancies/ as written; with its ``schema`` (write_discrepancies'), read as is."""
    reader = spark.read if schema is None else spark.read.schema(schema)
    return reader.parquet(str(parquet))


def write_csv(
    spark: SparkSession, parquet: Path, path: Path, schema: StructType | None = None
) -> None:
    """discrepancies/ as one CSV file with a header, sorted by kind, topic and msg_id:
    Spark writes it (in one task: no row reaches the driver), then its part file moves."""
    parts = path.with_name(path.name + ".parts")
    found = findings_at(spark, parquet, schema).coalesce(1)
    found = found.sortWithinPartitions("kind", "topic", "msg_id")
    safe_columns(found).write.mode("overwrite").csv(
        str(parts),
        header=True,
        escape='"',  # a quote in a field doubled (RFC 4180), as spreadsheets and csv read it
        timestampFormat="yyyy-MM-dd HH:mm:ss.SSSXXX",
        ignoreLeadingWhiteSpace=False,  # each cell as safe_columns made it: by default
        ignoreTrailingWhiteSpace=False,  # the writer drops whitespace, the guard's too
    )
    written = sorted(parts.glob("part-*"))
    if written and written[0].stat().st_size:
        written[0].replace(path)
    else:  # no finding: Spark writes no header
        path.write_text(",".join(FINDING_COLUMNS) + "\n")
    shutil.rmtree(parts)


def first_findings(
    spark: SparkSession, parquet: Path, schema: StructType | None = None
) -> dict[str, list[dict[str, Any]]]:
    """The first ``LISTED`` findings of each kind report.html lists, by commit time (a
    top-N per kind on the executors: only those rows reach the driver)."""
    from pyspark.sql import Window as W

    from spark_jobs.report import LISTED_KINDS

    order = W.partitionBy("kind").orderBy(
        F.col("created_at").asc_nulls_last(), F.col("first_at_broker"), F.col("msg_id")
    )
    shown = "yyyy-MM-dd HH:mm:ss.SSSXXX"  # in the session's time zone, UTC for the jobs
    rows = (
        findings_at(spark, parquet, schema)
        .where(F.col("kind").isin(*LISTED_KINDS))
        .withColumn("n", F.row_number().over(order))
        .where(F.col("n") <= LISTED)
        .withColumn("created_at", F.date_format("created_at", shown))
        .withColumn("first_at_broker", F.date_format("first_at_broker", shown))
        .orderBy("kind", "n")
        .collect()
    )
    found: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        found.setdefault(row["kind"], []).append(row.asDict())
    return found


def first_out_of_order(classified: DataFrame) -> list[dict[str, Any]]:
    """The first ``LISTED`` out-of-order deliveries by topic, key and seq, for the report
    (a top-N per partition: the table itself stays on the executors)."""
    late = classified.where(F.col("after_seq").isNotNull())
    columns = ("topic", "key", "msg_id", "seq", "after_seq")
    rows = late.select(*columns).orderBy("topic", "key", "seq").limit(LISTED).collect()
    return [row.asDict() for row in rows]
