"""Reports under ``--reports DIR``: each reconciliation (summary.json beside report.html)
and comparison (compare.json beside compare.html), with its summary figures; files are
served read-only and only from under DIR."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from spark_jobs.report import verdict

MAX_REPORTS = 200  # the newest listed; a folder of years of nightly runs stays one page
FIGURES = (
    "committed",
    "delivered",
    "lost",
    "stuck",
    "phantom",
    "duplicated",
    "out_of_order",
    "dead",
)


def find_reports(root: Path) -> list[dict[str, Any]]:
    """Every summary.json and compare.json under ``root``, newest first."""
    found = [*root.rglob("summary.json"), *root.rglob("compare.json")]
    found = [p for p in found if p.is_file() and not p.is_symlink() and inside(root, p)]
    found.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    return [describe(root, path) for path in found[:MAX_REPORTS]]


def describe(root: Path, path: Path) -> dict[str, Any]:
    folder = path.parent.relative_to(root).as_posix()
    kind = "reconciliation" if path.name == "summary.json" else "comparison"
    page = path.with_name("report.html" if kind == "reconciliation" else "compare.html")
    report: dict[str, Any] = {
        "kind": kind,
        "folder": folder or ".",
        "written": datetime.fromtimestamp(path.stat().st_mtime, UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "json": path.relative_to(root).as_posix(),
        "html": page.relative_to(root).as_posix() if page.is_file() else None,
        "models": [],
        "error": None,
    }
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        report["error"] = f"unreadable ({type(exc).__name__})"
        return report
    totals = summaries(kind, data)
    if totals is None:
        report["error"] = NOT_A_SUMMARY
    else:
        report["models"] = [figures(name, total) for name, total in totals]
    return report


NOT_A_SUMMARY = "not a reconciliation summary"


def summaries(kind: str, data: Any) -> list[tuple[str, dict[str, Any]]] | None:
    """(name, totals) of each model the file sums up; None when it is not the JSON
    `outbox reconcile` or `outbox compare` writes (another tool's file of that name)."""
    if not isinstance(data, dict):
        return None
    if kind == "reconciliation":
        total = data.get("total") or {}
        return [("", total)] if isinstance(total, dict) else None
    models = data.get("models") or {}
    if not isinstance(models, dict) or not all(isinstance(m, dict) for m in models.values()):
        return None
    return [(f"model {str(name).upper()}", m) for name, m in sorted(models.items())]


def figures(name: str, total: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "verdict": verdict(total),
        "figures": [(k.replace("_", " "), total.get(k)) for k in FIGURES if k in total],
    }


def inside(root: Path, path: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
    except ValueError:
        return False
    return True


def served_file(root: Path, wanted: str) -> Path | None:
    """The file ``wanted`` names under ``root``, None for anything else: a '..' or an
    absolute path leading out, a symlink leading out, a folder, nothing there."""
    if "\x00" in wanted or Path(wanted).is_absolute() or ".." in Path(wanted).parts:
        return None
    path = (root / wanted).resolve()
    if not inside(root, path) or not path.is_file():
        return None
    return path
