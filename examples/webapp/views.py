"""``POST /inbound``: the row and its message in the request's own transaction.

``{"sku": "A-100", "quantity": 12, "dock": "D1"}``:
- bad input is refused with 422 before anything is written, naming the field: every
  field is bound to what its column takes (``quantity`` an INTEGER from 1 to 2**31-1,
  ``sku`` and ``dock`` at most their String length, storable: examples.warehouse);
- otherwise the row is added to ``db.session`` and ``ob.send(db.session, ...)`` writes
  the message in the same transaction; ``db.session.commit()`` commits both, or neither.
  A closed dock is found after both were written: the session rolls back, 409, no row,
  no message;
- a database DataError or IntegrityError that still happens is a hole in that
  validation: logged, answered 422 (409 for IntegrityError), never a 500.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flask import Blueprint, request
from flask.typing import ResponseReturnValue
from sqlalchemy.exc import DataError, IntegrityError

from examples.warehouse import (
    CLOSED_DOCKS,
    DOCK_LENGTH,
    INT_MAX,
    SKU_LENGTH,
    TOPIC,
    DockClosed,
    database_refused,
    unstorable,
)
from examples.webapp.extensions import db, ob
from examples.webapp.models import Inbound

bp = Blueprint("inbound", __name__)


class InvalidDelivery(ValueError):
    """The request body breaks a rule: answered with 422 naming the field, nothing written."""

    def __init__(self, field: str, rule: str) -> None:
        super().__init__(f"{field}: {rule}")
        self.field = field


@dataclass(frozen=True)
class Delivery:
    sku: str
    quantity: int
    dock: str


@bp.post("/inbound")
def receive() -> ResponseReturnValue:
    delivery = parse(request.get_json(silent=True))
    row = Inbound(sku=delivery.sku, quantity=delivery.quantity, dock=delivery.dock)
    db.session.add(row)
    db.session.flush()  # the row's id, for the message
    payload = {"id": row.id, "sku": row.sku, "quantity": row.quantity}
    msg_id = ob.send(db.session, TOPIC, payload, key=row.sku)
    if row.dock in CLOSED_DOCKS:
        raise DockClosed(row.dock)  # after the row and the message: both roll back
    db.session.commit()  # the row and the message, together
    return {"id": row.id, "msg_id": msg_id}, 201


@bp.get("/health")
def health() -> ResponseReturnValue:
    return {"relay": "up" if ob.stats is not None else "down"}


@bp.app_errorhandler(InvalidDelivery)
def invalid(exc: InvalidDelivery) -> ResponseReturnValue:
    return {"error": str(exc), "field": exc.field}, 422


@bp.app_errorhandler(DockClosed)
def dock_closed(exc: DockClosed) -> ResponseReturnValue:
    db.session.rollback()
    return {"error": f"dock {exc} is closed"}, 409


@bp.app_errorhandler(DataError)
@bp.app_errorhandler(IntegrityError)
def refused_by_database(exc: Exception) -> ResponseReturnValue:
    db.session.rollback()
    return database_refused(exc)


def parse(body: Any) -> Delivery:
    if not isinstance(body, dict):
        raise InvalidDelivery("body", "must be a JSON object")
    sku = text(body.get("sku"), "sku", SKU_LENGTH)
    quantity = body.get("quantity")
    if isinstance(quantity, bool) or not isinstance(quantity, int) or not 0 < quantity <= INT_MAX:
        raise InvalidDelivery("quantity", f"must be an integer from 1 to {INT_MAX}")
    return Delivery(sku, quantity, text(body.get("dock", "D1"), "dock", DOCK_LENGTH))


def text(value: object, field: str, longest: int) -> str:
    """``value`` once its column takes it: a string of 1 to ``longest`` characters, storable."""
    if not isinstance(value, str) or not 0 < len(value) <= longest:
        raise InvalidDelivery(field, f"must be a string of 1 to {longest} characters")
    if rule := unstorable(value):
        raise InvalidDelivery(field, rule)
    return value
