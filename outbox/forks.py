"""What a process forked with ``os.fork()`` does with what its parent made.

A child (gunicorn ``--preload`` workers, multiprocessing with fork, Celery prefork)
starts as a copy of its parent: pooled database connections whose sockets the parent
still uses, relay objects whose threads did not survive the fork, and locks that
another thread may have held at that instant (held for ever in the child). Objects
registered here get a reset hook, run in each child right after the fork, before the
child's own code goes on (``os.register_at_fork``).

Whatever belonged to the parent is kept referenced, never closed or collected: closing
a pooled connection sends the server a goodbye on the parent's socket, and the finalizer
of an async driver's connection or of a broker client may touch an event loop whose
epoll instance the parent shares. The cost is some file descriptors in each child.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

log = logging.getLogger("outbox.forks")

T = TypeVar("T")

# Object -> its reset; weak keys: a registration never keeps an object alive.
_resets: weakref.WeakKeyDictionary[Any, Callable[[Any], None]] = weakref.WeakKeyDictionary()
_abandoned: list[object] = []  # the parent's, kept for as long as the child lives


def after_fork_in_child(obj: T, reset: Callable[[T], None]) -> None:
    """Call ``reset(obj)`` in every child forked from now on while ``obj`` is alive."""
    _resets[obj] = reset


def abandon(*parts: object) -> None:
    """Keep the parent's ``parts`` referenced in this child: never stopped, closed or freed."""
    _abandoned.extend(part for part in parts if part is not None)


def fresh_pool(engine: Engine) -> None:
    """A new, empty pool for ``engine`` in this child; the parent's connections untouched.

    SQLAlchemy's documented pattern (``Engine.dispose(close=False)``); the old pool is
    kept (``abandon``) so that no connection of the parent is ever finalized here.
    """
    abandon(engine.pool)
    engine.dispose(close=False)


def first_connect(engine: Engine) -> None:
    """Connect ``engine`` once on this thread, before the relay's threads do.

    SQLAlchemy sets an engine's dialect up on its first connection, marked done when it
    begins: a child forked while another thread is in the middle of it (gunicorn
    ``--preload`` forks right after ``start()``) gets an engine whose dialect is never set
    up, and every statement of the child's relay fails. A database that cannot be reached
    now is left to the relay's threads, which keep trying.
    """
    try:
        with engine.connect():
            pass
    except SQLAlchemyError as exc:
        log.warning("the database is not reachable yet (%s): the relay keeps trying",
                    type(exc).__name__)  # fmt: skip


def _in_child() -> None:
    for obj, reset in list(_resets.items()):
        try:
            reset(obj)
        except Exception:  # one object's reset must not leave the others as the parent's
            log.exception("resetting %s after fork failed", type(obj).__name__)


os.register_at_fork(after_in_child=_in_child)
