"""A tiny business for `outbox compare`, the benches and tests: placing an order.

``place_order`` is the local transaction a ``SqlTransactionListener`` runs; an order
with ``fail`` set is rejected and rolls back.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Column, Integer, MetaData, String, Table
from sqlalchemy.orm import Session

business = MetaData()
orders = Table(
    "hop_orders", business, Column("id", Integer, primary_key=True), Column("sku", String(20))
)


def place_order(session: Session, msg: object, arg: Any) -> None:
    session.execute(orders.insert().values(sku=arg["sku"]))
    if arg.get("fail"):
        raise ValueError("rejected")
