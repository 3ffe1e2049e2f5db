"""Warehouse inbound, async: a FastAPI service that records a delivery and announces it, atomically.

``POST /inbound`` with ``{"sku": "A-100", "quantity": 12, "dock": "D1", "tags": ["pallet"]}``:
- a body that breaks the Pydantic model is refused with 422 before any transaction starts;
  the model bounds every field to what its column takes (the Flask example's rules:
  ``quantity`` an INTEGER up to 2**31-1, ``sku`` and ``dock`` their String length, no
  control characters, lone surrogates or surrounding whitespace), and the detail names it;
- otherwise ``record_delivery`` runs under the async ``@ob.transactional``: the inbound row
  and the ``warehouse.inbound`` message are written in one transaction on an AsyncSession,
  so both commit or neither does. A closed dock raises inside the transaction (after the
  row and the message were written) and the whole request rolls back: 409, no row, no
  message. A message ``send()`` refuses (say a tag with a space) rolls back too: 400
  naming the field. A database DataError or IntegrityError that still happens is a hole
  in the validation: logged with its traceback, answered 422 (409), never a 500.

The table, the topic and the closed docks are the Flask example's (examples/webapp), so
both services write the same rows and messages. The relay starts in the lifespan and
runs on its own threads; the request handlers never wait for the broker.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import AfterValidator, BaseModel, Field, StrictInt
from sqlalchemy import Engine
from sqlalchemy.exc import DataError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from examples.cli import add_db_and_broker
from examples.webapp.app import (
    CLOSED_DOCKS,
    INT_MAX,
    TOPIC,
    DockClosed,
    database_refused,
    inbound,
    metadata,
    unstorable,
)
from outbox import Outbox, migrate
from outbox.engines import async_engine_from
from outbox.errors import OutboxError


def storable(value: str) -> str:
    if rule := unstorable(value):
        raise ValueError(rule)
    return value


# What the columns take: 1 to the String's length, storable (the Flask example's rules).
Sku = Annotated[str, Field(min_length=1, max_length=inbound.c.sku.type.length),
                AfterValidator(storable)]  # fmt: skip
Dock = Annotated[str, Field(min_length=1, max_length=inbound.c.dock.type.length),
                 AfterValidator(storable)]  # fmt: skip
Tag = Annotated[str, Field(min_length=1)]


class Delivery(BaseModel):
    sku: Sku
    quantity: StrictInt = Field(gt=0, le=INT_MAX)
    dock: Dock = "D1"
    tags: list[Tag] | None = None  # sent as the message's tags: send() has the last word


class Recorded(BaseModel):
    id: int
    msg_id: str


def prepare(engine: Engine) -> None:
    """The outbox tables and the app's own (an app with Alembic migrates both its own way)."""
    migrate.upgrade(engine)
    metadata.create_all(engine)


def create_app(db: str, broker: str, pool_size: int = 20, **options: Any) -> FastAPI:
    """The app; its lifespan starts the outbox relay and stops it on shutdown.

    ``db`` is an async URL (``postgresql+asyncpg://``, ``postgresql+psycopg://``,
    ``sqlite+aiosqlite://``...); the relay uses the sync driver beside it.
    Requests take their AsyncSession from the app's own engine and session factory, given
    to the outbox; its pool holds ``pool_size`` connections (SQLAlchemy's default of 5
    would open and close a connection per request under more concurrent requests).
    ``options`` go to the Outbox. Each worker process of a server runs the lifespan, so
    each starts (and stops) a relay of its own.
    """
    engine = async_engine_from(db, pool_size=pool_size)  # asyncpg gets libpq's options too
    ob = Outbox(db, broker=broker, session_factory=async_sessionmaker(engine), **options)

    @ob.transactional
    async def record_delivery(session: AsyncSession, delivery: Delivery) -> Recorded:
        row = inbound.insert().values(sku=delivery.sku, quantity=delivery.quantity,
                                      dock=delivery.dock)  # fmt: skip
        row_id = (await session.execute(row.returning(inbound.c.id))).scalar_one()
        body = {"id": row_id, "sku": delivery.sku, "quantity": delivery.quantity}
        msg_id = ob.send(session, TOPIC, body, key=delivery.sku, tags=delivery.tags)  # not awaited
        if delivery.dock in CLOSED_DOCKS:
            raise DockClosed(delivery.dock)
        return Recorded(id=row_id, msg_id=msg_id)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(prepare, ob.engine)  # blocking DDL off the event loop
        ob.start()  # returns at once; the relay connects in the background
        try:
            yield
        finally:
            await ob.stop_async()
            await engine.dispose()

    app = FastAPI(title="warehouse inbound", lifespan=lifespan)
    app.state.outbox = ob
    app.add_middleware(ServedBy)

    @app.post("/inbound", status_code=201)
    async def receive(delivery: Delivery) -> Recorded:
        return await record_delivery(delivery)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        # FastAPI's own answer echoes each input: a megabyte sku comes back, and a lone
        # surrogate cannot be encoded at all (a 500). Where and why is enough.
        detail = [{k: e[k] for k in ("loc", "msg", "type")} for e in exc.errors()]
        body = json.dumps({"detail": detail})  # ASCII escapes: any text encodes
        return Response(body, status_code=422, media_type="application/json")

    @app.exception_handler(DockClosed)
    async def dock_closed(request: Request, exc: DockClosed) -> JSONResponse:
        return JSONResponse({"error": f"dock {exc} is closed"}, status_code=409)

    @app.exception_handler(OutboxError)
    async def refused(request: Request, exc: OutboxError) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=400)  # "tags: must not contain..."

    @app.exception_handler(DataError)
    @app.exception_handler(IntegrityError)
    async def refused_by_database(request: Request, exc: Exception) -> JSONResponse:
        body, status = database_refused(exc)
        return JSONResponse(body, status_code=status)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"relay": "up" if ob.stats is not None else "down"}

    return app


class ServedBy:
    """Names the worker process in each reply (X-Worker): shows how a server spreads them."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def named(message: Message) -> None:
            if message["type"] == "http.response.start":
                worker = (b"x-worker", str(os.getpid()).encode())
                message["headers"] = [*message.get("headers", []), worker]
            await send(message)

        await self.app(scope, receive, named)


def from_env(**options: Any) -> FastAPI:
    """The app for an ASGI server, on OUTBOX_DB and OUTBOX_BROKER::

    uvicorn --workers 2 --factory examples.fastapi_app.app:from_env
    """
    return create_app(os.environ["OUTBOX_DB"], os.environ["OUTBOX_BROKER"], **options)


def main() -> None:
    parser = argparse.ArgumentParser(description="the async warehouse inbound example service")
    add_db_and_broker(parser)
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    # INFO: uvicorn's start-up lines say where it listens; no line per request.
    uvicorn.run(create_app(args.db, args.broker), host="127.0.0.1", port=args.port,
                log_level="info", access_log=False)  # fmt: skip


if __name__ == "__main__":
    main()
