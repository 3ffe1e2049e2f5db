"""Synthetic ledger and broker-log Parquet of any size, with known injected faults.

Seeded and reproducible. Every committed message is delivered once unless picked
as lost (never at the broker), pending (committed within the SLA before the window's
end, not at the broker yet), or duplicated (two copies); phantoms are broker entries
with no ledger row. Broker timestamps can be skewed by up to ``skew_ms`` either way.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from spark_jobs import session

DEFAULT_START = datetime(2026, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class Plan:
    rows: int
    lost: int = 0
    duplicated: int = 0
    phantom: int = 0
    pending: int = 0
    skew_ms: int = 0
    seed: int = 7
    start: datetime = DEFAULT_START
    hours: float = 1.0
    sla_s: float = 60.0

    @property
    def end(self) -> datetime:
        return self.start + timedelta(hours=self.hours)


def pick(plan: Plan) -> tuple[set[int], set[int]]:
    """Disjoint lost and duplicated ids among the settled rows (not the pending tail)."""
    settled = plan.rows - plan.pending
    chosen = random.Random(plan.seed).sample(range(settled), plan.lost + plan.duplicated)
    return set(chosen[: plan.lost]), set(chosen[plan.lost :])


def msg_id(col: str, seed: int) -> Column:  # a UUID-shaped, unique, reproducible id
    return F.format_string(f"{seed:08x}-0000-7000-8000-%012x", F.col(col))


def ledger_frame(spark: SparkSession, plan: Plan) -> DataFrame:
    span_s = plan.hours * 3600 - plan.sla_s * 2  # settled rows end well before the SLA edge
    settled = plan.rows - plan.pending
    start = F.lit(plan.start).cast("double")
    created = F.when(
        F.col("id") < settled, start + F.col("id") * F.lit(span_s / max(settled, 1))
    ).otherwise(F.lit(plan.end.timestamp() - plan.sla_s / 2))  # pending: inside the SLA
    return spark.range(plan.rows).select(
        F.col("id"),
        msg_id("id", plan.seed).alias("msg_id"),
        F.concat(F.lit("topic."), (F.col("id") % 3).cast("string")).alias("topic"),
        F.lit("sent").alias("status"),
        created.cast("timestamp").alias("created_at"),
        created.cast("timestamp").alias("sent_at"),
        F.lit(0).alias("attempts"),
        F.col("id").cast("string").alias("receipt"),
    )


def broker_frame(spark: SparkSession, plan: Plan, ledger: DataFrame) -> DataFrame:
    lost, duplicated = pick(plan)
    settled = plan.rows - plan.pending
    latency_ms = F.pmod(F.xxhash64("id", F.lit(plan.seed)), F.lit(50)) + 1
    skew_ms = (
        (F.pmod(F.xxhash64(F.lit(plan.seed), "id"), F.lit(2 * plan.skew_ms + 1)) - plan.skew_ms)
        if plan.skew_ms
        else F.lit(0)
    )
    delivered = ledger.where(F.col("id") < settled).where(
        ~F.col("id").isin(list(lost)) if lost else F.lit(True)
    )
    broker_ts = F.col("created_at").cast("double") + (latency_ms + skew_ms) / 1000
    copies = delivered.select(
        "id", "msg_id", "topic", broker_ts.cast("timestamp").alias("broker_ts")
    )
    extra = copies.where(F.col("id").isin(list(duplicated))) if duplicated else copies.limit(0)
    middle = plan.start.timestamp() + plan.hours * 1800
    phantoms = spark.range(plan.rows, plan.rows + plan.phantom).select(
        "id", msg_id("id", plan.seed + 1).alias("msg_id"), F.lit("topic.0").alias("topic"),
        (F.lit(middle) + F.col("id") % 1000).cast("timestamp").alias("broker_ts"),
    )  # fmt: skip
    return (
        copies.unionByName(extra)
        .unionByName(phantoms)
        .select("msg_id", "topic", F.col("id").cast("string").alias("seq"), "broker_ts")
    )


def generate(
    spark: SparkSession,
    plan: Plan,
    out: str | Path,
    step: Callable[[str], None] = lambda _: None,
) -> dict[str, object]:
    """Write ledger/ and broker/ Parquet under ``out``; returns the expected counts.

    ``step`` is told when each is written. expected.json comes last: a folder that has
    it holds the whole input.
    """
    out = Path(out)
    ledger = ledger_frame(spark, plan)
    ledger.write.mode("overwrite").parquet(str(out / "ledger"))
    step(f"ledger/: {plan.rows:,} rows")
    broker_frame(spark, plan, ledger).write.mode("overwrite").parquet(str(out / "broker"))
    step("broker/: the ledger's rows delivered, with the injected faults")
    expected = {
        "committed": plan.rows,
        "delivered": plan.rows - plan.lost - plan.pending,
        "lost": plan.lost,
        "pending": plan.pending,
        "duplicated": plan.duplicated,
        "phantom": plan.phantom,
        "window": {
            "start": plan.start.isoformat(),
            "end": plan.end.isoformat(),
            "sla_s": plan.sla_s,
        },
        "plan": plan_json(plan),
    }
    (out / "expected.json").write_text(json.dumps(expected, indent=2))
    return expected


def plan_json(plan: Plan) -> dict[str, object]:
    """The plan as expected.json holds it: what made the input, to tell if it can be reused."""
    return {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in asdict(plan).items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rows", type=int, required=True)
    for name in ("lost", "duplicated", "phantom", "pending", "skew-ms", "seed"):
        parser.add_argument(f"--{name}", type=int, default=7 if name == "seed" else 0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--master", default="local[*]")
    args = parser.parse_args(argv)
    plan = Plan(
        args.rows, args.lost, args.duplicated, args.phantom, args.pending, args.skew_ms, args.seed
    )
    started = time.monotonic()

    def step(what: str) -> None:  # on stderr: stdout is the expected counts' JSON
        print(f"generate: {what} ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)

    spark = session.started(session.builder("outbox-generate", args.master))
    try:
        print(json.dumps(generate(spark, plan, args.out, step), indent=2))
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
