"""The README's usage examples run as written: every ```python block, each in a fresh directory."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_quickstart_shows_sync_and_async_use() -> None:
    blocks = python_blocks()
    assert any("async def" in block and "asyncio.run(" in block for block in blocks)
    assert any("async def" not in block for block in blocks)


@pytest.mark.parametrize(
    "example", python_blocks(), ids=lambda b: "async" if "async def" in b else "sync"
)
def test_usage_example_runs(example: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    scope: dict[str, object] = {}
    exec(compile(example, "README.md", "exec"), scope)
    assert uuid.UUID(str(scope["msg_id"])).version == 7
    engine = create_engine("sqlite:///shop.sqlite")
    with engine.connect() as conn:
        assert conn.execute(text("SELECT sku, qty FROM inbound")).all() == [("A-1", 3)]
        topic, key = conn.execute(text("SELECT topic, key FROM outbox_message")).one()
    assert (topic, key) == ("warehouse.inbound", "A-1")
    engine.dispose()


def test_readme_names_the_two_commands() -> None:
    text_ = README.read_text()
    assert text_.index("make demo") < text_.index("## Use")
    assert "make test" in text_


def test_the_migrate_lines_are_what_migrate_prints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The README's `outbox migrate` lines, for a new database and a second run, are the
    command's own (they said `upgraded 0001 -> 0007` where a new database prints `none`)."""
    from relay.cli import main

    url = f"sqlite:///{tmp_path}/new.sqlite"
    printed = []
    for _ in range(2):
        assert main(["migrate", "--db", url]) == 0
        printed.append(capsys.readouterr().out.strip().replace(url, "URL"))
    shown = re.findall(r"`(outbox schema [^`]*)`", README.read_text())
    assert printed[0].startswith("outbox schema upgraded none -> ")
    assert printed[1].startswith("outbox schema already at ")
    assert set(printed) <= set(shown), (printed, shown)
