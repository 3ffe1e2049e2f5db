"""The example apps as pre-fork servers load them, for tests/acceptance/test_prefork.py:
the schema first (a deploy's migrate step), then the app from its factory.

The test sets OUTBOX_SWEEPER_AGE_S: the sweeper takes no row younger than an hour, so
within a test only the fast path delivers.
"""

from __future__ import annotations

from fastapi import FastAPI
from flask import Flask

from examples.fastapi_async import app as fastapi_async
from examples.webapp import app as webapp

SWEEPER_AGE_S = 3600.0


def flask_app() -> Flask:
    webapp.prepare()
    return webapp.create_app()


def fastapi_app() -> FastAPI:
    app = fastapi_async.create_app()
    fastapi_async.prepare()
    return app
