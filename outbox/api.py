"""``Outbox``: what an application holds to write messages in its own transactions."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar, cast, overload
from uuid import UUID

from sqlalchemy import Connection, Engine, make_url
from sqlalchemy.exc import UnboundExecutionError
from sqlalchemy.orm import Session, scoped_session, sessionmaker

from outbox import aio, forks, rows, tracing
from outbox.broker import Broker
from outbox.engines import (
    async_engine_from,
    check_broker_url,
    engine_from,
    given_url,
    is_async_url,
    relay_engine,
    sync_url,
)
from outbox.errors import ConfigError, WrongDatabase
from outbox.events import RelayListener, Stats
from outbox.message import Message, build_message, check_cancel_id
from outbox.payload import JsonDefault, check_json_default
from outbox.secrets import mask_url, url_of
from outbox.settings import Settings
from outbox.table import outbox_message
from outbox.target import mismatch
from outbox.tracking import cancel_staged, remember, stage

if TYPE_CHECKING:  # types only: the relay itself is imported by start(), asyncio by aio
    from sqlalchemy.ext.asyncio import (
        AsyncEngine,
        AsyncSession,
        async_scoped_session,
        async_sessionmaker,
    )

    from relay.runtime import Relay

    AnySession = (
        Session | scoped_session[Session] | AsyncSession | async_scoped_session[AsyncSession]
    )
    AnyFactory = sessionmaker[Session] | async_sessionmaker[AsyncSession]

P = ParamSpec("P")
R = TypeVar("R")

log = logging.getLogger("outbox")
START_RETRY_S = 5.0  # a forked child whose relay failed to start tries again on a send()


class Outbox:
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
        self._engine: Engine | None = None  # None until bound
        self._owns_engine = False
        self._async_engine: AsyncEngine | None = None
        self._owns_async_engine = True
        self._made_session_factory = not isinstance(session_factory, sessionmaker)
        self.session_factory: sessionmaker[Session] = sessionmaker()  # bound by bind()
        self._async_factory: async_sessionmaker[AsyncSession] | None = None
        if aio.is_async_factory(session_factory):
            self._async_factory = session_factory
        elif session_factory is not None:
            self.session_factory = session_factory
        self._made_async_factory = self._async_factory is None  # made on first async use
        self._current: ContextVar[Session | None] = ContextVar("outbox_session", default=None)
        self._current_async: ContextVar[tuple[AsyncSession, object] | None] = ContextVar(
            "outbox_async_session", default=None
        )
        self.sweeper = sweeper
        self._relay: Relay | None = None  # the last one started (kept after stop: its stats)
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

    def __repr__(self) -> str:
        db = None if self._engine is None else url_of(self._engine)
        return f"Outbox(db={db!r}, broker={shown_broker(self.broker)!r})"

    @property
    def engine(self) -> Engine:
        """The sync Engine the outbox reads its database through (the app's, when given one);
        a ConfigError naming ``bind()`` while the Outbox is not bound."""
        if self._engine is None:
            raise unbound()
        return self._engine

    @property
    def bound(self) -> bool:
        """Whether the Outbox has its database (given to Outbox() or to bind())."""
        return self._engine is not None

    def bind(self, db: str | Engine | AsyncEngine) -> Outbox:
        """Bind the Outbox to its database: ``db`` as ``Outbox(db, ...)`` takes it, later.

        For an app factory: build the Outbox at import time, with its broker and settings
        (``ob = Outbox(broker=os.environ.get("OUTBOX_BROKER"))``), and bind it where the
        app's engine exists, e.g. ``with app.app_context(): ob.bind(db.engine)`` in a Flask
        factory. The app's Engine is used as it is: one engine, one pool. Returns the Outbox.

        Binding it again (the next app a test suite builds, on the same database or a
        fresh one) moves it there while no relay runs; while its relay runs, binding it
        again raises ConfigError (stop() first).
        """
        if db is self._engine or (db is not None and db is self._async_engine):
            return self
        engine, async_engine = self._engines_for(db)
        try:
            if self._engine is not None:
                self._check_rebind(engine)
        except ConfigError:
            for made in (e for e in (engine, async_engine) if e is not None and e is not db):
                dispose(made)
            raise
        self._use(engine, async_engine, db)
        return self

    def _engines_for(self, db: str | Engine | AsyncEngine) -> tuple[Engine, AsyncEngine | None]:
        """The sync Engine the outbox and its relay use for ``db``, and the AsyncEngine of an
        async ``db`` (an async driver's URL, or the app's AsyncEngine)."""
        timeout = self.settings.connect_timeout_s
        if aio.is_async_engine(db) or (isinstance(db, str) and is_async_url(db)):
            async_engine = async_engine_from(db, timeout)
            # Its own sync engine: an async engine's sync_engine cannot run on another thread.
            source = db if isinstance(db, str) else given_url(async_engine)  # with options
            engine = engine_from(sync_url(make_url(source)), timeout)
            if differs := mismatch(async_engine.sync_engine, engine):
                raise ConfigError(f"db: the relay's engine would reach another table ({differs})")
            return engine, async_engine
        return engine_from(db, timeout), None

    def _check_rebind(self, engine: Engine) -> None:
        """An Outbox already bound may move while no relay runs (a test suite's fresh
        database per test), not while its relay works on the engine bound now."""
        bound = self.engine
        if self._relay is not None and self._relay.running:
            raise ConfigError(
                f"db: this Outbox's relay is running on {url_of(bound)}; stop() it before "
                f"binding the Outbox to {url_of(engine)}"
            )

    def _use(self, engine: Engine, async_engine: AsyncEngine | None, db: object) -> None:
        """Bind to ``engine`` (and ``async_engine``), leaving the ones bound before."""
        for old, owned in ((self._engine, self._owns_engine),
                           (self._async_engine, self._owns_async_engine)):  # fmt: skip
            if old is not None and owned:
                dispose(old)  # made here from a URL; no relay runs on it (checked)
        self._engine, self._owns_engine = engine, engine is not db
        self._async_engine, self._owns_async_engine = async_engine, async_engine is not db
        if self._made_session_factory:
            self.session_factory.configure(bind=engine)
        if self._made_async_factory:
            self._async_factory = None  # made again, on the new async engine, when used

    @property
    def async_engine(self) -> AsyncEngine:
        """The AsyncEngine async handlers' sessions use: the app's, or one made on first use."""
        if self._async_engine is None:
            self._async_engine = async_engine_from(self.engine.url, self.settings.connect_timeout_s)
        return self._async_engine

    @property
    def async_session_factory(self) -> async_sessionmaker[AsyncSession]:
        if self._async_factory is None:
            engine = self.async_engine  # imports asyncio support, or names the extra
            from sqlalchemy.ext.asyncio import async_sessionmaker

            self._async_factory = async_sessionmaker(engine)
        return self._async_factory

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
        staged = aio.is_async_session(session) or aio.is_async_scoped(session)
        checked = self._check_session(session)
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
            [written] = rows.write(rows.flushed_connection(checked), [message])
            remember(checked, written, self._on_commit)
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

    @overload
    def transactional(
        self, fn: Callable[Concatenate[AsyncSession, P], Coroutine[Any, Any, R]]
    ) -> Callable[P, Coroutine[Any, Any, R]]: ...

    @overload
    def transactional(self, fn: Callable[Concatenate[Session, P], R]) -> Callable[P, R]: ...

    def transactional(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Run ``fn(session, ...)`` in a new transaction: commit on return, roll back on error.

        ``async def`` handlers get a new AsyncSession, sync ones a Session. A decorated
        call made while another one is running in the same thread (sync) or asyncio
        task (async) joins the outer transaction instead of opening its own; tasks the
        handler starts get their own, as an AsyncSession must not be shared by tasks.
        """
        if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
            # Its body would run after the transaction closed: nothing it sends would commit.
            raise ConfigError(
                "transactional: generator functions are not supported; return a value instead"
            )
        if inspect.iscoroutinefunction(fn):
            return self._async_transactional(fn)
        return self._sync_transactional(fn)

    def _async_transactional(
        self, fn: Callable[Concatenate[AsyncSession, P], Coroutine[Any, Any, R]]
    ) -> Callable[P, Coroutine[Any, Any, R]]:
        @functools.wraps(fn)
        async def run_in_transaction(*args: P.args, **kwargs: P.kwargs) -> R:
            task = asyncio.current_task()
            outer = self._current_async.get()
            if outer is not None and outer[1] is task:
                return await fn(outer[0], *args, **kwargs)
            if self._engine is None:
                raise unbound()
            async with self.async_session_factory() as session:
                token = self._current_async.set((session, task))
                try:
                    async with session.begin():
                        return await fn(session, *args, **kwargs)
                finally:
                    self._current_async.reset(token)

        return run_in_transaction

    def _sync_transactional(self, fn: Callable[Concatenate[Session, P], R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def run_in_transaction(*args: P.args, **kwargs: P.kwargs) -> R:
            outer = self._current.get()
            if outer is not None:
                return fn(outer, *args, **kwargs)
            if self._engine is None:
                raise unbound()
            with self.session_factory() as session:
                token = self._current.set(session)
                try:
                    with session.begin():
                        return fn(session, *args, **kwargs)
                finally:
                    self._current.reset(token)

        return run_in_transaction

    @property
    def listeners(self) -> tuple[RelayListener, ...]:
        """The listeners the relay calls (``listener=`` and those added)."""
        return self._listeners

    def add_listener(self, listener: RelayListener) -> None:
        """Call ``listener``'s hooks too, from the next event on (also while running)."""
        with self._count_lock:
            self._listeners = (*self._listeners, listener)
            relay = self._relay
        if relay is not None:
            relay.add_listener(listener)

    @property
    def relay(self) -> Relay | None:
        """The in-process ``relay.runtime.Relay`` last started (None before start()): its
        ``running``, ``dispatcher`` and ``jobs`` are what metrics read."""
        return self._relay

    @property
    def stats(self) -> Stats | None:
        """Counters of the in-process relay (kept after stop), or None before start."""
        relay = self._relay
        return None if relay is None else relay.stats

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

    def start(self, broker: str | Broker | None = None, *, sweeper: bool | None = None) -> None:
        """Start the in-process relay: committed messages are published from memory.

        Needs the database (``bind()``) and ``broker``. Returns at once, even while the
        broker is unreachable: the relay keeps connecting in the background and the sweeper
        covers the gap. It connects to the database once first (a process forked later must
        not copy an engine in the middle of its first connection): an unreachable database
        holds it up to the engine's connect timeout (``connect_timeout_s`` for an engine the
        outbox built), then the relay keeps trying in the background.
        In a process forked after start(), the first send() starts the child's own relay.

        Starts nothing, with one INFO line, when ``start_relay`` is false
        (``OUTBOX_START_RELAY=false``: CLI commands, task workers, tests) or the Outbox was
        built with ``broker=""`` (an empty ``OUTBOX_BROKER``). ``broker`` and ``sweeper``
        given here replace the Outbox's for this start (a test's ``ob.start(broker=
        MemoryBroker(), sweeper=False)``), and a broker given here starts the relay
        whatever ``start_relay`` says. While a relay runs, start() does nothing; asking it
        for another broker or sweeper then is a ConfigError (stop() first).
        """
        engine = self.engine  # unbound: the ConfigError naming bind()
        chosen = None if broker is None or no_broker(broker) else check_broker(broker)
        running = self._relay is not None and self._relay.running
        if chosen is None and sweeper is None and running:
            return  # already started (by a test's fixture, say): nothing to do or tell
        if chosen is None and not self._wanted(broker):
            return
        target = chosen or self.broker
        if target is None:
            raise ConfigError(
                "broker: start() needs a broker URL, e.g. nats://127.0.0.1:4222, or a Broker"
            )
        with self._start_lock:  # send() in a forked child may race another thread's start()
            relay = self._relay
            if relay is None or not relay.running:
                self._start(target, self.sweeper if sweeper is None else sweeper)
                self._overrides = (chosen, sweeper)
            elif (chosen, sweeper) != (None, None) and (chosen, sweeper) != self._overrides:
                raise ConfigError(
                    f"start: the relay already runs on {url_of(engine)}; stop() it before "
                    "starting it with another broker or sweeper"
                )
            self._start_in_child = False  # only once started: a failed start is tried again

    def _wanted(self, broker: object) -> bool:
        """Whether start() without a broker of its own starts a relay; one line if not."""
        if broker is not None:  # start(broker=""): no broker, said explicitly
            log.info("relay not started: start() was given an empty broker")
            return False
        if not self.settings.start_relay:
            log.info("relay not started: start_relay is false (OUTBOX_START_RELAY)")
            return False
        if self._no_broker:
            log.info("relay not started: the broker is empty (OUTBOX_BROKER=''), no relay here")
            return False
        return True

    def _start(self, broker: str | Broker, sweeper: bool) -> None:
        from relay.runtime import Relay  # the app's one import of the relay layer

        engine = relay_engine(self.engine)  # never the app's own connection: ConfigError
        forks.first_connect(engine)
        try:
            relay = Relay(engine, broker, self.settings, self._listeners, sweeper=sweeper,
                          own_engine=engine is not self.engine)  # fmt: skip
        except BaseException:
            if engine is not self.engine:
                engine.dispose()
            raise
        relay.sweeper.batch_log_level = logging.DEBUG  # batches and purges: a worker's lines
        relay.start()
        log.info("outbox relay started: %s", relay.description)  # its one line at INFO
        with self._count_lock:
            self._relay = relay
            for listener in self._listeners:  # one added meanwhile is missed: add it now
                relay.add_listener(listener)

    def _start_after_fork(self) -> None:
        broker, sweeper = self._overrides  # as the parent's relay was started
        try:
            self.start(broker, sweeper=sweeper)
        except Exception:  # send() goes on: the row waits in the table for a sweeper
            self._start_retry_at = time.monotonic() + START_RETRY_S
            log.exception("starting the relay in a forked process failed; next try in %s s",
                          START_RETRY_S)  # fmt: skip

    def _after_fork(self) -> None:
        """In a forked child: new locks and pools, the parent's relay forgotten (outbox.forks)."""
        self._count_lock, self._start_lock = threading.Lock(), threading.Lock()
        for engine in self._engines():  # the app's too: the relay or its sessions use them
            forks.fresh_pool(engine)
        forks.abandon(self._relay)
        self._start_in_child = self._start_in_child or (
            self._relay is not None and self._relay.running
        )
        self._start_retry_at = 0.0
        self._relay = None
        self.committed = self.handed_off = 0

    def _engines(self) -> set[Engine]:
        """Every sync Engine this outbox or its session factories connect through."""
        found = set() if self._engine is None else {self._engine}
        if self._async_engine is not None:
            found.add(self._async_engine.sync_engine)
        for factory in (self.session_factory, self._async_factory):
            bind = factory.kw.get("bind") if factory is not None else None
            if isinstance(bind, Engine):
                found.add(bind)
            elif aio.is_async_engine(bind):
                found.add(bind.sync_engine)
        return found

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the relay: no new work; in-flight publishes and acks finish within ``timeout``.

        Anything not yet published stays pending in the table for the sweeper. The
        relay's thread and broker connection are gone when this returns, and so are
        the pooled DB connections when the outbox created its engine itself. In a forked
        child it stops the child's own relay and connections, never the parent's.
        """
        self._start_in_child = False
        relay = self._relay
        if relay is not None and relay.running:  # a second stop() does nothing
            relay.stop(timeout)
            log.info("outbox relay stopped")
        if self._engine is not None and self._owns_engine:
            self._engine.dispose()

    async def stop_async(self, timeout: float = 5.0) -> None:
        """``stop()`` off the event loop, then the pooled async connections the outbox made."""
        await asyncio.to_thread(self.stop, timeout)
        if self._async_engine is not None and self._owns_async_engine:
            await self._async_engine.dispose()

    def _on_commit(self, messages: list[Message], certain: bool) -> None:
        relay = self._relay
        taken = relay.submit(messages, check=not certain) if relay is not None else 0
        with self._count_lock:
            self.committed += len(messages)
            self.handed_off += taken

    def _check_session(self, session: AnySession) -> Session:
        """The (underlying sync) Session, once it is known to write to this outbox's database."""
        if isinstance(session, scoped_session) or aio.is_async_scoped(session):
            session = session()
        if aio.is_async_session(session):
            session = session.sync_session
        if not isinstance(session, Session):
            raise ConfigError(
                "session: must be a sqlalchemy.orm.Session or AsyncSession, "
                f"got {type(session).__name__}"
            )
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
            return session
        if differs := mismatch(engine, self.engine):  # worked out once per engine
            raise WrongDatabase(
                f"session: bound to {url_of(engine)}, but this outbox writes to "
                f"{url_of(self.engine)}: another table ({differs})"
            )
        return session


def no_broker(broker: object) -> bool:
    """``""`` (or blanks): no broker, so no relay here (an empty ``OUTBOX_BROKER``)."""
    return isinstance(broker, str) and not broker.strip()


def unbound() -> ConfigError:
    return ConfigError("db: this Outbox is not bound to a database yet; call ob.bind(engine)")


def dispose(engine: Engine | AsyncEngine) -> None:
    """Let go of an engine the outbox made: a sync one's pooled connections are closed; an
    async one's can be closed only on their event loop, and are left to the collector."""
    if isinstance(engine, Engine):
        engine.dispose()
    else:
        engine.sync_engine.dispose(close=False)


def canceled(withdrawn: bool, changed: bool | None) -> bool:
    """A cancel's answer: the written row's fate (``changed``, None when there is no row);
    else whether a staged message was withdrawn. A staged copy of a written row (the same
    dedup_key) would never have been written."""
    return withdrawn if changed is None else changed


# What the relay calls; a class need not subclass outbox.broker.Broker (whose
# isinstance also asks for the async-with methods it only gives its subclasses).
BROKER_METHODS = ("connect", "publish", "close")


def check_broker(broker: object) -> str | Broker | None:
    """A broker URL with a product scheme, a Broker object, or None; ConfigError else."""
    if broker is None or isinstance(broker, str):
        return check_broker_url(broker)
    if not all(callable(getattr(broker, name, None)) for name in BROKER_METHODS):
        raise ConfigError(
            "broker: must be a URL or a Broker object (with connect, publish and close), "
            f"got {type(broker).__name__}"
        )
    return cast(Broker, broker)


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
