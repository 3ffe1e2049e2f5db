"""Real traffic through the outbox, then tampering at the broker, export and reconcile."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import nats
from pyspark.sql import SparkSession
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from outbox import Outbox, migrate
from relay import cli
from relay.brokers.nats import create_stream
from relay.lab.compare.workload import business, place_order
from relay.lab.halfop import (
    Coordinator,
    CoordinatorSettings,
    SqlTransactionListener,
    TransactionProducer,
)
from relay.testing.embedded import NatsServer
from spark_jobs.reconciliation import reconcile
from spark_jobs.window import Window
from tests.helpers import wait_until

OUTBOX = str(Path(sys.executable).with_name("outbox"))
QUICK_CHECKS = CoordinatorSettings(check_interval_s=0.2, transaction_timeout_s=0.3)


def deliver(pg_url: str, server: NatsServer, stream: tuple[str, str], count: int) -> None:
    """Commit ``count`` messages in one transaction and wait until all are marked sent."""
    name, prefix = stream
    migrate.upgrade(pg_url)
    ob = Outbox(pg_url, broker=f"{server.url}?stream={name}&subjects={prefix}.>", sweeper=False)
    ob.start()
    with Session(ob.engine) as session, session.begin():
        for i in range(count):
            ob.send(session, f"{prefix}.orders", {"n": i})
    wait_until(lambda: ob.stats is not None and ob.stats.marked == count, what="all delivered")
    ob.stop()


RECONCILE_STEPS = [
    "starting Spark",
    "read 300 ledger rows, 299 broker log entries",
    "joined 303 messages: 296 delivered, 0 pending, 0 stuck, 4 lost, 3 phantom",
    "wrote 7 discrepancies, summary.json and report.html to {out}",
]

COMPARE_STEPS = [
    "running model a",
    "running model b",
    "exporting both models' ledgers and broker logs",
    "starting Spark",
    "reconciling model a",
    "model a: read N ledger rows, N broker log entries",
    "model a: joined N messages: N delivered, N pending, N stuck, N lost, N phantom",
    "model a: wrote N discrepancies, summary.json and report.html to OUT/a/report",
    "reconciling model b",
    "model b: read N records, N half/op entries, N broker log entries",
    "model b: joined N messages: N delivered, N pending, N stuck, N lost, N phantom",
    "model b: wrote N discrepancies, summary.json and report.html to OUT/b/report",
    "writing compare.json and compare.html",
]
# Spark's log lines (log4j's layout: 26/11/24 17:16:57 WARN Utils: ...) and stage bars;
# the project's own log lines (2026-11-24 17:16:57,123 INFO relay...) are not Spark's.
SPARK_NOISE = re.compile(
    r"^\d\d/\d\d/\d\d \d\d:\d\d:\d\d [A-Z]+ |NativeCodeLoader|\[Stage |log4j", re.M
)


def test_deleted_and_extra_broker_messages_are_counted_exactly(
    pg_url: str, nats_server: NatsServer, stream: tuple[str, str], tmp_path: Path
) -> None:
    name, prefix = stream
    start = datetime.now(UTC) - timedelta(seconds=1)
    deliver(pg_url, nats_server, stream, 300)

    async def tamper() -> None:
        nc = await nats.connect(nats_server.url)
        js = nc.jetstream()
        for seq in (5, 50, 150, 299):  # lost at the broker
            await js.delete_msg(name, seq)
        for i in range(3):  # published by nobody's transaction
            await js.publish(f"{prefix}.orders", b"{}", headers={"Nats-Msg-Id": f"phantom-{i}"})
        await nc.close()

    asyncio.run(tamper())
    end = datetime.now(UTC) + timedelta(seconds=120)  # the SLA has passed for every message
    ledger, broker, out = (
        tmp_path / "ledger.parquet",
        tmp_path / "broker.parquet",
        tmp_path / "report",
    )
    for args in (
        ["export", "ledger", "--db", pg_url, "--out", str(ledger)],
        ["export", "broker", "--broker", nats_server.url, "--stream", name, "--out", str(broker)],
    ):
        done = subprocess.run(
            [OUTBOX, *args], capture_output=True, text=True, timeout=120, check=False
        )
        assert done.returncode == 0, done.stderr
    reconcile = [OUTBOX, "reconcile", "--ledger", str(ledger), "--broker-log", str(broker)]
    reconcile += ["--out", str(out), "--start", start.isoformat(), "--end", end.isoformat()]
    reconcile += ["--sla", "60", "--master", "local[2]"]
    done = subprocess.run(reconcile, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 3, done.stdout + done.stderr  # lost and phantom found: alert
    steps = re.findall(r"^outbox reconcile: (.+) \(\d+ s\)$", done.stderr, re.M)
    expected = [line.format(out=out) for line in RECONCILE_STEPS]
    assert steps == expected, done.stderr  # one line per step, with counts, in order
    assert not SPARK_NOISE.search(done.stderr.replace("\r", "\n")), done.stderr
    total = json.loads((out / "summary.json").read_text())["total"]
    assert (total["committed"], total["delivered"], total["lost"]) == (300, 296, 4)
    assert (total["phantom"], total["duplicated"], total["pending"]) == (3, 0, 0)
    assert total["latency_p50_ms"] is not None and total["latency_p50_ms"] >= 0

    # The same ledger read straight from PostgreSQL over JDBC, in id ranges.
    by_jdbc = [arg if arg != str(ledger) else pg_url for arg in reconcile]
    by_jdbc[by_jdbc.index(str(out))] = str(tmp_path / "report-jdbc")
    done = subprocess.run(by_jdbc, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 3, done.stdout + done.stderr
    jdbc_total = json.loads((tmp_path / "report-jdbc" / "summary.json").read_text())["total"]
    assert jdbc_total == total


def test_the_job_file_runs_under_spark_submit(tmp_path: Path) -> None:
    """The spark_jobs folder alone, as a cluster would get it: the job file and a zip of the
    folder (--py-files), run away from the checkout; outbox, relay and SQLAlchemy cannot
    be imported (packages that raise on import shadow them), so the job needs none."""
    root = Path(__file__).resolve().parents[2]
    gen = [sys.executable, "-m", "spark_jobs.generate", "--rows", "3000", "--lost", "2"]
    gen += ["--phantom", "1", "--out", str(tmp_path / "in"), "--master", "local[2]"]
    assert (
        subprocess.run(gen, cwd=root, capture_output=True, timeout=300, check=False).returncode == 0
    )
    expected = json.loads((tmp_path / "in" / "expected.json").read_text())
    shipped = tmp_path / "ship"
    shutil.copytree(
        root / "spark_jobs", shipped / "spark_jobs", ignore=shutil.ignore_patterns("__pycache__")
    )
    archive = shutil.make_archive(str(tmp_path / "spark_jobs"), "zip", shipped, "spark_jobs")
    blocked = tmp_path / "blocked"
    for name in ("outbox", "relay", "sqlalchemy"):
        (blocked / name).mkdir(parents=True)
        (blocked / name / "__init__.py").write_text(f"raise ImportError('{name} is not shipped')")
    submit = [str(Path(sys.executable).with_name("spark-submit")), "--master", "local[2]"]
    log_config = shipped / "spark_jobs" / "log4j2.properties"  # as the example's README says
    submit += ["--conf", f"spark.driver.extraJavaOptions=-Dlog4j2.configurationFile={log_config}"]
    submit += ["--py-files", archive, str(shipped / "spark_jobs" / "reconcile_job.py")]
    submit += ["--ledger", str(tmp_path / "in" / "ledger"), "--out", str(tmp_path / "out")]
    submit += ["--broker-log", str(tmp_path / "in" / "broker")]
    submit += ["--start", expected["window"]["start"], "--end", expected["window"]["end"]]
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYTHONPATH": str(blocked)}
    done = subprocess.run(
        submit, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 3, done.stderr[-2000:]  # lost and phantom found
    printed = done.stdout + done.stderr  # spark-submit's PythonRunner merges the two
    assert not SPARK_NOISE.search(printed.replace("\r", "\n")), printed
    steps = re.findall(r"^reconcile: (.+) \(\d+ s\)$", printed, re.M)
    assert steps and steps[0] == "starting Spark", printed
    assert steps[-1].startswith("wrote 3 discrepancies"), printed
    total = json.loads((tmp_path / "out" / "summary.json").read_text())["total"]
    assert (total["lost"], total["phantom"], total["delivered"]) == (2, 1, 2998)


def test_model_b_run_reconciled_from_records_halfs_ops_and_the_real_stream(
    pg_url: str,
    nats_server: NatsServer,
    stream: tuple[str, str],
    tmp_path: Path,
    spark: SparkSession,
) -> None:
    """Model B for real: every end request dropped, so check-back settles all 40 halfs."""
    name, prefix = stream
    start = datetime.now(UTC) - timedelta(seconds=1)
    migrate.upgrade(pg_url)
    engine = create_engine(pg_url)
    business.create_all(engine)
    coordinator = Coordinator(nats_server.url, QUICK_CHECKS)
    coordinator.start()
    producer = TransactionProducer(
        group="orders",
        broker=nats_server.url,
        listener=SqlTransactionListener(engine, place_order, group="orders", rollback_after_s=0.5),
    )
    try:
        create_stream(nats_server.url, name, f"{prefix}.>")
        producer.start()
        producer.drop_end_requests = True
        for i in range(40):  # every fourth order is rejected: 30 commit
            producer.send_in_transaction(
                f"{prefix}.orders", b"{}", {"sku": f"S{i}", "fail": i % 4 == 0}
            )
        wait_until(lambda: coordinator.stats.ops_written >= 40, timeout=60, what="all settled")
    finally:
        producer.stop()
        coordinator.stop()
        engine.dispose()

    async def tamper() -> None:
        nc = await nats.connect(nats_server.url)
        js = nc.jetstream()
        for seq in (3, 17):  # lost at the broker
            await js.delete_msg(name, seq)
        await js.publish(f"{prefix}.orders", b"{}", headers={"Nats-Msg-Id": "phantom-b"})
        await nc.close()

    asyncio.run(tamper())
    files = {k: str(tmp_path / f"{k}.parquet") for k in ("records", "halfop", "broker")}
    assert cli.main(["export", "records", "--db", pg_url, "--out", files["records"]]) == 0
    assert (
        cli.main(["export", "halfop", "--broker", nats_server.url, "--out", files["halfop"]]) == 0
    )
    broker = ["export", "broker", "--broker", nats_server.url, "--stream", name]
    assert cli.main([*broker, "--out", files["broker"]]) == 0
    window = Window(start, datetime.now(UTC) + timedelta(seconds=120), sla_s=60)
    out = tmp_path / "report"
    summary = reconcile(spark, files["records"], files["broker"], out, window, files["halfop"])
    total = summary["total"]
    assert (total["committed"], total["delivered"], total["lost"], total["phantom"]) == (
        30,
        28,
        2,
        1,
    )
    assert (total["halfs"], total["unresolved"], total["discarded"]) == (40, 0, 0)
    # One op per half written: a round that put a half back (a slow answer) adds a copy's op.
    assert total["halfs"] <= total["ops"] <= total["half_writes"], total
    assert total["checks"] >= 40 and total["half_writes"] >= 80  # each checked and put back


def test_outbox_compare_reports_both_models_side_by_side(tmp_path: Path) -> None:
    """A short `outbox compare` with a fault of each model: both reconciled, nothing lost."""
    cmd = [OUTBOX, "compare", "--transactions", "200", "--rate", "200", "--fault-seconds", "1"]
    cmd += ["--faults", "kill,drop-ends", "--out", str(tmp_path), "--master", "local[2]"]
    env = {**os.environ, "OUTBOX_PROGRESS_EVERY_S": "0.2"}  # running totals, not per 5 s
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for model in ("a", "b"):  # each run's transactions counted as they finish, never past 200
        done_counts = [int(n) for n in re.findall(
            rf"^outbox compare: model {model}: (\d+)/200 \(", done.stderr, re.M)]  # fmt: skip
        assert done_counts and done_counts == sorted(done_counts), done.stderr
        assert done_counts[-1] <= 200
    models = json.loads((tmp_path / "compare.json").read_text())["models"]
    for model in ("a", "b"):
        assert models[model]["lost"] == models[model]["stuck"] == models[model]["phantom"] == 0
        assert models[model]["committed"] == models[model]["delivered"] > 150
    assert models["a"]["faults"]["kill"] is not None and models["b"]["faults"]["kill"] is not None
    assert models["a"]["skipped_faults"] == ["drop-ends"] and models["b"]["halfs"] >= 200
    assert models["b"]["broker_writes_per_message"] > models["a"]["broker_writes_per_message"]
    b = models["b"]
    assert isinstance(b["unresolved"], int) and b["op_log_bytes"] > 0
    assert b["check_backs_per_transaction"] == round(b["check_backs"] / b["halfs"], 2) > 0
    assert "unresolved" not in models["a"]
    page = (tmp_path / "compare.html").read_text()
    assert 'id="chart-a"' in page and 'id="chart-b"' in page and "model B: half/op" in page
    assert "n/a" in page and (tmp_path / "a" / "report" / "report.html").exists()
    assert "| lost | 0 | 0 |" in done.stdout
    for label, value in [
        ("unresolved halfs (B: neither an op nor a discard at the end)", b["unresolved"]),
        ("check-backs per transaction (B: check requests / halfs)",
         f"{b['check_backs_per_transaction']:.2f}"),
    ]:  # fmt: skip
        assert f"| {label} | n/a | {value} |" in done.stdout
    steps = re.findall(r"^outbox compare: (.+) \(\d+ s\)$", done.stderr, re.M)
    steps = [re.sub(r"\b\d+\b", "N", step.replace(str(tmp_path), "OUT")) for step in steps]
    assert steps == COMPARE_STEPS, done.stderr  # one line per step, with counts, in order
    assert not SPARK_NOISE.search(done.stderr.replace("\r", "\n")), done.stderr
