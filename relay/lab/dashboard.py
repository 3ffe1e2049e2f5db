"""Model B in the dashboard (/halfop): what the SqlTransactionListener recorded.

Model B keeps its halfs and op messages in NATS JetStream, not in the database; the one
table it writes is ``outbox_transaction_record``: a row per local transaction that
committed, which check-back reads to answer COMMIT (no row: ROLLBACK). So the database
cannot tell which halfs are unresolved; it shows what check-back will find.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from sqlalchemy import func, inspect, select

from outbox.table import transaction_record as r
from relay import Page
from relay.dashboard.app import config_of, page
from relay.dashboard.database import Database

LATEST = 50
TEMPLATES = Path(__file__).parent / "templates"


def halfop_records(db: Database) -> dict[str, Any] | None:
    """Per producer group: records and the latest one's time; the LATEST records. None
    when the table is not there (a schema before model B's migration)."""
    with db.reading() as conn:
        if not inspect(conn).has_table(r.name, schema=r.schema):
            return None
        groups = conn.execute(
            select(r.c.producer_group, func.count(), func.max(r.c.created_at))
            .group_by(r.c.producer_group)
            .order_by(r.c.producer_group)
        ).all()
        latest = conn.execute(
            select(r.c.transaction_id, r.c.producer_group, r.c.msg_id, r.c.created_at)
            .order_by(r.c.created_at.desc())
            .limit(LATEST)
        ).all()
    return {
        "groups": [{"group": g, "records": int(n), "latest": at} for g, n, at in groups],
        "latest": [row._asdict() for row in latest],
        "shown": LATEST,
    }


def halfop_page(request: Request) -> Response:
    return page(request, "halfop.html", {"records": halfop_records(config_of(request).database)})


PAGES = (Page("/halfop", halfop_page, "Model B", TEMPLATES),)
