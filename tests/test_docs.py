"""The docs check: every `outbox` command line the docs show parses, every option is
documented, every relative link resolves.

The other commands the docs show are run by tests: `make demo` (acceptance/test_demo),
`python -m examples.webapp` and its POST (acceptance/test_webapp), the metrics scrape
(acceptance/test_relay_metrics), the nightly job (spark/test_end_to_end), `outbox
compare` (spark/test_end_to_end) and the README's Python example (test_readme); the
testing guide's examples run here, as a user's pytest suite.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from outbox.settings import Settings
from relay.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "examples").glob("*/README.md"))]  # fmt: skip


def command_lines() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        for block in re.findall(r"```(?:sh|text)\n(.*?)```", doc.read_text(), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                command = re.split(r"\s+#", line)[0].strip()
                if re.match(r"^(\S+=\S+\s+)*outbox ", command):
                    found.append((doc.name, command))
    return found


@pytest.mark.parametrize(("doc", "line"), command_lines())
def test_every_outbox_command_shown_parses(doc: str, line: str) -> None:
    words = shlex.split(line.replace("[", "").replace("]", "").replace("...", "x"))
    words = words[words.index("outbox") + 1 :]
    words = [w for w in words if w not in ("|", "&")]
    try:
        build_parser().parse_args(words)
    except SystemExit as exc:
        pytest.fail(f"{doc}: `{line}` does not parse (exit {exc.code})")


def test_the_docs_show_commands_at_all() -> None:
    shown = {line.split("outbox ", 1)[1].split()[0] for _, line in command_lines()}
    assert {"migrate", "relay", "status", "requeue", "drain", "export", "reconcile",
            "compare"} <= shown  # fmt: skip


def test_every_option_is_in_the_configuration_reference() -> None:
    reference = (ROOT / "docs" / "configuration.md").read_text()
    missing = [f.name for f in dataclasses.fields(Settings) if f"`{f.name}`" not in reference]
    assert not missing


def test_relative_links_resolve() -> None:
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#]+)\)", doc.read_text()):
            if "://" not in target and not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken


def guide_files() -> dict[str, str]:
    """docs/testing.md's Python blocks as the files of a user's test suite: a block whose
    first line is ``# NAME.py...`` goes into NAME.py (after the blocks before it of that
    name), one without into test_guide.py."""
    files: dict[str, str] = {}
    for block in re.findall(
        r"```python\n(.*?)```", (ROOT / "docs" / "testing.md").read_text(), re.S
    ):
        named = re.match(r"# (\w+\.py)\b", block)
        name = named.group(1) if named else "test_guide.py"
        files[name] = files.get(name, "") + block + "\n"
    return files


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_the_testing_guide_runs_as_a_users_test_suite(
    database: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """docs/testing.md: its Python blocks are a user's app and pytest suite (the app,
    conftest.py, the tests), run by pytest in a process of their own; every test passes,
    on SQLite and on PostgreSQL (TEST_DATABASE_URL, as the recipe reads it)."""
    files = guide_files()
    assert {"shop.py", "conftest.py", "test_shop.py", "test_guide.py"} <= set(files)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    if database == "postgresql":
        env["TEST_DATABASE_URL"] = str(request.getfixturevalue("pg_url"))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W",
         "error::sqlalchemy.exc.SAWarning", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    tests = sum(len(re.findall(r"^def test_", t, re.M)) for t in files.values())
    assert run.returncode == 0 and f"{tests} passed" in run.stdout, run.stdout + run.stderr
