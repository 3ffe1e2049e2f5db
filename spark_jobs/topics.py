"""Topic patterns in the broker's wildcard syntax (NATS subjects), on both sides of the
audit: `outbox export ledger|broker --topic` and `outbox reconcile --topic` filter with
them, and a JetStream stream "captures" a topic when one of its subjects matches it.

``*`` matches one dot-separated token, ``>`` (last token only) one or more tokens;
anything else matches itself. Plain Python, so that spark_jobs stays importable alone:
``pattern_regex`` is the one definition, used by ``matches`` and by Spark's ``rlike``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

# Parquet metadata key of a broker log export: JSON {source: [subjects it captures]}.
SOURCES_KEY = b"outbox.sources"


def pattern_regex(pattern: str) -> str:
    """An anchored regular expression for ``pattern`` (see the module's docstring)."""
    tokens = pattern.split(".")
    parts = []
    for i, token in enumerate(tokens):
        if token == "*":
            parts.append(r"[^.]+")
        elif token == ">" and i == len(tokens) - 1:
            parts.append(r".+")
        else:
            parts.append(re.escape(token))
    return "^" + r"\.".join(parts) + "$"


def patterns_regex(patterns: Sequence[str]) -> str:
    """One regular expression matching a topic any of ``patterns`` matches."""
    return "|".join(f"(?:{pattern_regex(p)})" for p in patterns)


def matches(patterns: Sequence[str], topic: str) -> bool:
    """Whether any of ``patterns`` matches ``topic``; no pattern at all matches every topic."""
    return not patterns or re.match(patterns_regex(patterns), topic) is not None


def capturing(sources: Mapping[str, Sequence[str]], topic: str) -> list[str]:
    """The sources (streams) whose subjects capture ``topic``."""
    return [name for name, subjects in sources.items() if subjects and matches(subjects, topic)]


def uncaptured(sources: Mapping[str, Sequence[str]], topics: Iterable[str]) -> list[str]:
    """The topics no source captures, sorted."""
    return sorted({topic for topic in topics if not capturing(sources, topic)})


def read_captures(broker_log: str) -> dict[str, list[str]] | None:
    """{stream: subjects it captures} as the export recorded it, or None (a remote path,
    a folder, or an export made before it recorded them)."""
    import pyarrow.parquet as pq

    path = Path(broker_log.removeprefix("file://"))
    if "://" in broker_log.removeprefix("file://") or not path.is_file():
        return None
    metadata = pq.read_schema(path).metadata or {}
    if SOURCES_KEY not in metadata:
        return None
    found: dict[str, list[str]] = json.loads(metadata[SOURCES_KEY])
    return found


def unaudited_lines(summary: Mapping[str, Any]) -> list[str]:
    """One warning line per topic with unaudited messages."""
    return [
        f"topic {topic}: no stream at the broker captures it, {counts['unaudited']} messages "
        "not audited"
        for topic, counts in sorted(summary.get("topics", {}).items())
        if counts.get("unaudited")
    ]
