"""Which ``outbox_message`` table an engine's connections write to, told from its settings.

``send()`` refuses a session whose engine reaches another table than the outbox's: the
row would be published by one relay, never marked, and published again by the other
database's sweeper. What picks the table: the backend, host, port, database and user,
and the schema (PostgreSQL's ``search_path``; a ``schema_translate_map``). They are read
from what the driver is called with (the URL's parameters and the engine's
``connect_args``: libpq ``options``, asyncpg ``server_settings``), whichever driver,
sync or async, so an asyncpg engine and a psycopg one compare like for like.

Trade-off: no SQL is run (send() stays a dict lookup once an engine is known), so what a
``connect`` event handler, ``PGOPTIONS``, or ``ALTER ROLE ... SET search_path`` changes
on the server is not seen; names are compared as written (``localhost`` is not
``127.0.0.1``).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

from sqlalchemy import Engine

from outbox.dialects import dialect_for

PG_DEFAULT_PATH = ("$user", "public")


@dataclass(frozen=True)
class Target:
    """What picks the table. None: the driver's default, the same for every engine."""

    backend: str
    host: str | None = None
    port: int | None = None
    database: str | None = None
    user: str | None = None
    schema: tuple[str, ...] | None = None


_targets: weakref.WeakKeyDictionary[Engine, Target] = weakref.WeakKeyDictionary()


def target_of(engine: Engine) -> Target:
    """``engine``'s Target, worked out once per engine (its settings never change)."""
    found = _targets.get(engine)
    if found is None:
        found = _targets[engine] = _work_out(engine)
    return found


def mismatch(engine: Engine, other: Engine) -> str | None:
    """None when both engines reach one table, else what differs (never a password)."""
    mine, theirs = target_of(engine), target_of(other)
    if mine == theirs:
        return None
    return "; ".join(
        f"{f.name} {_show(getattr(mine, f.name))} != {_show(getattr(theirs, f.name))}"
        for f in fields(Target)
        if getattr(mine, f.name) != getattr(theirs, f.name)
    )


def _show(value: object) -> str:
    if isinstance(value, tuple):
        return repr(", ".join(value))
    return "(default)" if value is None else repr(value)


def connect_params(engine: Engine) -> tuple[list[Any], dict[str, Any]]:
    """The arguments the engine's driver is called with: the URL's and ``connect_args``.

    SQLAlchemy keeps them in its default pool creator's closure and nowhere public; an
    engine with a ``creator`` of its own has only its URL to go by.
    """
    creator = getattr(engine.pool, "_creator", None)
    code = getattr(creator, "__code__", None)
    cells = dict(
        zip(
            getattr(code, "co_freevars", ()),
            (c.cell_contents for c in getattr(creator, "__closure__", None) or ()),
            strict=False,
        )
    )
    cargs, cparams = cells.get("cargs_tup"), cells.get("cparams")
    if isinstance(cparams, Mapping) and isinstance(cargs, list | tuple):
        return list(cargs), dict(cparams)
    args, params = engine.dialect.create_connect_args(engine.url)
    return list(args), dict(params)


def _work_out(engine: Engine) -> Target:
    dialect = dialect_for(engine.url)
    cargs, params = connect_params(engine)
    translated = (engine.get_execution_options().get("schema_translate_map") or {}).get(None)
    if dialect.file_database:
        return _file(engine, dialect.target_backend, cargs, params, translated)
    port = params.get("port")
    target = Target(
        backend=dialect.target_backend,  # MariaDB and MySQL: one protocol, one server
        host=_text(params.get("unix_socket") or params.get("host")),
        port=int(port) if port not in (None, "") else dialect.default_port,
        database=_text(params.get("dbname") or params.get("database") or params.get("db")),
        user=_text(params.get("user") or params.get("username")),
    )
    if dialect.schema_is_database:
        host = target.host or "localhost"
        return _replace(target, host=host, database=translated or target.database)
    if dialect.schema_in_options:  # the search_path
        path = (translated,) if translated else search_path(params)
        return _replace(target, database=target.database or target.user, schema=path)
    return target


def _file(
    engine: Engine, backend: str, cargs: list[Any], params: dict[str, Any], schema: str | None
) -> Target:
    name = str(cargs[0] if cargs else params.get("database") or ":memory:")
    if name.startswith("file:"):  # a URI filename: its path, without ?mode=...
        name = name[len("file:") :].split("?", 1)[0]
    if name in ("", ":memory:") or "mode=memory" in str(cargs[:1]):
        # Every engine (every connection, even) opens an empty database of its own.
        name = f":memory: of engine {id(engine):#x}"
    else:
        name = os.path.realpath(name)
    attached = (schema,) if schema not in (None, "main") else None
    return Target(backend, database=name, schema=attached)


def _replace(target: Target, **changes: Any) -> Target:
    return Target(**{**{f.name: getattr(target, f.name) for f in fields(Target)}, **changes})


def _text(value: object) -> str | None:
    if value in (None, ""):
        return None
    if isinstance(value, list | tuple):  # asyncpg's several hosts
        return ",".join(str(v) for v in value)
    return str(value)


def search_path(params: Mapping[str, Any]) -> tuple[str, ...]:
    """The search_path a PostgreSQL connection gets, as a tuple of schema names."""
    path = search_path_setting(params)
    return PG_DEFAULT_PATH if path is None else _path_items(path)


def search_path_setting(params: Mapping[str, Any]) -> str | None:
    """The search_path set by libpq ``options`` or asyncpg's ``server_settings``, if any."""
    path: str | None = None
    settings = params.get("server_settings")
    if isinstance(settings, Mapping) and settings.get("search_path") is not None:
        path = str(settings["search_path"])
    options = params.get("options")
    if isinstance(options, str):
        path = dict(_libpq_settings(options)).get("search_path", path)
    return path


def libpq_escape(value: str) -> str:
    """``value`` as one word of libpq's ``options``: backslashes and whitespace escaped."""
    return "".join(f"\\{c}" if c == "\\" or c.isspace() else c for c in value)


def _libpq_settings(options: str) -> Iterator[tuple[str, str]]:
    """``-c name=value``, ``-cname=value`` and ``--name=value`` of a libpq options string."""
    words = libpq_words(options)
    for i, word in enumerate(words):
        if word == "-c" and i + 1 < len(words):
            setting = words[i + 1]
        elif word.startswith("-c") or word.startswith("--"):
            setting = word[2:]
        else:
            continue
        name, eq, value = setting.partition("=")
        if eq:
            yield name.lower().replace("-", "_"), value


def libpq_words(options: str) -> list[str]:
    """Split as the server does: whitespace separates, a backslash escapes the next character."""
    words: list[str] = []
    word: list[str] = []
    escaped = False
    for char in options:
        if escaped:
            word.append(char)
            escaped = False
        elif char == "\\":
            escaped = True
        elif char.isspace():
            if word:
                words.append("".join(word))
            word = []
        else:
            word.append(char)
    if word:
        words.append("".join(word))
    return words


def _path_items(path: str) -> tuple[str, ...]:
    """A search_path's schemas as the server reads them: unquoted ones folded to lower case."""
    items: list[str] = []
    item: list[str] = []
    i = 0
    while i < len(path):
        char = path[i]
        i += 1
        if char == '"':  # a quoted name, as written; "" inside it is one quote
            while i < len(path) and (path[i] != '"' or path[i + 1 : i + 2] == '"'):
                i += 2 if path[i] == '"' else 1
                item.append(path[i - 1])
            i += 1
        elif char == ",":
            items.append("".join(item))
            item = []
        elif not char.isspace():
            item.append(char.lower())
    items.append("".join(item))
    return tuple(items)
