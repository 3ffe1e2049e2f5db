"""``--app module:attr``: a worker takes the database, broker and settings of the app's
own ``Outbox``, so that app and workers cannot disagree (as procrastinate's ``--app``).

``attr`` names an ``Outbox``, or a callable that returns one when called without
arguments; a dotted ``attr`` reaches into the module (``myshop.app:services.outbox``).
The current directory is searched first, as ``python -m`` does. Flags still win.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import TypeVar

from outbox import Outbox
from outbox.errors import ConfigError
from outbox.settings import Settings
from relay.cli.common import UsageError
from relay.display import one_line

FLAG = "--app"


APP_HELP = ("take --db, --broker and every setting from the app's own Outbox (an Outbox, "
            "or a callable returning one), e.g. myshop.outbox:ob; flags still win")  # fmt: skip


def add_app_flag(parser: argparse.ArgumentParser, text: str = APP_HELP) -> None:
    parser.add_argument(FLAG, metavar="MODULE:ATTR", help=text)


def use_app(args: argparse.Namespace) -> Settings | None:
    """With --app: fill --db and --broker where not given, and return the app's settings."""
    spec = getattr(args, "app", None)
    if spec is None:
        return None
    ob = load_app(spec)
    if args.db is None:
        args.db = app_db(ob, spec)
    if getattr(args, "broker", "") is None:  # `outbox migrate` has no --broker
        if ob.broker_url is None and ob.broker is not None:  # an object lives in its process
            raise UsageError(
                f"{FLAG}: the app's Outbox has a {type(ob.broker).__name__} object, not a "
                "broker URL, to hand to a worker: give --broker URL"
            )
        args.broker = ob.broker_url
    return ob.settings


def app_db(ob: Outbox, spec: str) -> str:
    """The URL of the app's database; an Outbox built without one (bound later, in the
    app's factory) has none to give here."""
    try:
        url: str = ob.engine.url.render_as_string(hide_password=False)
    except ConfigError:  # not bound yet
        raise UsageError(
            f"{FLAG}: the Outbox {spec!r} is not bound to a database (it is bound later, "
            "e.g. by ob.bind(engine) in the app's factory): give --db URL, or name a "
            "callable that returns a bound Outbox"
        ) from None
    return url


def load_app(spec: str) -> Outbox:
    """The Outbox ``spec`` (``module:attr``) names; a UsageError naming --app otherwise."""
    return load_object(spec, Outbox, "myshop.outbox:ob")


T = TypeVar("T")


def load_object(spec: str, kind: type[T], example: str) -> T:
    """The ``kind`` object ``spec`` (``module:attr``) names, or that a callable there
    returns when called; a UsageError naming --app otherwise."""
    module_name, colon, path = spec.partition(":")
    if not (colon and module_name and path):
        raise UsageError(f"{FLAG}: {spec!r} must be MODULE:ATTR, e.g. {example}")
    found: object = import_app_module(module_name)
    for attr in path.split("."):
        if not hasattr(found, attr):
            raise UsageError(f"{FLAG}: module {module_name!r} has no attribute {path!r}")
        found = getattr(found, attr)
    if not isinstance(found, kind) and callable(found):
        try:
            found = found()
        except Exception as exc:  # the app's own factory failed: say so, in one line
            raise UsageError(f"{FLAG}: calling {spec!r} failed: {describe(exc)}") from exc
    if not isinstance(found, kind):
        raise UsageError(
            f"{FLAG}: {spec!r} is of type {type(found).__name__}, not an {kind.__name__} "
            f"(or a callable returning one)"
        )
    return found


def import_app_module(name: str) -> object:
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (name == exc.name or name.startswith(exc.name + ".")):
            raise UsageError(f"{FLAG}: no module named {name!r}") from None
        raise UsageError(f"{FLAG}: importing {name!r} failed: {describe(exc)}") from exc
    except Exception as exc:  # the module's own code failed
        raise UsageError(f"{FLAG}: importing {name!r} failed: {describe(exc)}") from exc


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {one_line(str(exc))}"
