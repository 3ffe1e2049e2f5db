"""Schema migrations for the outbox's tables, shipped inside the package.

``upgrade(db)`` is what ``outbox migrate`` runs; it is idempotent and safe to run
from several processes at once on PostgreSQL (an advisory lock serialises them).
"""

from __future__ import annotations

from alembic import command
from alembic.config import Config
from alembic.migration import MigrationContext
from sqlalchemy import Engine

from outbox.config import engine_from

VERSION_TABLE = "outbox_alembic_version"


def alembic_config(db: str | Engine | None = None) -> Config:
    config = Config()
    config.set_main_option("script_location", "outbox:migrations")
    if isinstance(db, str):
        # ConfigParser interpolation would read a '%' in a password as a directive.
        config.set_main_option("sqlalchemy.url", db.replace("%", "%%"))
    return config


def upgrade(db: str | Engine, revision: str = "head") -> None:
    _run(command.upgrade, db, revision)


def downgrade(db: str | Engine, revision: str = "base") -> None:
    _run(command.downgrade, db, revision)


def upgrade_sql(url: str, revision: str = "head") -> None:
    """Print the upgrade as SQL (Alembic's offline mode) instead of running it."""
    command.upgrade(alembic_config(url), revision, sql=True)


def current_revision(db: str | Engine) -> str | None:
    with engine_from(db).connect() as conn:
        context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        return context.get_current_revision()


def _run(cmd: object, db: str | Engine, revision: str) -> None:
    engine = engine_from(db)
    config = alembic_config()
    with engine.connect() as conn:
        config.attributes["connection"] = conn
        cmd(config, revision)  # type: ignore[operator]
        conn.commit()
