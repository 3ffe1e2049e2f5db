"""`outbox compare`: one workload through model A (outbox) and model B (half/op), reconciled.

Runs ``relay.lab.compare.run``'s workload on both models against the same PostgreSQL (a
scratch schema, dropped afterwards) and the same broker (the wheel's nats-server
unless ``--broker`` names one), exports each model's inputs, reconciles both with the
Spark job and writes ``compare.json`` and ``compare.html`` side by side. Exit status 3
when either model lost a message, produced a phantom or delivered a key out of order;
else 4 when either left a message stuck (still pending past the SLA).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jinja2 import PackageLoader

from outbox import migrate
from outbox.errors import OutboxError
from outbox.secrets import mask_url
from relay import export
from relay.brokers import reader_for
from relay.lab import export as lab_export
from relay.lab.compare import add_arguments, workload_of
from relay.lab.compare.run import Counter, RunResult, run_models
from relay.lab.compare.workload import Workload
from relay.testing import NatsServer, scratch_schema
from spark_jobs import session
from spark_jobs.reconcile_job import EXIT_DISCREPANCY, EXIT_STUCK, exit_status, spark_error, told
from spark_jobs.report import embedded, environment, fmt, latency_chart, verdict, write_plotlyjs
from spark_jobs.window import Window

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

ROWS = (
    ("committed", "committed (by the ledger / listener records)"),
    ("delivered", "delivered"),
    ("lost", "lost"),
    ("stuck", "stuck (pending past the SLA)"),
    ("duplicated", "duplicated at the broker"),
    ("phantom", "phantom"),
    ("out_of_order", "out of order (per key)"),
    ("dead", "dead-lettered"),
    ("scheduled", "scheduled (due after the window)"),
    ("canceled", "canceled by the app"),
    ("latency_p50_ms", "due -> broker p50 (ms)"),
    ("latency_p99_ms", "due -> broker p99 (ms)"),
    ("broker_writes_per_message", "broker writes per committed message"),
    ("db_statements_per_message", "DB statements per committed message (this process)"),
    ("check_backs", "check-backs (B)"),
    ("check_backs_per_transaction", "check-backs per transaction (B: check requests / halfs)"),
    ("half_retries", "half sends retried (B)"),
    ("halfs", "halfs (B)"),
    ("unresolved", "unresolved halfs (B: neither an op nor a discard at the end)"),
    ("ops", "op messages (B)"),
    ("op_log_bytes", "op log bytes (B)"),
    ("discarded", "discarded halfs (B)"),
    ("rolled_back", "rolled back by the app"),
    ("failed", "transactions failed by a fault"),
    ("poisoned", "poison transactions offered"),
)

# report.html's link back to compare.html, from <out>/<model>/report/.
BACK = ("the comparison of both models (compare.html)", "../../compare.html")

# Figures only model B has: model A's column says "n/a".
ONLY_B = {
    "check_backs", "check_backs_per_transaction", "half_retries", "halfs", "unresolved", "ops",
    "op_log_bytes", "discarded",
}  # fmt: skip


@contextlib.contextmanager
def broker(url: str | None) -> Iterator[tuple[str, NatsServer | None]]:
    if url is not None:
        yield url, None
        return
    with NatsServer() as server:
        yield server.url, server


def export_inputs(db: str, url: str, result: RunResult, folder: Path) -> dict[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    files = {"broker": str(folder / "broker.parquet")}
    export.export_broker(reader_for(url), [result.stream], files["broker"])
    if result.model == "a":
        files["ledger"] = str(folder / "ledger.parquet")
        export.export_ledger(db, files["ledger"])
    else:
        files["ledger"] = str(folder / "records.parquet")
        files["halfop"] = str(folder / "halfop.parquet")
        lab_export.export_records(db, files["ledger"])
        since = result.started - timedelta(seconds=1)
        lab_export.export_halfop_nats(url, files["halfop"], since=since)
    return files


def figures(result: RunResult, summary: dict[str, Any], broker_writes: int) -> dict[str, Any]:
    total = summary["total"]
    committed = max(int(total.get("committed") or 0), 1)
    return {
        **{k: total.get(k) for k, _ in ROWS if k in total},
        **(model_b_figures(result, total) if result.model == "b" else {}),
        "model": result.model,
        "broker_writes_per_message": broker_writes / committed,
        "db_statements_per_message": result.statements / committed,
        "check_backs": result.check_backs,
        "rolled_back": result.rolled_back,
        "failed": result.failed,
        "poisoned": result.poisoned,
        "latency_histogram": summary.get("latency_histogram", []),
        "faults": {f.name: (None if f.skipped else f.settle_s) for f in result.faults},
        "skipped_faults": [f.name for f in result.faults if f.skipped],
    }


def model_b_figures(result: RunResult, total: dict[str, Any]) -> dict[str, Any]:
    """What only model B has beyond the reconciliation's counts."""
    halfs = int(total.get("halfs") or 0)
    per_transaction = round(result.check_backs / halfs, 2) if halfs else None
    return {
        "check_backs_per_transaction": per_transaction,
        "op_log_bytes": result.op_log_bytes,
        "half_retries": result.half_retries,
    }


def shown(model: dict[str, Any], key: str) -> str:
    """A figure as the table shows it: "n/a" where the model has no such thing."""
    if key in ONLY_B and model.get("model") != "b":
        return "n/a"
    value = model.get(key)
    if key == "check_backs_per_transaction" and value is not None:
        return f"{value:.2f}"
    return fmt(value)


def stored_rows(*paths: str) -> int:
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(p).metadata.num_rows for p in paths)


def reconcile_both(
    inputs: dict[str, dict[str, str]],
    results: list[RunResult],
    out: Path,
    args: argparse.Namespace,
    step: Callable[[str], None],
) -> dict[str, dict[str, Any]]:
    """Both models' reconciliations in one Spark session; Spark's errors become one line."""
    from py4j.protocol import Py4JError  # type: ignore[import-untyped]
    from pyspark.errors import PySparkException

    step("starting Spark")
    start = min(r.started for r in results) - timedelta(seconds=1)
    window = Window(start, datetime.now(UTC) + timedelta(seconds=120), sla_s=60)
    made = session.builder("outbox-compare", args.master, args.verbose)
    try:
        spark = session.started(made.config("spark.ui.enabled", "false"), args.verbose)
        try:
            return {
                r.model: reconcile_model(spark, inputs[r.model], r, out / r.model, window, step)
                for r in results
            }
        finally:
            spark.stop()
    except (Py4JError, PySparkException) as exc:
        raise OutboxError(f"Spark failed: {spark_error(exc, args.master)}") from None


def reconcile_model(
    spark: SparkSession,
    files: dict[str, str],
    result: RunResult,
    out: Path,
    window: Window,
    step: Callable[[str], None],
) -> dict[str, Any]:
    """One model's reconciliation into ``out``/report, its steps told as the model's."""
    from spark_jobs.reconciliation import reconcile

    step(f"reconciling model {result.model}")
    halfop = files.get("halfop")
    summary = reconcile(
        spark, files["ledger"], files["broker"], out / "report", window, halfop,
        lambda what: step(f"model {result.model}: {what}"), links=[BACK],
    )  # fmt: skip
    writes = stored_rows(files["broker"], *([halfop] if halfop else []))
    return figures(result, summary, writes)


def write_html(path: Path, models: dict[str, dict[str, Any]], workload: Workload) -> None:
    """compare.html beside the models' folders (``a/report/report.html``, linked)."""
    a, b = models["a"], models["b"]
    # one y range for both histograms: the same count is drawn at the same height
    top = max((int(n) for m in (a, b) for _, n in m["latency_histogram"]), default=1)
    charts = [
        (m, embedded(latency_chart(models[m]["latency_histogram"], top), f"chart-{m}"))
        for m in ("a", "b")
    ]
    env = environment(PackageLoader("relay.lab.compare", "templates"))
    page = env.get_template("compare.html").render(
        title="Outbox vs half/op",
        workload=workload,
        rows=[(label, shown(a, key), shown(b, key)) for key, label in ROWS],
        faults=[(name, settle(a, name), settle(b, name)) for name in workload.faults],
        verdicts=[(m, verdict(models[m])) for m in ("a", "b")],
        reports={m: f"{m}/report/report.html" for m in ("a", "b")},
        charts=charts,
    )
    write_plotlyjs(path.parent)
    path.write_text(page)


def settle(model: dict[str, Any], name: str) -> str:
    if name in model["skipped_faults"]:
        return "n/a"
    value = model["faults"].get(name)
    return "not settled" if value is None else f"{value:.2f}"


def print_table(models: dict[str, dict[str, Any]], workload: Workload) -> None:
    a, b = models["a"], models["b"]
    lines = ["| figure | model A: outbox | model B: half/op |", "|---|---|---|"]
    lines += [f"| {label} | {shown(a, k)} | {shown(b, k)} |" for k, label in ROWS]
    lines += [
        f"| settle after {n} (s) | {settle(a, n)} | {settle(b, n)} |" for n in workload.faults
    ]
    print("\n".join(lines))


def report_args(args: argparse.Namespace) -> dict[str, Any]:
    """The run's options (its own flags, not the CLI's) for compare.json, its URLs masked."""
    own = argparse.ArgumentParser()
    add_arguments(own)
    options = {name: getattr(args, name) for name in vars(own.parse_args([]))}
    urls = {name: mask_url(options[name]) for name in ("db", "broker") if options.get(name)}
    return {**options, **urls}


def not_counted(what: str, total: int) -> contextlib.nullcontext[Callable[[int], None]]:
    """No progress shown (the command passes its own: relay.lab.cli)."""
    return contextlib.nullcontext(lambda n: None)


def run(args: argparse.Namespace, counted: Counter = not_counted) -> int:
    """Run both models, reconcile them, write the report; exit status 3 on a discrepancy.
    ``counted(what, total)`` shows a model's transactions done (progress).

    A workload the flags describe wrongly raises ValueError before anything runs.
    """
    workload = workload_of(args)
    step = told("outbox compare", time.monotonic())  # a line per step on stderr
    for quiet in ("alembic", "apscheduler", "relay.lab.halfop", "py4j", "nats"):
        logging.getLogger(quiet).setLevel(logging.WARNING)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with scratch_schema(args.db, "compare") as db, broker(args.broker) as (url, server):
        migrate.upgrade(db, model_b=True)  # model B's table too
        results = list(run_models(db, url, server, workload, step, counted))
        step("exporting both models' ledgers and broker logs")
        inputs = {r.model: export_inputs(db, url, r, out / r.model) for r in results}
    models = reconcile_both(inputs, results, out, args, step)
    step("writing compare.json and compare.html")
    (out / "compare.json").write_text(
        json.dumps({"workload": report_args(args), "models": models}, indent=2, default=str)
    )
    write_html(out / "compare.html", models, workload)
    print_table(models, workload)
    print(f"report: {out / 'compare.html'}")
    return worst(exit_status(m) for m in models.values())


def worst(statuses: Iterable[int]) -> int:
    """The run's exit status: data wrong (3) in either model before stuck (4) before 0."""
    found = set(statuses)
    return next((code for code in (EXIT_DISCREPANCY, EXIT_STUCK) if code in found), 0)
