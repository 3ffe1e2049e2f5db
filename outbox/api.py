"""``Outbox``: what an application holds to write messages in its own transactions."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any
from uuid import UUID

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import UnboundExecutionError
from sqlalchemy.orm import Session, scoped_session, sessionmaker

from outbox import aio, forks, rows, tracing
from outbox.broker import Broker
from outbox.errors import ConfigError, WrongDatabase
from outbox.events import RelayListener
from outbox.lifecycle import RelayLifecycle, check_broker, no_broker
from outbox.message import Message, build_message, check_cancel_id
from outbox.payload import JsonDefault, check_json_default
from outbox.secrets import mask_url, url_of
from outbox.settings import Settings
from outbox.table import outbox_message
from outbox.target import mismatch
from outbox.tracking import cancel_staged, remember, stage
from outbox.transactions import Transactions

if TYPE_CHECKING:  # types only: the relay itself is imported by start(), asyncio by aio
    from sqlalchemy.ext.asyncio import (
        AsyncEngine,
        AsyncSession,
        async_scoped_session,
        async_sessionmaker,
    )

    AnySession = (
        Session | scoped_session[Session] | AsyncSession | async_scoped_session[AsyncSession]
    )
    AnyFactory = sessionmaker[Session] | async_sessionmaker[AsyncSession]


class Outbox(RelayLifecycle, Transactions):
    """Writes messages into ``outbox_message`` inside the caller's transaction.

    Delivery is at least once: a committed message is published (by the in-process
    relay or, after a crash, by a sweeper), and a message whose transaction rolled
    back is never published. A crash between publishing and marking the row sent
    publishes it again; consumers deduplicate by ``msg_id``.

    ``db`` is a SQLAlchemy URL or the app's own Engine or AsyncEngine: one Outbox serves
    sync Sessions and AsyncSessions alike. It may come later, through ``bind()`` (an app
    factory's engine); until then send(), start() and transactional calls raise
    ConfigError. The relay always works through a sync engine on its own threads (an
    async driver's sync counterpart: asyncpg -> psycopg, aiosqlite -> pysqlite,
    asyncmy/aiomysql -> PyMySQL). ``broker`` is a broker URL
    (``nats://``, ``amqp://``, ``redis://``), a ``outbox.broker.Broker`` object (e.g.
    ``relay.testing.MemoryBroker()`` in an app's tests), or None when another process
    relays (start() then refuses); ``""`` (an empty ``OUTBOX_BROKER``) means no relay here:
    start() logs one line and starts nothing.
    ``sweeper``: also run the sweeper in this process once started (default True).
    ``listener``: an ``outbox.events.RelayListener`` whose hooks hear what the relay
    did with each message (more with ``add_listener``).
    ``json_default``: called with each object of a payload that send() does not encode
    itself, like ``json.dumps``' ``default`` (docs/input.md, Payloads).
    Other options are the fields of ``outbox.settings.Settings``.
    """

    def __init__(
        self,
        db: str | Engine | AsyncEngine | None = None,
        broker: str | Broker | None = None,
        *,
        session_factory: AnyFactory | None = None,
        sweeper: bool = True,
        listener: RelayListener | None = None,
        json_default: JsonDefault | None = None,
        **options: Any,
    ) -> None:
        self.settings = Settings.from_options(options)
        self.json_default = check_json_default(json_default)
        self._no_broker = no_broker(broker)  # an empty OUTBOX_BROKER: no relay in this process
        self.broker = None if self._no_broker else check_broker(broker)
        self.broker_url = self.broker if isinstance(self.broker, str) else None
        self._unbound(session_factory)
        self._current: ContextVar[Session | None] = ContextVar("outbox_session", default=None)
        self._current_async: ContextVar[tuple[AsyncSession, object] | None] = ContextVar(
            "outbox_async_session", default=None
        )
        self.sweeper = sweeper  # self._relay: the last one started (kept after stop: its stats)
        self._count_lock = threading.Lock()
        self._listeners: tuple[RelayListener, ...] = () if listener is None else (listener,)
        self.committed = 0  # messages whose transaction committed, seen by this process
        self.handed_off = 0  # of those, taken by the in-process relay
        self._start_lock = threading.Lock()
        self._start_in_child = False  # forked from a parent whose relay ran: start on send()
        self._start_retry_at = 0.0  # after a failed start in a child, not before this
        self._overrides: tuple[str | Broker | None, bool | None] = (None, None)  # start()'s
        self._recordings: tuple[list[Message], ...] = ()  # the open recording() blocks' lists
        if db is not None:
            self.bind(db)
        forks.after_fork_in_child(self, Outbox._after_fork)

    @property
    def relay(self) -> Any:
        """The in-process ``relay.runtime.Relay`` last started (None before start()): its
        ``running``, ``dispatcher`` and ``jobs`` are what metrics read. Typed loosely: the
        app layer names the relay's types at one seam only, start()'s import below."""
        return self._relay

    def _relay_class(self) -> Any:
        """The relay, for start() (and a forked child's first send(), which starts one)."""
        return relay_runtime().Relay

    def __repr__(self) -> str:
        db = None if self._engine is None else url_of(self._engine)
        return f"Outbox(db={db!r}, broker={shown_broker(self.broker)!r})"

    def send(
        self,
        session: AnySession,
        topic: str,
        payload: object,
        *,
        key: str | None = None,
        ordered: bool = False,
        tags: str | list[str] | None = None,
        headers: dict[str, str] | None = None,
        delay: timedelta | float | None = None,
        deliver_at: datetime | None = None,
        delay_level: int | None = None,
        dedup_key: str | None = None,
    ) -> str:
        """Write one message in ``session``'s transaction and return its msg_id (UUIDv7; with
        a ``dedup_key``, the UUIDv5 of (topic, dedup_key)).

        Scheduled (docs/concepts.md, Scheduling): ``delay`` (a timedelta or seconds),
        ``deliver_at`` (an aware datetime) or ``delay_level`` (RocketMQ's 1 to 18) make the
        message due that long after its INSERT, or at that instant, by the database clock;
        a relay's scheduler publishes it then, never before. ``dedup_key``: the msg_id is
        derived from (topic, dedup_key), and a second send of the pair, while its row is
        in the table, writes nothing and returns the same msg_id. ``cancel()`` withdraws a
        scheduled message until it is published.

        ``ordered=True`` (needs a ``key``): the messages of one (topic, key) sent so reach
        the broker in the order their transactions committed, each after the one before
        was acknowledged (docs/concepts.md). Such a message is staged like an
        AsyncSession's and written just before COMMIT, where it takes its number under a
        lock on the key held through the COMMIT: writers of one key commit one at a time.

        Input is checked before any SQL runs (the rules: docs/input.md): an
        ``outbox.errors.InvalidMessage`` leaves the transaction as it was. The message
        is published only after the transaction commits; a rollback (of it, or of the
        savepoint it was sent in) discards it.

        With an AsyncSession, send() is not awaited: like ``session.add()`` it stages the
        message, and the row is written by one INSERT (for all of the transaction's
        messages) inside the transaction, just before its COMMIT.
        """
        if self._start_in_child and time.monotonic() >= self._start_retry_at:
            self._start_after_fork()
        # A plain Session (most sends) is neither async nor scoped: no asks of aio's types.
        plain = type(session) is Session
        staged = not plain and (aio.is_async_session(session) or aio.is_async_scoped(session))
        checked, bind = self._checked_bind(session)
        message = build_message(
            topic,
            payload,
            key=key,
            tags=tags,
            headers=with_trace_context(headers),
            ordered=ordered,
            delay=delay,
            deliver_at=deliver_at,
            delay_level=delay_level,
            dedup_key=dedup_key,
            max_payload_bytes=self.settings.max_payload_bytes,
            json_default=self.json_default,
        )
        if staged:  # written just before COMMIT; AUTOCOMMIT refused now if it is known
            rows.check_staged(checked)
            stage(checked, message, self._on_commit)
        elif message.ordered:  # the key's lock is taken at COMMIT only
            rows.transaction_connection(checked)  # AUTOCOMMIT refused now
            stage(checked, message, self._on_commit)
        else:  # the app's pending rows are flushed first: their errors are the app's
            conn = rows.flushed_connection(checked)
            [written] = rows.write(conn, [message])
            # The COMMIT's outlook reads this connection (a Connection bind: uncertain).
            remember(checked, written, self._on_commit, conn if isinstance(bind, Engine) else None)
        if self._recordings:  # the whole cost of recording() when none is open
            self._record(message)
        return message.msg_id

    def cancel(self, session: Session | scoped_session[Session], msg_id: str | UUID) -> bool:
        """Cancel the scheduled message ``msg_id`` in ``session``'s transaction.

        True iff this canceled it: a scheduled message (sent with delay, deliver_at,
        delay_level or dedup_key) not yet published nor canceled, its row committed or
        written in this transaction, or staged by this session and not yet written (an
        AsyncSession's: then never written). Once the transaction commits, the message is
        never published; a rollback undoes the cancel. An unscheduled message cannot be
        canceled (False: it is published right after its COMMIT), nor an unknown one.

        A publish in flight holds the row's lock: the cancel waits for it to finish (at
        most the relay's publish timeout), then returns False if it went out, True if the
        publish failed (the outbox then never publishes it; a copy whose answer never came,
        a publish timeout, may be at the broker: docs/concepts.md). An AsyncSession takes
        ``await ob.cancel_async(session, msg_id)``.
        """
        msg_id = check_cancel_id(msg_id)
        if aio.is_async_session(session) or aio.is_async_scoped(session):
            raise ConfigError("session: an AsyncSession cancels with await ob.cancel_async(...)")
        checked = self._check_session(session)
        return canceled(cancel_staged(checked, msg_id), rows.cancel_written(checked, msg_id))

    async def cancel_async(self, session: AnySession, msg_id: str | UUID) -> bool:
        """``cancel()`` for an AsyncSession: the same rules, awaited."""
        msg_id = check_cancel_id(msg_id)
        if not (aio.is_async_session(session) or aio.is_async_scoped(session)):
            raise ConfigError("session: cancel_async() takes an AsyncSession; use cancel()")
        checked = self._check_session(session)
        withdrawn = cancel_staged(checked, msg_id)
        given = session() if aio.is_async_scoped(session) else session
        return canceled(withdrawn, await given.run_sync(rows.cancel_written, msg_id))

    @contextmanager
    def recording(self) -> Iterator[list[Message]]:
        """``with ob.recording() as sent:``: ``sent`` lists the messages
        (``outbox.message.Message``) that send() wrote or staged through this Outbox
        while the block runs, in order, from any thread, whether their transaction then
        commits or rolls back (a test whose outer transaction rolls back still sees what
        the code under test sent).

        Blocks may nest or overlap (other threads): each sees the sends made while it is
        open. Nothing is recorded, and send() pays one attribute check, when none is open.
        """
        sent: list[Message] = []
        with self._count_lock:
            self._recordings = (*self._recordings, sent)
        try:
            yield sent
        finally:
            with self._count_lock:
                self._recordings = tuple(r for r in self._recordings if r is not sent)

    def _record(self, message: Message) -> None:
        with self._count_lock:  # one order for every open recording
            for sent in self._recordings:
                sent.append(message)

    def _check_session(self, session: AnySession) -> Session:
        """The (underlying sync) Session, once it is known to write to this outbox's database."""
        return self._checked_bind(session)[0]

    def _checked_bind(self, session: AnySession) -> tuple[Session, Engine | Connection]:
        """``_check_session``, and what the Session writes the outbox's rows through."""
        if type(session) is not Session:
            session = self._sync_session(session)
        try:
            bind = session.get_bind(clause=outbox_message)
        except UnboundExecutionError:
            raise ConfigError(
                "session: is bound to no database; create it with Session(engine)"
            ) from None
        engine = bind.engine if isinstance(bind, Connection) else bind
        if engine is self.engine or (
            self._async_engine is not None and engine is self._async_engine.sync_engine
        ):
            return session, bind
        if differs := mismatch(engine, self.engine):  # worked out once per engine
            raise WrongDatabase(
                f"session: bound to {url_of(engine)}, but this outbox writes to "
                f"{url_of(self.engine)}: another table ({differs})"
            )
        return session, bind

    def _sync_session(self, session: AnySession) -> Session:
        """The Session of a scoped session or an AsyncSession; ConfigError for anything else."""
        if isinstance(session, scoped_session) or aio.is_async_scoped(session):
            session = session()
        if aio.is_async_session(session):
            session = session.sync_session
        if not isinstance(session, Session):
            raise ConfigError(
                "session: must be a sqlalchemy.orm.Session or AsyncSession, "
                f"got {type(session).__name__}"
            )
        return session


def canceled(withdrawn: bool, changed: bool | None) -> bool:
    """A cancel's answer: the written row's fate (``changed``, None when there is no row);
    else whether a staged message was withdrawn. A staged copy of a written row (the same
    dedup_key) would never have been written."""
    return withdrawn if changed is None else changed


# What the relay calls; a class need not subclass outbox.broker.Broker (whose
# isinstance also asks for the async-with methods it only gives its subclasses).
BROKER_METHODS = ("connect", "publish", "close")


def shown_broker(broker: str | Broker | None) -> str | None:
    """The broker as logs and reprs show it: a URL masked, an object by its class name
    (its fields may hold credentials)."""
    if broker is None or isinstance(broker, str):
        return None if broker is None else mask_url(broker)
    return f"<{type(broker).__name__}>"


def with_trace_context(headers: object) -> object:
    """The caller's headers plus the active trace's context; the caller's win on a clash."""
    context = tracing.context_headers()
    if not context:
        return headers
    if headers is None:
        return context
    if not isinstance(headers, Mapping):
        return headers
    # Names are unique ignoring case: the caller's "Traceparent" replaces "traceparent".
    given = {name.lower() for name in headers if isinstance(name, str)}
    return {**{k: v for k, v in context.items() if k.lower() not in given}, **headers}


def relay_runtime() -> Any:
    """relay.runtime, imported when first asked: the app layer's one import of the relay
    layer, for Outbox.start() and Inbox.run()."""
    from relay import runtime

    return runtime
