"""Prometheus metrics of the relay (optional: ``pip install outbox-relay[metrics]``).

Nothing is counted twice: the collector reads the relay's own counters and
histograms when Prometheus scrapes, so the hot path pays nothing for it.

In an app::

    from relay.metrics import register
    register(ob)  # into prometheus_client's default registry, served by your app

A worker: ``outbox relay --metrics-port 9464`` serves ``/metrics`` itself.

Metrics: ``outbox_messages_sent_total{path}``, ``outbox_messages_retried_total{path}``
(path = fast or sweeper), ``outbox_messages_swept_total``, ``outbox_messages_dead_total``,
``outbox_messages_left_for_sweeper_total{reason}``, ``outbox_queue_depth``,
``outbox_timewheel_size``, ``outbox_commit_to_ack_seconds`` (histogram),
``outbox_sweep_batch_size`` and ``outbox_sweep_duration_seconds`` (histograms).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from outbox.api import Outbox
    from relay.dispatcher import Dispatcher
    from relay.stats import Histogram
    from relay.worker import RelayJobs

Parts = Callable[[], "tuple[Dispatcher | None, RelayJobs | None]"]


class OutboxCollector(Collector):
    def __init__(self, parts: Parts) -> None:
        self.parts = parts

    def collect(self) -> Iterator[Metric]:
        dispatcher, jobs = self.parts()
        sent = CounterMetricFamily(
            "outbox_messages_sent", "Messages the broker acknowledged", labels=["path"]
        )
        retried = CounterMetricFamily(
            "outbox_messages_retried", "Failed attempts scheduled again", labels=["path"]
        )
        if dispatcher is not None:
            yield from fast_path_metrics(dispatcher, sent, retried)
        if jobs is not None:
            yield from sweeper_metrics(jobs, sent, retried)
        yield sent
        yield retried


def fast_path_metrics(
    dispatcher: Dispatcher, sent: CounterMetricFamily, retried: CounterMetricFamily
) -> Iterator[Metric]:
    stats = dispatcher.stats
    sent.add_metric(["fast"], stats.published)
    retried.add_metric(["fast"], stats.retried)
    left = CounterMetricFamily(
        "outbox_messages_left_for_sweeper",
        "Messages the fast path gave up on; the sweeper publishes them",
        labels=["reason"],
    )
    for reason in ("queue_full", "exhausted", "too_old", "rejected", "mark_failed"):
        left.add_metric([reason], getattr(stats, reason))
    queue, wheel = dispatcher.depths()
    yield left
    yield GaugeMetricFamily("outbox_queue_depth", "Messages waiting in msgQueue", value=queue)
    yield GaugeMetricFamily("outbox_timewheel_size", "Messages waiting to retry", value=wheel)
    yield histogram(
        "outbox_commit_to_ack_seconds", "From COMMIT to the broker's ack", stats.commit_to_ack
    )


def sweeper_metrics(
    jobs: RelayJobs, sent: CounterMetricFamily, retried: CounterMetricFamily
) -> Iterator[Metric]:
    sweeper = jobs.sweeper
    totals = sweeper.totals
    sent.add_metric(["sweeper"], totals.sent)
    retried.add_metric(["sweeper"], totals.failed)
    yield CounterMetricFamily(
        "outbox_messages_swept", "Rows claimed by the sweeper", value=totals.claimed
    )
    yield CounterMetricFamily(
        "outbox_messages_dead", "Rows the sweeper gave up on (dead)", value=totals.dead
    )
    yield histogram("outbox_sweep_batch_size", "Rows claimed per batch", sweeper.batch_sizes)
    yield histogram(
        "outbox_sweep_duration_seconds", "One batch: claim to commit", sweeper.batch_seconds
    )


def histogram(name: str, documentation: str, source: Histogram) -> HistogramMetricFamily:
    buckets = source.cumulative()
    return HistogramMetricFamily(name, documentation, buckets=buckets, sum_value=source.sum)


def register(ob: Outbox, registry: CollectorRegistry = REGISTRY) -> OutboxCollector:
    """Expose ``ob``'s relay in ``registry`` (it follows ob.start()/stop())."""
    collector = OutboxCollector(ob.relay_parts)
    registry.register(collector)
    return collector


def serve(parts: Parts, port: int, addr: str = "0.0.0.0") -> Any:
    """Serve /metrics for a worker on ``port``; returns the server (it runs in a thread)."""
    registry = CollectorRegistry()
    registry.register(OutboxCollector(parts))
    server, _ = start_http_server(port, addr=addr, registry=registry)
    return server
