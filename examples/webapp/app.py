"""Warehouse inbound: a Flask service that records a delivery and announces it, atomically.

``POST /inbound`` with ``{"sku": "A-100", "quantity": 12, "dock": "D1"}``:
- bad input is refused with 422 before any transaction starts, naming the field: every
  field is bound to what its column takes (``quantity`` an INTEGER from 1 to 2**31-1,
  ``sku`` and ``dock`` at most their String length, without control characters, lone
  surrogates or surrounding whitespace: PostgreSQL text holds no NUL, and the sku is the
  message key, a header value);
- a database DataError or IntegrityError that still happens is a hole in that validation:
  it is logged with its traceback and answered 422 (409 for IntegrityError) without the
  database's text, never a 500;
- otherwise ``record_delivery`` runs under ``@ob.transactional``: the inbound row and
  the ``warehouse.inbound`` message are written in one transaction, so both commit or
  neither does. A closed dock raises inside the transaction (after the row and the
  message were written) and the whole request rolls back: 409, no row, no message.

Flask runs each request in a worker thread; ``@ob.transactional`` opens one session
per call (nested decorated calls join it), so handlers share nothing but the engine.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import re
from dataclasses import dataclass
from typing import Any

from flask import Flask, Response, jsonify, request
from sqlalchemy import Column, DateTime, Integer, MetaData, String, Table, func
from sqlalchemy.exc import DataError, IntegrityError
from sqlalchemy.orm import Session

from examples.cli import add_db_and_broker
from outbox import Outbox, migrate

TOPIC = "warehouse.inbound"
CLOSED_DOCKS = {"D9"}  # a business rule that fails inside the transaction

metadata = MetaData()
inbound = Table(
    "warehouse_inbound",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("sku", String(40), nullable=False),
    Column("quantity", Integer, nullable=False),
    Column("dock", String(10), nullable=False),
    Column("received_at", DateTime(timezone=True), server_default=func.now(), nullable=False),
)


INT_MAX = 2**31 - 1  # an INTEGER column's largest value (PostgreSQL, MariaDB)
# Control characters (C0 with NUL, tab, CR, LF; DEL; C1) and lone surrogates (no UTF-8).
UNSTORABLE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")

log = logging.getLogger("examples.webapp")


class InvalidDelivery(ValueError):
    """The request body breaks a rule: answered with 422 naming the field, nothing written."""

    def __init__(self, field: str, rule: str) -> None:
        super().__init__(f"{field}: {rule}")
        self.field = field


class DockClosed(Exception):
    """Found inside the transaction: everything it wrote rolls back."""


@dataclass(frozen=True)
class Delivery:
    sku: str
    quantity: int
    dock: str


def parse(body: Any) -> Delivery:
    if not isinstance(body, dict):
        raise InvalidDelivery("body", "must be a JSON object")
    sku = text(body.get("sku"), "sku")
    quantity = body.get("quantity")
    if isinstance(quantity, bool) or not isinstance(quantity, int) or not 0 < quantity <= INT_MAX:
        raise InvalidDelivery("quantity", f"must be an integer from 1 to {INT_MAX}")
    return Delivery(sku, quantity, text(body.get("dock", "D1"), "dock"))


def text(value: object, field: str) -> str:
    """``value`` once its column takes it: a string of 1 to the column's length, storable."""
    longest = inbound.c[field].type.length
    if not isinstance(value, str) or not 0 < len(value) <= longest:
        raise InvalidDelivery(field, f"must be a string of 1 to {longest} characters")
    if rule := unstorable(value):
        raise InvalidDelivery(field, rule)
    return value


def unstorable(value: str) -> str | None:
    """The rule ``value`` breaks, or None: shared by the FastAPI example's model."""
    if bad := UNSTORABLE.search(value):
        return f"must not contain control characters or lone surrogates, got {bad.group()!a}"
    if value != value.strip():
        return "must not begin or end with whitespace"
    return None


def database_refused(exc: Exception) -> tuple[dict[str, str], int]:
    """The last resort for a database error on client data: validation missed a rule.

    Logged with its traceback (the bug to fix is in the validation), answered 422 for a
    value the database refused and 409 for a constraint, without the database's text.
    """
    log.error("the database refused a request's values: validation missed a rule", exc_info=exc)
    if isinstance(exc, IntegrityError):
        return {"error": "the request conflicts with the stored data"}, 409
    return {"error": "the database refused a value of the request"}, 422


def create_app(db: str, broker: str, **options: Any) -> Flask:
    """The app, with its outbox relay started (and stopped at exit); ``options`` go to Outbox.

    Safe under pre-fork servers (gunicorn ``--preload``): each worker forked from this
    process starts its own relay on its first message, and stops only its own at exit.
    """
    migrate.upgrade(db)  # the outbox tables; an app with Alembic adds them to its own history
    ob = Outbox(db, broker=broker, **options)
    metadata.create_all(ob.engine)
    ob.start()
    atexit.register(ob.stop)

    @ob.transactional
    def record_delivery(session: Session, delivery: Delivery) -> tuple[int, str]:
        row = inbound.insert().values(sku=delivery.sku, quantity=delivery.quantity,
                                      dock=delivery.dock)  # fmt: skip
        row_id = session.execute(row.returning(inbound.c.id)).scalar_one()
        msg_id = ob.send(
            session, TOPIC, {"id": row_id, "sku": delivery.sku, "quantity": delivery.quantity},
            key=delivery.sku,
        )  # fmt: skip
        if delivery.dock in CLOSED_DOCKS:
            raise DockClosed(delivery.dock)
        return row_id, msg_id

    app = Flask(__name__)
    app.extensions["outbox"] = ob
    app.after_request(served_by)

    @app.post("/inbound")
    def receive() -> Any:
        try:
            delivery = parse(request.get_json(silent=True))
        except InvalidDelivery as exc:
            return jsonify(error=str(exc), field=exc.field), 422
        try:
            row_id, msg_id = record_delivery(delivery)
        except DockClosed as exc:
            return jsonify(error=f"dock {exc} is closed"), 409
        return jsonify(id=row_id, msg_id=msg_id), 201

    @app.errorhandler(DataError)
    @app.errorhandler(IntegrityError)
    def refused_by_database(exc: Exception) -> Any:
        body, status = database_refused(exc)
        return jsonify(body), status

    @app.get("/health")
    def health() -> Any:
        stats = ob.stats
        return jsonify(relay="up" if stats is not None else "down")

    serve_metrics(app, ob)
    return app


def serve_metrics(app: Flask, ob: Outbox) -> None:
    """``GET /metrics``: this process's relay in Prometheus' format (with the metrics
    extra): what the app's own fast path published, which no worker sees."""
    try:
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

        from relay.metrics import register
    except ImportError:  # installed without [metrics]: no /metrics
        return
    registry = CollectorRegistry()
    register(ob, registry)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(registry), mimetype=CONTENT_TYPE_LATEST)


def served_by(response: Response) -> Response:
    """Names the worker process in each reply (X-Worker): shows how a server spreads them."""
    response.headers["X-Worker"] = str(os.getpid())
    return response


def from_env(**options: Any) -> Flask:
    """The app for a WSGI server, on OUTBOX_DB and OUTBOX_BROKER::

    gunicorn --preload -w 3 'examples.webapp.app:from_env()'
    """
    return create_app(os.environ["OUTBOX_DB"], os.environ["OUTBOX_BROKER"], **options)


def main() -> None:
    parser = argparse.ArgumentParser(description="the warehouse inbound example service")
    add_db_and_broker(parser)
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    app = create_app(args.db, args.broker)
    app.run(
        host="127.0.0.1", port=args.port, threaded=True
    )  # Flask's server; use gunicorn in production


if __name__ == "__main__":
    main()
