"""Prometheus metrics of the relay (optional: ``pip install outbox-relay[metrics]``).

The counters come from a listener (outbox.events.RelayListener) the relay calls once per batch;
the fast path's gauges are read when Prometheus scrapes. The table's gauges (backlog, for
alerts) come from one GROUP BY query, cached ``BACKLOG_CACHE_S``, whatever the number of
scrapes or gauges: ``outbox relay`` serves them; ``register(ob, backlog=True)`` in an app.

In an app::

    from relay.metrics import register
    register(ob)  # into prometheus_client's default registry, served by your app

A worker: ``outbox relay --metrics-port 9464`` serves ``/metrics`` itself.

Metrics: ``outbox_messages_sent_total{path}``, ``outbox_messages_retried_total{path}``
(path = fast, sweeper or scheduler), ``outbox_messages_swept_total``,
``outbox_messages_dead_total``, ``outbox_messages_left_for_sweeper_total{reason}``,
``outbox_messages_held`` (all the fast path holds, at most ``queue_size``), ``outbox_queue_depth``,
``outbox_timewheel_size``, ``outbox_commit_to_ack_seconds`` (histogram),
``outbox_sweep_batch_size`` and ``outbox_sweep_duration_seconds`` (histograms).
Backlog, per topic, as ``outbox status`` and the dashboard count it (relay.store.Backlog):
``outbox_pending_messages{topic}`` (due, not yet sent: blocked and stuck ones included),
``outbox_blocked_messages{topic}`` (pending behind a dead message of their ordered key),
``outbox_stuck_messages{topic}`` (pending, due for longer than 60 s: ``outbox status``'s
default ``--sla``), ``outbox_dead_messages{topic}``,
``outbox_oldest_pending_age_seconds{topic}`` (since the row was due: created, requeued, or
its retry time after a failed attempt; 0 while it waits out a backoff),
``outbox_blocked_keys{topic}`` (keys whose head, the lowest unsettled ordered message, is
dead: their later messages wait for ``outbox requeue`` or ``outbox skip``),
``outbox_scheduled_messages{topic}`` (pending with a deliver_at still to come, by the
database clock: not counted as pending until due), ``outbox_next_due_seconds{topic}``
(until the earliest of them; no sample when a topic has none), and
``outbox_backlog_up`` (0 when the last query failed; the others are then left out).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from outbox.events import REASONS, Failed, Path, Reason, RelayListener, Sent, SweepResult
from outbox.forks import after_fork_in_child
from outbox.secrets import mask_url
from relay import store
from relay.fastpath.stats import BATCH_SIZE_BUCKETS, LATENCY_BUCKETS_S, SWEEP_BUCKETS_S, Histogram

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from relay.fastpath.dispatcher import Dispatcher
    from relay.sweep.jobs import SweeperJobs

log = logging.getLogger("relay.metrics")

# The backlog query runs at most once per this many seconds, for every scrape in between.
BACKLOG_CACHE_S = 5.0

# Why messages left the fast path: the hook's reasons, and rejected (a hook of its own).
LEFT_REASONS = (*REASONS, "rejected")


class Watched(Protocol):
    """What the metrics read of a relay (relay.runtime.Relay; named here, not imported,
    as the Relay imports this module for its metrics duty)."""

    @property
    def running(self) -> bool: ...

    @property
    def dispatcher(self) -> Dispatcher | None: ...

    @property
    def jobs(self) -> SweeperJobs | None: ...

    @property
    def engine(self) -> Engine: ...

    def add_listener(self, listener: RelayListener) -> None: ...


class RelayCounts(RelayListener):
    """What the relay reported, summed; hooks come from several threads, hence the lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        after_fork_in_child(self, RelayCounts._new_lock)
        self.sent = {"fast": 0, "sweeper": 0, "scheduler": 0}
        self.retries = {"fast": 0, "sweeper": 0, "scheduler": 0}
        self.left = dict.fromkeys(LEFT_REASONS, 0)
        self.swept_rows = 0
        self.dead_rows = 0
        self.commit_to_ack = Histogram(LATENCY_BUCKETS_S)
        self.batch_sizes = Histogram(BATCH_SIZE_BUCKETS)  # rows claimed per sweep batch
        self.batch_seconds = Histogram(SWEEP_BUCKETS_S)  # claim to commit of a sweep batch

    def _new_lock(self) -> None:
        self.lock = threading.Lock()  # a relay thread of the parent may have held it

    def published(self, sent: Sequence[Sent], path: Path) -> None:
        with self.lock:
            self.sent[path] += len(sent)
            for one in sent:
                if one.latency_s is not None:
                    self.commit_to_ack.observe(one.latency_s)

    def retried(self, failed: Sequence[Failed], path: Path) -> None:
        with self.lock:
            self.retries[path] += len(failed)

    def rejected(self, failed: Sequence[Failed]) -> None:
        with self.lock:
            self.left["rejected"] += len(failed)

    def left_for_sweeper(self, msg_ids: Sequence[str], reason: Reason) -> None:
        with self.lock:
            self.left[reason] += len(msg_ids)

    def dead(self, failed: Sequence[Failed]) -> None:
        with self.lock:
            self.dead_rows += len(failed)

    def swept(self, result: SweepResult, seconds: float) -> None:
        with self.lock:
            self.swept_rows += result.claimed
            self.batch_sizes.observe(result.claimed)
            self.batch_seconds.observe(seconds)


class OutboxCollector(Collector):
    """Families for the duties of the relay running now: the fast path's only while it
    runs. ``current`` gives that relay (None when there is none)."""

    def __init__(self, current: Callable[[], Watched | None], counts: RelayCounts) -> None:
        self.current = current
        self.counts = counts

    def collect(self) -> list[Metric]:
        relay = self.current()
        running = relay is not None and relay.running
        dispatcher = relay.dispatcher if relay is not None and running else None
        jobs = relay.jobs if relay is not None and running else None
        with self.counts.lock:  # one consistent view of the counters
            families = [*self.totals(dispatcher is not None, jobs is not None)]
            if dispatcher is not None:
                families += fast_path_metrics(self.counts, dispatcher)
            if jobs is not None:
                families += sweeper_metrics(self.counts)
        return families

    def totals(self, fast: bool, sweeper: bool) -> list[Metric]:
        sent = CounterMetricFamily(
            "outbox_messages_sent", "Messages the broker acknowledged", labels=["path"]
        )
        retried = CounterMetricFamily(
            "outbox_messages_retried", "Failed attempts scheduled again", labels=["path"]
        )
        duties = (("fast", fast), ("sweeper", sweeper), ("scheduler", fast or sweeper))
        paths = [path for path, running in duties if running]
        for path in paths:
            sent.add_metric([path], self.counts.sent[path])
            retried.add_metric([path], self.counts.retries[path])
        return [sent, retried]


def fast_path_metrics(counts: RelayCounts, dispatcher: Dispatcher) -> list[Metric]:
    left = CounterMetricFamily(
        "outbox_messages_left_for_sweeper",
        "Messages the fast path gave up on; the sweeper publishes them",
        labels=["reason"],
    )
    for reason, count in counts.left.items():
        left.add_metric([reason], count)
    queue, wheel = dispatcher.depths()
    held = dispatcher.held()
    return [
        left,
        GaugeMetricFamily(
            "outbox_messages_held",
            "Messages the fast path holds in memory (at most queue_size)",
            value=held,
        ),
        GaugeMetricFamily("outbox_queue_depth", "Messages waiting in msgQueue", value=queue),
        GaugeMetricFamily("outbox_timewheel_size", "Messages waiting to retry", value=wheel),
        histogram(
            "outbox_commit_to_ack_seconds", "From COMMIT to the broker's ack", counts.commit_to_ack
        ),
    ]


def sweeper_metrics(counts: RelayCounts) -> list[Metric]:
    return [
        CounterMetricFamily(
            "outbox_messages_swept", "Rows claimed by the sweeper", value=counts.swept_rows
        ),
        CounterMetricFamily(
            "outbox_messages_dead", "Rows the sweeper gave up on (dead)", value=counts.dead_rows
        ),
        histogram("outbox_sweep_batch_size", "Rows claimed per batch", counts.batch_sizes),
        histogram(
            "outbox_sweep_duration_seconds", "One batch: claim to commit", counts.batch_seconds
        ),
    ]


class BacklogRow(NamedTuple):
    """One topic's backlog gauges."""

    pending: int  # blocked and stuck ones included (relay.store.Backlog)
    oldest_age_s: float
    dead: int
    blocked_keys: int
    scheduled: int = 0  # pending, deliver_at still to come
    next_due_s: float | None = None  # until the earliest of them; None: none scheduled
    blocked: int = 0  # pending behind a dead message of their key
    stuck: int = 0  # pending, due for longer than store.STUCK_AFTER_S


class Backlog(Collector):
    """The table's state per topic, for alerts: one query per ``cache_s`` however often
    Prometheus (or several) scrape. A topic once seen stays, at 0, when its rows are gone."""

    def __init__(self, engine: Engine, cache_s: float = BACKLOG_CACHE_S) -> None:
        self.engine = engine
        self.cache_s = cache_s
        self.lock = threading.Lock()
        after_fork_in_child(self, Backlog._new_lock)
        self.read_at: float | None = None
        self.topics: dict[str, BacklogRow] = {}
        self.up = True

    def _new_lock(self) -> None:
        self.lock = threading.Lock()

    def collect(self) -> list[Metric]:
        with self.lock:  # scrapes side by side wait for the one query
            now = time.monotonic()
            if self.read_at is None or now - self.read_at >= self.cache_s:
                self.refresh()
                self.read_at = now
            return backlog_metrics(self.topics, self.up)

    def refresh(self) -> None:
        try:
            with self.engine.connect() as conn:
                db_now = store.db_clock(conn)
                rows = store.backlog_by_topic(conn, db_now)
        except Exception as exc:  # a scrape must answer: the database down is a value
            if self.up:  # once per outage, not per scrape
                log.warning("metrics: backlog query on %s failed: %s",
                            mask_url(self.engine.url), exc)  # fmt: skip
            self.up = False
            return
        if not self.up:
            log.info("metrics: backlog query works again")
        self.up = True
        self.topics = dict.fromkeys(self.topics, BacklogRow(0, 0.0, 0, 0))
        for row in rows:
            age = age_s(db_now, row.oldest_pending) if row.oldest_pending is not None else 0.0
            due = None if row.next_due is None else (row.next_due - db_now).total_seconds()
            self.topics[row.topic] = BacklogRow(
                row.pending, age, row.dead, row.blocked_keys, row.scheduled, due,
                row.blocked, row.stuck,
            )  # fmt: skip


def age_s(now: datetime, then: datetime) -> float:
    """Seconds since ``then``; 0 for a time still to come (a retry's backoff)."""
    return max(0.0, (now - then).total_seconds())


def backlog_metrics(topics: dict[str, BacklogRow], up: bool) -> list[Metric]:
    families: list[Metric] = [
        GaugeMetricFamily(
            "outbox_backlog_up", "1 when the last backlog query succeeded", value=int(up)
        )
    ]
    if not up:
        return families
    pending = GaugeMetricFamily(
        "outbox_pending_messages",
        "Rows due and not yet sent, blocked and stuck ones included",
        labels=["topic"],
    )
    blocked_rows = GaugeMetricFamily(
        "outbox_blocked_messages",
        "Pending rows behind a dead message of their ordered key (requeue or skip it)",
        labels=["topic"],
    )
    stuck = GaugeMetricFamily(
        "outbox_stuck_messages",
        f"Pending rows due for longer than {store.STUCK_AFTER_S:g} s",
        labels=["topic"],
    )
    oldest = GaugeMetricFamily(
        "outbox_oldest_pending_age_seconds",
        "How long the oldest pending row has been due (since created, requeued or retry time)",
        labels=["topic"],
    )
    dead = GaugeMetricFamily("outbox_dead_messages", "Rows given up on", labels=["topic"])
    blocked = GaugeMetricFamily(
        "outbox_blocked_keys",
        "Keys whose next ordered message is dead: the key waits for requeue or skip",
        labels=["topic"],
    )
    scheduled = GaugeMetricFamily(
        "outbox_scheduled_messages",
        "Rows whose deliver_at is still to come (not pending until due)",
        labels=["topic"],
    )
    next_due = GaugeMetricFamily(
        "outbox_next_due_seconds",
        "Seconds until the earliest scheduled row is due (no sample: none scheduled)",
        labels=["topic"],
    )
    for topic, row in sorted(topics.items()):
        pending.add_metric([topic], row.pending)
        blocked_rows.add_metric([topic], row.blocked)
        stuck.add_metric([topic], row.stuck)
        oldest.add_metric([topic], row.oldest_age_s)
        dead.add_metric([topic], row.dead)
        blocked.add_metric([topic], row.blocked_keys)
        scheduled.add_metric([topic], row.scheduled)
        if row.next_due_s is not None:
            next_due.add_metric([topic], row.next_due_s)
    return [*families, pending, blocked_rows, stuck, oldest, dead, blocked, scheduled, next_due]


def histogram(name: str, documentation: str, source: Histogram) -> HistogramMetricFamily:
    buckets = source.cumulative()
    return HistogramMetricFamily(name, documentation, buckets=buckets, sum_value=source.sum)


class App(Protocol):
    """What ``register`` reads of an ``outbox.Outbox`` (not imported: the Outbox starts
    the relay, which imports this module)."""

    @property
    def relay(self) -> Watched | None: ...

    @property
    def engine(self) -> Engine: ...

    def add_listener(self, listener: RelayListener) -> None: ...


def register(
    ob: App, registry: CollectorRegistry = REGISTRY, backlog: bool = False
) -> OutboxCollector:
    """Expose ``ob``'s relay in ``registry`` (it follows ob.start()/stop()).

    ``backlog``: the table's gauges too (a query per scrape interval from each process
    that registers them: one per deployment is enough, and ``outbox relay`` has them).
    """
    counts = RelayCounts()
    ob.add_listener(counts)
    collector = OutboxCollector(lambda: ob.relay, counts)
    registry.register(collector)
    if backlog:
        registry.register(Backlog(ob.engine))
    return collector


def serve(relay: Watched, port: int, addr: str = "127.0.0.1") -> Any:
    """Serve /metrics of ``relay`` on ``port`` at ``addr``; returns the server (it runs in a
    thread). Loopback by default, like the dashboard: a scraper on another machine needs
    ``addr`` said (``outbox relay --metrics-addr 0.0.0.0``).

    Counts what the relay does from now on: call it before it starts work (a Relay with
    ``metrics_port`` does).
    """
    counts = RelayCounts()
    relay.add_listener(counts)
    registry = CollectorRegistry()
    registry.register(OutboxCollector(lambda: relay, counts))
    registry.register(Backlog(relay.engine))
    server, _ = start_http_server(port, addr=addr, registry=registry)
    return server
