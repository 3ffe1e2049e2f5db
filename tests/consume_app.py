"""An app's inbox for `outbox consume --app tests.consume_app:inbox` in the consumer tests.

Its database comes from CONSUME_TEST_DB. The handler of ``bill.*`` writes an invoice row
(the business table ``consume_test_invoice``); a message whose payload says
``{"hold": true}`` waits inside its transaction until the file CONSUME_TEST_RELEASE
exists, having written CONSUME_TEST_INSIDE first: a test kills the process there.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from sqlalchemy import Column, Engine, Integer, MetaData, String, Table, insert
from sqlalchemy.orm import Session

from outbox.inbox import Inbox, InboxMessage

business = MetaData()
invoice = Table(
    "consume_test_invoice",
    business,
    Column("msg_id", String(36), primary_key=True),
    Column("amount", Integer, nullable=False),
)


def build(db: str | Engine, consumer: str = "billing", **options: object) -> Inbox:
    inbox = Inbox(db, consumer, **options)  # type: ignore[arg-type]

    @inbox.handler("bill.*")
    def bill(session: Session, message: InboxMessage) -> None:
        body = json.loads(message.payload)
        session.execute(insert(invoice).values(msg_id=str(message.msg_id), amount=body["amount"]))
        if body.get("hold"):
            Path(os.environ["CONSUME_TEST_INSIDE"]).write_text(str(os.getpid()))
            release = Path(os.environ["CONSUME_TEST_RELEASE"])
            while not release.exists():
                time.sleep(0.02)

    return inbox


def inbox() -> Inbox:
    """For --app: the inbox on CONSUME_TEST_DB."""
    return build(os.environ["CONSUME_TEST_DB"])
