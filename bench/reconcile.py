"""Reconciliation benchmark: Spark (local[2]) against DuckDB on the same Parquet files.

`python -m bench.reconcile --rows 1000000 10000000` generates each size with known
injections, reconciles it with the Spark job and with an equivalent DuckDB query, and
prints wall time, rows/s, the Spark driver's peak memory and the detection check.
DuckDB is a bench-only dependency (`pip install duckdb`).
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.report import print_rows

SQL = """
WITH ledger AS (SELECT * FROM read_parquet('{ledger}/*.parquet')),
broker AS (SELECT * FROM read_parquet('{broker}/*.parquet')),
copies AS (SELECT msg_id, count(*) AS n FROM broker GROUP BY msg_id),
committed AS (
  SELECT l.msg_id, l.created_at, c.n FROM ledger l LEFT JOIN copies c USING (msg_id)
  WHERE l.created_at >= TIMESTAMPTZ '{start}' AND l.created_at < TIMESTAMPTZ '{end}'
)
SELECT
  count(*) AS committed,
  count(n) AS delivered,
  count(*) FILTER (WHERE n IS NULL AND created_at <  {edge}) AS lost,
  count(*) FILTER (WHERE n IS NULL AND created_at >= {edge}) AS pending,
  coalesce(sum(n - 1) FILTER (WHERE n > 1), 0) AS duplicated,
  (SELECT count(DISTINCT b.msg_id) FROM broker b ANTI JOIN ledger l USING (msg_id)) AS phantom
FROM committed
"""


def spark_run(
    root: Path, data: Path, expected: dict[str, object]
) -> tuple[float, float, dict[str, int]]:
    """Wall seconds and the driver JVM's peak RSS (MiB) of one spark-submit of the job."""
    import json

    window = expected["window"]
    assert isinstance(window, dict)
    cmd = [str(Path(sys.executable).with_name("spark-submit")), "--master", "local[2]"]
    cmd += ["--driver-memory", "2g", str(root / "spark_jobs" / "reconcile.py")]
    cmd += ["--ledger", str(data / "ledger"), "--broker-log", str(data / "broker")]
    cmd += ["--out", str(data / "out"), "--start", window["start"], "--end", window["end"]]
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    started = time.monotonic()
    subprocess.run(cmd, env=env, capture_output=True, check=False)
    elapsed = time.monotonic() - started
    peak = max(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, before) / 1024
    total = json.loads((data / "out" / "summary.json").read_text())["total"]
    return elapsed, peak, total


def duckdb_run(data: Path, expected: dict[str, object]) -> tuple[float, dict[str, int]]:
    import duckdb

    window = expected["window"]
    assert isinstance(window, dict)
    edge = f"TIMESTAMPTZ '{window['end']}' - INTERVAL {int(window['sla_s'])} SECOND"
    sql = SQL.format(
        ledger=data / "ledger",
        broker=data / "broker",
        start=window["start"],
        end=window["end"],
        edge=edge,
    )
    started = time.monotonic()
    con = duckdb.connect()
    con.execute("SET threads TO 2")
    row = con.execute(sql).fetchone()
    elapsed = time.monotonic() - started
    assert row is not None
    names = ("committed", "delivered", "lost", "pending", "duplicated", "phantom")
    return elapsed, dict(zip(names, (int(v) for v in row), strict=True))


def main() -> None:
    import json

    parser = argparse.ArgumentParser(description="reconciliation benchmark")
    parser.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 10_000_000])
    args = parser.parse_args()
    root = Path(__file__).resolve().parents[1]
    table: list[tuple[str, ...]] = []
    for rows in args.rows:
        with tempfile.TemporaryDirectory(prefix="outbox-bench-") as tmp:
            data = Path(tmp)
            gen = [
                sys.executable,
                "-m",
                "spark_jobs.generate",
                "--rows",
                str(rows),
                "--lost",
                "101",
            ]
            gen += ["--duplicated", "57", "--phantom", "23", "--pending", "11", "--skew-ms", "2000"]
            gen += ["--out", str(data), "--master", "local[2]"]
            subprocess.run(gen, cwd=root, capture_output=True, check=True)
            expected = json.loads((data / "expected.json").read_text())
            spark_s, peak_mib, spark_total = spark_run(root, data, expected)
            duck_s, duck_total = duckdb_run(data, expected)
            keys = ("lost", "duplicated", "phantom", "pending", "delivered")
            detected = all(spark_total[k] == expected[k] for k in keys)
            agree = all(spark_total[k] == duck_total[k] for k in keys)
            table.append(
                (f"{rows:,}", f"{spark_s:.1f}", f"{rows / spark_s:,.0f}", f"{peak_mib:,.0f}",
                 f"{duck_s:.1f}", f"{spark_s / duck_s:.1f}x", "yes" if detected else "NO",
                 "yes" if agree else "NO")
            )  # fmt: skip
    header = ("rows each side", "spark s", "rows/s", "driver peak MiB", "duckdb s", "spark/duckdb",
              "100% found, 0 false", "duckdb agrees")  # fmt: skip
    print_rows(
        f"reconciliation, local[2] vs DuckDB (2 threads), {os.cpu_count()} CPUs", [header, *table]
    )


if __name__ == "__main__":
    main()
