"""The warehouse's rules, shared by the three example services.

The Flask app (examples/webapp), the FastAPI + SQLModel app (examples/fastapi_sqlmodel)
and the async FastAPI app (examples/fastapi_async) each have their own model of the
same table and announce each delivery on the same topic. What they share is here: the
topic, the columns' bounds and the checks that keep a value the database would refuse
out of a transaction.
"""

from __future__ import annotations

import logging
import re

from sqlalchemy.exc import IntegrityError

TOPIC = "warehouse.inbound"
TABLE = "warehouse_inbound"
CLOSED_DOCKS = frozenset({"D9"})  # a business rule that fails inside the transaction
INT_MAX = 2**31 - 1  # an INTEGER column's largest value (PostgreSQL, MariaDB)
SKU_LENGTH = 40
DOCK_LENGTH = 10
# Control characters (C0 with NUL, tab, CR, LF; DEL; C1) and lone surrogates (no UTF-8).
UNSTORABLE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")

log = logging.getLogger("examples.warehouse")


class DockClosed(Exception):
    """Found inside the transaction: everything it wrote rolls back."""


def unstorable(value: str) -> str | None:
    """The rule ``value`` breaks, or None. PostgreSQL text holds no NUL, and the sku is the
    message key, a header value: no control characters, no surrounding whitespace."""
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
