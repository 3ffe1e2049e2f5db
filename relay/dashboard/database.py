"""The dashboard's database, and whether it answers.

Every page reads (and every action writes) through one Database. An error saying the
database is down or unreachable becomes DatabaseDown, which the app answers with a 503
page; the outage is logged once when it starts and once when the database answers
again (relay.outage.Outage), never once per request: a page polled every 3 s by a few
browsers would otherwise print a traceback a second.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from sqlalchemy import Connection, Engine, exc, text

from outbox.dialects import dialect_for
from outbox.secrets import scrub, url_of
from relay.display import one_line
from relay.outage import Outage

log = logging.getLogger("relay.dashboard")


class DatabaseDown(Exception):
    """The database did not answer; ``reason`` is the error's kind (no host, no text of
    the driver's: the page shows it to whoever asks)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def unreachable(error: BaseException) -> bool:
    """An error that says the database is down or unreachable (refused, timed out, its
    connection dropped, connections not allowed), not that a query was wrong."""
    if isinstance(error, exc.DBAPIError) and error.connection_invalidated:
        return True
    return isinstance(error, exc.OperationalError | exc.InterfaceError | exc.TimeoutError)


class Database:
    """The engine the pages read through, and its outage (thread-safe: the pages run
    on a thread pool)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.outage = Outage(f"dashboard: database {url_of(engine)}", log, every_s=math.inf)

    @contextmanager
    def reading(self) -> Iterator[Connection]:
        """A connection for a page's reads. PostgreSQL's JIT is off in its transaction: the
        backlog's correlated subquery makes the planner's estimate huge, and compiling the
        plan took a second where running it takes tens of milliseconds (bench/dashboard.py)."""
        with self.watching(self.engine.connect) as conn:
            for statement in dialect_for(conn).reading_setup:
                conn.execute(text(statement))
            yield conn

    def writing(self) -> AbstractContextManager[Connection]:
        """A transaction for an action, committed when the block ends without an error."""
        return self.watching(self.engine.begin)

    @contextmanager
    def watching(
        self, opening: Callable[[], AbstractContextManager[Connection]]
    ) -> Iterator[Connection]:
        """A connection ``opening()`` gives; an outage's error as DatabaseDown."""
        try:
            with opening() as conn:
                yield conn
        except Exception as error:
            if not unreachable(error):
                raise
            self.outage.failed(self.detail(error))
            raise DatabaseDown(type(getattr(error, "orig", None) or error).__name__) from None
        self.outage.ok()

    def detail(self, error: Exception) -> str:
        """The error's first line for the log, without the URL's secrets."""
        cause = getattr(error, "orig", None) or error
        first = one_line(str(cause)) or type(cause).__name__
        return scrub(first, [self.engine.url.render_as_string(hide_password=False)])

    def health(self) -> dict[str, Any]:
        """The database's part of /healthz: up and how fast it answered, or down and why."""
        started = time.monotonic()
        try:
            with self.reading() as conn:
                conn.execute(text("SELECT 1"))
        except DatabaseDown as down:
            return {"status": "down", "error": down.reason}
        return {"status": "up", "answered_ms": round((time.monotonic() - started) * 1000, 1)}
