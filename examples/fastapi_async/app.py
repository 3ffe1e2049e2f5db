"""Warehouse inbound on FastAPI, async: the row and its message in the request's AsyncSession.

``POST /inbound`` with ``{"sku": "A-100", "quantity": 12, "dock": "D1", "tags": ["pallet"]}``:
the route gets an ``AsyncSession`` from the ``get_session`` dependency (an
``async_sessionmaker`` on the app's engine), adds the row, calls ``ob.send(session, ...)``
(not awaited: it stages the message, written by one INSERT just before COMMIT) and
awaits ``session.commit()``: the row and the message commit together, or neither does.
A body the model refuses is a 422 naming the field; a closed dock, found after both
were written, rolls both back (409); a message send() refuses rolls back too (400).

``ob`` is built at import time and bound to the app's engine in ``create_app``; the
lifespan starts its relay (unless ``OUTBOX_START_RELAY=false`` or no ``OUTBOX_BROKER``)
and stops it. The relay runs on its own threads with the sync driver beside the async
one (asyncpg -> psycopg): a request never waits for the broker.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from examples.fastapi_async.models import Base, Delivery, Inbound
from examples.fastapi_common import Recorded, ServedBy, answer_errors
from examples.warehouse import CLOSED_DOCKS, TOPIC, DockClosed
from outbox import Outbox
from outbox.engines import async_engine_from

ob = Outbox(broker=os.environ.get("OUTBOX_BROKER", ""))


async def get_session(request: Request) -> AsyncIterator[AsyncSession]:
    """One AsyncSession per request; closed after it (rolled back, unless committed)."""
    async with request.app.state.sessions() as session:
        yield session


SessionDep = Annotated[AsyncSession, Depends(get_session)]


router = APIRouter()


@router.post("/inbound", status_code=201)
async def receive(delivery: Delivery, session: SessionDep) -> Recorded:
    row = Inbound(sku=delivery.sku, quantity=delivery.quantity, dock=delivery.dock)
    session.add(row)
    await session.flush()  # the row's id, for the message
    payload = {"id": row.id, "sku": row.sku, "quantity": row.quantity}
    msg_id = ob.send(session, TOPIC, payload, key=row.sku, tags=delivery.tags)  # no await
    if row.dock in CLOSED_DOCKS:
        raise DockClosed(row.dock)  # after the row and the message: both roll back
    await session.commit()  # the row and the message, together
    return Recorded(id=row.id, msg_id=msg_id)


@router.get("/health")
async def health() -> dict[str, str]:
    return {"relay": "up" if ob.stats is not None else "down"}


def create_app(db: str | None = None, broker: str | None = None, pool_size: int = 20) -> FastAPI:
    """The app on ``db`` (default ``OUTBOX_DB``, an async URL: ``postgresql+asyncpg://``,
    ``sqlite+aiosqlite://``...). ``broker`` replaces ``OUTBOX_BROKER`` for this app's relay
    (a benchmark's). The pool holds ``pool_size`` connections: SQLAlchemy's default of 5
    would open and close a connection per request under more concurrent requests.
    ``uvicorn --factory examples.fastapi_async.app:create_app``: each worker process runs
    the lifespan, so each starts (and stops) a relay of its own.
    """
    # outbox.engines.async_engine_from: create_async_engine that also takes libpq's
    # options= (a search_path) on asyncpg.
    engine = async_engine_from(db or os.environ["OUTBOX_DB"], pool_size=pool_size)
    ob.bind(engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ob.start(broker)  # returns at once; the relay connects in the background
        try:
            yield
        finally:
            await ob.stop_async()
            await engine.dispose()

    app = FastAPI(title="warehouse inbound (async)", lifespan=lifespan)
    app.state.sessions = async_sessionmaker(engine, expire_on_commit=False)
    app.state.outbox = ob
    app.add_middleware(ServedBy)
    answer_errors(app)
    app.include_router(router)
    return app


def prepare() -> None:
    """The outbox's tables and the app's, through the sync engine the outbox keeps beside
    the async one (an app with Alembic migrates both its own way)."""
    import outbox.migrate

    outbox.migrate.upgrade(ob.engine)
    Base.metadata.create_all(ob.engine)


def main() -> None:
    """``python -m examples.fastapi_async``: the schema, then uvicorn."""
    parser = argparse.ArgumentParser(description="the warehouse inbound service (async)")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    app = create_app()
    prepare()
    # INFO: uvicorn's start-up lines say where it listens; no line per request.
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="info", access_log=False)
