"""Every documented install works: the wheel in fresh virtualenvs, one per extra and combination.

The checkout's .venv has every extra (``dev`` pulls them all), so it cannot show an import
that needs an extra the user did not install. Here the wheel is built once from the
working tree and installed into a new virtualenv (no system site-packages) per case: no
extra, each user-facing extra of pyproject.toml, and each combination the README or the
docs name. In each, ``outbox --help`` runs and install_probe.py imports outbox and relay,
runs every command's --help, sends a message on SQLite and checks what the extras give.
pip installs from the machine's configured mirrors and cache, three cases at a time.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import cast

import pytest

from outbox import aio
from outbox.broker import BROKER_SCHEMES
from relay.cli import EXTRA_OF

ROOT = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("install_probe.py")
EXTRAS = set(
    tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
)
CHECKOUT_ONLY = {"dev", "bench", "peers", "demo", "examples", "docs"}  # the checkout's, not users'
USER_EXTRAS = EXTRAS - CHECKOUT_ONLY
PIP_LINE = re.compile(r"outbox-relay\[([^\]]*)\]")
DATA_FOLDERS = ["relay/lab/compare/templates", "relay/dashboard/templates",
                "relay/dashboard/static", "spark_jobs/templates"]  # fmt: skip
INSTALL_TIMEOUT_S = 600  # a cold pip cache downloads pyspark (~300 MB)
# One worker runs this file and test_install_floors.py: the session fixtures (the wheel,
# every case's virtualenv) are built per xdist worker, and `installs` makes them all.
pytestmark = pytest.mark.xdist_group("install")


def documented() -> set[tuple[str, ...]]:
    """The extras combinations named as ``outbox-relay[...]`` in the README and the docs."""
    pages = [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("examples/**/*.md")]
    found = {match for page in pages for match in PIP_LINE.findall(page.read_text())}
    return {tuple(sorted(part.strip() for part in combo.split(","))) for combo in found}


CASES = sorted({(), *((extra,) for extra in USER_EXTRAS), *documented()})


def test_every_extra_named_anywhere_exists() -> None:
    """The docs, the CLI's errors and the broker table name only extras pyproject has."""
    named = {extra for combo in documented() for extra in combo}
    assert ("metrics", "nats") in documented()  # the README's line is found
    assert named <= USER_EXTRAS, named - USER_EXTRAS
    assert set(EXTRA_OF.values()) <= USER_EXTRAS
    assert set(BROKER_SCHEMES.values()) <= USER_EXTRAS
    assert "outbox-relay[async]" in aio.INSTALL and "async" in USER_EXTRAS


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built once from a copy of the working tree's files (no stale build/)."""
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout.split("\0")  # fmt: skip
    for name in filter(None, listed):
        if (ROOT / name).is_file():  # a deleted, not yet committed file is still listed
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    # Not --quiet: the build's own warnings are kept for the test below.
    log = pip(["wheel", "--no-deps", "-w", str(out), str(source)])
    (out / "build.log").write_text(log)
    [built] = out.glob("outbox_relay-*.whl")
    return built


def test_building_the_wheel_prints_no_warning_and_keeps_the_data_files(wheel: Path) -> None:
    """Every install used to print ~180 lines of setuptools' "Package would be ignored"
    (the template and static folders were not declared): none now, and each of those
    folders' files is in the wheel."""
    log = wheel.with_name("build.log").read_text()
    assert "would be ignored" not in log, log
    data = [path.relative_to(ROOT).as_posix() for folder in DATA_FOLDERS
            for path in (ROOT / folder).iterdir() if path.is_file()]  # fmt: skip
    assert len(data) >= 10, data
    with zipfile.ZipFile(wheel) as built:
        missing = set(data) - set(built.namelist())
    assert not missing, missing


class Installs:
    """The selected cases' virtualenvs, installed ``WORKERS`` at a time in the background.

    pip waits on disk and the mirrors as much as on the CPU: side by side the whole set
    takes about half the time. Each test waits for its own case only.
    """

    WORKERS = 3

    def __init__(self, wheel: Path, folder: Path, cases: list[tuple[str, ...]]) -> None:
        self.folder = folder
        self.pool = ThreadPoolExecutor(self.WORKERS)
        self.futures = {case: self.pool.submit(install, wheel, folder / name(case), case)
                        for case in cases}  # fmt: skip

    @contextmanager
    def venv(self, case: tuple[str, ...]) -> Iterator[Path]:
        """The case's virtualenv once installed; removed afterwards (pyspark's weigh ~700 MB)."""
        folder = self.futures[case].result()
        try:
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture(scope="session")
def installs(
    request: pytest.FixtureRequest, wheel: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Installs]:
    selected = [cast(tuple[str, ...], item.callspec.params["extras"])
                for item in request.session.items if isinstance(item, pytest.Function)
                and item.name.startswith("test_the_wheel_")]  # fmt: skip
    installs = Installs(wheel, tmp_path_factory.mktemp("venvs"), selected)
    yield installs
    installs.close()


def install(wheel: Path, folder: Path, extras: tuple[str, ...]) -> Path:
    """A new virtualenv without pip (this pip installs into it) and without site-packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    target = f"{wheel}[{','.join(extras)}]" if extras else str(wheel)
    pip(["--python", str(folder / "bin" / "python"), "install", "--quiet", target])
    return folder


def name(extras: tuple[str, ...]) -> str:
    return "+".join(extras) or "no-extra"


def pip(args: list[str]) -> str:
    """Runs pip, asserts it succeeded and returns what it printed."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", *args], capture_output=True, text=True,
        timeout=INSTALL_TIMEOUT_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


@pytest.mark.parametrize("extras", CASES, ids=name)
def test_the_wheel_imports_runs_and_sends(
    extras: tuple[str, ...], installs: Installs, tmp_path: Path
) -> None:
    with installs.venv(extras) as venv:
        probe(venv, extras, tmp_path)


def probe(venv: Path, extras: tuple[str, ...], tmp_path: Path) -> None:
    python = venv / "bin" / "python"
    helped = subprocess.run(
        [venv / "bin" / "outbox", "--help"], capture_output=True, text=True, timeout=60
    )
    assert helped.returncode == 0 and "usage: outbox" in helped.stdout, helped.stderr
    probed = subprocess.run(
        [python, "-I", PROBE, ",".join(extras), str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert probed.returncode == 0, probed.stdout + probed.stderr
    assert "probe ok" in probed.stdout


def test_the_demo_runs_with_only_the_demo_extra(wheel: Path, tmp_path: Path) -> None:
    """`make demo` installs the `demo` extra alone: the demo must need nothing more."""
    venv = install(wheel, tmp_path / "demo-venv", ("demo",))
    demo = shutil.copy(ROOT / "examples" / "demo.py", tmp_path)  # away from the checkout's code
    try:
        env = {k: v for k, v in os.environ.items() if k not in ("OUTBOX_DB", "OUTBOX_BROKER")}
        done = subprocess.run(
            [venv / "bin" / "python", "-I", demo, "--requests", "50"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        assert "first message at the broker" in done.stdout
        assert not list(venv.glob("lib/python*/site-packages/pyspark")), "the demo pulled in Spark"
    finally:
        shutil.rmtree(venv, ignore_errors=True)
