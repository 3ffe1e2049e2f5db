"""How committed messages reach the broker: dispatcher, time wheel, sweeper, brokers.

Plugins add to the product without it importing them: a distribution names a
``register(plugins)`` function in the entry-point group ``outbox.plugins``, and
``plugins()`` calls each one once, in name order. A plugin adds ``outbox`` command groups
(a module or object with ``PARSERS`` and ``COMMANDS``, as relay.cli's own), dashboard
pages (a function returning ``Page``s, called when a dashboard is made, so that the
plugin imports the dashboard's extra only then) and export kinds (``outbox export
KIND``). Model B, the comparison lab (relay.lab), plugs in this way.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

PLUGIN_GROUP = "outbox.plugins"


class CommandGroup(Protocol):
    """What relay.cli reads of a group (a module, say): its parser builders, each given
    the subparsers to add its command to, and the handler of each command."""

    @property
    def PARSERS(self) -> Sequence[Callable[[Any], None]]: ...

    @property
    def COMMANDS(self) -> Mapping[str, Callable[[argparse.Namespace], int]]: ...


@dataclass(frozen=True)
class Page:
    """A dashboard page: its URL, the handler (``handler(request) -> Response``), the nav
    link's label, and the folder of its templates (they may extend ``base.html``)."""

    path: str
    handler: Callable[..., Any]
    label: str
    templates: Path


@dataclass(frozen=True)
class ExportKind:
    """``outbox export NAME``: ``run(args)`` writes ``args.out`` and returns the row count;
    ``help`` is its part of the ``what`` argument's help."""

    name: str
    help: str
    run: Callable[[argparse.Namespace], int]


@dataclass
class Plugins:
    """What the registered plugins add, in the order they added it."""

    command_groups: list[CommandGroup] = field(default_factory=list)
    page_loaders: list[Callable[[], Sequence[Page]]] = field(default_factory=list)
    export_kinds: dict[str, ExportKind] = field(default_factory=dict)

    def pages(self) -> list[Page]:
        """Every plugin's dashboard pages (this imports what the pages need)."""
        return [page for load in self.page_loaders for page in load()]


_loaded: Plugins | None = None
_loading = threading.Lock()


def plugins() -> Plugins:
    """The registered plugins, loaded once per process."""
    global _loaded
    with _loading:
        if _loaded is None:
            found = Plugins()
            group = importlib.metadata.entry_points(group=PLUGIN_GROUP)
            for entry in sorted(group, key=lambda e: e.name):
                entry.load()(found)
            _loaded = found
        return _loaded


# Modules that moved in the restructuring still import from their old paths, with a
# DeprecationWarning, for one release: old path -> new one; a moved package's modules
# follow it (relay.halfop.link -> relay.lab.halfop.link).
MOVED = {
    "relay.dispatcher": "relay.fastpath.dispatcher",
    "relay.lanes": "relay.fastpath.lanes",
    "relay.timewheel": "relay.fastpath.timewheel",
    "relay.acks": "relay.fastpath.acks",
    "relay.batches": "relay.fastpath.batches",
    "relay.stats": "relay.fastpath.stats",
    "relay.sweeper": "relay.sweep.sweeper",
    "relay.sweeper_jobs": "relay.sweep.jobs",
    "relay.scheduler": "relay.sweep.scheduler",
    "relay.dead_letters": "relay.sweep.dead_letters",
    "relay.quiet": "relay.sweep.quiet",
    "relay.halfop": "relay.lab.halfop",
    "relay.compare": "relay.lab.compare",
    "relay.cli.modelb": "relay.lab.cli",
    "relay.dashboard.halfop": "relay.lab.dashboard",
}


def moved_to(name: str) -> str | None:
    """Where the module once called ``name`` lives now (None: it did not move)."""
    for old, new in MOVED.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old) :]
    return None


class MovedLoader(importlib.abc.Loader):
    """Loads an old path as the module at its new path: one module object, two names."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{spec.name} moved to {self.new}; the old path goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module at the new path is already imported."""


class MovedFinder(importlib.abc.MetaPathFinder):
    """Answers imports of the old paths in ``MOVED``; every other import passes by."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = moved_to(fullname) if fullname.startswith("relay.") else None
        return None if new is None else importlib.util.spec_from_loader(fullname, MovedLoader(new))


# First in line: the path finder would load a second copy of a moved package's module.
if not any(isinstance(finder, MovedFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, MovedFinder())

__all__ = [
    "MOVED",
    "PLUGIN_GROUP",
    "CommandGroup",
    "ExportKind",
    "MovedFinder",
    "Page",
    "Plugins",
    "moved_to",
    "plugins",
]
