"""How a message is shown to an operator, by the CLI (relay.cli) and the dashboard
(relay.dashboard) alike: ages, text with control characters escaped, an error in one
line, payloads as text or escaped bytes, a failed message's fields.

A leaf: it imports nothing of relay, so that any part (the sweep side's log lines too)
may show an error the way the others do."""

from __future__ import annotations

from datetime import datetime
from typing import Any


def duration(seconds: float) -> str:
    """An age as an operator reads it: 42s, 7m, 3h, 2d."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{max(seconds, 0):.0f}s"


def safe(text: str) -> str:
    """Text fit for a terminal: control characters (a planted row may hold escapes) escaped."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def one_line(text: str, limit: int | None = None, every_line: bool = False) -> str:
    """An error as one line: its first line (every line, joined, when ``every_line``),
    runs of spaces collapsed, cut to ``limit`` characters with "..." when longer."""
    lines = text.strip().splitlines()
    kept = lines if every_line else lines[:1]
    line = " ".join(" ".join(kept).split())
    if limit is None or len(line) <= limit:
        return line
    return line[: limit - 3] + "..."


def utf8(payload: bytes, cut: bool) -> str | None:
    """The payload as text, None when it is not UTF-8 (a cut may split its last character)."""
    try:
        return payload.decode()
    except UnicodeDecodeError as exc:
        if cut and exc.start >= len(payload) - 3 and exc.reason == "unexpected end of data":
            return payload[: exc.start].decode()
        return None


def payload_text(payload: bytes, cut: bool) -> str:
    """UTF-8 as text (line breaks kept), anything else as escaped bytes: b'\\x00...'."""
    text = utf8(payload, cut)
    if text is None:
        return repr(payload)
    return "\n".join(safe(line) for line in text.split("\n"))


def failure_json(row: Any, now: datetime) -> dict[str, Any]:
    """A dead or failing message's fields (`outbox dead --json`, the dashboard's /dead),
    from a relay.operator.Failure."""
    return {
        "msg_id": str(row.msg_id),
        "status": row.status,
        "topic": row.topic,
        "key": row.key,
        "seq": row.seq,
        "blocks_behind": row.blocks_behind,
        "attempts": row.attempts,
        "created_at": row.created_at.isoformat(),
        "age_s": round((now - row.created_at).total_seconds(), 3),
        "next_attempt_at": row.next_attempt_at.isoformat() if row.next_attempt_at else None,
        "last_error": row.last_error,
    }
