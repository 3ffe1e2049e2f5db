"""The example apps as pre-fork servers load them, for tests/acceptance/test_prefork.py:
the schema first (a deploy's migrate step), then the app from its factory.

The test sets OUTBOX_SWEEPER_AGE_S: the sweeper takes no row younger than an hour, so
within a test only the fast path delivers.
"""

from __future__ import annotations

import fcntl
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fastapi import FastAPI
from flask import Flask

from examples.fastapi_async import app as fastapi_async
from examples.webapp import app as webapp

SWEEPER_AGE_S = 3600.0


@contextmanager
def one_worker_at_a_time() -> Iterator[None]:
    """The schema step, one worker process at a time: each worker runs the factory, and
    two create_all() at once both find the app's table missing and both create it."""
    with open(Path(tempfile.gettempdir()) / "outbox-prefork-schema.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def flask_app() -> Flask:
    with one_worker_at_a_time():
        webapp.prepare()
    return webapp.create_app()


def fastapi_app() -> FastAPI:
    app = fastapi_async.create_app()
    with one_worker_at_a_time():
        fastapi_async.prepare()
    return app
