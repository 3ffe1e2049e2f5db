"""One rule for schema names (outbox.names), at every entry point that takes one.

Hostile names raise ConfigError naming the field and the rule, before anything runs:
nothing is created and no server option is set.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from outbox.engines import schema_url
from outbox.errors import ConfigError
from outbox.names import check_name
from relay.testing import scratch_schema
from tests.conftest import PG_URL

HOSTILE = [
    pytest.param('a"b', id="double-quote"),
    pytest.param("a'b", id="quote"),
    pytest.param('x"; DROP SCHEMA public CASCADE; --', id="statement"),
    pytest.param("a;b", id="semicolon"),
    pytest.param("a b", id="space"),
    pytest.param("public -c session_replication_role=replica", id="libpq-option"),
    pytest.param("-c", id="dash-c"),
    pytest.param("a\\ b", id="backslash"),
    pytest.param("a\x00b", id="nul"),
    pytest.param("a\nb", id="newline"),
    pytest.param("a\n", id="trailing-newline"),
    pytest.param("x" * 64, id="too-long"),
    pytest.param("", id="empty"),
    pytest.param("1abc", id="leading-digit"),
    pytest.param("sch\u00e9ma", id="unicode"),
    pytest.param("\uff41", id="fullwidth"),
    pytest.param("Abc", id="upper-case"),
    pytest.param(None, id="none"),
]
ENTRY_POINTS: dict[str, tuple[str, Callable[[object], object]]] = {
    "check_name": ("schema", lambda name: check_name("schema", name)),
    "schema_url": ("schema", lambda name: schema_url(PG_URL, name)),  # type: ignore[arg-type]
    "scratch_schema": ("prefix", lambda name: scratch_schema(PG_URL, name).__enter__()),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_name_is_refused_with_the_field_and_the_rule(entry: str, name: object) -> None:
    field, call = ENTRY_POINTS[entry]
    with pytest.raises(ConfigError, match=rf"^{field}: must be 1 to \d+ characters of lower-case"):
        call(name)


@pytest.mark.parametrize("name", ["a", "_", "t_0123", "x" * 63])
def test_a_plain_name_is_accepted(name: str) -> None:
    assert check_name("schema", name) == name
    assert schema_url(PG_URL, name).endswith(f"options=-csearch_path%3D{name}")


def test_a_prefix_leaves_room_for_the_scratch_suffix() -> None:
    with pytest.raises(ConfigError, match=r"^prefix: must be 1 to 50 characters"):
        scratch_schema(PG_URL, "x" * 51).__enter__()


def schemas() -> set[str]:
    with create_engine(PG_URL, poolclass=NullPool).connect() as conn:
        return set(conn.execute(text("SELECT nspname FROM pg_namespace")).scalars())


def test_nothing_runs_and_no_option_is_set_on_the_server() -> None:
    """Only this test's own schemas are looked at: other tests (or suites) make theirs."""
    hostiles = (
        'x"; CREATE SCHEMA pwned_by_prefix; --',
        "public -c session_replication_role=replica",
    )
    for hostile in hostiles:
        with pytest.raises(ConfigError):
            scratch_schema(PG_URL, hostile).__enter__()
        with pytest.raises(ConfigError):
            schema_url(PG_URL, hostile)
    made = {s for s in schemas() if s.startswith(('x"', "pwned", "public "))}
    assert made == set(), "a hostile prefix made a schema"
    with (
        scratch_schema(PG_URL, "names") as url,
        create_engine(url, poolclass=NullPool).connect() as conn,
    ):
        assert conn.execute(text("SHOW session_replication_role")).scalar() == "origin"
        own = conn.execute(text("SELECT current_schema()")).scalar()
        assert own is not None and own.startswith("names_")
    assert own not in schemas(), "the scratch schema was not dropped"
