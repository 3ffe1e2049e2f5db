"""SQLAlchemy's asyncio support, imported only when the app uses it.

SQLAlchemy 2.1 made greenlet optional (the ``async`` extra installs it), and importing
``sqlalchemy.ext.asyncio`` without greenlet raises ImportError: so ``import outbox`` and
the CLI must not import it. The type checks need no import either: an app that holds an
AsyncEngine, AsyncSession or async_sessionmaker has imported the module already, so
``isinstance`` looks the classes up in ``sys.modules`` and answers False while the module
is not loaded. Building an async engine imports it
through ``require()``, which turns a missing greenlet into a ConfigError naming the extra.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

from outbox.errors import ConfigError

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import (
        AsyncEngine,
        AsyncSession,
        async_scoped_session,
        async_sessionmaker,
    )
    from typing_extensions import TypeIs

MODULE = "sqlalchemy.ext.asyncio"
INSTALL = "pip install 'outbox-relay[async]'"


def is_instance(obj: object, *names: str) -> bool:
    """Is ``obj`` one of ``sqlalchemy.ext.asyncio``'s classes ``names``? Never imports it."""
    module = sys.modules.get(MODULE)
    if module is None:
        return False
    classes = tuple(c for c in (getattr(module, name, None) for name in names) if c is not None)
    return bool(classes) and isinstance(obj, classes)


def is_async_engine(obj: object) -> TypeIs[AsyncEngine]:
    return is_instance(obj, "AsyncEngine")


def is_async_session(obj: object) -> TypeIs[AsyncSession]:
    return is_instance(obj, "AsyncSession")


def is_async_scoped(obj: object) -> TypeIs[async_scoped_session[Any]]:
    return is_instance(obj, "async_scoped_session")


def is_async_factory(obj: object) -> TypeIs[async_sessionmaker[Any]]:
    return is_instance(obj, "async_sessionmaker")


def require(field: str = "db") -> ModuleType:
    """``sqlalchemy.ext.asyncio``, or a ConfigError naming the ``async`` extra.

    greenlet is checked first: SQLAlchemy raises its ImportError on the first import
    only, and a second import succeeds without greenlet (failing later, mid-query).
    """
    try:
        importlib.import_module("greenlet")
    except ImportError:
        raise ConfigError(
            f"{field}: asyncio support needs the 'async' extra (SQLAlchemy's asyncio module "
            f"needs greenlet, which is not installed): {INSTALL}"
        ) from None
    return importlib.import_module(MODULE)
