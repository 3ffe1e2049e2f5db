"""report.html: the reconciliation's verdict, findings, tables and charts.

Rendered from Jinja2 templates (spark_jobs/templates, autoescaped: topics, msg_ids and
details come from the data) with Plotly charts; plotly.min.js is written beside the
page, so it opens offline.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jinja2 import BaseLoader, ChoiceLoader, Environment, PackageLoader, select_autoescape
from markupsafe import Markup

if TYPE_CHECKING:
    import plotly.graph_objects as go

# report.html's table of counts per topic, under grouped headers.
COUNT_GROUPS = (
    ("messages", ("committed", "delivered", "pending", "stuck", "blocked", "scheduled")),
    (
        "discrepancies",
        ("lost", "phantom", "out_of_order", "duplicated", "malformed", "malformed_at_broker"),
    ),
    ("not expected at the broker", ("dead", "skipped", "canceled")),
)
COUNT_COLUMNS = tuple(c for _, group in COUNT_GROUPS for c in group)
LATENCY_COLUMNS = ("latency_p50_ms", "latency_p90_ms", "latency_p99_ms", "latency_max_ms")
COLUMNS = COUNT_COLUMNS + LATENCY_COLUMNS
MODEL_B_COLUMNS = ("halfs", "half_writes", "ops", "checks", "unresolved", "discarded")
# Column headers a reader understands, in place of summary.json's keys.
HEADERS = {
    "committed": "committed", "delivered": "delivered", "pending": "pending (within SLA)",
    "stuck": "stuck (pending past SLA)", "blocked": "blocked (of those, behind a dead row)",
    "scheduled": "scheduled (due later)", "lost": "lost",
    "dead": "dead-lettered", "skipped": "skipped", "canceled": "canceled",
    "duplicated": "extra copies", "phantom": "phantom", "out_of_order": "out of order",
    "malformed": "malformed rows", "malformed_at_broker": "malformed at the broker",
    "latency_p50_ms": "p50", "latency_p90_ms": "p90",
    "latency_p99_ms": "p99", "latency_max_ms": "max", "halfs": "halfs",
    "half_writes": "half writes", "ops": "ops", "checks": "check requests",
    "unresolved": "unresolved", "discarded": "discarded",
}  # fmt: skip
KINDS = (
    "delivered", "pending", "stuck", "blocked", "scheduled", "lost", "dead", "skipped",
    "canceled", "duplicated", "phantom", "out_of_order", "malformed", "malformed_at_broker",
)  # fmt: skip
# What makes a run fail (exit status 3, verdict DISCREPANCIES): data lost, invented or
# reordered, or entries at the broker the relay cannot have written (a stranger's).
# Dead and skipped messages are the relay's and the operator's to report; scheduled
# (not due by the window's end) and canceled ones are not expected at all.
ALARMS = ("lost", "phantom", "out_of_order", "malformed_at_broker")
# Late, not lost (verdict STUCK, exit status 4): committed, still pending in the table
# past the SLA, so the sweeper may yet deliver them; the relay or the broker is stalled.
LATE = ("stuck",)
LATE_COLUMNS = ("topic", "key", "msg_id", "seq", "after_seq")
# The findings report.html lists by msg_id (the first few of each; discrepancies.csv
# has them all), and the columns it shows of each. Publish attempts: the failed ones the
# table recorded, plus the acked one for a row marked sent (reconciliation.publish_attempts).
LISTED_KINDS = ("lost", "phantom", "malformed_at_broker", "duplicated", "stuck", "blocked", "dead")
FINDING_COLUMNS = (
    ("msg_id", "msg_id"), ("topic", "topic"), ("created_at", "committed at"),
    ("details", "status in the ledger"), ("attempts", "publish attempts"),
    ("copies", "copies at the broker"), ("first_at_broker", "first at the broker"),
)  # fmt: skip
# A blocked row: what holds it (its details: "behind dead <msg_id> (<topic>/<key> seq <n>)").
BLOCKED_COLUMNS = (
    ("msg_id", "msg_id"), ("topic", "topic"), ("key", "key"), ("seq", "seq"),
    ("created_at", "committed at"), ("details", "held by"),
)  # fmt: skip
DEAD_COLUMNS = (
    ("msg_id", "msg_id"), ("topic", "topic"), ("key", "key"), ("seq", "seq"),
    ("created_at", "committed at"), ("attempts", "publish attempts"),
)  # fmt: skip
KIND_COLUMNS = {"blocked": BLOCKED_COLUMNS, "dead": DEAD_COLUMNS}
# Log axes start at 10**-0.5: a count of 1 is a bar of its own, not a sliver.
LOG_BOTTOM = -0.5
COLOURS = {"ok": "#1a7f37", "alarm": "#c62828", "late": "#b26a00", "bar": "#3b6ea8"}
CSV = "discrepancies.csv"


def alarming(total: dict[str, Any]) -> bool:
    """Whether a summary's totals hold lost, phantom or out-of-order messages, or
    malformed entries at the broker."""
    return any(total.get(name) for name in ALARMS)


def late(total: dict[str, Any]) -> bool:
    """Whether a summary's totals hold stuck messages (undelivered past the SLA)."""
    return any(total.get(name) for name in LATE)


def verdict(total: dict[str, Any]) -> str:
    return "DISCREPANCIES" if alarming(total) else "STUCK" if late(total) else "OK"


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def topic_cell(name: Any) -> Markup:
    """A topic for a table cell: each dot-separated part unbreakable, a line break allowed
    only after a dot (a long "shop.orders.created" never wraps mid-word)."""
    if name is None:
        return Markup("-")
    parts = [Markup('<span class="part">%s</span>') % part for part in str(name).split(".")]
    return Markup('<span class="topic">%s</span>') % Markup(".<wbr>").join(parts)


def environment(*loaders: BaseLoader) -> Environment:
    """The templates of spark_jobs (and of ``loaders`` first), HTML autoescaped."""
    env = Environment(
        loader=ChoiceLoader([*loaders, PackageLoader("spark_jobs", "templates")]),
        autoescape=select_autoescape(default=True),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["fmt"] = fmt
    env.filters["topic"] = topic_cell
    env.globals.update(headers=HEADERS, colours=COLOURS)
    return env


def write_plotlyjs(folder: Path) -> None:
    """plotly.min.js beside the pages (from the installed package: no CDN)."""
    from plotly.offline import get_plotlyjs

    target = folder / "plotly.min.js"
    if not target.exists():
        target.write_text(get_plotlyjs())


def embedded(fig: go.Figure, div_id: str) -> str:
    """A figure as a <div> and its script, for a template's ``| safe``."""
    html = fig.to_html(
        full_html=False,
        include_plotlyjs=False,
        div_id=div_id,
        config={"responsive": True, "displaylogo": False},
    )
    return str(html)


def kind_colour(kind: str) -> str:
    if kind in ALARMS:
        return COLOURS["alarm"]
    return COLOURS["late"] if kind in LATE else COLOURS["bar"]


def kinds_chart(total: dict[str, Any]) -> go.Figure:
    """Messages per kind, horizontal bars on a log scale: 8 lost show beside 50,000."""
    import plotly.graph_objects as go

    counts = [(k, int(total.get(k) or 0)) for k in KINDS if total.get(k)]
    fig = go.Figure(
        go.Bar(
            x=[v for _, v in counts],
            y=[HEADERS[k] for k, _ in counts],
            orientation="h",
            marker_color=[kind_colour(k) for k, _ in counts],
            text=[f"{v:,}" for _, v in counts],
            textposition="outside",
            cliponaxis=False,
            hovertemplate="%{y}: %{x:,} messages<extra></extra>",
        )
    )
    top = max((v for _, v in counts), default=1)
    fig.update_layout(
        **layout(height=80 + 32 * max(len(counts), 1)),
        xaxis={
            "type": "log",
            "dtick": 1,
            "title": "messages (log scale)",
            "range": [LOG_BOTTOM, log_top(top)],
        },
        yaxis={"autorange": "reversed", "automargin": True},
    )
    return fig


def latency_labels(buckets: list[tuple[str, Any]]) -> list[str]:
    """summary.json's "<=10", "<=5000", ">60000" (ms) as "≤10 ms", "≤5 s", ">60 s"."""
    return [readable_bucket(label) for label, _ in buckets]


def readable_bucket(label: str) -> str:
    sign, ms = ("≤", label[2:]) if label.startswith("<=") else (label[:1], label[1:])
    value = float(ms)
    return f"{sign}{value / 1000:g} s" if value >= 1000 else f"{sign}{value:g} ms"


def latency_chart(buckets: list[tuple[str, Any]], top: int | None = None) -> go.Figure:
    """Delivered messages per latency bucket, counts on a log scale (axis up to ``top``:
    charts drawn side by side share one)."""
    import plotly.graph_objects as go

    counts = [int(v) for _, v in buckets]
    fig = go.Figure(
        go.Bar(
            x=latency_labels(buckets),
            y=counts,
            marker_color=COLOURS["bar"],
            text=[f"{v:,}" if v else "" for v in counts],
            textposition="outside",
            cliponaxis=False,
            hovertemplate="%{x}: %{y:,} messages<extra></extra>",
        )
    )
    fig.update_layout(
        **layout(height=360),
        xaxis={"title": "due to broker latency", "tickangle": -90, "type": "category"},
        yaxis={
            "type": "log",
            "dtick": 1,  # 1, 10, 100...: no minor labels
            "title": "messages (log scale)",
            "range": [LOG_BOTTOM, log_top(top if top is not None else max(counts, default=1))],
        },
    )
    return fig


def log_top(top: int) -> float:
    """The upper end of a log axis for counts up to ``top``, with room for the labels."""
    return math.log10(max(top, 1) * 3)


def layout(height: int) -> dict[str, Any]:
    return {
        "height": height,
        "margin": {"l": 60, "r": 30, "t": 10, "b": 10},
        "font": {"size": 13},
        "showlegend": False,
        "plot_bgcolor": "#fafafa",
    }


def table_rows(summary: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [("all topics", summary["total"]), *sorted(summary["topics"].items())]


def write_report(
    path: Path,
    summary: dict[str, Any],
    title: str = "Outbox reconciliation",
    out_of_order: list[dict[str, Any]] | None = None,
    findings: dict[str, list[dict[str, Any]]] | None = None,
    links: list[tuple[str, str]] | None = None,
) -> None:
    """``out_of_order``: the first few out-of-order deliveries (columns LATE_COLUMNS);
    ``findings``: the first few msg_ids of each of LISTED_KINDS; ``links``: (label,
    relative href) of related pages, e.g. the comparison this run is part of."""
    model_b = summary.get("model") == "b"
    if model_b:
        title += " (model B: half/op)"
    total = summary["total"]
    page = (
        environment()
        .get_template("report.html")
        .render(
            title=title,
            summary=summary,
            total=total,
            verdict=verdict(total),
            window=summary.get("window", {}),
            rows=table_rows(summary),
            count_groups=COUNT_GROUPS,
            count_columns=COUNT_COLUMNS,
            latency_columns=LATENCY_COLUMNS,
            model_b_columns=MODEL_B_COLUMNS if model_b else (),
            findings=[
                (
                    kind,
                    (findings or {}).get(kind, []),
                    int(total.get(kind) or 0),
                    KIND_COLUMNS.get(kind, FINDING_COLUMNS),
                )
                for kind in LISTED_KINDS
            ],
            out_of_order=out_of_order or [],
            late_columns=LATE_COLUMNS,
            csv=CSV if (path.parent / CSV).exists() else None,
            links=links or [],
            kinds_chart=embedded(kinds_chart(total), "kinds-chart"),
            latency_chart=embedded(
                latency_chart(summary.get("latency_histogram", [])), "latency-chart"
            ),
        )
    )
    write_plotlyjs(path.parent)
    path.write_text(page)
