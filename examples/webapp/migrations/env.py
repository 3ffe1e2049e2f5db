"""Flask-Migrate's environment: the app's engine and models, the configure arguments of
``Migrate(...)`` (``include_object=outbox.migrate.include_object``: autogenerate never
proposes to drop the outbox's tables).

Unlike Flask-Migrate's template, it leaves logging alone (no ``fileConfig``): the app
configures its own.
"""

from __future__ import annotations

import logging
from typing import Any

from alembic import context
from flask import current_app

log = logging.getLogger("alembic.env")


def no_empty_revision(ctx: Any, revision: Any, directives: list[Any]) -> None:
    """``flask db migrate`` with nothing to change writes no revision file."""
    autogenerate = getattr(context.config.cmd_opts, "autogenerate", False)
    if autogenerate and directives[0].upgrade_ops.is_empty():
        directives[:] = []
        log.info("No changes in schema detected.")


def run_migrations_online() -> None:
    migrate = current_app.extensions["migrate"]
    options = {"process_revision_directives": no_empty_revision, **migrate.configure_args}
    with migrate.db.engine.connect() as connection:
        context.configure(connection=connection, target_metadata=migrate.db.metadata, **options)
        with context.begin_transaction():
            context.run_migrations()


def run_migrations_offline() -> None:
    """``flask db upgrade --sql``: the SQL, not run."""
    migrate = current_app.extensions["migrate"]
    context.configure(
        url=migrate.db.engine.url, target_metadata=migrate.db.metadata, literal_binds=True,
        **migrate.configure_args,
    )  # fmt: skip
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
