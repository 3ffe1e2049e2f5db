"""``Relay``: the one object that owns a running relay and its parts.

``Outbox.start()`` (the one place where the app layer imports the relay), ``outbox
relay``, ``outbox drain`` and, through those two, ``outbox compare`` build one; no
other code assembles the parts. A Relay starts its parts in order and stops them in
the reverse order, within one deadline:

- the metrics server, first up and last down (it only reads the others);
- ``BrokerLoop`` (relay.loop): the thread that owns the broker connection; the fast
  path and the sweeper publish through it, so it starts first and stops last;
- ``Sweeper`` (relay.sweep.sweeper) and ``SweeperJobs`` (relay.sweep.jobs), which call it
  on a schedule (the sweeper duty) with the retention purge;
- ``Scheduler`` (relay.sweep.scheduler), with either duty: publishes scheduled messages
  (``send(delay=...)``) when due, through the sweeper's machinery;
- ``Dispatcher`` (relay.fastpath.dispatcher), the fast path, with its ``AckBatcher``: up last,
  down first, so that at stop it has the whole deadline for the publishes and acks it
  holds (acked but unmarked rows would be published again) and takes no new commits
  while a sweep finishes.

Every part, and the Relay, keeps relay.part's contract: ``start()``, ``stop(timeout)
-> bool``, both idempotent and safe from any thread. A Relay still running when the
interpreter exits (a script that forgot ``ob.stop()``) is stopped by an atexit hook,
within AT_EXIT_TIMEOUT_S: its threads would otherwise be killed mid-loop ("Task was
destroyed but it is pending!"); what it did not finish stays pending for a sweeper.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import Engine

from outbox.broker import Broker
from outbox.errors import OutboxError
from outbox.events import RelayListener, Stats
from outbox.message import Message
from outbox.secrets import mask_url
from outbox.settings import Settings
from relay.brokers import broker_for
from relay.consume.runner import run as consume
from relay.consume.runner import run_until_signalled as consume_until_signalled
from relay.fastpath.acks import sql_finisher, sql_heads, sql_verifier
from relay.fastpath.dispatcher import Dispatcher
from relay.listener import Listeners
from relay.loop import BrokerLoop
from relay.part import Lifecycle, Part
from relay.sweep.jobs import SweeperJobs
from relay.sweep.scheduler import Scheduler
from relay.sweep.sweeper import Sweeper

# What the app layer reaches through its one seam (outbox.api.relay_runtime): the relay
# for Outbox.start(), an inbox's runner for Inbox.run() and run_async().
__all__ = ["Relay", "consume", "consume_until_signalled"]

log = logging.getLogger("relay.runtime")
# A Relay left running at exit gets this long to finish its publishes and acks: what it
# has not finished by then stays pending (the sweeper publishes it later).
AT_EXIT_TIMEOUT_S = 5.0


class Relay(Lifecycle):
    """A relay: publishes committed messages from ``engine``'s outbox table to ``broker``.

    ``broker`` is a broker URL or an ``outbox.broker.Broker`` object (a test double of
    ``relay.testing``, say). ``listeners`` hear what the relay did with each message
    (more with ``add_listener``). The duties:

    - ``fast_path``: publish what ``submit`` hands over right after COMMIT;
    - ``sweeper``: sweep due rows every ``sweep_interval_s`` (``concurrency`` sweeps side
      by side) and, with ``retention``, purge old sent rows; ``relay.sweep.sweeper`` is there
      without this duty too, for sweeps on demand (``outbox drain``);
    - with either duty, ``scheduler`` publishes scheduled messages once due (submitted
      ones are its hints, others are read from the table);
    - ``metrics_port``: serve Prometheus ``/metrics`` on ``metrics_addr`` (loopback unless
      said; needs the [metrics] extra).

    ``name`` names the broker loop's thread. The engine stays the caller's to dispose,
    unless ``own_engine``: then stop() disposes of it (an engine made for this relay alone,
    ``outbox.engines.relay_engine``).
    """

    def __init__(
        self,
        engine: Engine,
        broker: str | Broker,
        settings: Settings | None = None,
        listeners: Iterable[RelayListener] = (),
        *,
        fast_path: bool = True,
        sweeper: bool = True,
        retention: bool = True,
        concurrency: int = 1,
        metrics_port: int | None = None,
        metrics_addr: str = "127.0.0.1",
        name: str = "outbox-relay",
        own_engine: bool = False,
    ) -> None:
        super().__init__()
        self.engine = engine
        self._own_engine = own_engine
        self._pid = os.getpid()  # the process that started it (set again by start())
        self.settings = settings = settings or Settings()
        self.listeners = Listeners(*listeners)  # one set: the fast path's and the sweeper's
        self.broker_loop = BrokerLoop(broker_for(broker) if isinstance(broker, str) else broker,
                                      name)  # fmt: skip
        self.broker_shown = mask_url(broker) if isinstance(broker, str) else type(broker).__name__
        self.dispatcher = self._fast_path() if fast_path else None
        self.sweeper = Sweeper(engine, self.broker_loop, settings, self.listeners)
        self.jobs = SweeperJobs(self.sweeper, concurrency, retention) if sweeper else None
        self.scheduler = Scheduler(self.sweeper) if fast_path or sweeper else None
        self._metrics = MetricsServer(self, metrics_port, metrics_addr)

    def _fast_path(self) -> Dispatcher:
        verify = sql_verifier(self.engine) if self.settings.verify_commit else None
        finish = sql_finisher(self.engine, self.settings.mark_mode)
        return Dispatcher(self.broker_loop, finish, self.settings, verify=verify,
                          listener=self.listeners, heads=sql_heads(self.engine))  # fmt: skip

    @property
    def description(self) -> str:
        """What runs, for a start line: ``broker nats://host:4222 (sweeper on)``."""
        return f"broker {self.broker_shown} (sweeper {'off' if self.jobs is None else 'on'})"

    @property
    def stats(self) -> Stats | None:
        """The fast path's counters (kept after stop), None without the fast path."""
        return None if self.dispatcher is None else self.dispatcher.stats

    def add_listener(self, listener: RelayListener) -> None:
        """Call ``listener``'s hooks too, from the next event on (also while running)."""
        self.listeners.add(listener)

    def submit(self, messages: Sequence[Message], check: bool = True) -> int:
        """Hand committed messages over: scheduled ones to the scheduler (never the fast
        path), the others to the fast path; how many the fast path took (see Dispatcher).

        ``check`` is the fast path's (scheduled rows are claimed from the table, and a
        row whose commit did not happen is not found there)."""
        now: list[Message] = []
        later: list[Message] = []
        for message in messages:
            (later if message.scheduled else now).append(message)
        if later and self.scheduler is not None:
            self.scheduler.hint(later)
        if not now or self.dispatcher is None:
            return 0
        return self.dispatcher.submit(now, check)

    def wait_connected(self, timeout: float) -> bool:
        """True once the broker connection is up (it reconnects by itself after)."""
        return self.broker_loop.wait_connected(timeout)

    def _start(self) -> None:
        """The metrics first, then the loop, then what publishes through it; if one part
        fails to start, the ones started are stopped again and the error is raised."""
        try:
            for part in self._parts():
                part.start()
        except BaseException:
            self._stop(5.0)
            raise
        self._pid = os.getpid()
        atexit.register(self._stop_at_exit)

    def _stop_at_exit(self) -> None:
        """At interpreter exit, after the app's own threads ended and before the relay's
        daemon threads are killed: stop as stop() does, in this process only (a forked
        child that exits through atexit holds a copy of the Relay without its threads)."""
        if os.getpid() == self._pid:
            self.stop(AT_EXIT_TIMEOUT_S)

    def _stop(self, timeout: float) -> bool:
        """The parts in reverse order, within ``timeout`` in all: the fast path finishes
        its publishes and acks, then a sweep in hand its batch, then the broker loop closes.
        False when one of them did not finish in time (what it held stays pending)."""
        atexit.unregister(self._stop_at_exit)
        deadline = time.monotonic() + timeout
        finished = True
        for part in reversed(self._parts()):
            finished = part.stop(max(0.0, deadline - time.monotonic())) and finished
        if self._own_engine:  # a connection still checked out is closed when returned
            self.engine.dispose()
        return finished

    def _parts(self) -> list[Part]:
        """The parts in start order."""
        parts: list[Part | None] = [
            self._metrics,
            self.broker_loop,
            self.sweeper,
            self.jobs,
            self.scheduler,
            self.dispatcher,
        ]
        return [part for part in parts if part is not None]


class MetricsServer(Lifecycle):
    """``/metrics`` for a Relay on ``port`` (nothing when None): relay.metrics' server."""

    def __init__(self, relay: Relay, port: int | None, addr: str) -> None:
        super().__init__()
        self.relay, self.port, self.addr = relay, port, addr
        self._server: Any = None
        if port is not None:
            try:  # checked at once: a worker fails before it starts anything
                from relay import metrics  # noqa: F401
            except ImportError:
                raise OutboxError("metrics_port: serving /metrics needs prometheus_client: "
                                  "pip install 'outbox-relay[metrics]'") from None  # fmt: skip

    def _start(self) -> None:
        if self.port is None:
            return
        from relay.metrics import serve

        # Started before the parts: it counts what they do from their first message on.
        self._server = serve(self.relay, self.port, self.addr)
        log.info("metrics on http://%s:%d/metrics", self.addr, self.port)

    def _stop(self, timeout: float) -> bool:
        if self._server is not None:
            self._server.shutdown()
        return True
