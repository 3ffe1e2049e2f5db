"""Binding an ``Outbox`` to its database: the sync Engine the outbox and its relay use,
the AsyncEngine of an async app, and the session factories bound to them.

``Binding`` is a part of ``outbox.Outbox`` (its base class): ``bind()`` and the engines.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, Self

from sqlalchemy import Engine, make_url
from sqlalchemy.orm import Session, sessionmaker

from outbox import aio
from outbox.engines import async_engine_from, engine_from, given_url, is_async_url, sync_url
from outbox.errors import ConfigError
from outbox.secrets import url_of
from outbox.settings import Settings
from outbox.target import mismatch

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker


class Running(Protocol):
    """What binding asks of the relay (relay.runtime.Relay): whether it runs."""

    @property
    def running(self) -> bool: ...


class Binding:
    """The database side of an ``Outbox``: what ``bind()`` sets."""

    settings: Settings
    session_factory: sessionmaker[Session]
    _engine: Engine | None
    _owns_engine: bool
    _async_engine: AsyncEngine | None
    _owns_async_engine: bool
    _made_session_factory: bool
    _async_factory: async_sessionmaker[AsyncSession] | None
    _made_async_factory: bool
    _relay: Running | None

    def _unbound(self, session_factory: Any) -> None:
        """No database yet (``bind()`` gives one); the app's own session factory, sync or
        async, where it gives one, else ours, bound by ``bind()`` or made on first use."""
        self._engine, self._owns_engine = None, False
        self._async_engine, self._owns_async_engine = None, True
        self._made_session_factory = not isinstance(session_factory, sessionmaker)
        self.session_factory = sessionmaker()
        self._async_factory = None
        if aio.is_async_factory(session_factory):
            self._async_factory = session_factory
        elif session_factory is not None:
            self.session_factory = session_factory
        self._made_async_factory = self._async_factory is None
        self._relay = None

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

    def bind(self, db: str | Engine | AsyncEngine) -> Self:
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


def unbound() -> ConfigError:
    return ConfigError("db: this Outbox is not bound to a database yet; call ob.bind(engine)")


def dispose(engine: Engine | AsyncEngine) -> None:
    """Let go of an engine the outbox made: a sync one's pooled connections are closed; an
    async one's can be closed only on their event loop, and are left to the collector."""
    if isinstance(engine, Engine):
        engine.dispose()
    else:
        engine.sync_engine.dispose(close=False)
