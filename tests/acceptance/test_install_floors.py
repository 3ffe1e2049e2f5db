"""The lowest versions pyproject.toml claims for the core dependencies work.

Apps pin older releases than the newest (Alembic especially), and pip honours our floors
only as far as they are true. One fresh virtualenv gets the wheel with every core
dependency pinned to its floor (``SQLAlchemy>=2.0`` -> ``SQLAlchemy==2.0``), no extra;
floor_probe.py then migrates PostgreSQL (psycopg at its floor) and SQLite, runs a relay
that publishes a committed message and not a rolled-back one, reads the rows back, and
runs ``migrate.upgrade(conn)`` inside a caller's transaction. The virtualenv must hold
nothing an extra installs. pip reuses its cache: about half a minute warm.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.acceptance.test_install import ROOT, pip
from tests.acceptance.test_install import wheel as wheel  # the fixture: built once a session

PROBE = Path(__file__).with_name("floor_probe.py")
# What a core dependency installs itself: SQLAlchemy 2.0 requires greenlet on most
# platforms (2.1 no longer does; the async extra asks for it there).
PULLED_BY_THE_CORE = {"greenlet"}
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
pytestmark = pytest.mark.xdist_group("install")  # on test_install.py's worker: one wheel


def floors() -> dict[str, tuple[str, str]]:
    """Each core dependency: (the pip requirement pinned to its floor, the floor)."""
    found = {}
    for line in PROJECT["dependencies"]:
        req = Requirement(line)
        [floor] = [s.version for s in req.specifier if s.operator == ">="]
        extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
        found[req.name] = (f"{req.name}{extras}=={floor}", floor)
    return found


def extras_only() -> set[str]:
    """The distributions only an extra asks for (normalised names)."""
    core = {Requirement(line).name.lower() for line in PROJECT["dependencies"]}
    named = {
        Requirement(line).name.lower()
        for extra, lines in PROJECT["optional-dependencies"].items()
        for line in lines
    }
    return named - core - PULLED_BY_THE_CORE - {"outbox-relay"}


def installed(python: Path) -> set[str]:
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "list", "--format=json"],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout  # fmt: skip
    return {d["name"].lower().replace("_", "-") for d in json.loads(listed)}


def test_the_lowest_claimed_versions_work(wheel: Path, pg_url: str, tmp_path: Path) -> None:
    pinned = floors()
    assert {"SQLAlchemy", "alembic", "psycopg", "APScheduler"} <= set(pinned), pinned
    venv = tmp_path / "floors"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    pip(["--python", str(python), "install", "--quiet", str(wheel),
         *(requirement for requirement, _ in pinned.values())])  # fmt: skip
    versions = {name: floor for name, (_, floor) in pinned.items()}
    probed = subprocess.run(
        [python, "-I", PROBE, json.dumps(versions), pg_url, str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert probed.returncode == 0, probed.stdout + probed.stderr
    assert "floor probe ok" in probed.stdout
    pulled = installed(python) & {name.replace("_", "-") for name in extras_only()}
    assert not pulled, f"the core pulled what only extras ask for: {sorted(pulled)}"
