"""The broker families the product knows, each as it declares itself.

A broker adapter declares one ``BrokerRegistration``: its family name, URL schemes, the
pip extra of its client, its adapter and log reader (lazily, as ``"module:attr"`` or a
callable that imports the heavy client only when called), the flags that name its log
sources, its wire limits and its test harness. The registrations are listed in the
entry-point group ``outbox.brokers`` (pyproject.toml lists nats, rabbitmq and redis),
so a package of one's own adds a broker by adding an entry point. They are loaded once,
on first use, and every table about brokers is derived from them: the URL schemes
(``outbox.broker.BROKER_SCHEMES``), the adapters (``relay.brokers.ADAPTERS``), the extras
the CLI names (``relay.cli.EXTRA_OF``), the test harness's kinds, and the limits
``send()`` checks (``strictest_limits``).

The app layer never imports the relay: loading an entry point is a plugin lookup by
name, at run time. A registration module must stay light (no broker client imports),
so that an install without the broker's extra still loads it.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, TypeVar

log = logging.getLogger(__name__)

GROUP = "outbox.brokers"
# The product's own registrations, by entry-point name, as pyproject.toml lists them; used
# for a name the installed metadata lacks (a checkout run without `pip install -e .`).
BUILTIN = {
    "nats": "relay.brokers.registrations:NATS",
    "rabbitmq": "relay.brokers.registrations:RABBITMQ",
    "redis": "relay.brokers.registrations:REDIS",
}
V = TypeVar("V")
Factory = str | Callable[..., Any]  # "module:attr", or the callable itself


@dataclass(frozen=True, slots=True)
class WireLimits:
    """What one broker refuses on the wire, so that ``send()`` refuses it first.

    ``None`` means no limit of this broker's own. ``send()`` holds every message to the
    strictest limits of all registered brokers (``strictest_limits``): a message accepted
    once can be relayed to any of them.
    """

    max_topic_bytes: int | None = None  # the subject, routing key or stream name, in UTF-8
    max_header_name_bytes: int | None = None
    max_content_type_bytes: int | None = None  # a property of its own at some brokers
    max_header_bytes: int | None = None  # the whole header block, once encoded
    reserved_header_prefixes: tuple[str, ...] = ()  # lower case: the broker's own headers
    reserved_header_names: frozenset[str] = frozenset()  # lower case


@dataclass(frozen=True, slots=True)
class BrokerRegistration:
    """One broker family, as its adapter declares it (see the module's docstring)."""

    family: str  # nats, rabbitmq, redis: the harness's kind, the CLI's and logs' name
    schemes: tuple[str, ...]  # the URL schemes it serves: ("nats", "tls")
    extra: str  # the pip extra that installs its client: outbox-relay[extra]
    adapter: Factory  # url -> a not yet connected outbox.broker.Broker
    reader: Factory | None = None  # url -> its outbox.broker.LogReader; None: the adapter
    client_modules: tuple[str, ...] = ()  # the top-level modules its extra installs
    log_source_flags: tuple[str, ...] = ("--stream",)  # `outbox export broker` names sources so
    limits: WireLimits = WireLimits()
    # (prefix, relay.testing.harness.HarnessOptions) -> iterator of one BrokerUnderTest:
    # how tests get a namespace of their own at this broker (relay.testing.harness).
    harness: Factory | None = None
    requirement: str = ""  # what `pip install` takes for the extra; "" outbox-relay[extra]

    @property
    def install(self) -> str:
        return self.requirement or f"outbox-relay[{self.extra}]"


def resolve(factory: Factory) -> Callable[..., Any]:
    """The callable a factory names: ``"module:attr"`` imported now, a callable as it is.
    An ImportError says the module (or the client it imports) is not installed."""
    if callable(factory):
        return factory
    module, _, attr = factory.partition(":")
    found: Callable[..., Any] = getattr(importlib.import_module(module), attr)
    return found


_loaded: dict[str, BrokerRegistration] | None = None
_strictest: WireLimits | None = None
_derived: list[Derived[Any]] = []


def registrations() -> dict[str, BrokerRegistration]:
    """Every registered broker, by family, in family order; loaded once.

    A broken plugin's warning is logged only once the table is in place: a logging filter
    may itself ask for the broker schemes (the CLI's secret scrubber does), and asking
    while loading would load again, without end."""
    global _loaded
    if _loaded is None:
        found, problems = _load()
        _loaded = {r.family: r for r in sorted(found, key=lambda r: r.family)}
        for problem in problems:
            log.warning("%s", problem)
    return _loaded


def _load() -> tuple[list[BrokerRegistration], list[str]]:
    """The registrations the entry points name, and a line for each one that is broken."""
    found = {ep.name: ep.value for ep in entry_points(group=GROUP)}
    loaded: list[BrokerRegistration] = []
    problems: list[str] = []
    for name, target in {**BUILTIN, **found}.items():
        try:
            registration = resolve(target)
        except Exception as exc:  # one broken plugin must not take the others with it
            problems.append(f"entry point {name}={target} of {GROUP} failed to load: {exc!r}")
            continue
        if not isinstance(registration, BrokerRegistration):
            problems.append(f"entry point {name}={target} of {GROUP} is no BrokerRegistration")
            continue
        loaded.append(registration)
    return loaded, problems


def registration_for(family: str) -> BrokerRegistration:
    """The registration of ``family``; KeyError when none is registered."""
    return registrations()[family]


def register(registration: BrokerRegistration) -> None:
    """Add (or replace) a registration at run time, as an entry point would: for tests,
    and for an app that builds its broker's registration in code."""
    registrations()[registration.family] = registration
    _changed()


def unregister(family: str) -> None:
    registrations().pop(family, None)
    _changed()


def _changed() -> None:
    global _strictest
    _strictest = None
    for table in _derived:
        table.forget()


def limits_of(family: str) -> WireLimits:
    return registration_for(family).limits


def strictest_limits() -> WireLimits:
    """The limits ``send()`` checks: the strictest of every registered broker's, cached."""
    global _strictest
    if _strictest is None:
        _strictest = strictest(r.limits for r in registrations().values())
    return _strictest


def strictest(limits: Iterable[WireLimits]) -> WireLimits:
    """The lowest of each maximum, every reserved prefix and name."""
    every = list(limits)

    def lowest(values: Iterable[int | None]) -> int | None:
        given = [v for v in values if v is not None]
        return min(given) if given else None

    return WireLimits(
        max_topic_bytes=lowest(w.max_topic_bytes for w in every),
        max_header_name_bytes=lowest(w.max_header_name_bytes for w in every),
        max_content_type_bytes=lowest(w.max_content_type_bytes for w in every),
        max_header_bytes=lowest(w.max_header_bytes for w in every),
        reserved_header_prefixes=tuple(
            dict.fromkeys(p for w in every for p in w.reserved_header_prefixes)
        ),
        reserved_header_names=frozenset(n for w in every for n in w.reserved_header_names),
    )


@dataclass(eq=False)
class Derived(Mapping[str, V]):
    """A read-only table computed from the registrations on first use (not at import:
    loading them scans the installed packages), and again after ``register``."""

    build: Callable[[dict[str, BrokerRegistration]], dict[str, V]]
    _table: dict[str, V] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        _derived.append(self)

    def table(self) -> dict[str, V]:
        if self._table is None:
            self._table = self.build(registrations())
        return self._table

    def forget(self) -> None:
        self._table = None

    def __getitem__(self, key: str) -> V:
        return self.table()[key]

    def __contains__(self, key: object) -> bool:
        return key in self.table()

    def __iter__(self) -> Iterator[str]:
        return iter(self.table())

    def __len__(self) -> int:
        return len(self.table())

    def __repr__(self) -> str:
        return repr(self.table())


def derived(build: Callable[[dict[str, BrokerRegistration]], dict[str, V]]) -> Derived[V]:
    """A table of ``build(registrations())``, kept in step with them."""
    return Derived(build)


# scheme -> broker family, e.g. "tls" -> "nats"
BROKER_SCHEMES: Derived[str] = derived(
    lambda regs: {scheme: r.family for r in regs.values() for scheme in r.schemes}
)


def client_extras(regs: Mapping[str, BrokerRegistration]) -> dict[str, str]:
    """The top-level module of each broker client -> the extra that installs it."""
    return {module: r.extra for r in regs.values() for module in r.client_modules}
