"""Warehouse inbound on FastAPI + SQLModel: the row and its message in the request's Session.

``POST /inbound`` with ``{"sku": "A-100", "quantity": 12, "dock": "D1", "tags": ["pallet"]}``:
the route gets a ``Session`` from the ``get_session`` dependency, adds the row, calls
``ob.send(session, ...)`` and commits: the row and the message commit together, or
neither does. A body the model refuses is a 422 naming the field; a closed dock, found
after both were written, rolls both back (409); a message send() refuses rolls back too
(400 naming the field).

The engine is the app's (``OUTBOX_DB``); ``ob`` is built at import time and bound to it
in the lifespan, which also starts the relay (unless ``OUTBOX_START_RELAY=false`` or no
``OUTBOX_BROKER``). Tests replace ``get_session`` (``app.dependency_overrides``) and
bind ``ob`` to their own database.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Annotated

import uvicorn
from fastapi import Depends, FastAPI
from sqlmodel import Session, create_engine

from examples.fastapi_common import Recorded, ServedBy, answer_errors
from examples.fastapi_sqlmodel.models import Inbound, InboundIn
from examples.warehouse import CLOSED_DOCKS, TOPIC, DockClosed
from outbox import Outbox

engine = create_engine(os.environ.get("OUTBOX_DB", "sqlite:///warehouse.sqlite"))
ob = Outbox(broker=os.environ.get("OUTBOX_BROKER", ""))


def get_session() -> Iterator[Session]:
    """One Session per request; closed after it (rolled back, unless the route committed)."""
    with Session(engine) as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    ob.bind(engine)
    ob.start()  # returns at once; the relay connects in the background
    try:
        yield
    finally:
        await ob.stop_async()


app = FastAPI(title="warehouse inbound (SQLModel)", lifespan=lifespan)
app.add_middleware(ServedBy)
answer_errors(app)


@app.post("/inbound", status_code=201)
def receive(delivery: InboundIn, session: SessionDep) -> Recorded:
    row = Inbound.model_validate(delivery)
    session.add(row)
    session.flush()  # the row's id, for the message
    payload = {"id": row.id, "sku": row.sku, "quantity": row.quantity}
    msg_id = ob.send(session, TOPIC, payload, key=row.sku, tags=delivery.tags)
    if row.dock in CLOSED_DOCKS:
        raise DockClosed(row.dock)  # after the row and the message: both roll back
    session.commit()  # the row and the message, together
    return Recorded(id=row.id, msg_id=msg_id)


@app.get("/health")
def health() -> dict[str, str]:
    return {"relay": "up" if ob.stats is not None else "down"}


def main() -> None:
    """``python -m examples.fastapi_sqlmodel``: the schema, then uvicorn."""
    parser = argparse.ArgumentParser(description="the warehouse inbound service (SQLModel)")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    prepare()
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="info", access_log=False)


def prepare() -> None:
    """The outbox's tables and the app's (an app with Alembic migrates both its own way)."""
    import outbox.migrate

    outbox.migrate.upgrade(engine)
    Inbound.metadata.create_all(engine)
