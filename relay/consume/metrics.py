"""Prometheus metrics of a consumer (`outbox consume --metrics-port`), read from its
runner when scraped: ``outbox_consumer_messages_total{consumer,outcome}`` (handled,
duplicate, retry, held, dead, rejected, out of order) and
``outbox_consumer_lag_messages{consumer}`` (not yet settled at the broker: each
subscription's ``lag``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from relay.consume.runner import Consumer


class ConsumerCollector(Collector):
    def __init__(self) -> None:
        self.consumer: Consumer | None = None

    def attach(self, consumer: Consumer) -> None:
        self.consumer = consumer

    def collect(self) -> list[Metric]:
        consumer = self.consumer
        if consumer is None:
            return []
        name = consumer.inbox.consumer
        counted = CounterMetricFamily(
            "outbox_consumer_messages", "Deliveries by outcome", labels=["consumer", "outcome"]
        )
        for outcome, n in sorted(consumer.counts.items()):
            counted.add_metric([name, str(outcome)], n)
        metrics: list[Metric] = [counted]
        if consumer.lag is not None:
            lag = GaugeMetricFamily(
                "outbox_consumer_lag_messages", "Not yet settled at the broker", labels=["consumer"]
            )
            lag.add_metric([name], consumer.lag)
            metrics.append(lag)
        return metrics


def serve(port: int) -> ConsumerCollector:
    """Serve /metrics on ``port`` (all interfaces) from a registry of its own."""
    collector = ConsumerCollector()
    registry = CollectorRegistry()
    registry.register(collector)
    start_http_server(port, registry=registry)
    return collector
