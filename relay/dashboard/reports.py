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
    if kind == "reconciliation":
        report["models"] = [figures("", data.get("total") or {})]
    else:
        models = data.get("models") or {}
        report["models"] = [
            figures(f"model {name.upper()}", m) for name, m in sorted(models.items())
        ]
    return report


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
