"""The reconciliation on a real Spark standalone cluster (two workers): the same summary
as local mode, the ledger read over JDBC on the executors, model B, and spark-submit as
examples/nightly_reconcile documents it (issue #27)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from relay import cli
from relay.testing import scratch_schema
from relay.testing.spark_cluster import SparkCluster
from spark_jobs.reconciliation import reconcile
from tests.conftest import PG_URL
from tests.spark.nights import EXPECTED, WINDOW, fill_year, night_broker_log
from tests.spark.test_model_b import WINDOW as B_WINDOW
from tests.spark.test_model_b import model_b_inputs

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
README = ROOT / "examples" / "nightly_reconcile" / "README.md"
# The driver on loopback (the cluster's address) and the executors on this Python
ENV = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable}


def window_flags(window: Any) -> list[str]:
    return ["--start", window.start.isoformat(), "--end", window.end.isoformat(), "--sla", "60"]


def run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300, check=False
    )


def total_in(out: Path) -> dict[str, Any]:
    return dict(json.loads((out / "summary.json").read_text())["total"])


def executor_logs(cluster: SparkCluster) -> set[Path]:
    """The executors' stderr files of every application so far, in the work folders."""
    return set(cluster.root.glob("work-*/*/*/stderr"))


@dataclass(frozen=True)
class Night:
    db: str  # the year's ledger in PostgreSQL
    broker: str  # the night's broker log, Parquet
    local: dict[str, Any]  # local mode's totals


@pytest.fixture(scope="module")
def night(spark: SparkSession, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Night]:
    """One night's inputs and local mode's summary, for the tests of this file to compare."""
    folder = tmp_path_factory.mktemp("night")
    with scratch_schema(PG_URL, "cluster") as db:
        fill_year(db)
        broker = night_broker_log(folder / "broker.parquet")
        local = reconcile(spark, db, broker, folder / "local", WINDOW)["total"]
        assert {k: local[k] for k in EXPECTED} == EXPECTED
        yield Night(db, broker, local)


def test_jdbc_ledger_on_the_cluster_gives_local_modes_summary(
    spark_cluster: SparkCluster, night: Night, tmp_path: Path
) -> None:
    pg_url, broker, local = night.db, night.broker, night.local

    before = executor_logs(spark_cluster)
    cmd = [str(BIN / "outbox"), "reconcile", "--ledger", pg_url, "--broker-log", broker]
    cmd += ["--out", str(tmp_path / "cluster"), *window_flags(WINDOW)]
    done = run([*cmd, "--master", spark_cluster.master_url], cwd=tmp_path)
    assert done.returncode == 3, done.stderr[-3000:]  # lost and phantom found
    assert total_in(tmp_path / "cluster") == local  # the ledger came through the executors
    # this run's executors (their own stderr files) fetched the JDBC driver jar
    logs = "".join(p.read_text(errors="replace") for p in executor_logs(spark_cluster) - before)
    assert re.search(r"Fetching spark://\S+/jars/postgresql\.jar", logs), logs[-3000:]


def test_model_b_on_the_cluster_gives_local_modes_summary(
    spark: SparkSession, spark_cluster: SparkCluster, tmp_path: Path
) -> None:
    records, broker, halfop, _ = model_b_inputs(tmp_path)
    local = reconcile(spark, records, broker, tmp_path / "local", B_WINDOW, halfop)["total"]
    cmd = [str(BIN / "outbox"), "reconcile", "--ledger", records, "--broker-log", broker]
    cmd += ["--halfop-log", halfop, "--out", str(tmp_path / "cluster"), *window_flags(B_WINDOW)]
    done = run([*cmd, "--master", spark_cluster.master_url], cwd=tmp_path)
    assert done.returncode == 3, done.stderr[-3000:]
    assert total_in(tmp_path / "cluster") == local
    assert (local["halfs"], local["lost"], local["phantom"]) == (7, 1, 1)


def documented_commands() -> list[list[str]]:
    """The README's bundle and spark-submit commands, continuations joined."""
    text = README.read_text()
    [block] = [b for b in re.findall(r"```sh\n(.*?)```", text, re.S) if "spark-submit" in b]
    return [shlex.split(line, comments=True) for line in block.replace("\\\n", " ").splitlines()]


def telling(archive: Path) -> None:
    """Make the zip's spark_jobs/__init__.py say where it is imported from."""
    with zipfile.ZipFile(archive) as zipped:
        members = {name: zipped.read(name) for name in zipped.namelist()}
    members["spark_jobs/__init__.py"] += (
        b"\nimport sys\nprint('spark_jobs imported from', __file__, file=sys.stderr)\n"
    )
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zipped:
        for name, data in members.items():
            zipped.writestr(name, data)


def test_spark_submit_as_the_example_documents_it(
    spark_cluster: SparkCluster, night: Night, tmp_path: Path
) -> None:
    """The README's very commands, with this cluster, these inputs and this window."""
    ledger = str(tmp_path / "ledger.parquet")
    assert cli.main(["export", "ledger", "--db", night.db, "--out", ledger]) == 0
    shutil.copyfile(night.broker, tmp_path / "broker.parquet")
    given = {"spark://spark-master:7077": spark_cluster.master_url, "reconcile/": "out",
             "2026-11-21T00:00:00Z": WINDOW.start.isoformat(),
             "2026-11-22T00:00:00Z": WINDOW.end.isoformat()}  # fmt: skip
    programs = {"python": sys.executable, "spark-submit": str(BIN / "spark-submit")}
    bundle, submit = documented_commands()
    assert bundle[:3] == ["python", "-m", "spark_jobs.bundle"] and submit[0] == "spark-submit"
    assert run([programs[bundle[0]], *bundle[1:]], cwd=tmp_path).returncode == 0
    telling(tmp_path / "ship" / "spark_jobs.zip")
    done = run([programs[submit[0]], *(given.get(a, a) for a in submit[1:])], cwd=tmp_path)
    said = done.stdout + done.stderr
    assert done.returncode == 3, said[-3000:]
    # the driver imported the package from the zip, not from this checkout
    [imported] = re.findall(r"spark_jobs imported from (\S+)", said)
    assert "spark_jobs.zip" in imported, imported
    assert total_in(tmp_path / "out") == night.local  # a Parquet ledger: the same summary
    assert "DISCREPANCIES" in (tmp_path / "out" / "report.html").read_text()
    shipped = zipfile.ZipFile(tmp_path / "ship" / "spark_jobs.zip").namelist()
    assert {"spark_jobs/reconcile_job.py", "spark_jobs/templates/report.html"} <= set(shipped)


class Recorded(SparkCluster):
    """A cluster that keeps every daemon it launched, to check they all ended."""

    launched: list[subprocess.Popen[bytes]]

    def _launch(self, name: str, args: list[str]) -> None:
        super()._launch(name, args)
        self.launched = [*getattr(self, "launched", []), self.procs[name]]


def test_a_failed_start_says_why_and_leaves_nothing_running(tmp_path: Path) -> None:
    """A worker that refuses its flags: the error has its log's tail, the master is gone."""
    cluster = Recorded(workers=1, memory="lots", root=tmp_path)
    with pytest.raises(RuntimeError, match="worker-0 exited") as failed:
        cluster.start()
    assert "--- worker-0.out" in str(failed.value) and "Usage" in str(failed.value)
    assert len(cluster.launched) == 2 and all(p.poll() is not None for p in cluster.launched)
    assert cluster.procs == {} and cluster.state() == {}  # the master's web UI is down
