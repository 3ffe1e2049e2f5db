"""`outbox dead`, `outbox show`, `outbox skip`: which messages failed, why, one message in
full, and giving messages up.

`outbox dead` rather than `outbox messages --status ...`: it is the question an operator
asks after `outbox status` reports dead rows (exit 3) or a drain reports failures, and
`dead` is what the table, the listener hook and `requeue --dead` call them. It lists
the failing ones too (pending, with failed attempts), which are on their way there.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from outbox.settings import LARGEST_PAYLOAD
from outbox.table import DEAD, PENDING
from relay.cli.common import (
    EXIT_DATA,
    EXIT_OK,
    EXIT_USAGE,
    Commands,
    add_db_flag,
    msg_id,
    operator_on,
)
from relay.display import duration, failure_json, one_line, payload_text, safe, utf8
from relay.operator import KINDS, Failure, SkipOutcome
from spark_jobs.flags import bounded_int

ERROR_CHARS = 100  # the last error in `outbox dead`'s table: one line, cut
PREVIEW_BYTES = 1024  # `outbox show` prints this much of the payload unless --full
PAGE = bounded_int(1, 10_000)  # `outbox dead --limit`: a page, not the whole table
# `outbox show --bytes`: at most the largest payload a message may have (max_payload_bytes)
SHOWN_BYTES = bounded_int(1, LARGEST_PAYLOAD)
# What the table keeps of a message's past: one row, overwritten by each attempt.
HISTORY = (
    "the table keeps the latest attempt only: attempts counts them, last_error and "
    "next_attempt_at are the last one's; sent_at and receipt once sent"
)


def add_dead(commands: Commands) -> None:
    dead = commands.add_parser(
        "dead",
        help="list dead and failing messages with their last error, newest first",
        description="List dead messages and failing ones (pending, with failed attempts): "
        "msg_id, status, topic, attempts, age, last error. Newest first, a page at a time.",
        epilog="The next page: the same command with --before the last msg_id listed (the "
        "table's last line says so; --json: next_before). `outbox show MSG_ID` prints one "
        "message; `outbox requeue --id MSG_ID` or `--dead` puts messages back. Exit status 3 "
        "when it lists a dead message (as `outbox status`), 0 when none, 2 for an unknown "
        "--before.",
    )
    add_db_flag(dead)
    dead.add_argument(
        "--status", choices=sorted(KINDS), default="both", help="which ones (default both)"
    )
    dead.add_argument("--topic", help="only this topic")
    dead.add_argument(
        "--limit", type=PAGE, default=20, help=f"messages per page ({PAGE.range}, default 20)"
    )
    dead.add_argument("--before", type=msg_id, metavar="MSG_ID", help="the page after this message")
    dead.add_argument("--json", action="store_true", help="one JSON document")
    dead.add_argument(
        "--consumer",
        metavar="NAME",
        help="list this consumer's dead letters instead (its inbox: messages its handler "
        "failed past their attempts), newest first",
    )


def add_show(commands: Commands) -> None:
    show = commands.add_parser(
        "show",
        help="print one message: status, attempts, last error, headers, payload",
        description="Print one message's row: status, topic, key, tags, attempts, times "
        "(deliver_at: a scheduled message's due time), "
        "last error, headers and the start of its payload. " + HISTORY.capitalize() + ".",
        epilog="An unknown msg_id is bad usage (exit status 2). Text is printed with control "
        "characters escaped; a payload that is not UTF-8 is printed as escaped bytes "
        "(base64 in --json).",
    )
    add_db_flag(show)
    show.add_argument("msg_id", type=msg_id, metavar="MSG_ID", help="the message's msg_id")
    show.add_argument(
        "--bytes",
        type=SHOWN_BYTES,
        default=PREVIEW_BYTES,
        help=f"payload bytes to print ({SHOWN_BYTES.range}, default {PREVIEW_BYTES})",
    )
    show.add_argument("--full", action="store_true", help="print the whole payload")
    show.add_argument("--json", action="store_true", help="one JSON document")


def add_skip(commands: Commands) -> None:
    skip = commands.add_parser(
        "skip",
        help="give messages up: dead or pending ones become skipped, releasing their keys",
        description="Mark messages skipped: an operator gave them up; they are not published "
        "(again) and not expected at the broker. A dead ordered message blocks its key "
        "(`outbox status` lists blocked keys): skipping it lets the key's next message go. "
        "A sent message is never skipped. A skip waits for a relay holding the row.",
        epilog="Prints what it did per msg_id: skipped, already sent (left alone), already "
        "skipped, unknown. Exit status 2 when a msg_id is unknown (the others are still "
        "skipped), 0 otherwise. A pending message may be on its way to the broker as you skip "
        "it; `outbox requeue --id MSG_ID` puts a skipped message back.",
    )
    add_db_flag(skip)
    skip.add_argument(
        "msg_ids", nargs="+", type=msg_id, metavar="MSG_ID", help="the messages to give up"
    )
    skip.add_argument("--json", action="store_true", help="one JSON document")


def cmd_dead(args: argparse.Namespace) -> int:
    if args.consumer is not None:
        return dead_letters(args)
    with operator_on(args) as operator:
        now, rows, _ = operator.dead(
            KINDS[args.status], args.topic, args.limit, args.before, field="--before"
        )
    more = str(rows[-1].msg_id) if len(rows) == args.limit else None
    if args.json:
        listed = [failure_json(r, now) for r in rows]
        print(json.dumps({"now": now.isoformat(), "messages": listed, "next_before": more}))
    else:
        print_failures(rows, now, more)
    return EXIT_DATA if any(r.status == DEAD for r in rows) else EXIT_OK


def dead_letters(args: argparse.Namespace) -> int:
    """`outbox dead --consumer NAME`: the consumer's dead letters, exit 3 when there are."""
    with operator_on(args) as operator:
        now, rows = operator.dead_letters(args.consumer, args.topic, args.limit)
    if args.json:
        listed = [{"msg_id": str(r.msg_id), "topic": r.topic, "attempts": r.attempts,
                   "created_at": r.created_at.isoformat(), "last_error": r.last_error}
                  for r in rows]  # fmt: skip
        print(json.dumps({"now": now.isoformat(), "consumer": args.consumer, "messages": listed}))
    elif not rows:
        print(f"no dead letters of consumer {safe(args.consumer)}")
    else:
        table = [["msg_id", "topic", "attempts", "age", "last_error"]]
        table += [[str(r.msg_id), safe(r.topic), str(r.attempts),
                   duration((now - r.created_at).total_seconds()), error_cell(r.last_error or "")]
                  for r in rows]  # fmt: skip
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
        for row in table:
            print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
    return EXIT_DATA if rows else EXIT_OK


def print_failures(rows: Sequence[Failure], now: datetime, more: str | None) -> None:
    if not rows:
        print("no dead or failing messages")
        return
    header = ["msg_id", "status", "topic", "key", "seq", "attempts", "age", "last_error"]
    table = [
        [
            str(r.msg_id),
            r.status,
            safe(r.topic),
            "-" if r.key is None else safe(r.key),
            "-" if r.seq is None else str(r.seq),
            str(r.attempts),
            duration((now - r.created_at).total_seconds()),
            blocks(r) + error_cell(r.last_error or ""),
        ]
        for r in rows
    ]
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(header)]
    for row in [header, *table]:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
    if more:
        print(f"more: --before {more}")


def blocks(row: Failure) -> str:
    """A dead ordered head holds its key: said before its error."""
    if row.blocks_behind is None:
        return ""
    return f"[blocks key {safe(row.key or '')} ({row.blocks_behind} behind)] "


def error_cell(text: str) -> str:
    """The whole error in one line, escaped, then cut (an escape may lengthen it)."""
    return one_line(safe(one_line(text, every_line=True)), ERROR_CHARS)


def cmd_show(args: argparse.Namespace) -> int:
    with operator_on(args) as operator:
        row = operator.show(args.msg_id, None if args.full else args.bytes, field="MSG_ID")
    if args.json:
        print(json.dumps(message_json(row)))
    else:
        print_message(row)
    return EXIT_OK


def message_json(row: dict[str, Any]) -> dict[str, Any]:
    payload = bytes(row["payload"])
    text = utf8(payload, len(payload) < row["size"])
    if text is not None:
        preview, encoding = text, "utf-8"
    else:
        preview, encoding = base64.b64encode(payload).decode(), "base64"
    times = ("created_at", "deliver_at", "next_attempt_at", "sent_at")
    shown = {k: v.isoformat() if k in times and v else v for k, v in row.items()}
    del shown["id"], shown["payload"], shown["size"]
    return {
        **shown,
        "msg_id": str(row["msg_id"]),
        "payload_bytes": row["size"],
        "payload_preview": preview,
        "payload_encoding": encoding,
        "payload_cut": len(payload) < row["size"],
        "history": HISTORY,
    }


def print_message(row: dict[str, Any]) -> None:
    fields = ("msg_id", "status", "topic", "key", "seq", "tags", "attempts", "created_at",
              "deliver_at", "next_attempt_at", "sent_at", "receipt", "last_error")  # fmt: skip
    for name in fields:
        value = row[name]
        print(f"{name + ':':<16} {'-' if value is None else safe(str(value))}")
    headers = row["headers"]
    if isinstance(headers, dict) and headers:
        print("headers:")
        for name, value in headers.items():
            print(f"  {safe(str(name))}: {safe(str(value))}")
    else:
        print(f"{'headers:':<16} {'-' if not headers else safe(json.dumps(headers))}")
    payload = bytes(row["payload"])
    cut = len(payload) < row["size"]
    print(f"payload: {row['size']} bytes" + (f", the first {len(payload)} shown" if cut else ""))
    print(payload_text(payload, cut))
    print(f"history: {HISTORY}")


def cmd_skip(args: argparse.Namespace) -> int:
    ids = list(dict.fromkeys(args.msg_ids))  # each once, in the order given
    with operator_on(args) as operator:
        outcomes = operator.skip(ids)  # one transaction: the keys are released together
    if args.json:
        print(json.dumps({"messages": [skip_json(o) for o in outcomes]}))
    else:
        for outcome in outcomes:
            print(skip_line(outcome))
    for outcome in outcomes:
        if (warning := released(outcome)) is not None:
            print(f"warning: {warning}", file=sys.stderr)
    return EXIT_USAGE if any(o.outcome == "unknown" for o in outcomes) else EXIT_OK


SKIP_SAYS = {
    "already_sent": "left alone: it reached the broker; a sent message is never skipped",
    "already_skipped": "nothing to do",
    "unknown": "no such message: a typo, or purged by retention",
}


def skip_line(outcome: SkipOutcome) -> str:
    said = outcome.outcome.replace("_", " ")
    if outcome.outcome != "skipped":
        return f"{outcome.msg_id}  {said} ({SKIP_SAYS[outcome.outcome]})"
    where = f"topic {safe(outcome.topic or '')}"
    if outcome.seq is not None:
        where += f", key {safe(outcome.key or '')}, seq {outcome.seq}"
    note = ": a relay may be publishing it right now" if outcome.was == PENDING else ""
    return f"{outcome.msg_id}  skipped (was {outcome.was}{note}; {where})"


def released(outcome: SkipOutcome) -> str | None:
    """The warning for a skipped ordered message: its key goes on without it."""
    if outcome.outcome != "skipped" or outcome.seq is None:
        return None
    key = f"key {safe(outcome.key or '')} of topic {safe(outcome.topic or '')}"
    if outcome.held_by_earlier:
        return f"{key}: seq {outcome.seq} skipped; an earlier message still holds the key"
    return f"{key} released: its next message goes now (seq {outcome.seq} will not be delivered)"


def skip_json(outcome: SkipOutcome) -> dict[str, Any]:
    shown = outcome._asdict()
    held = shown.pop("held_by_earlier")
    ordered = outcome.outcome == "skipped" and outcome.seq is not None
    return {**shown, "key_released": (not held) if ordered else None}


PARSERS = (add_dead, add_show, add_skip)
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "dead": cmd_dead,
    "show": cmd_show,
    "skip": cmd_skip,
}
