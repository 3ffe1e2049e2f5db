"""Alembic environment for the tables the outbox owns.

Its version table is ``outbox_alembic_version`` so that it never meets the app's own
Alembic history in the same database.
"""

from __future__ import annotations

from typing import Any

from alembic import context
from sqlalchemy import Connection
from sqlalchemy.pool import NullPool

from outbox.dialects import dialect_for
from outbox.engines import engine_from
from outbox.migrate import VERSION_TABLE, migration_lock, revision_of
from outbox.table import metadata


def include_object(
    obj: object, name: str | None, type_: str, reflected: bool, compare_to: object
) -> bool:
    """Look only at our own tables: the app's tables live in the same database."""
    if type_ == "table":
        return name in metadata.tables
    return True


def configure(**kw: Any) -> None:
    context.configure(
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        include_object=include_object,
        compare_type=True,
        **kw,
    )


def run_online(connection: Connection) -> None:
    # The lock opens the transaction, so Alembic sees it as the caller's and commits
    # nothing itself: the lock is held until the caller's COMMIT. A transaction that is
    # the caller's own (an app's revision) gets no lock that would begin or commit one.
    with migration_lock(connection, caller=context.config.attributes.get("caller", False)):
        # What this run found, under the lock: `outbox migrate` says whether it upgraded.
        context.config.attributes["found"] = revision_of(connection)
        configure(connection=connection, render_as_batch=dialect_for(connection).alters_by_batch)
        with context.begin_transaction():
            context.run_migrations()


def main() -> None:
    config = context.config
    if context.is_offline_mode():
        configure(url=config.get_main_option("sqlalchemy.url"), literal_binds=True)
        with context.begin_transaction():
            context.run_migrations()
        return
    connection = config.attributes.get("connection")
    if connection is not None:
        run_online(connection)
        return
    engine = engine_from(config.get_main_option("sqlalchemy.url") or "", poolclass=NullPool)
    with engine.connect() as conn:
        run_online(conn)
        conn.commit()


main()
