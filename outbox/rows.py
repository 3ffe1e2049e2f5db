"""A ``Message`` as a row of ``outbox_message``, and a row as a ``Message``: both ways, once.

``send()`` writes rows (``Outbox.send`` through a Session; ``outbox.tracking`` just before
the COMMIT of an AsyncSession) and the relay reads them back (the sweeper's claim, a
drain); a column added to the message is added here and nowhere else. It sits beside
the table, not in ``outbox.message``, because that module knows nothing of SQL.

Rows are input too: a hand or an older version may have written them. Reading one
back raises an ``outbox.errors.InvalidMessage`` subclass when it breaks the contract
``send()`` enforces, so that the relay can fail that row alone.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from sqlalchemy import Connection, insert
from sqlalchemy.orm import Session

from outbox.errors import InvalidHeaders, InvalidPayload
from outbox.message import Message, recheck
from outbox.table import outbox_message

INSERT_MESSAGE = insert(outbox_message)


class StoredRow(Protocol):
    """The columns of ``outbox_message`` that make a message, however the row was read
    (``relay.store.Claimed``, an SQLAlchemy ``Row``); any value may be wrong."""

    @property
    def msg_id(self) -> Any: ...
    @property
    def topic(self) -> Any: ...
    @property
    def key(self) -> Any: ...
    @property
    def tags(self) -> Any: ...
    @property
    def headers(self) -> Any: ...
    @property
    def payload(self) -> Any: ...


def row_values(message: Message) -> dict[str, Any]:
    """The INSERT's values for ``message``; the other columns take their defaults."""
    return {
        "msg_id": uuid.UUID(message.msg_id),
        "topic": message.topic,
        "tags": message.tags,
        "key": message.key,
        "headers": message.headers or None,
        "payload": message.payload,
    }


def write(conn: Session | Connection, messages: Sequence[Message]) -> None:
    """Insert the rows of ``messages`` in ``conn``'s transaction: one statement."""
    values = [row_values(m) for m in messages]
    # One dict is a plain execute: the single send() of a Session, its hot path.
    conn.execute(INSERT_MESSAGE, values[0] if len(values) == 1 else values)


def message_of(row: StoredRow, payload: bytes | None = None) -> Message:
    """The message of a row; ``payload`` when the read left it out.

    A NULL payload or headers that are not a JSON object raise an ``InvalidMessage``
    subclass; nothing else is checked (``stored_message`` checks the rest).
    """
    body = row.payload if payload is None else payload
    if body is None:
        raise InvalidPayload("payload", "is NULL in the table")
    headers = {} if row.headers is None else row.headers
    if not isinstance(headers, Mapping):
        raise InvalidHeaders("headers", f"must be stored as a JSON object, got {headers!r:.80}")
    return Message(
        msg_id=str(row.msg_id),
        topic=row.topic,
        payload=bytes(body),
        key=row.key,
        tags=row.tags,
        headers=dict(headers),
    )


def stored_message(
    row: StoredRow, payload: bytes | None = None, known: KnownForms | None = None
) -> Message:
    """The row's message, once it keeps the contract ``send()`` enforces (``recheck``).

    Raises an ``InvalidMessage`` subclass when it does not, or whatever else a strange
    row makes the conversion raise: the caller fails that row alone. ``known`` skips
    the check for a row of a form that already passed.
    """
    message = message_of(row, payload)
    if known is None or not known.seen(row):
        recheck(message)
        if known is not None:
            known.add(row)
    return message


class KnownForms:
    """The forms (topic, key, tags, headers) of rows that passed ``recheck``.

    Whether a row keeps the contract depends on its form alone once its msg_id is a
    ``uuid.UUID`` (the column's type: its text is canonical) and its payload bytes
    (message_of makes it so): a row of a form already found good needs no second look.
    Rows of one app share few forms, so this saves the per-row recheck (about 40 us a
    row); a row of a new form, or one whose form cannot be hashed, is checked in full.
    """

    LIMIT = 4096  # forms remembered; forgotten all at once when full

    def __init__(self) -> None:
        self._good: set[tuple[Any, ...]] = set()

    def seen(self, row: StoredRow) -> bool:
        if not isinstance(row.msg_id, uuid.UUID):
            return False
        form = _form(row)
        return form is not None and form in self._good

    def add(self, row: StoredRow) -> None:
        form = _form(row)
        if form is None:
            return
        if len(self._good) >= self.LIMIT:
            self._good.clear()
        self._good.add(form)


def _form(row: StoredRow) -> tuple[Any, ...] | None:
    headers = row.headers
    if headers is not None and type(headers) is not dict:
        return None
    form = (row.topic, row.key, row.tags, tuple(headers.items()) if headers else ())
    try:
        hash(form)
    except TypeError:  # a list or an object among the values: not remembered
        return None
    return form
