"""The plugin seam (relay.plugins()): model B reaches the product only by registering, and
without it the product has no model B command, export kind or dashboard page."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

import relay
from outbox import migrate
from relay import PLUGIN_GROUP, Plugins, cli, plugins
from relay.cli import build_parser
from relay.dashboard import create_app


@pytest.fixture
def no_plugins(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """As if no plugin were installed (relay.plugins() already loaded: its cache)."""
    monkeypatch.setattr(relay, "_loaded", Plugins())
    yield


def test_model_b_registers_through_the_entry_point() -> None:
    [entry] = [e for e in importlib.metadata.entry_points(group=PLUGIN_GROUP) if e.name == "modelb"]
    assert entry.value == "relay.lab:register"
    found = plugins()
    commands = {name for group in found.command_groups for name in group.COMMANDS}
    assert commands == {"coordinator", "compare"}
    assert set(found.export_kinds) == {"records", "halfop"}
    assert [(p.path, p.label) for p in found.pages()] == [("/halfop", "Model B")]


def test_the_cli_has_model_b_commands_from_the_lab_only() -> None:
    """relay.cli's own groups have none; the plugin's come in before dashboard, as ever."""
    home = {
        name: group.__name__  # type: ignore[attr-defined]
        for group in cli.GROUPS
        for name in group.COMMANDS
    }
    assert {name for name, module in home.items() if module == "relay.lab.cli"} == {
        "coordinator",
        "compare",
    }
    assert all(m.startswith("relay.cli.") for m in home.values() if m != "relay.lab.cli")
    assert list(home)[-3:] == ["coordinator", "compare", "dashboard"]


def test_without_plugins_there_is_no_model_b_export(no_plugins: None) -> None:
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["export", "halfop", "--out", "x.parquet"])
    assert parser.parse_args(["export", "ledger", "--out", "x.parquet"]).what == "ledger"


def test_without_plugins_the_dashboard_has_no_model_b_page(
    no_plugins: None, sqlite_url: str
) -> None:
    migrate.upgrade(sqlite_url)
    with TestClient(create_app(sqlite_url), base_url="http://127.0.0.1") as client:
        assert client.get("/halfop").status_code == 404
        overview = client.get("/")
        assert overview.status_code == 200
        assert "Model B" not in overview.text and 'href="/blocked"' in overview.text
