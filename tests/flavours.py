"""One test case, run by a sync app (Session) and by an async one (AsyncSession).

A case is an ``async def`` that awaits ``maybe(...)`` around every session call. The
async flavour runs it on an event loop against an AsyncSession. The sync flavour drives
the same coroutine by hand against a Session: nothing in it ever suspends then, so the
code under test runs exactly as in a sync app (no event loop, sync @transactional).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy import URL, Engine, create_engine, make_url
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from outbox import Outbox
from outbox.engines import async_engine_from, async_url

T = TypeVar("T")
Case = Coroutine[Any, Any, T]
# The async drivers proven, per database; the sync ones are the URL's own.
ASYNC_DRIVERS = {
    "psycopg_async": "postgresql+psycopg",  # create_async_engine picks psycopg's async side
    "asyncpg": "postgresql+asyncpg",
    "aiosqlite": "sqlite+aiosqlite",
    "asyncmy": "mysql+asyncmy",
}


def drive(case: Case[T]) -> T:
    """Run a coroutine that never suspends, without an event loop."""
    try:
        case.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    case.close()
    raise RuntimeError("a sync case awaited something that suspends")


async def maybe(value: Awaitable[T] | T) -> T:
    """Await what an AsyncSession returns; take what a Session returns as it is."""
    if inspect.isawaitable(value):
        return await value
    return value


@contextlib.asynccontextmanager
async def enter(manager: Any) -> AsyncIterator[Any]:
    """``async with`` over a sync or async context manager."""
    if hasattr(manager, "__aenter__"):
        async with manager as value:
            yield value
    else:
        with manager as value:
            yield value


@dataclass
class Flavour:
    """How a case reaches the database: ``ob`` and sessions of one kind, ``engine`` to check."""

    name: str
    ob: Outbox
    engine: Engine  # sync, for reading back what the case wrote
    is_async: bool

    def run(self, case: Callable[[], Case[T]]) -> T:
        return asyncio.run(self._on_a_loop(case)) if self.is_async else drive(case())

    async def _on_a_loop(self, case: Callable[[], Case[T]]) -> T:
        try:
            return await case()
        finally:  # pooled async connections belong to this loop: close them on it
            await self.ob.async_engine.dispose()

    def session(self, bind: Any = None) -> Any:
        """A new Session or AsyncSession on the outbox's database (or on ``bind``)."""
        if self.is_async:
            return AsyncSession(bind if bind is not None else self.ob.async_engine)
        return Session(bind if bind is not None else self.ob.engine)

    def engine_for(self, url: str | URL) -> Any:
        """An Engine or AsyncEngine of the app's own for ``url`` (a sync URL)."""
        if self.is_async:
            return create_async_engine(async_url(make_url(url)))
        return create_engine(url)

    def same_engine(self) -> Any:
        """An Engine or AsyncEngine of the app's own, for the outbox's database."""
        if self.is_async:  # its own driver; asyncpg's settings are connect arguments
            return async_engine_from(self.ob.engine.url.set(drivername=self.driver))
        return create_engine(self.ob.engine.url)

    @property
    def driver(self) -> str:
        return self.ob.async_engine.url.drivername

    def transactional(self, body: Callable[..., Case[T]]) -> Callable[..., Case[T]]:
        """``body`` decorated as the flavour's app would: async def, or a plain def."""
        if self.is_async:
            return self.ob.transactional(body)

        def handler(session: Session, *args: Any) -> T:
            return drive(body(session, *args))

        decorated = self.ob.transactional(handler)

        async def call(*args: Any) -> T:
            return decorated(*args)

        return call
