"""Rows written straight into outbox_message, as a hand or an older version would."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import Engine, insert, select

from outbox import outbox_message
from outbox.message import uuid7

t = outbox_message


def plant(engine: Engine, topic: str, payload: bytes = b"{}", **columns: Any) -> str:
    """Insert one pending row (columns: key, tags, headers as a JSON value); its msg_id."""
    msg_id = uuid7()
    with engine.begin() as conn:
        conn.execute(insert(t).values(msg_id=msg_id, topic=topic, payload=payload, **columns))
    return str(msg_id)


def row_of(engine: Engine, msg_id: str) -> Any:
    with engine.connect() as conn:
        return conn.execute(select(t).where(t.c.msg_id == uuid.UUID(msg_id))).one()
