"""Every numeric flag of every `outbox` command has a range, says it in --help, and a value
outside it is a usage error (exit status 2) naming the flag and the range, found before
the command does anything; so are --out paths that cannot be written.

The parser is walked, not listed: a numeric flag added later without a range fails
test_every_numeric_flag_has_a_range, and its bad values are tried by the others.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from outbox.settings import MOST, Settings, range_of, type_of
from relay import cli
from relay.cli.common import msg_id
from relay.cli.settings_flags import SCALED, dest_of, scaled_range
from relay.lab import cli as lab_cli
from relay.lab.compare import report
from spark_jobs import reconcile_job
from spark_jobs.flags import Bounded, iso_time, shown, spark_master

ID = "00000000-0000-4000-8000-000000000000"
DB = ["--db", "sqlite://"]
BROKER = ["--broker", "nats://127.0.0.1:1"]
WINDOW = ["--start", "2026-03-01T00:00:00Z", "--end", "2026-03-01T01:00:00Z"]
# What each command needs besides the flag tried, so that only that flag can be wrong.
BASE = {
    "consume": ["--app", "tests.consume_app:inbox", "--broker", "nats://127.0.0.1:1"],
    "migrate": DB,
    "status": DB,
    "requeue": [*DB, "--dead"],
    "dead": DB,
    "show": [ID, *DB],
    "skip": [ID, *DB],
    "relay": [*DB, *BROKER],
    "drain": [*DB, *BROKER],
    "purge": DB,
    "export": ["ledger", *DB],
    "reconcile": ["--ledger", "l", "--broker-log", "b", *WINDOW],
    "coordinator": BROKER,
    "compare": [],
    "dashboard": DB,
}
OUT = {"export": ["--out", "x.parquet"], "reconcile": ["--out", "o"]}  # required, tried apart
# The issue's values and their kind: out of any range, not finite, negative, not ASCII.
BAD = ["99999999999999999999", "3000000000", "1e308", "inf", "nan", "-1", "²", "١٢",
       "", "0x10", "1e99999", "9" * 5000]  # fmt: skip
TEXT_TYPES = (None, msg_id, iso_time, spark_master)  # the types of flags that are not numbers
NUMERIC_FIELDS = {f.name: f for f in fields(Settings) if range_of(f) is not None}


def commands() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    found = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(found[0].choices)


def numeric_flags() -> list[tuple[str, str, Any]]:
    """(command, flag, how its range is checked) for every numeric flag of every command:
    a Bounded type, a Settings field (checked by outbox.settings.check) or an older
    spelling in another unit (--retention-days)."""
    found = []
    for command, parser in commands().items():
        for action in parser._actions:
            flag = action.option_strings[0] if action.option_strings else action.dest
            if isinstance(action.type, Bounded):
                found.append((command, flag, action.type))
            elif action.dest in NUMERIC_FIELDS:
                found.append((command, flag, NUMERIC_FIELDS[action.dest]))
            elif flag in SCALED and action.dest == dest_of(flag):
                found.append((command, flag, flag))
    return found


def range_text(check: Any) -> str:
    """How the flag's help and error state its range."""
    if isinstance(check, Bounded):
        return check.range
    if isinstance(check, str):  # an older spelling in another unit
        return scaled_range(SCALED[check][0], check)
    return str(range_of(check))


def above(check: Any) -> str:
    """A value just past the top of the range."""
    if isinstance(check, Bounded):
        return str(check.hi + 1)
    if isinstance(check, str):
        name, unit = SCALED[check]
        return str(MOST[name] / unit * 2)
    return str(int(MOST[check.name]) + 1)


PARSER = cli.build_parser()
FLAGS = numeric_flags()
CASES = [
    pytest.param(command, flag, value, range_text(check), id=f"{command} {flag} {shown(value)}")
    for command, flag, check in FLAGS
    for value in [*BAD, above(check)]
]


@pytest.fixture(autouse=True)
def nothing_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A value wrongly accepted runs nothing (no worker, no comparison): the command's
    handler is replaced, so such a run ends at once with 0 and the test fails."""
    for name in cli.COMMANDS:
        monkeypatch.setitem(cli.COMMANDS, name, lambda args: 0)
    monkeypatch.setattr(cli, "build_parser", lambda: PARSER)  # built once: 900 runs
    for name in [n for n in os.environ if n.startswith("OUTBOX_")]:
        monkeypatch.delenv(name)


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """The `outbox` command in this process: its exit status and stderr."""
    try:
        status = cli.main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        status = exc.code if isinstance(exc.code, int) else 1
    return status, capsys.readouterr().err


def test_every_numeric_flag_has_a_range() -> None:
    """No flag parses a number by itself (int, float or a function of its own): each
    numeric one is Bounded or a Settings field, and its help states the range."""
    for command, parser in commands().items():
        assert command in BASE, f"{command}: add its required arguments to BASE"
        for action in parser._actions:
            assert action.type in TEXT_TYPES or isinstance(action.type, Bounded), (
                f"{command} {action.option_strings}: type {action.type!r}; numbers take "
                "spark_jobs.flags.bounded_int, bounded_number or bounded_seconds"
            )
    for command, flag, check in FLAGS:
        action = next(a for a in commands()[command]._actions if flag in a.option_strings)
        if action.help == argparse.SUPPRESS:  # a worker's hidden fast-path flag: no help
            continue
        assert range_text(check) in str(action.help), f"{command} {flag}: no range in its help"


def test_every_numeric_setting_has_a_largest_value() -> None:
    numeric = {f.name for f in fields(Settings) if type_of(f) not in ("bool", "str")}
    assert set(NUMERIC_FIELDS) == numeric
    assert set(MOST) == numeric


def test_the_issues_flags_are_walked() -> None:
    walked = {(command, flag) for command, flag, _ in FLAGS}
    wanted = {("dead", "--limit"), ("show", "--bytes"), ("status", "--sla"),
              ("status", "--blocked-limit"), ("relay", "--sweep-batch"),
              ("drain", "--retry-delays-ms"), ("relay", "--retention-days"),
              ("status", "--connect-timeout-s"), ("reconcile", "--lookback"),
              ("compare", "--rollback-rate"), ("dashboard", "--port")}  # fmt: skip
    assert wanted <= walked


@pytest.mark.parametrize(("command", "flag", "value", "bounds"), CASES)
def test_a_value_outside_the_range_is_a_usage_error(
    command: str, flag: str, value: str, bounds: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status, err = run([command, *BASE[command], *OUT.get(command, []), flag, value], capsys)
    assert status == 2, err
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert flag in line and bounds in line, line


@pytest.mark.parametrize(
    ("command", "flag", "check"), [c for c in FLAGS if isinstance(c[2], Bounded)]
)
def test_the_ends_of_a_range_are_taken(command: str, flag: str, check: Bounded) -> None:
    assert check(str(check.lo).removesuffix(".0")) == check.lo
    assert check(str(check.hi).removesuffix(".0")) == check.hi
    assert check(f" {check.hi} ") == check.hi  # as a shell variable may leave it


def test_a_settings_flag_takes_its_largest_value(capsys: pytest.CaptureFixture[str]) -> None:
    given = [f"--{name.replace('_', '-')}={int(most)}" for name, most in MOST.items()
             if name not in ("handoff_limit_s", "retry_delays_ms")]  # fmt: skip
    status, err = run(["relay", *BASE["relay"], *given, "--retry-delays-ms", "0,86400000"], capsys)
    assert status == 0, err


def unwritable(tmp_path: Path) -> Path:
    """A folder this process may not write in (as root, which writes anywhere else, the
    kernel's /proc/sys)."""
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(0o555)
    return folder if not os.access(folder, os.W_OK) else Path("/proc/sys")


@pytest.mark.parametrize(
    ("command", "out", "problem"),
    [
        ("export", "missing/x.parquet", "no folder"),
        ("export", "a-file/x.parquet", "is not a folder"),
        ("export", ".", "a folder, not a file"),
        ("export", "LOCKED/x.parquet", "is not writable"),
        ("export --by-day", "missing/days", "no folder"),
        ("export --by-day", "a-file", "a file"),
        ("export --by-day", "LOCKED/days", "is not writable"),
        ("reconcile", "a-file", "a file, not a folder"),
        ("reconcile", "a-file/report", "is not a folder"),
        ("reconcile", "LOCKED/report", "is not writable"),
        ("compare", "a-file", "a file, not a folder"),
        ("compare", "LOCKED/new/report", "is not writable"),
    ],
)
def test_an_out_that_cannot_be_written_is_a_usage_error(
    command: str,
    out: str,
    problem: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found before any work: the real handlers run, and would connect, export or start
    Spark past the check (the Spark job is stubbed: nothing may reach it)."""
    monkeypatch.setattr(cli, "COMMANDS", {**cli.data.COMMANDS, **lab_cli.COMMANDS})
    monkeypatch.setattr(reconcile_job, "run", lambda args, prog: 0)
    monkeypatch.setattr(report, "run", lambda args: 0)
    (tmp_path / "a-file").write_text("")
    path = out.replace("LOCKED", str(unwritable(tmp_path))) if "LOCKED" in out else out
    path = str(tmp_path / path) if not path.startswith("/") else path
    name, *flags = command.split()
    before = sorted(tmp_path.rglob("*"))
    status, err = run([name, *BASE[name], *flags, "--out", path], capsys)
    assert status == 2, err
    line = err.strip().splitlines()[-1]
    assert f"--out {path}" in line and problem in line, line
    assert sorted(tmp_path.rglob("*")) == before, "nothing written"
