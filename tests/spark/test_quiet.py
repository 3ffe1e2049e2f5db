"""`outbox reconcile` is quiet: its own steps with counts, the totals, no Spark logs or bars.

Run as a subprocess: the log configuration reaches a JVM only as it starts, and the
in-process tests share one JVM started long before.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from spark_jobs import ledger, reconcile_job
from spark_jobs.generate import Plan, generate

OUTBOX = str(Path(sys.executable).with_name("outbox"))
# What Spark's own logging and progress look like (log4j's layout, the stage bars).
SPARK_NOISE = re.compile(
    r"^\d\d/\d\d/\d\d \d\d:\d\d:\d\d [A-Z]+ |NativeCodeLoader|\[Stage |log4j|Setting default "
    r"log level"
)
STEP = re.compile(r"^outbox reconcile: (.+) \(\d+ s\)$")
# The JVM's own notice at start (Spark's launcher adds an incubator module): not a log line.
JVM_NOTICE = "WARNING: Using incubator modules"


@pytest.fixture(scope="module")
def night(spark: SparkSession, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("night")
    generate(spark, Plan(rows=300, lost=1, pending=2, phantom=1), folder)
    return folder


def reconcile(night: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """`outbox reconcile` of the night; ``extra`` flags come last (argparse: last wins)."""
    window = json.loads((night / "expected.json").read_text())["window"]
    cmd = [OUTBOX, "reconcile", "--ledger", str(night / "ledger"), "--out", str(out)]
    cmd += ["--broker-log", str(night / "broker"), "--start", window["start"]]
    cmd += ["--end", window["end"], *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)


def noise(done: subprocess.CompletedProcess[str]) -> list[str]:
    lines = (done.stdout + done.stderr).replace("\r", "\n").splitlines()
    return [line for line in lines if SPARK_NOISE.search(line)]


def test_reconcile_prints_its_steps_with_counts_and_nothing_of_spark(
    night: Path, tmp_path: Path
) -> None:
    done = reconcile(night, tmp_path / "out", "--master", "local[1]")
    assert done.returncode == 3, done.stderr  # one lost, one phantom
    assert noise(done) == [], done.stderr
    # nor anything else: a library's own print to the JVM's stderr (DataSketches' warning)
    others = [line for line in done.stderr.splitlines() if not STEP.match(line)]
    assert [line for line in others if not line.startswith(JVM_NOTICE)] == [], done.stderr
    steps = [m[1] for line in done.stderr.splitlines() if (m := STEP.match(line))]
    assert steps == [
        "starting Spark",
        "read 300 ledger rows, 298 broker log entries",
        "joined 301 messages: 297 delivered, 2 pending, 0 stuck, 1 lost, 1 phantom",
        f"wrote 2 discrepancies, summary.json and report.html to {tmp_path / 'out'}",
    ], done.stderr
    assert json.loads(done.stdout)["lost"] == 1  # the totals, alone on stdout


def test_errors_are_one_line_naming_the_cause(night: Path, tmp_path: Path) -> None:
    missing = reconcile(night, tmp_path / "out", "--ledger", str(tmp_path / "nowhere"))
    assert missing.returncode == 1  # found before Spark starts
    assert missing.stderr.splitlines() == [
        f"outbox reconcile: --ledger {tmp_path / 'nowhere'}: no such file or folder"
    ]
    bad_master = reconcile(night, tmp_path / "out", "--master", "nowhere://1")
    assert bad_master.returncode == 2  # before a JVM that would exit with a Java stack
    assert bad_master.stderr.splitlines()[-1].endswith(
        "argument --master: not a Spark master: 'nowhere://1' (local[N], local[*], "
        "spark://HOST:PORT, yarn, k8s://URL)"
    )
    # A path only Spark can judge: its error, cut to the root cause.
    remote = reconcile(night, tmp_path / "out", "--master", "local[1]", "--broker-log",
                       "nowhere://bucket/broker")  # fmt: skip
    assert remote.returncode == 1
    judged = [line for line in remote.stderr.splitlines() if not STEP.match(line)]
    assert judged[-1] == (
        "outbox reconcile: org.apache.hadoop.fs.UnsupportedFileSystemException: No FileSystem "
        'for scheme "nowhere"'
    ), remote.stderr
    assert [line for line in judged if not line.startswith(JVM_NOTICE)] == judged[-1:]


def test_a_missing_jdbc_jar_is_one_line(
    night: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(ledger, "JDBC_JAR", str(tmp_path / "postgresql.jar"))
    parser = argparse.ArgumentParser()
    reconcile_job.add_arguments(parser)
    args = parser.parse_args(
        ["--ledger", "postgresql://u:secret@127.0.0.1/test", "--broker-log", str(night / "broker"),
         "--out", str(tmp_path / "out"), "--start", "2026-01-01", "--end", "2026-01-02"]
    )  # fmt: skip
    assert reconcile_job.run(args, prog="outbox reconcile") == 1  # before Spark starts
    assert capsys.readouterr().err.splitlines() == [
        f"outbox reconcile: --ledger: {tmp_path / 'postgresql.jar'} missing: apt-get install "
        "libpostgresql-jdbc-java"
    ]


def test_verbose_gives_sparks_logs_back(night: Path, tmp_path: Path) -> None:
    done = reconcile(night, tmp_path / "out", "--master", "local[1]", "--verbose")
    assert done.returncode == 3, done.stderr
    assert noise(done), done.stderr  # Spark's own lines, as before
