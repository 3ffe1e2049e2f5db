"""`outbox migrate --app MODULE:ATTR`: the database of the app's own Outbox, loaded as
`outbox relay --app` loads it."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from relay.cli import build_parser, main
from tests.migration.test_migrations import OUTBOX_TABLES, tables

APP = """
from outbox import Outbox
from relay.testing import MemoryBroker

ob = Outbox("{url}", broker="nats://127.0.0.1:1", connect_timeout_s=3)
in_memory = Outbox("{url}", broker=MemoryBroker())  # no broker URL: no matter to migrate
unbound = Outbox(broker="nats://127.0.0.1:1")  # bound later, in the app's factory


def bound():
    return unbound.bind("{url}")
"""


@pytest.fixture
def app_module(tmp_path: Path, sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    name = f"outbox_migrate_app_{tmp_path.name}".replace("-", "_")
    (tmp_path / f"{name}.py").write_text(APP.format(url=sqlite_url))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("OUTBOX_DB", raising=False)
    yield name
    module = sys.modules.pop(name, None)
    for ob in (module.ob, module.in_memory, module.unbound) if module else ():
        if ob.bound:
            ob.engine.dispose()


@pytest.mark.parametrize("attr", ["ob", "in_memory", "bound"])
def test_migrate_takes_the_apps_database(
    app_module: str, attr: str, sqlite_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["migrate", "--app", f"{app_module}:{attr}"]) == 0
    assert f"outbox schema upgraded none -> 0011 in {sqlite_url}" in capsys.readouterr().out
    assert tables(sqlite_url) == OUTBOX_TABLES


def test_the_apps_settings_come_along(app_module: str) -> None:
    from relay.cli import command_settings
    from relay.cli.app import use_app

    args = build_parser().parse_args(["migrate", "--app", f"{app_module}:ob"])
    assert command_settings(args, use_app(args)).connect_timeout_s == 3


def test_an_unbound_outbox_asks_for_db(app_module: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["migrate", "--app", f"{app_module}:unbound"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"outbox migrate: --app: the Outbox '{app_module}:unbound' is not bound")
    assert "give --db URL" in err


def test_db_wins_over_the_app(app_module: str, tmp_path: Path) -> None:
    other = f"sqlite:///{tmp_path}/other.sqlite"
    assert main(["migrate", "--app", f"{app_module}:unbound", "--db", other]) == 0
    assert tables(other) == OUTBOX_TABLES


def test_the_help_shows_app_and_model_b(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["migrate", "--help"])
    shown = capsys.readouterr().out
    assert "--app MODULE:ATTR" in shown and "--model-b" in shown
