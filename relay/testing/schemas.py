"""Scratch PostgreSQL schemas: a test (or a comparison run) gets an empty schema of its own."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import text
from sqlalchemy.pool import NullPool

from outbox.config import engine_from, schema_url


@contextmanager
def scratch_schema(db: str, prefix: str = "scratch") -> Iterator[str]:
    """A new, empty PostgreSQL schema for the block (its URL), dropped afterwards."""
    schema = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = engine_from(db, poolclass=NullPool)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield schema_url(db, schema)
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()
