"""W3C trace context across the outbox (optional: ``pip install outbox-relay[otel]``).

When OpenTelemetry is installed and a span is active at ``send()``, its context
(``traceparent``, and ``tracestate``/``baggage`` when set) goes into the message's
headers, so a consumer continues the trace. The relay publishes a batch inside one
``outbox publish`` span (kind PRODUCER) that links to the context of every message it
carries. Without OpenTelemetry, or without an active span, both do nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from outbox.message import Message

try:
    from opentelemetry import context as otel_context
    from opentelemetry import propagate, trace
except ImportError:  # the extra is not installed: tracing is off
    otel_context = propagate = trace = None  # type: ignore[assignment]

TRACEPARENT = "traceparent"


def context_headers() -> dict[str, str]:
    """The active span's context as headers, or {} when there is none."""
    # An empty context (no span, no baggage: most sends) is the cheap test.
    if trace is None or not otel_context.get_current():
        return {}
    if not trace.get_current_span().get_span_context().is_valid:
        return {}
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


NO_SPAN = contextlib.nullcontext()  # reusable: it holds nothing


def publish_span(messages: Sequence[Message]) -> AbstractContextManager[object]:
    """One PRODUCER span around a batch's publish, linked to each message's trace; a
    batch that carries no trace context gets no span (and no generator made for it)."""
    links = linked_contexts(messages) if trace is not None else []
    if not links:
        return NO_SPAN
    tracer = trace.get_tracer("outbox.relay")
    return tracer.start_as_current_span(
        "outbox publish",
        kind=trace.SpanKind.PRODUCER,
        links=links,
        attributes={"messaging.batch.message_count": len(messages)},
    )


def linked_contexts(messages: Sequence[Message]) -> list[Any]:
    links = []
    for message in messages:
        if TRACEPARENT in message.headers:
            context = trace.get_current_span(propagate.extract(message.headers))
            span_context = context.get_span_context()
            if span_context.is_valid:
                links.append(trace.Link(span_context))
    return links
