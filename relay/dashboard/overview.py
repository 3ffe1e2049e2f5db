"""The overview's figures: per topic backlog and sends from the table, charts of the last
hour, and a relay's own counters from its /metrics (``--metrics URL``)."""

from __future__ import annotations

import json
import math
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any

import plotly.graph_objects as go
from prometheus_client.parser import text_string_to_metric_families

from outbox.secrets import mask_url
from relay.metrics import age_s
from relay.operator import Backlog, Minute, Operator

HOUR = timedelta(hours=1)
MINUTES = 60  # the charts' span, a bar or a point per minute
COLORS = ["#3366cc", "#dc6b2f"]  # bars and p50, p99
GRID = "#e4e7ec"
CHART_ROWS = 20_000  # sends read for the charts at most (the latest); the title says so
METRICS_TIMEOUT_S = 2.0
METRICS_CACHE_S = 2.0  # one scrape for all the pages polling within this time
OVERVIEW_CACHE_S = 2.0  # one set of queries for all the pages polling within this time


def overview(operator: Operator, metrics: RelayMetrics | None) -> dict[str, Any]:
    """What /api/overview answers (the overview page shows it but the charts, which its
    script draws from /api/overview); DatabaseDown when the database does not answer
    (``operator`` reads through the dashboard's Database)."""
    now, backlog, sent, minutes, capped = operator.activity(HOUR, MINUTES, CHART_ROWS)
    topics = topic_rows(backlog, sent, now)
    return {
        "now": now.isoformat(),
        "topics": topics,
        "consumers": consumer_rows(operator.consumers()),
        "total": totals(topics),
        "charts": charts(minutes, now, capped),
        "metrics": None if metrics is None else metrics.read(),
    }


def consumer_rows(counts: dict[str, dict[str, int]]) -> list[dict[str, Any]]:
    """Per consumer (outbox.inbox.Inbox): the msg_ids its inbox remembers as handled, its
    dead letters and those requeued, waiting for its runner."""
    return [
        {"consumer": name, "handled": by.get("handled", 0), "dead": by.get("dead", 0),
         "requeued": by.get("requeued", 0)}
        for name, by in sorted(counts.items())
    ]  # fmt: skip


COUNTS = ("pending", "blocked", "stuck", "scheduled", "dead", "blocked_keys", "sent_1h")


def topic_rows(
    backlog: Sequence[Backlog], sent: dict[str, int], now: datetime
) -> list[dict[str, Any]]:
    """Per topic: the backlog's figures (as `outbox status` and the gauges count them,
    stuck by relay.operator.STUCK_AFTER_S) and the sends of the last hour."""
    by_topic = {row.topic: row for row in backlog}
    rows = []
    for topic in sorted(by_topic.keys() | sent.keys()):
        row = by_topic.get(topic)
        oldest = None if row is None else row.oldest_pending
        rows.append(
            {
                "topic": topic,
                "pending": row.pending if row else 0,  # blocked and stuck ones included
                "blocked": row.blocked if row else 0,
                "stuck": row.stuck if row else 0,
                "oldest_pending_age_s": None if oldest is None else round(age_s(now, oldest), 1),
                "scheduled": row.scheduled if row else 0,
                "dead": row.dead if row else 0,
                "blocked_keys": row.blocked_keys if row else 0,
                "sent_1h": sent.get(topic, 0),
            }
        )
    return rows


def totals(topics: Sequence[dict[str, Any]]) -> dict[str, Any]:
    total: dict[str, Any] = {name: sum(row[name] for row in topics) for name in COUNTS}
    ages = [
        row["oldest_pending_age_s"] for row in topics if row["oldest_pending_age_s"] is not None
    ]
    total["oldest_pending_age_s"] = max(ages, default=None)
    return total


def charts(minutes: Sequence[Minute], now: datetime, capped: bool) -> dict[str, Any]:
    """Sent per minute and commit->ack p50/p99 per minute over the last hour, as Plotly
    figures (JSON-ready dicts); a minute without sends is a gap in the latency lines."""
    start = now.replace(second=0, microsecond=0) - timedelta(minutes=MINUTES - 1)
    slots = [start + timedelta(minutes=i) for i in range(MINUTES)]
    by_minute = {m.minute: m for m in minutes}
    shown = [by_minute.get(slot) for slot in slots]
    note = f" (the latest {CHART_ROWS:,} sends)" if capped else ""
    x = [slot.isoformat() for slot in slots]
    throughput = go.Figure(go.Bar(x=x, y=[m.sent if m else 0 for m in shown], name="sent"))
    throughput.update_layout(
        title=f"Messages sent per minute, last hour{note}",
        xaxis_title="minute (UTC)",
        yaxis_title="messages per minute",
    )
    lines = [("p50", [m.p50_ms if m else None for m in shown])]
    lines.append(("p99", [m.p99_ms if m else None for m in shown]))
    latency = go.Figure(
        [
            go.Scatter(x=x, y=[rounded(v) for v in y], name=name, mode="lines+markers")
            for name, y in lines
        ]
    )
    latency.update_layout(
        title=f"Commit to ack latency per minute{note}",
        xaxis_title="minute (UTC)",
        yaxis_title="created_at to sent_at (ms)",
    )
    for fig in (throughput, latency):  # both over the same hour, whatever minutes have data
        # No template: Plotly's default one is ~14 KB of JSON in every answer.
        fig.update_layout(
            template="none",
            height=320,
            margin={"l": 60, "r": 20, "t": 50, "b": 50},
            font={"family": "system-ui, sans-serif", "size": 12},
            colorway=COLORS,
        )
        fig.update_xaxes(showgrid=True, gridcolor=GRID)
        fig.update_yaxes(showgrid=True, gridcolor=GRID, rangemode="tozero")
        fig.update_xaxes(
            range=[
                (start - timedelta(seconds=30)).isoformat(),
                (now + timedelta(seconds=30)).isoformat(),
            ]
        )
    return {"throughput": figure(throughput), "latency": figure(latency)}


def rounded(value: float | None) -> float | None:
    return None if value is None else round(float(value), 1)


def figure(fig: go.Figure) -> dict[str, Any]:
    """A figure as plain JSON data (plotly's encoder: dates and numbers as Plotly.js reads them)."""
    data: dict[str, Any] = json.loads(fig.to_json())
    return data


class Cached:
    """A value computed at most once every ``seconds`` for all callers: the pages polling
    at once wait for one computation and share it."""

    def __init__(self, compute: Callable[[], dict[str, Any]], seconds: float) -> None:
        self.compute = compute
        self.seconds = seconds
        self.lock = threading.Lock()
        self.cached: tuple[float, dict[str, Any]] | None = None

    def get(self) -> dict[str, Any]:
        with self.lock:
            if self.cached is None or time.monotonic() - self.cached[0] >= self.seconds:
                value = self.compute()
                self.cached = (time.monotonic(), value)
            return self.cached[1]


class RelayMetrics:
    """A relay's /metrics, read at most every METRICS_CACHE_S for every page polling."""

    def __init__(self, url: str, fetch: Callable[[str], str] | None = None) -> None:
        self.url = url
        self.shown_url = mask_url(url)
        self.fetch = fetch or fetch_text
        self.cache = Cached(self.scrape, METRICS_CACHE_S)

    def read(self) -> dict[str, Any]:
        return self.cache.get()

    def scrape(self) -> dict[str, Any]:
        try:
            text = self.fetch(self.url)
            rows = relay_figures(text_string_to_metric_families(text))
        except Exception as exc:  # unreachable, not Prometheus text: said on the page
            reason = type(exc).__name__
            return {"url": self.shown_url, "error": f"could not read it ({reason})", "rows": []}
        return {"url": self.shown_url, "error": None, "rows": rows}


def fetch_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=METRICS_TIMEOUT_S) as reply:
        text: str = reply.read().decode()
    return text


# relay.metrics' names: what the overview shows of them, summed over their labels.
SHOWN = (
    ("outbox_messages_sent_total", "sent (since the relay started)"),
    ("outbox_messages_retried_total", "retried"),
    ("outbox_messages_swept_total", "swept"),
    ("outbox_messages_dead_total", "dead-lettered"),
    ("outbox_messages_left_for_sweeper_total", "left for the sweeper"),
    ("outbox_messages_held", "held by the fast path now"),
    ("outbox_queue_depth", "fast path queue depth"),
    ("outbox_timewheel_size", "waiting to retry"),
)
LATENCY = "outbox_commit_to_ack_seconds"


def relay_figures(families: Iterable[Any]) -> list[dict[str, Any]]:
    """The SHOWN sums, and commit->ack p50/p99 estimated from the histogram's buckets."""
    sums: dict[str, float] = {}
    buckets: list[tuple[float, float]] = []
    for family in families:
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
            if sample.name == f"{LATENCY}_bucket":
                buckets.append((float(sample.labels["le"]), sample.value))
    rows = [{"name": label, "value": sums[name]} for name, label in SHOWN if name in sums]
    for q in (0.5, 0.99):
        bound = bucket_bound(sorted(buckets), q)
        if bound is not None:
            rows.append({"name": f"commit to ack p{q * 100:g} (ms, at most)", "value": bound})
    return rows


def bucket_bound(buckets: Sequence[tuple[float, float]], q: float) -> float | None:
    """The upper bound (ms) of the first bucket holding the q-th observation."""
    if not buckets or buckets[-1][1] == 0:
        return None
    wanted = q * buckets[-1][1]
    bound = next(le for le, count in buckets if count >= wanted)
    return None if math.isinf(bound) else round(bound * 1000, 1)
