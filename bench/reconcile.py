"""Reconciliation benchmark: Spark (local[2]) against DuckDB on the same Parquet files.

`python -m bench.reconcile --rows 1000000 10000000` generates each size with known
injections, reconciles it with the Spark job and with an equivalent DuckDB query, and
prints wall time, rows/s, the Spark driver's peak memory and the detection check.
DuckDB is a bench-only dependency (`pip install duckdb`).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.report import print_rows

CLUSTER = "local-cluster[1,2,2048]"  # one worker, 2 cores, executors in their own JVMs

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


ROLES = {
    "org.apache.spark.deploy.SparkSubmit": "driver JVM",
    "CoarseGrainedExecutorBackend": "executor JVM",
    "reconcile_job.py": "driver Python",
}


class PeakWatcher(threading.Thread):
    """Polls the process tree under one pid: the peak RSS (VmHWM) per role, in MiB.

    In local[N] mode the driver JVM runs the executors' tasks too; under
    local-cluster[...] they are separate JVMs, so the driver's own memory shows.
    """

    def __init__(self, root: int) -> None:
        super().__init__(daemon=True)
        self.root, self.peaks, self.done = (
            root,
            dict.fromkeys(ROLES.values(), 0.0),
            threading.Event(),
        )

    def run(self) -> None:
        while not self.done.wait(0.2):
            for pid in descendants(self.root):
                role, peak = role_and_peak(pid)
                if role:
                    self.peaks[role] = max(self.peaks[role], peak)


def descendants(root: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int(
                    (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
                )
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, parent in parents.items() if parent in frontier]
        found += frontier
    return found


def role_and_peak(pid: int) -> tuple[str | None, float]:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None, 0.0
    role = next((r for key, r in ROLES.items() if key in cmdline), None)
    if role == "driver Python" and "java" in cmdline:
        role = None  # the JVM's own command line names the job file too
    kib = next(
        (int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM")), 0
    )
    return role, kib / 1024


def spark_run(
    root: Path, data: Path, expected: dict[str, object], master: str = "local[2]"
) -> tuple[float, dict[str, float], dict[str, int]]:
    """Wall seconds, peak RSS per role (MiB) and the totals of one spark-submit of the job."""
    import json

    import pyspark

    window = expected["window"]
    assert isinstance(window, dict)
    cmd = [str(Path(sys.executable).with_name("spark-submit")), "--master", master]
    cmd += ["--driver-memory", "2g", str(root / "spark_jobs" / "reconcile_job.py")]
    cmd += ["--ledger", str(data / "ledger"), "--broker-log", str(data / "broker")]
    cmd += ["--out", str(data / "out"), "--start", window["start"], "--end", window["end"]]
    # local-cluster starts executors with SPARK_HOME's scripts: the pip package's own.
    spark_home = str(Path(pyspark.__file__).parent)
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "SPARK_HOME": spark_home}
    started = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    watcher = PeakWatcher(proc.pid)
    watcher.start()
    proc.wait()
    elapsed = time.monotonic() - started
    watcher.done.set()
    watcher.join()
    total = json.loads((data / "out" / "summary.json").read_text())["total"]
    return elapsed, watcher.peaks, total


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
            spark_s, _, spark_total = spark_run(root, data, expected)
            _, peaks, _ = spark_run(root, data, expected, CLUSTER)
            duck_s, duck_total = duckdb_run(data, expected)
            keys = ("lost", "duplicated", "phantom", "pending", "delivered")
            detected = all(spark_total[k] == expected[k] for k in keys)
            agree = all(spark_total[k] == duck_total[k] for k in keys)
            table.append(
                (f"{rows:,}", f"{spark_s:.1f}", f"{rows / spark_s:,.0f}",
                 f"{peaks['driver JVM']:,.0f}", f"{peaks['driver Python']:,.0f}",
                 f"{peaks['executor JVM']:,.0f}", f"{duck_s:.1f}", f"{spark_s / duck_s:.1f}x",
                 "yes" if detected else "NO", "yes" if agree else "NO")
            )  # fmt: skip
    header = ("rows each side", "spark s", "rows/s", "driver JVM MiB*", "driver Python MiB*",
              "executor MiB*", "duckdb s", "spark/duckdb", "100% found, 0 false",
              "duckdb agrees")  # fmt: skip
    print_rows(
        f"reconciliation, local[2] vs DuckDB (2 threads), {os.cpu_count()} CPUs", [header, *table]
    )
    print(f"* peak RSS from a second run under {CLUSTER}, where executors are separate JVMs")


if __name__ == "__main__":
    main()
