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
import importlib.metadata
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
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


__all__ = ["PLUGIN_GROUP", "CommandGroup", "ExportKind", "Page", "Plugins", "plugins"]
