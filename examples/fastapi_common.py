"""What the two FastAPI examples share: their answer, how they answer errors, X-Worker.

Each error is answered without echoing the input (a megabyte sku, a lone surrogate that
cannot be encoded): where and why is enough.
"""

from __future__ import annotations

import json
import os

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from sqlalchemy.exc import DataError, IntegrityError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from examples.warehouse import DockClosed, database_refused
from outbox.errors import OutboxError


class Recorded(BaseModel):
    id: int
    msg_id: str


def answer_errors(app: FastAPI) -> None:
    """422 naming the field, 409 for a closed dock, 400 for a message send() refuses,
    and 422 (409) for a database error the validation let through, never a 500."""

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
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
