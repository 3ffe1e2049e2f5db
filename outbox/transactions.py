"""``Outbox.transactional``: a function run in a new transaction, or in the one its
caller already runs in the same thread (sync) or asyncio task (async).

``Transactions`` is a part of ``outbox.Outbox`` (its base class).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable, Coroutine
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar, overload

from sqlalchemy.orm import Session

from outbox.binding import Binding, unbound
from outbox.errors import ConfigError

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession

P = ParamSpec("P")
R = TypeVar("R")


class Transactions(Binding):
    """The transactional decorator of an ``Outbox``."""

    _current: ContextVar[Session | None]
    _current_async: ContextVar[tuple[AsyncSession, object] | None]

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
