"""outbox.target: what picks the table, read from an engine's settings without connecting."""

from __future__ import annotations

import pytest
from sqlalchemy import Engine, create_engine
from sqlalchemy.ext.asyncio import create_async_engine

from outbox.engines import given_url
from outbox.target import PG_DEFAULT_PATH, libpq_escape, libpq_words, mismatch, target_of

PG = "postgresql+psycopg://u:pw@h:5432/d"


def sync(url: str, **connect_args: object) -> Engine:
    if "async" in url or "aiosqlite" in url:
        return create_async_engine(url, connect_args=connect_args).sync_engine
    return create_engine(url, connect_args=connect_args)


@pytest.mark.parametrize(
    ("url", "args", "path"),
    [
        (PG, {}, PG_DEFAULT_PATH),
        (PG + "?options=-csearch_path%3Da", {}, ("a",)),
        (PG + "?options=-c%20search_path%3DA,%22B%22", {}, ("a", "B")),
        (PG + "?options=--search-path%3Da", {}, ("a",)),
        (PG, {"options": "-c statement_timeout=5 -c search_path=a"}, ("a",)),
        (
            "postgresql+asyncpg://u@h/d",
            {"server_settings": {"search_path": "a, public"}},
            ("a", "public"),
        ),
        ("postgresql+psycopg_async://u@h/d", {"options": "-csearch_path=a"}, ("a",)),
    ],
)
def test_the_search_path_is_read_from_the_url_and_connect_args(
    url: str, args: dict[str, object], path: tuple[str, ...]
) -> None:
    assert target_of(sync(url, **args)).schema == path


def test_one_database_through_every_driver_is_one_target() -> None:
    schema = "-csearch_path=s"
    engines = [
        sync("postgresql+psycopg://u@h/d?options=" + schema),
        sync("postgresql+psycopg_async://u@h:5432/d", options=schema),
        sync("postgresql+asyncpg://u@h/d", server_settings={"search_path": "s"}),
    ]
    assert {target_of(e) for e in engines} == {target_of(engines[0])}
    assert mismatch(sync("mysql+pymysql://u@h/d"), sync("mariadb+asyncmy://u@h:3306/d")) is None
    assert mismatch(sync("sqlite:///x.db"), sync("sqlite+aiosqlite:///./x.db")) is None


def test_what_differs_is_named_and_no_password_shows() -> None:
    differs = mismatch(
        sync("postgresql+psycopg://u:secret@h/d"), sync("postgresql+psycopg://v:secret@h:6432/e")
    )
    assert differs == "port 5432 != 6432; database 'd' != 'e'; user 'u' != 'v'"


def test_a_schema_translate_map_picks_the_schema() -> None:
    plain = sync(PG + "?options=-csearch_path%3Db")
    translated = sync(PG).execution_options(schema_translate_map={None: "b"})
    assert target_of(translated).schema == ("b",)
    assert mismatch(translated, plain) is None
    assert mismatch(sync(PG).execution_options(schema_translate_map={None: "c"}), plain)


def test_in_memory_sqlite_is_one_database_per_engine() -> None:
    assert mismatch(sync("sqlite://"), sync("sqlite://")) is not None


def test_targets_are_worked_out_once_per_engine() -> None:
    engine = sync(PG)
    assert target_of(engine) is target_of(engine)


def test_libpq_escaping_round_trips() -> None:
    value = "a b\\c\td"
    assert libpq_words(f"-csearch_path={libpq_escape(value)} -cx=1") == [
        f"-csearch_path={value}",
        "-cx=1",
    ]


def test_an_apps_async_engine_gives_its_search_path_to_the_relays_url() -> None:
    asyncpg = create_async_engine(
        "postgresql+asyncpg://u@h/d", connect_args={"server_settings": {"search_path": "a b"}}
    )
    assert given_url(asyncpg).query["options"] == "-csearch_path=a\\ b"
    psycopg = create_async_engine("postgresql+psycopg://u@h/d", connect_args={"options": "-cx=1"})
    assert given_url(psycopg).query["options"] == "-cx=1"
