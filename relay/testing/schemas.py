"""Scratch PostgreSQL schemas: a test (or a comparison run) gets an empty schema of its own."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy.pool import NullPool
from sqlalchemy.schema import CreateSchema, DropSchema

from outbox.engines import engine_from, schema_url
from outbox.names import NAME_MAX, check_name

SUFFIX = 13  # "_" and 12 hex digits


@contextmanager
def scratch_schema(db: str, prefix: str = "scratch") -> Iterator[str]:
    """A new, empty PostgreSQL schema for the block (its URL), dropped afterwards.

    ``prefix`` follows outbox.names' rule, in at most 50 characters (the schema is
    ``{prefix}_{12 hex digits}``); anything else raises ConfigError before connecting.
    """
    schema = check_name("prefix", prefix, NAME_MAX - SUFFIX) + f"_{uuid.uuid4().hex[:12]}"
    url = schema_url(db, schema)
    admin = engine_from(db, poolclass=NullPool)
    with admin.begin() as conn:
        conn.execute(CreateSchema(schema))  # quoted by the dialect, should the rule ever widen
    try:
        yield url
    finally:
        with admin.begin() as conn:
            conn.execute(DropSchema(schema, cascade=True))
        admin.dispose()
