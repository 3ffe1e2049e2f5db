"""Reconciliation at scale: one input through the Spark job on local[1], local[2] and a
standalone cluster of two one-core workers, beside DuckDB on the same Parquet files.

`python -m bench.reconcile` generates 10,000,000 ledger rows and their broker log (about
as many entries, with known injected faults) once into a cache folder (reused while the
plan is the same), then runs `spark_jobs/reconcile_job.py` under spark-submit in each
mode, one after the other, every time with `--driver-memory 512m` (the driver never
holds a table), and prints one table: wall seconds, ledger rows/s, rows/s per core, CPU
seconds, peak RSS of the driver's JVM and Python and of the largest executor, the ratio
to local[2], and whether the injected faults were found exactly. `--modes local[2]
cluster` runs some, `--rows 1000000` another size. DuckDB is the `bench` extra's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.report import print_rows

ROOT = Path(__file__).resolve().parents[1]
MODES = ("duckdb", "local[1]", "local[2]", "cluster")
WORKERS, WORKER_MEMORY = 2, "1g"  # the cluster: two workers with one core and 1 GiB each
INJECTED = ("lost", "duplicated", "phantom", "pending", "skew_ms")  # the plan's fault fields
CHECKED = ("committed", "delivered", "lost", "pending", "duplicated", "phantom")
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
DEFAULT_CACHE = DEFAULT_CACHE / "outbox-bench" / "reconcile"

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


@dataclass(frozen=True)
class Run:
    """One mode's run: its wall and CPU seconds, peak RSS (MiB) and whether it was exact."""

    mode: str
    cores: int
    wall_s: float
    exact: bool
    cpu_s: float | None = None
    driver_jvm_mib: float | None = None
    driver_python_mib: float | None = None
    executor_mib: float | None = None  # the largest executor; None: tasks ran in the driver
    failed: bool = False  # the job failed: no figures


HEADER = ("mode", "cores", "wall s", "rows/s", "rows/s/core", "cpu s", "driver JVM MiB",
          "driver py MiB", "executor MiB", "vs local[2]", "exact")  # fmt: skip


def table(rows: int, runs: Sequence[Run]) -> list[tuple[str, ...]]:
    """The header and one row per run; rows/s counts ledger rows, the ratio is wall time
    over local[2]'s in the same run ("-" without one)."""
    base = next((r.wall_s for r in runs if r.mode == "local[2]" and not r.failed), None)
    lines: list[tuple[str, ...]] = [HEADER]
    for run in runs:
        if run.failed:
            lines.append((run.mode, str(run.cores), *["-"] * (len(HEADER) - 3), "FAILED"))
            continue
        rate = rows / run.wall_s
        lines.append(
            (run.mode, str(run.cores), f"{run.wall_s:.1f}", f"{rate:,.0f}",
             f"{rate / run.cores:,.0f}", mib(run.cpu_s, "{:.0f}"), mib(run.driver_jvm_mib),
             mib(run.driver_python_mib), mib(run.executor_mib),
             f"{run.wall_s / base:.2f}x" if base else "-", "yes" if run.exact else "NO")
        )  # fmt: skip
    return lines


def mib(value: float | None, form: str = "{:,.0f}") -> str:
    return "-" if value is None else form.format(value)


def exact(total: dict[str, int], expected: dict[str, object]) -> bool:
    """Whether a run found the injected faults and nothing else."""
    return all(total.get(key) == expected[key] for key in CHECKED)


class Watcher(threading.Thread):
    """Polls the process trees under some pids: peak RSS (VmHWM, MiB) per role and the CPU
    seconds the role processes used. An executor's peak is the largest of them."""

    def __init__(self, roots: Callable[[], list[int]]) -> None:
        super().__init__(daemon=True)
        self.roots, self.done = roots, threading.Event()
        self.peaks = dict.fromkeys(ROLES.values(), 0.0)
        self.ticks: dict[int, int] = {}

    def run(self) -> None:
        while not self.done.wait(0.2):
            self.poll()

    def poll(self) -> None:
        parents = process_parents()
        for pid in descendants(parents, self.roots()):
            role, peak, ticks = role_and_usage(pid)
            if role:
                self.peaks[role] = max(self.peaks[role], peak)
                self.ticks[pid] = max(self.ticks.get(pid, 0), ticks)

    def stop(self) -> None:
        self.done.set()
        self.join()
        self.poll()  # the last look: what ended since the last poll is gone anyway

    def cpu_s(self) -> float:
        return sum(self.ticks.values()) / os.sysconf("SC_CLK_TCK")


def process_parents() -> dict[int, int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                parents[int(entry.name)] = int(stat[1])
            except (OSError, IndexError, ValueError):
                continue
    return parents


def descendants(parents: dict[int, int], roots: list[int]) -> list[int]:
    found, frontier = list(roots), set(roots)
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier}
        found += frontier
    return found


def role_and_usage(pid: int) -> tuple[str | None, float, int]:
    """The process's role, its peak RSS in MiB and its CPU clock ticks (user + system)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        status = Path(f"/proc/{pid}/status").read_text()
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None, 0.0, 0
    role = next((r for key, r in ROLES.items() if key in cmdline), None)
    if role == "driver Python" and "java" in cmdline:
        role = None  # the JVM's own command line names the job file too
    kib = next(
        (int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM")), 0
    )
    return role, kib / 1024, int(stat[11]) + int(stat[12])


def cached_input(cache: Path, rows: int) -> tuple[Path, dict[str, object]]:
    """The generated input for ``rows`` under ``cache``: reused when its expected.json
    (written last) is there for the same plan, else generated once, with its steps shown."""
    from spark_jobs.generate import Plan, plan_json

    plan = Plan(rows, lost=101, duplicated=57, phantom=23, pending=11, skew_ms=2000)
    folder = cache / f"rows-{rows}"
    expected_file = folder / "expected.json"
    if expected_file.is_file():
        expected = json.loads(expected_file.read_text())
        if expected.get("plan") == plan_json(plan):
            print(f"input: {rows:,} rows, reused from {folder}", flush=True)
            return folder, expected
    shutil.rmtree(folder, ignore_errors=True)
    print(f"input: generating {rows:,} rows into {folder} (once)", flush=True)
    gen = [sys.executable, "-m", "spark_jobs.generate", "--rows", str(rows), "--out", str(folder)]
    gen += ["--master", "local[2]", "--seed", str(plan.seed)]
    for name in INJECTED:
        gen += [f"--{name.replace('_', '-')}", str(getattr(plan, name))]
    subprocess.run(gen, cwd=ROOT, stdout=subprocess.DEVNULL, check=True)  # steps on stderr
    return folder, json.loads(expected_file.read_text())


def spark_run(
    mode: str,
    data: Path,
    expected: dict[str, object],
    driver_memory: str,
    master: str,
    cluster_pids: Callable[[], list[int]] = list,
) -> Run:
    """One spark-submit of the job on ``master``; its output goes to data/out-MODE.log."""
    from relay.testing.spark_cluster import spark_home
    from spark_jobs.session import log_options

    window = expected["window"]
    assert isinstance(window, dict)
    name = mode.replace("[", "-").strip("]")  # brackets in a path are a Hadoop glob
    out = data / f"out-{name}"
    cmd = [str(Path(sys.executable).with_name("spark-submit")), "--master", master]
    cmd += ["--driver-memory", driver_memory]
    cmd += ["--conf", f"spark.driver.extraJavaOptions={log_options()}"]
    if master.startswith("spark://"):  # one one-core executor per worker, with its memory
        cmd += ["--conf", "spark.driver.host=127.0.0.1", "--executor-cores", "1"]
        cmd += ["--executor-memory", WORKER_MEMORY, "--total-executor-cores", str(WORKERS)]
    cmd += [str(ROOT / "spark_jobs" / "reconcile_job.py"), "--out", str(out)]
    cmd += ["--ledger", str(data / "ledger"), "--broker-log", str(data / "broker")]
    cmd += ["--start", window["start"], "--end", window["end"]]
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    env["SPARK_HOME"] = str(spark_home())
    log = data / f"out-{name}.log"
    print(f"{mode}: running (its steps in {log})", flush=True)
    with log.open("w") as err:
        started = time.monotonic()
        # spark-submit's JVM passes the job's stderr on to its stdout
        proc = subprocess.Popen(cmd, env=env, stdout=err, stderr=subprocess.STDOUT)
        watcher = Watcher(lambda: [proc.pid, *cluster_pids()])
        watcher.start()
        code = proc.wait()
        elapsed = time.monotonic() - started
    watcher.stop()
    summary = out / "summary.json"
    cores = 1 if master == "local[1]" else 2
    if code not in (0, 3) or not summary.is_file():  # 3: the injected faults found
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-3:])
        print(f"{mode}: the job failed (exit {code}):\n{tail}", flush=True)
        return Run(mode, cores, elapsed, False, failed=True)
    total = json.loads(summary.read_text())["total"]
    peaks = watcher.peaks
    return Run(mode, cores, elapsed, exact(total, expected),
               watcher.cpu_s(), peaks["driver JVM"], peaks["driver Python"],
               peaks["executor JVM"] or None)  # fmt: skip


def duckdb_run(data: Path, expected: dict[str, object]) -> Run:
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
    print("duckdb: running", flush=True)
    started, cpu = time.monotonic(), time.process_time()
    con = duckdb.connect()
    con.execute("SET threads TO 2")
    row = con.execute(sql).fetchone()
    elapsed, cpu = time.monotonic() - started, time.process_time() - cpu
    assert row is not None
    total = dict(zip(CHECKED, (int(v) for v in row), strict=True))
    return Run("duckdb", 2, elapsed, exact(total, expected), cpu)


def run_modes(
    modes: Sequence[str], data: Path, expected: dict[str, object], driver_memory: str
) -> list[Run]:
    runs = []
    for mode in modes:
        if mode == "duckdb":
            runs.append(duckdb_run(data, expected))
        elif mode == "cluster":
            runs.append(cluster_run(data, expected, driver_memory))
        else:
            runs.append(spark_run(mode, data, expected, driver_memory, mode))
    return runs


def cluster_run(data: Path, expected: dict[str, object], driver_memory: str) -> Run:
    """The job on a fresh standalone cluster (relay.testing.SparkCluster): two workers,
    one core and 1 GiB each; its start is not timed."""
    from relay.testing.spark_cluster import SparkCluster

    with tempfile.TemporaryDirectory(prefix="outbox-bench-cluster-") as root:
        print("cluster: starting a master and two workers", flush=True)
        with SparkCluster(WORKERS, 1, WORKER_MEMORY, root) as cluster:

            def pids() -> list[int]:
                return [proc.pid for proc in cluster.procs.values()]

            return spark_run("cluster", data, expected, driver_memory, cluster.master_url, pids)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rows", type=int, default=10_000_000, help="ledger rows (10,000,000)")
    parser.add_argument(
        "--modes", nargs="+", choices=MODES, default=list(MODES), help="which runs (all)"
    )
    parser.add_argument("--driver-memory", default="512m", help="spark-submit's (512m)")
    parser.add_argument(
        "--cache", type=Path, default=DEFAULT_CACHE, help=f"generated inputs ({DEFAULT_CACHE})"
    )
    args = parser.parse_args(argv)
    data, expected = cached_input(args.cache, args.rows)
    load = os.getloadavg()[0]
    runs = run_modes(args.modes, data, expected, args.driver_memory)
    entries = sum(int(str(expected[k])) for k in ("delivered", "duplicated", "phantom"))
    title = (
        f"reconciliation of {args.rows:,} ledger rows x {entries:,} broker entries, "
        f"driver memory {args.driver_memory}, {os.cpu_count()} CPUs, "
        f"load {load:.1f} before, {os.getloadavg()[0]:.1f} after"
    )
    print_rows(title, table(args.rows, runs))
    print(
        "wall s: spark-submit to exit (JVM start included; the cluster's own start not); "
        "cpu s: the driver's and executors' processes; cluster: 2 workers x 1 core, 1 GiB"
    )


if __name__ == "__main__":
    main()
