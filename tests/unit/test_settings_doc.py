"""docs/configuration.md's table lists exactly the Settings fields, each with its type,
default, environment variables and flags as outbox.settings gives them: it cannot drift."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from outbox.settings import Settings, as_text, env_names, flag_names, has_flag
from relay.cli.settings_flags import SCALED

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
HEADER = "| field | type | default | environment | flag | what it does |"


def rows() -> dict[str, list[str]]:
    lines = DOC.read_text().splitlines()
    start = lines.index(HEADER) + 2
    table = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        table[cells[0].strip("`")] = cells
    return table


def quoted(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def test_the_table_lists_exactly_the_fields_in_their_order() -> None:
    assert list(rows()) == [f.name for f in dataclasses.fields(Settings)]


def test_each_row_gives_the_fields_default_environment_and_flags() -> None:
    table = rows()
    for f in dataclasses.fields(Settings):
        _, kind, default, env, flags, what = table[f.name]
        assert quoted(default)[0] == as_text(f.default), f.name
        assert quoted(env) == list(env_names(f)), f.name
        older = [flag for flag, (name, _) in SCALED.items() if name == f.name]
        shown = [*flag_names(f), *older] if has_flag(f) else []  # start_relay: the app's only
        assert quoted(flags) == shown, f.name
        assert kind and what, f.name
