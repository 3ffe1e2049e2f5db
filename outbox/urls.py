"""Database URL schemes as hosting platforms write them, mapped to the drivers we ship.

``postgres://`` (Heroku, Render, Fly put it in ``DATABASE_URL``) and a bare
``postgresql://`` would ask SQLAlchemy for psycopg2, ``mysql://`` and ``mariadb://`` for
mysqlclient: none of them is a dependency of outbox-relay. A URL that names its driver
(``postgresql+asyncpg://``) is left as it is.
"""

from __future__ import annotations

from sqlalchemy import URL
from sqlalchemy.engine import make_url

from outbox.dialects import driver_of_scheme

# The scheme as written -> the SQLAlchemy dialect+driver used for it (each Dialect's
# default_driver).
DRIVER_OF_SCHEME = driver_of_scheme()


def with_driver(db: str | URL) -> URL:
    """``db`` parsed, a bare scheme given the driver outbox-relay installs for it."""
    url = make_url(db)
    driver = DRIVER_OF_SCHEME.get(url.drivername)
    return url if driver is None else url.set(drivername=driver)
