"""The example apps as an ASGI server with workers loads them, for tests/acceptance/test_prefork.py.

The sweeper takes no row younger than an hour: within a test only the fast path delivers.
"""

from __future__ import annotations

from fastapi import FastAPI

from examples.fastapi_app.app import from_env

SWEEPER_AGE_S = 3600.0


def fastapi_app() -> FastAPI:
    return from_env(sweeper_age_s=SWEEPER_AGE_S)
