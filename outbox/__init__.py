"""Transactional outbox for SQLAlchemy applications.

from outbox import Outbox
ob = Outbox("postgresql+psycopg://postgres@127.0.0.1:5432/test", broker="nats://127.0.0.1:4222")
"""

from __future__ import annotations

from outbox.api import Outbox
from outbox.errors import OutboxError
from outbox.inbox import Inbox, InboxMessage
from outbox.table import outbox_message

__all__ = ["Inbox", "InboxMessage", "Outbox", "OutboxError", "outbox_message"]
__version__ = "0.1.0"
