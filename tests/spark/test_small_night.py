"""A small night takes the small-input path (a JVM that starts fast, plain plans); a
large one, a remote input or spark-submit's JVM never does. No timings here:
bench/small_night.py measures them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from spark_jobs import session
from spark_jobs.generate import Plan, generate

SMALL_KEYS = ("spark.ui.enabled", "spark.sql.codegen.wholeStage", "spark.sql.adaptive.enabled",
              "spark.sql.shuffle.partitions")  # fmt: skip


@pytest.fixture()
def inputs(tmp_path: Path) -> list[str | None]:
    ledger, broker = tmp_path / "ledger.parquet", tmp_path / "broker"
    ledger.write_bytes(b"x" * 1000)
    broker.mkdir()
    (broker / "part-0.parquet").write_bytes(b"x" * 1000)
    return [str(ledger), str(broker), None]


def test_small_local_inputs_on_a_local_master_are_small(inputs: list[str | None]) -> None:
    assert session.small_input(None, inputs)
    assert session.small_input("local[2]", inputs)
    assert session.small_input("local[*]", [f"file://{inputs[0]}", inputs[1], None])


def test_inputs_past_the_threshold_are_large(
    inputs: list[str | None], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(session, "SMALL_INPUT_BYTES", 1999)  # the two inputs hold 2,000
    assert not session.small_input(None, inputs)


@pytest.mark.parametrize(
    "ledger",
    ["postgresql://u@db/app", "postgresql+psycopg://u@db/app", "hdfs://nn/ledger", "s3a://b/l"],
)
def test_a_remote_input_is_large(ledger: str, inputs: list[str | None]) -> None:
    assert not session.small_input("local[2]", [ledger, inputs[1], None])


def test_a_cluster_or_spark_submits_jvm_is_not_ours_to_size(
    inputs: list[str | None], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert not session.small_input("spark://127.0.0.1:7077", inputs)
    monkeypatch.setenv("PYSPARK_GATEWAY_PORT", "40000")  # spark-submit started the JVM
    assert not session.small_input(None, inputs)


def test_a_large_input_builds_the_session_as_before() -> None:
    options = session.builder("job", None)._options
    assert options["spark.driver.extraJavaOptions"] == session.log_options()
    assert options["spark.sql.adaptive.enabled"] == "true"
    assert not any(key in options for key in SMALL_KEYS[:2] + SMALL_KEYS[3:])


def test_a_small_input_gets_a_fast_starting_jvm_and_plain_plans() -> None:
    options = session.builder("job", None, small=True)._options
    java = options["spark.driver.extraJavaOptions"]
    assert java == f"{session.SMALL_JAVA_OPTIONS} {session.log_options()}"  # logs still quiet
    assert {key: options[key] for key in SMALL_KEYS} == session.SMALL_INPUT
    verbose = session.builder("job", None, verbose=True, small=True)._options
    assert verbose["spark.driver.extraJavaOptions"] == session.SMALL_JAVA_OPTIONS


def test_a_small_night_from_the_cli_counts_as_a_large_one(
    spark: SparkSession, tmp_path: Path
) -> None:
    """The same night through `outbox reconcile` on both paths: the same findings."""
    night = tmp_path / "night"
    generate(spark, Plan(rows=300, lost=2, duplicated=3, phantom=1, pending=2), night)
    window = json.loads((night / "expected.json").read_text())["window"]
    flags = ["--ledger", str(night / "ledger"), "--broker-log", str(night / "broker")]
    flags += ["--start", window["start"], "--end", window["end"]]
    outs = []
    for path in ("small", "large"):
        out = tmp_path / f"out-{path}"
        forced = "" if path == "small" else "session.small_input = lambda *_: False; "
        code = f"import sys; from spark_jobs import session; {forced}from relay.cli import main; "
        code += "sys.exit(main())"
        cmd = [sys.executable, "-c", code, "reconcile", *flags, "--out", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        assert done.returncode == 3, done.stderr  # the lost and the phantom
        outs.append(out)
    small, large = (json.loads((out / "summary.json").read_text()) for out in outs)
    assert small == large
    assert small["total"]["lost"] == 2 and small["total"]["duplicated"] == 3
    csvs = [(out / "discrepancies.csv").read_text() for out in outs]
    assert csvs[0] == csvs[1]
