"""Metrics scraped over HTTP and trace context carried from send() to the broker."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy.orm import Session

from outbox import Outbox, migrate
from relay.brokers.nats import read_stream
from relay.metrics import serve
from relay.testing.embedded import NatsServer, free_port
from tests.helpers import wait_until


@pytest.fixture
def outbox(pg_url: str, nats_server: NatsServer, stream: tuple[str, str]) -> Iterator[Outbox]:
    name, prefix = stream
    migrate.upgrade(pg_url)
    ob = Outbox(pg_url, broker=f"{nats_server.url}?stream={name}&subjects={prefix}.>")
    ob.start()
    yield ob
    ob.stop()


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_metrics_endpoint_counts_what_the_relay_did(
    outbox: Outbox, stream: tuple[str, str]
) -> None:
    port = free_port()
    server = serve(outbox.relay, port, addr="127.0.0.1")
    try:
        with Session(outbox.engine) as session, session.begin():
            for i in range(7):
                outbox.send(session, f"{stream[1]}.orders", {"i": i})
        wait_until(lambda: outbox.stats is not None and outbox.stats.marked == 7, what="7 sent")
        samples = scrape(port)
    finally:
        server.shutdown()
    assert samples['outbox_messages_sent_total{path="fast"}'] == 7
    assert samples["outbox_commit_to_ack_seconds_count"] == 7
    assert samples['outbox_commit_to_ack_seconds_bucket{le="+Inf"}'] == 7
    assert 0 < samples["outbox_commit_to_ack_seconds_sum"] < 7 * 5
    assert samples["outbox_queue_depth"] == 0 and samples["outbox_timewheel_size"] == 0
    assert samples["outbox_messages_held"] == 0  # all 7 marked: every slot freed
    assert samples['outbox_messages_sent_total{path="sweeper"}'] == 0  # the in-app sweeper
    assert 'outbox_messages_left_for_sweeper_total{reason="queue_full"}' in samples


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    """One SDK tracer provider for the process (OpenTelemetry allows setting it once)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return exporter


def test_traceparent_travels_with_the_message_and_the_publish_links_to_it(
    outbox: Outbox, nats_server: NatsServer, stream: tuple[str, str], spans: InMemorySpanExporter
) -> None:
    name, prefix = stream
    tracer = trace.get_tracer("test")
    with (
        tracer.start_as_current_span("POST /inbound") as handler,
        Session(outbox.engine) as session,
        session.begin(),
    ):
        msg_id = outbox.send(session, f"{prefix}.orders", {"sku": "A"})
    with Session(outbox.engine) as session, session.begin():
        untraced = outbox.send(session, f"{prefix}.orders", {"sku": "B"})
    wait_until(lambda: outbox.stats is not None and outbox.stats.marked == 2, what="2 sent")
    by_id = {m.msg_id: m for m in asyncio.run(read_stream(nats_server.url, name))}
    trace_id = format(handler.get_span_context().trace_id, "032x")
    span_id = format(handler.get_span_context().span_id, "016x")
    assert by_id[msg_id].headers["traceparent"].startswith(f"00-{trace_id}-{span_id}-")
    assert "traceparent" not in by_id[untraced].headers
    publishes = [s for s in spans.get_finished_spans() if s.name == "outbox publish"]
    linked = {format(link.context.trace_id, "032x") for s in publishes for link in s.links}
    assert trace_id in linked
