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

import math
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import replace
from fractions import Fraction
from typing import Any, Protocol, cast

from sqlalchemy import (
    BigInteger,
    Connection,
    CursorResult,
    bindparam,
    func,
    insert,
    select,
    tuple_,
    update,
)
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.orm import Session
from sqlalchemy.sql.dml import Insert

from outbox.dialects import Dialect, dialect_for
from outbox.engines import autocommits, engine_autocommits
from outbox.errors import InvalidHeaders, InvalidPayload, NotTransactional, SchemaMissing
from outbox.message import Message, recheck
from outbox.secrets import url_of
from outbox.table import CANCELED, PENDING, db_now_plus, outbox_message, outbox_sequence, time_type

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
    @property
    def seq(self) -> Any: ...


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


def transaction_connection(session: Session) -> Connection:
    """The connection ``session``'s transaction writes the outbox's rows on (connected now
    if it has none yet). Raises ``NotTransactional`` if it commits each statement at once:
    the row would be published even if the work around it rolled back."""
    conn = session.connection(bind_arguments={"clause": outbox_message})
    if autocommits(conn):
        raise not_transactional(conn.engine)
    return conn


def flushed_connection(session: Session) -> Connection:
    """``transaction_connection``, once the app's pending changes are flushed.

    This is the autoflush ``Session.execute()`` runs before any statement (SQLAlchemy
    #9809), run first and on its own: an error of the app's own rows (an IntegrityError,
    say) is raised by the app's flush, never from inside the outbox's INSERT. Private
    ``_autoflush()``: the public ``flush()`` lacks its guards (``autoflush=False``,
    ``no_autoflush``, a send() from inside a flush's event hook).
    """
    conn = transaction_connection(session)
    session._autoflush()
    return conn


def check_staged(session: Session) -> None:
    """At an AsyncSession's send(), which cannot connect: ``NotTransactional`` if what is
    known already says the session autocommits (a bound Connection, the connection its
    transaction holds, else its engine's settings). Its COMMIT checks again, connected,
    before the row is written (``flushed_connection``)."""
    bind = session.get_bind(clause=outbox_message)
    conn = bind if isinstance(bind, Connection) else held_connection(session, bind)
    if conn is not None and autocommits(conn):
        raise not_transactional(conn.engine)
    if conn is None and isinstance(bind, Engine) and engine_autocommits(bind):
        raise not_transactional(bind)


def held_connection(session: Session, bind: object) -> Connection | None:
    """The connection to ``bind`` ``session``'s transaction holds, if any (private: the
    Session has no public way to ask without connecting)."""
    transaction = session.get_transaction()
    held = getattr(transaction, "_connections", {}).get(bind) if transaction else None
    return held[0] if held and isinstance(held[0], Connection) else None


def not_transactional(engine: Engine) -> NotTransactional:
    return NotTransactional(
        f"session: its connection to {url_of(engine)} is in AUTOCOMMIT, committing each "
        "statement at once: a message sent there would be published even if the work "
        "around it rolled back; send() in a transaction (without "
        "isolation_level='AUTOCOMMIT'); nothing was written"
    )


def write(conn: Session | Connection, messages: Sequence[Message]) -> list[Message]:
    """Insert the rows of ``messages`` in ``conn``'s transaction: one statement for the
    unscheduled ones, after the ordered ones took their sequence numbers (``take_seqs``),
    and one for the scheduled ones (``write_scheduled``). Returns the messages as
    written, with their ``seq``.

    No outbox table raises ``SchemaMissing`` (the driver's error is its ``__cause__``),
    told from the statement's error: nothing is checked first. On PostgreSQL the
    transaction is aborted then, as after any failed statement.
    """
    try:
        return _write(conn, messages)
    except DBAPIError as exc:
        if not missing_table(exc):
            raise
        said = str(exc.orig).strip().splitlines()[0]
        raise SchemaMissing(
            f"db: the outbox's tables are not in {url_of(_bind(conn).engine)} ({said}): "
            "run `outbox migrate` (or outbox.migrate.upgrade) first"
        ) from exc


PG_UNDEFINED_TABLE = "42P01"
MYSQL_NO_SUCH_TABLE = 1146


def missing_table(exc: SQLAlchemyError) -> bool:
    """Is ``exc`` a driver's "no such table" for one of the outbox's tables (PostgreSQL
    42P01, MariaDB/MySQL 1146, SQLite "no such table")?"""
    orig = getattr(exc, "orig", None)
    text = str(orig)
    if "outbox_" not in text:  # an app's table (a statement of its own, a trigger)
        return False
    code = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)  # psycopg, asyncpg
    args = getattr(orig, "args", None) or (None,)
    return (
        code == PG_UNDEFINED_TABLE
        or args[0] == MYSQL_NO_SUCH_TABLE  # PyMySQL, asyncmy
        or text.startswith("no such table")  # SQLite
    )


def _write(conn: Session | Connection, messages: Sequence[Message]) -> list[Message]:
    written = take_seqs(conn, messages)
    scheduled = [m for m in written if m.scheduled]
    now = [m for m in written if not m.scheduled] if scheduled else written
    if now:
        values = [row_values(m) for m in now]
        if any(m.seq is not None for m in now):  # else unnamed: a schema before 0004 works
            for value, message in zip(values, now, strict=True):
                value["seq"] = message.seq
        # One dict is a plain execute: the single send() of a Session, its hot path.
        conn.execute(INSERT_MESSAGE, values[0] if len(values) == 1 else values)
    if scheduled:
        write_scheduled(conn, scheduled)
    return written


def write_scheduled(conn: Session | Connection, messages: Sequence[Message]) -> None:
    """Insert scheduled messages, their due time computed by the database clock (one
    statement). A msg_id already in the table (a ``dedup_key`` used before, by this
    transaction or a committed one) writes nothing; one in a transaction still open makes
    this wait for its end, as any insert of a duplicate key does."""
    values = [scheduled_values(m) for m in messages]
    dialect = _dialect(conn)
    dialect.lock_dedup_keys(conn, messages)  # InnoDB: waiters of one key must not deadlock
    statement = dialect.built(_insert_scheduled)
    conn.execute(statement, values[0] if len(values) == 1 else values)


def scheduled_values(message: Message) -> dict[str, Any]:
    """``row_values`` and the due time's parameters: ``at`` (a deliver_at) or ``delay_us``."""
    values = row_values(message)
    delay = message.delay_s
    values["at"] = message.deliver_at
    values["delay_us"] = None if delay is None else delay_micros(delay)
    return values


def delay_micros(delay_s: float) -> int:
    """Whole microseconds, rounded up: never early. Exact arithmetic (a float product
    rounds by up to half a microsecond at a century), after rounding to nanoseconds what
    is only the float's noise (the float 0.1 is 0.1000000000000000055 s)."""
    return math.ceil(round(Fraction(delay_s) * 1_000_000, 3))


def _insert_scheduled(dialect: Dialect) -> Insert:
    """The scheduled rows' INSERT, built once per dialect: deliver_at is the given instant,
    or the database's now plus the delay; a msg_id already in the table writes nothing."""
    due = func.coalesce(
        bindparam("at", type_=time_type),
        db_now_plus(bindparam("delay_us", type_=BigInteger())),
    )
    return dialect.insert_ignoring(outbox_message, outbox_message.c.msg_id).values(deliver_at=due)


CANCEL = (
    update(outbox_message)
    .where(
        outbox_message.c.msg_id == bindparam("target"),
        outbox_message.c.status == PENDING,
        outbox_message.c.deliver_at.is_not(None),
    )
    .values(status=CANCELED)
)


def cancel(conn: Session | Connection, msg_id: str) -> bool:
    """Cancel the pending scheduled row ``msg_id`` in ``conn``'s transaction; True iff
    this changed it. A row locked by a publish in flight makes this wait for its end."""
    result = cast(CursorResult[Any], conn.execute(CANCEL, {"target": uuid.UUID(msg_id)}))
    return result.rowcount == 1


def cancel_written(conn: Session | Connection, msg_id: str) -> bool | None:
    """``cancel`` of a written row: whether it changed it, or None when no row ``msg_id``
    is in the table (yet). A Session in AUTOCOMMIT raises ``NotTransactional``: its cancel
    would stand even if the work around it rolled back."""
    if isinstance(conn, Session) and autocommits(
        held := conn.connection(bind_arguments={"clause": outbox_message})
    ):
        raise NotTransactional(
            f"session: its connection to {url_of(held.engine)} is in AUTOCOMMIT, committing "
            "each statement at once: a cancel there would stand even if the work around it "
            "rolled back; cancel() in a transaction; nothing was canceled"
        )
    if cancel(conn, msg_id):
        return True
    found = conn.execute(select(outbox_message.c.id).where(
        outbox_message.c.msg_id == uuid.UUID(msg_id))).first()  # fmt: skip
    return None if found is None else False


def _dialect(conn: Session | Connection, table: Any = outbox_message) -> Dialect:
    return dialect_for(_bind(conn, table))


def _bind(conn: Session | Connection, table: Any = outbox_message) -> Engine | Connection:
    return conn.get_bind(clause=table) if isinstance(conn, Session) else conn


def take_seqs(conn: Session | Connection, messages: Sequence[Message]) -> list[Message]:
    """``messages``, each ordered one numbered next in its (topic, key), in list order.

    One upsert for all the keys, which locks their ``outbox_sequence`` rows until the
    transaction ends: another writer of a key waits for our commit (or rollback, which
    gives the numbers back), so a key's numbers follow its commits, with no gap. The keys
    are locked in one order (sorted) by every writer: two never wait for each other.
    """
    counts: dict[tuple[str, str], int] = {}
    for m in messages:
        if m.ordered and m.seq is None:
            assert m.key is not None, "build_message refuses ordered=True without a key"
            counts[(m.topic, m.key)] = counts.get((m.topic, m.key), 0) + 1
    if not counts:
        return list(messages)
    # Each key's last number before these messages.
    before = {k: last - counts[k] for k, last in add_to_last_seqs(conn, counts).items()}
    numbered: list[Message] = []
    for m in messages:
        if m.ordered and m.seq is None and m.key is not None:
            before[(m.topic, m.key)] += 1
            m = replace(m, seq=before[(m.topic, m.key)])
        numbered.append(m)
    return numbered


def add_to_last_seqs(
    conn: Session | Connection, counts: Mapping[tuple[str, str], int]
) -> dict[tuple[str, str], int]:
    """-- take_seqs -- add each key's count to its last number, under the keys' row locks
    (one round trip where the driver batches, keys sorted); each key's new last number."""
    seq = outbox_sequence.c
    rows = [{"topic": t, "key": k, "last_seq": n} for (t, k), n in sorted(counts.items())]
    params = rows[0] if len(rows) == 1 else rows  # one dict: a plain execute
    dialect = _dialect(conn, outbox_sequence)
    upsert = dialect.built(_add_to_last_seq)
    if dialect.supports_upsert_returning:
        return {(r.topic, r.key): int(r.last_seq) for r in conn.execute(upsert, params)}
    conn.execute(upsert, params)
    # Our own updates: visible to our consistent read whatever the isolation level.
    mine = select(seq.topic, seq.key, seq.last_seq).where(
        tuple_(seq.topic, seq.key).in_(list(counts))
    )
    return {(r.topic, r.key): int(r.last_seq) for r in conn.execute(mine)}


def _add_to_last_seq(dialect: Dialect) -> Insert:
    """The upsert, built once per dialect: a statement made per call is compiled per
    call (~200 us)."""
    seq = outbox_sequence.c
    return dialect.upsert_adding(outbox_sequence, [seq.topic, seq.key], seq.last_seq)


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
        ordered=row.seq is not None,
        seq=row.seq,
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
