"""The in-process relay of an ``Outbox``: starting and stopping it, in forked children
too, and the hand-off of committed messages to it (``_on_commit``, from the session
hooks of outbox.tracking, after COMMIT).

``RelayLifecycle`` is a part of ``outbox.Outbox`` (its base class). ``start()`` is where
the app layer imports the relay layer, once (relay.runtime).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, cast

from outbox import forks
from outbox.binding import Binding
from outbox.broker import Broker
from outbox.engines import check_broker_url, relay_engine
from outbox.errors import ConfigError
from outbox.events import RelayListener, Stats
from outbox.message import Message
from outbox.secrets import url_of

log = logging.getLogger("outbox")
START_RETRY_S = 5.0  # a forked child whose relay failed to start tries again on a send()


class RelayLifecycle(Binding):
    """The relay side of an ``Outbox``: ``start()``, ``stop()``, listeners and counts."""

    broker: str | Broker | None
    sweeper: bool
    committed: int
    handed_off: int
    _no_broker: bool
    _count_lock: threading.Lock
    _listeners: tuple[RelayListener, ...]
    _start_lock: threading.Lock
    _start_in_child: bool
    _start_retry_at: float
    _overrides: tuple[str | Broker | None, bool | None]
    # The running relay.runtime.Relay (None before start()). Its type and class are the
    # relay layer's, which the app layer reaches at one seam only: Outbox.start() (api.py).
    _relay: Any

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
    def stats(self) -> Stats | None:
        """Counters of the in-process relay (kept after stop), or None before start."""
        relay = self._relay
        return None if relay is None else relay.stats

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

    def _relay_class(self) -> Callable[..., Any]:
        """relay.runtime.Relay, imported by Outbox at the app layer's one seam."""
        raise NotImplementedError

    def _start(self, broker: str | Broker, sweeper: bool) -> None:
        Relay = self._relay_class()
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


def no_broker(broker: object) -> bool:
    """``""`` (or blanks): no broker, so no relay here (an empty ``OUTBOX_BROKER``)."""
    return isinstance(broker, str) and not broker.strip()


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
