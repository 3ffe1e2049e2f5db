"""Reconcile the outbox ledger against what the broker holds, on Spark.

For a window [start, end) and an SLA (default 60 s), per topic and in total:
committed (ledger rows created in the window), delivered, pending (not at the broker
yet but younger than the SLA at the window's end: not lost), lost, dead (given up
by the sweeper), duplicated (extra copies of a msg_id at the broker), phantom (at the
broker in the window, with no ledger row at all), malformed (ledger rows without a
usable msg_id), and commit->broker latency p50/p90/p99/max.

Runs locally (``outbox reconcile``) and unchanged under ``spark-submit
spark_jobs/reconcile.py ...``; tables are never collected whole into the driver,
only the aggregates. Exit status 2 when lost or phantom > 0, for schedulers; 1 when
the job failed (a missing input or column is found before Spark starts).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from itertools import pairwise
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from outbox.config import iso_time, scrub
from spark_jobs.schema import BROKER, HALFOP_LOG, LEDGER, RECORDS

EXIT_FAILED, EXIT_DISCREPANCY = 1, 2
LATENCY_BUCKETS_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 60000)


class JobError(Exception):
    """The job cannot finish: an input is missing or unusable, or Spark failed."""


@dataclass(frozen=True)
class Window:
    start: datetime
    end: datetime
    sla_s: float = 60.0

    @property
    def pending_after(self) -> datetime:
        return self.end - timedelta(seconds=self.sla_s)


def classify(ledger: DataFrame, broker: DataFrame, window: Window) -> DataFrame:
    """One row per msg_id in question, with its kind and details (the discrepancies and more).

    One full outer join of the ledger with the broker's copies per msg_id gives both
    the committed side (delivered, pending, lost, dead) and the phantoms.
    """
    valid = ledger.where(F.col("msg_id").isNotNull() & (F.length("msg_id") > 0))
    in_broker_window = (F.col("broker_ts") >= F.lit(window.start)) & (
        F.col("broker_ts") < F.lit(window.end)
    )
    copies = broker.groupBy("msg_id").agg(  # entries without a msg_id group together: a phantom
        F.count(F.lit(1)).alias("copies"),
        F.sum(F.when(in_broker_window, 1).otherwise(0)).alias("copies_in_window"),
        F.min("broker_ts").alias("first_ts"),
        F.first("topic").alias("broker_topic"),
    )
    in_ledger = F.col("created_at").isNotNull()
    in_window = (F.col("created_at") >= F.lit(window.start)) & (
        F.col("created_at") < F.lit(window.end)
    )
    phantom = ~in_ledger & (F.col("copies_in_window") > 0)
    kind = (
        F.when(~in_ledger, F.lit("phantom"))
        .when(F.col("copies").isNotNull(), F.lit("delivered"))
        .when(F.col("status") == "dead", F.lit("dead"))
        .when(F.col("created_at") >= F.lit(window.pending_after), F.lit("pending"))
        .otherwise(F.lit("lost"))
    )
    judged = (
        valid.select("msg_id", "topic", "status", "created_at")
        .join(copies, "msg_id", "full_outer")
        .where((in_ledger & in_window) | phantom)
        .select(
            "msg_id",
            F.when(in_ledger, F.col("topic")).otherwise(F.col("broker_topic")).alias("topic"),
            kind.alias("kind"),
            F.when(in_ledger, F.coalesce("copies", F.lit(0)))
            .otherwise(F.col("copies_in_window"))
            .alias("copies"),
            latency_ms(F.col("first_ts"), F.col("created_at")).alias("latency_ms"),
            F.when(in_ledger, F.col("status")).otherwise(F.lit("no ledger row")).alias("details"),
        )
    )
    malformed = ledger.where(F.col("msg_id").isNull() | (F.length("msg_id") == 0)).select(
        "msg_id", "topic", F.lit(0).alias("copies"), "id"
    )
    malformed = labelled(
        malformed, "malformed", F.concat(F.lit("ledger id "), F.col("id").cast("string"))
    )
    return judged.unionByName(malformed)


def labelled(frame: DataFrame, kind: str, details: Column) -> DataFrame:
    return frame.select(
        "msg_id",
        "topic",
        F.lit(kind).alias("kind"),
        "copies",
        F.lit(None).cast("double").alias("latency_ms"),
        details.alias("details"),
    )


def latency_ms(broker_ts: Column, created_at: Column) -> Column:
    return (broker_ts.cast("double") - created_at.cast("double")) * 1000


def summarise(classified: DataFrame) -> dict[str, Any]:
    """Counts per topic and in total, and latency percentiles of delivered messages."""
    kinds = ("delivered", "pending", "lost", "dead", "phantom", "malformed")
    aggs = [F.sum(F.when(F.col("kind") == k, 1).otherwise(0)).alias(k) for k in kinds]
    aggs += [
        F.sum(F.when(F.col("kind") != "phantom", 1).otherwise(0)).alias("committed"),
        F.sum(F.when(F.col("copies") > 1, F.col("copies") - 1).otherwise(0)).alias("duplicated"),
        F.percentile_approx(
            F.when(F.col("kind") == "delivered", F.col("latency_ms")), [0.5, 0.9, 0.99]
        ).alias("lat"),
        F.max(F.when(F.col("kind") == "delivered", F.col("latency_ms"))).alias("latency_max_ms"),
        *histogram_aggs(),
    ]
    rows = (
        classified.withColumn("topic", F.coalesce("topic", F.lit("?")))
        .rollup("topic")
        .agg(*aggs)
        .collect()
    )
    summary: dict[str, Any] = {"topics": {}, "total": {}}
    for row in rows:
        data = row.asDict()
        buckets = [(label, int(data.pop(label) or 0)) for label in histogram_labels()]
        lat = data.pop("lat") or [None, None, None]
        data.update(latency_p50_ms=lat[0], latency_p90_ms=lat[1], latency_p99_ms=lat[2])
        data["committed"] -= data["malformed"]
        topic = data.pop("topic")
        clean = {k: (int(v) if isinstance(v, int) else v) for k, v in data.items()}
        if topic is None:
            summary["total"], summary["latency_histogram"] = clean, buckets
        else:
            summary["topics"][topic] = clean
    return summary


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


def run(
    spark: SparkSession,
    ledger_path: str,
    broker_path: str,
    out: str | Path,
    window: Window,
    halfop_path: str | None = None,
) -> dict[str, Any]:
    """Read the inputs, write summary.json, discrepancies/ and report.html.

    With ``halfop_path`` the run is for model B: ``ledger_path`` then holds the
    SqlTransactionListener's records, and the half/op log adds model B's counts.
    """
    from spark_jobs import model_b
    from spark_jobs.ledger import read_ledger
    from spark_jobs.report import write_report

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if halfop_path is None:
        ledger = read_ledger(spark, ledger_path)
    else:
        # read by the ledger and by model B's counts: grouped once
        per_msg = model_b.halfs_per_message(spark.read.parquet(halfop_path)).cache()
        ledger = model_b.ledger_from_records(spark.read.parquet(ledger_path), per_msg)
    classified = classify(ledger, spark.read.parquet(broker_path), window).cache()
    summary = summarise(classified)
    if halfop_path is not None:
        model_b.add_counts(summary, model_b.halfop_counts(per_msg, window))
        per_msg.unpersist()
    summary["window"] = {
        "start": window.start.isoformat(),
        "end": window.end.isoformat(),
        "sla_s": window.sla_s,
    }
    write_discrepancies(classified, out / "discrepancies")
    classified.unpersist()
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    write_report(out / "report.html", summary)
    return summary


def write_discrepancies(classified: DataFrame, path: Path) -> None:
    """msg_id, kind, topic, copies, details of every row that is not a clean delivery."""
    wrong = classified.where(
        F.col("kind").isin("lost", "phantom", "dead", "malformed") | (F.col("copies") > 1)
    )
    kind = F.when(F.col("kind") == "delivered", F.lit("duplicated")).otherwise(F.col("kind"))
    wrong.withColumn("kind", kind).select(
        "msg_id", "kind", "topic", "copies", "details"
    ).write.mode("overwrite").parquet(str(path))


def check_inputs(ledger: str, broker_log: str, halfop_log: str | None, out: str) -> None:
    """Each local Parquet input exists and has the columns the job reads.

    Remote paths (hdfs://, s3a://) and a JDBC ledger are left to Spark to judge.
    """
    if not is_remote(ledger):  # also skips a postgresql:// ledger
        require_columns("--ledger", ledger, LEDGER if halfop_log is None else RECORDS)
    if not is_remote(broker_log):
        require_columns("--broker-log", broker_log, BROKER)
    if halfop_log is not None and not is_remote(halfop_log):
        require_columns("--halfop-log", halfop_log, HALFOP_LOG)
    if not is_remote(out) and Path(out).is_file():
        raise JobError(f"--out {out}: a file, not a folder")


def is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def require_columns(flag: str, path: str, expected: pa.Schema) -> None:
    have = set(parquet_schema(flag, path).names)
    missing = [name for name in expected.names if name not in have]
    if missing:
        raise JobError(f"{flag} {path}: missing column(s) {', '.join(missing)}")


def parquet_schema(flag: str, path: str) -> pa.Schema:
    """The schema of a Parquet file, or of the first part file of a folder of them."""
    source = Path(path.removeprefix("file://"))
    if source.is_dir():
        parts = sorted(p for p in source.rglob("*.parquet") if not p.name.startswith(("_", ".")))
        if not parts:
            raise JobError(f"{flag} {path}: no Parquet file in the folder")
        source = parts[0]
    elif not source.exists():
        raise JobError(f"{flag} {path}: no such file or folder")
    try:
        return pq.read_schema(source)
    except (pa.ArrowException, OSError) as exc:
        raise JobError(f"{flag} {path}: not a Parquet file ({exc})") from None


def build_parser(prog: str = "reconcile") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument(
        "--ledger", required=True, help="ledger Parquet, or a postgresql:// URL read over JDBC"
    )
    parser.add_argument(
        "--broker-log", required=True, help="Parquet of the broker log (outbox export broker)"
    )
    parser.add_argument(
        "--halfop-log",
        help="model B: Parquet of the half/op streams (outbox export halfop); --ledger is "
        "then the listener's records (outbox export records)",
    )
    parser.add_argument(
        "--out", required=True, help="folder for summary.json, discrepancies/, report.html"
    )
    parser.add_argument("--start", type=iso_time, required=True, help="window start, ISO 8601")
    parser.add_argument("--end", type=iso_time, required=True, help="window end, ISO 8601")
    parser.add_argument(
        "--sla", type=float, default=60.0, help="seconds before a missing message is lost"
    )
    parser.add_argument(
        "--master", default=None, help="Spark master (default: local[*], or spark-submit's)"
    )
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "reconcile") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.end <= args.start:
        parser.error("--end must be after --start")
    try:
        check_inputs(args.ledger, args.broker_log, args.halfop_log, args.out)
        summary = run_on_spark(args)
    except JobError as exc:  # Spark's text may echo an input's URL, credentials and all
        inputs = [args.ledger, args.broker_log, args.halfop_log]
        print(scrub(f"{prog}: {exc}", inputs), file=sys.stderr)
        return EXIT_FAILED
    total = summary["total"]
    print(json.dumps(total, default=str))
    return EXIT_DISCREPANCY if total.get("lost") or total.get("phantom") else 0


def run_on_spark(args: argparse.Namespace) -> dict[str, Any]:
    """``run`` in a session of its own; what Spark raises becomes one line."""
    from py4j.protocol import Py4JJavaError  # type: ignore[import-untyped]
    from pyspark.errors import PySparkException

    builder = SparkSession.builder.appName("outbox-reconcile").config(
        "spark.sql.session.timeZone", "UTC"
    )
    if args.master:
        builder = builder.master(args.master)
    if args.ledger.startswith("postgresql"):
        from spark_jobs.ledger import with_jdbc_jar

        builder = with_jdbc_jar(builder)
    spark = builder.getOrCreate()
    try:
        window = Window(args.start, args.end, args.sla)
        return run(spark, args.ledger, args.broker_log, args.out, window, args.halfop_log)
    except Py4JJavaError as exc:  # its text is the whole Java stack
        raise JobError(first_line(exc.java_exception.toString())) from None
    except PySparkException as exc:
        raise JobError(first_line(str(exc))) from None
    finally:
        spark.stop()


def first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "Spark failed"


if __name__ == "__main__":
    sys.exit(main())
