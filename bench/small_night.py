"""A small night through `outbox reconcile`: where its seconds go, before and after.

`python -m bench.small_night` generates a 2,000-row night once (bench.reconcile's plan
and cache: a ledger and its broker log, with known injected faults) and runs `outbox
reconcile` over it in a fresh process each time, alternating "large" (the job as a
large input runs it: spark_jobs.session.small_input answers False) and "small" (as the
job runs this input), `--runs` times each. It prints one table of each phase's median
wall seconds (Python imports, JVM and SparkSession start, each step of the job, the
whole process), the JVM's CPU seconds and its Spark jobs (counted from Spark's event
log), the small/large ratio, and whether both gave the same summary.json. "small"
starts its JVM from the class data archive (spark_jobs.class_data: one unmeasured run
first writes it), "small, no archive" without it (``OUTBOX_SPARK_CDS=off``). A last
column, "floor", is Python, the JVM (from the archive) and a SparkSession with one tiny
job and nothing else: the least any run of the job can take here. `--rows 20000`
another size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.reconcile import DEFAULT_CACHE, cached_input
from bench.report import print_rows

ROOT = Path(__file__).resolve().parents[1]
MODES = ("large", "small, no archive", "small")
PHASES = ("python imports", "JVM + SparkSession start", "read inputs", "classify + summarise",
          "write outputs", "process wall")  # fmt: skip


def measured(mode: str, data: Path, expected: dict[str, Any], out: Path) -> dict[str, Any]:
    """One `outbox reconcile` (``mode`` "floor": a bare session and one tiny job) in a
    fresh Python: its phases' wall seconds, the JVM's CPU seconds, its Spark jobs."""
    events = out / f"events-{mode}"
    events.mkdir(parents=True)
    conf = [
        "spark.eventLog.enabled=true",
        "spark.eventLog.compress=false",
        "spark.eventLog.rolling.enabled=false",
        f"spark.eventLog.dir={events.as_uri()}",
    ]
    args = " ".join(f"--conf {c}" for c in conf)
    env = {**os.environ, "PYSPARK_SUBMIT_ARGS": f"{args} pyspark-shell"}
    if mode == "small, no archive":
        env["OUTBOX_SPARK_CDS"] = "off"
    window = expected["window"]
    child_mode = "small" if mode.startswith("small") else mode
    cmd = [sys.executable, "-m", "bench.small_night", "--child", child_mode, "--out", str(out)]
    cmd += ["--ledger", str(data / "ledger"), "--broker-log", str(data / "broker")]
    cmd += ["--start", window["start"], "--end", window["end"]]
    started = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{mode} run failed:\n{done.stderr}")
    figures: dict[str, Any] = json.loads((out / "phases.json").read_text())
    figures["process wall"] = time.monotonic() - started  # interpreter start and exit too
    figures["spark jobs"] = spark_jobs(events)
    return figures


def spark_jobs(events: Path) -> int:
    """The jobs Spark ran, from its event log."""
    count = 0
    for log in events.iterdir():
        with log.open() as lines:
            count += sum('"Event":"SparkListenerJobStart"' in line for line in lines)
    return count


def child(mode: str, argv: list[str], out: Path) -> None:
    """Inside the measured process: time the imports, the session's start, each step."""
    started = time.monotonic()
    from relay.cli import build_parser
    from spark_jobs import reconcile_job, session

    phases: dict[str, float] = {"python imports": time.monotonic() - started}
    last = [time.monotonic()]  # when the last phase ended
    start_session, stop_session = session.started, session.stopped

    def timed_start(*args: Any, **kwargs: Any) -> Any:
        began = time.monotonic()
        spark = start_session(*args, **kwargs)
        last[0] = time.monotonic()
        phases["JVM + SparkSession start"] = last[0] - began
        return spark

    def measured_stop(spark: Any) -> None:  # before the JVM exits
        jvm = spark.sparkContext._gateway.jvm
        phases["jvm cpu s"] = process_cpu_s(int(jvm.java.lang.ProcessHandle.current().pid()))
        stop_session(spark)

    session.started, session.stopped = timed_start, measured_stop
    if mode == "large":
        session.small_input = lambda *_: False
    if mode == "floor":
        spark = session.started(session.builder("floor", None, small=True), small=True)
        spark.range(1).count()
        session.stopped(spark)
    else:
        steps = iter(PHASES[2:5])
        timer = steps_timer(phases, steps, last)
        reconcile_job.told = lambda *_: timer
        args = build_parser().parse_args(["reconcile", *argv])
        reconcile_job.run(args)
    (out / "phases.json").write_text(json.dumps(phases))


def steps_timer(phases: dict[str, float], names: Any, last: list[float]) -> Callable[[str], None]:
    """The job's step callback: each step after "starting Spark" timed from the end of
    the phase before (``last``: the session's start sets it too)."""

    def step(what: str) -> None:
        now = time.monotonic()
        if what != "starting Spark":
            phases[next(names)] = now - last[0]
        last[0] = now

    return step


def process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def table(runs: dict[str, list[dict[str, Any]]], same: bool) -> list[tuple[str, ...]]:
    """Median of each figure per mode, and small/large."""
    rows: list[tuple[str, ...]] = [("phase (median s)", *MODES, "small/large", "floor")]
    small = MODES.index("small")
    for name in (*PHASES, "jvm cpu s", "spark jobs"):
        values = [statistics.median(run.get(name, 0.0) for run in runs[m]) for m in MODES]
        floor = statistics.median(run[name] for run in runs["floor"]) if name in (
            "python imports", "JVM + SparkSession start", "process wall", "jvm cpu s"
        ) else None  # fmt: skip
        ratio = f"{values[small] / values[0]:.2f}" if values[0] else "-"
        shown = "-" if floor is None else f"{floor:.2f}"
        rows.append((name, *(f"{v:.2f}" for v in values), ratio, shown))
    rows.append(("same summary.json", *[""] * (len(MODES) - 1), "yes" if same else "NO", "", ""))
    return rows


def summary_of(out: Path) -> dict[str, Any]:
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return summary


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rows", type=int, default=2_000, help="ledger rows (2,000)")
    parser.add_argument("--runs", type=int, default=3, help="runs of each mode (3)")
    parser.add_argument(
        "--cache", type=Path, default=DEFAULT_CACHE, help=f"generated inputs ({DEFAULT_CACHE})"
    )
    parser.add_argument("--child", choices=(*MODES, "floor"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args(argv)
    if args.child:
        child(args.child, [*rest, "--out", str(args.out)], args.out)
        return
    data, expected = cached_input(args.cache, args.rows)
    load = os.getloadavg()[0]
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in (*MODES, "floor")}
    summaries: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="small-night-") as tmp:
        warm = measured("small", data, expected, Path(tmp) / "warm-up")  # writes the archive
        print(f"warm-up small run (writes the class data archive if missing): "
              f"{warm['process wall']:.1f} s", flush=True)  # fmt: skip
        for n in range(args.runs):
            for mode in (*MODES, "floor"):
                out = Path(tmp) / f"{mode.replace(', ', '-').replace(' ', '-')}-{n}"
                runs[mode].append(measured(mode, data, expected, out))
                if mode != "floor":
                    summaries[mode] = summary_of(out)
                print(f"run {n + 1}/{args.runs} {mode}: {runs[mode][-1]['process wall']:.1f} s",
                      flush=True)  # fmt: skip
    title = (
        f"`outbox reconcile` of {args.rows:,} ledger rows, local[*], {os.cpu_count()} CPUs, "
        f"{args.runs} runs each, load {load:.1f} before, {os.getloadavg()[0]:.1f} after"
    )
    same = all(summary == summaries["large"] for summary in summaries.values())
    print_rows(title, table(runs, same))
    print(
        "large: as a large input runs (JIT C2, parallel GC, codegen, adaptive execution); "
        "small: the small-input path (spark_jobs.session.SMALL_INPUT), its JVM started "
        "from the class data archive (spark_jobs.class_data), or without it; floor: a "
        "session and one tiny job; process wall: fork to exit, JVM start included"
    )


if __name__ == "__main__":
    main()
