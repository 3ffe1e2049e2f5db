"""`outbox migrate`, `outbox status`, `outbox requeue`: the outbox tables and their rows."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Engine

from outbox import migrate, partitions
from outbox.secrets import mask_url
from relay.cli.app import add_app_flag
from relay.cli.common import (
    EXIT_DEAD,
    EXIT_OK,
    Commands,
    UsageError,
    add_db_flag,
    database,
    msg_id,
    operator_on,
)
from relay.cli.progress import counting
from relay.display import duration, safe
from relay.operator import REQUEUE_BATCH, STUCK_AFTER_S, Backlog, BlockedKey, Operator, Overtaken
from spark_jobs.flags import SLA_SECONDS, bounded_int

BLOCKED_LISTED = 20  # blocked keys `outbox status` lists; the rest are counted
BLOCKED_LIMIT = bounded_int(1, 10_000)  # --blocked-limit: a page, not the whole table
COUNTS = ("pending", "stuck", "blocked", "dead", "skipped", "blocked_keys", "scheduled",
          "canceled", "sent_1m", "sent_1h")  # fmt: skip
SETTLED = ("skipped", "canceled", "sent_1m", "sent_1h")  # the settled counts of Status
# The table's columns; next_due is shown as "in 12s" (--json: an ISO time and next_due_in_s).
HEADER = ("topic", "pending", "stuck", "blocked", "oldest_pending_age_s", "dead", "skipped",
          "blocked_keys", "scheduled", "next_due", "canceled", "sent_1m", "sent_1h")  # fmt: skip
SLA_S = STUCK_AFTER_S  # `outbox reconcile --sla`'s default: the same rows are stuck in both


def add_migrate(commands: Commands) -> None:
    mig = commands.add_parser(
        "migrate",
        help="create or upgrade the outbox tables (idempotent)",
        description="Upgrade the outbox tables to the newest schema. Safe to run again. "
        "Model B's table (outbox_transaction_record) is made only with --model-b; a "
        "database that has it already keeps it, upgraded.",
    )
    add_db_flag(mig)
    add_app_flag(mig, "take --db and the settings from the app's own Outbox (an Outbox, or "
                 "a callable returning one), e.g. myshop.outbox:ob; flags still win")  # fmt: skip
    mig.add_argument("--revision", default="head", help="target revision (default: head)")
    mig.add_argument(
        "--model-b",
        action="store_true",
        help="also create or upgrade model B's table (its own branch, `modelb`)",
    )
    mig.add_argument("--sql", action="store_true", help="print the SQL instead of running it")
    layout = mig.add_mutually_exclusive_group()
    layout.add_argument(
        "--partitioned",
        action="store_true",
        help="PostgreSQL: partition outbox_message by day so retention drops whole days "
        "(for high volume; an existing table is converted while senders go on)",
    )
    layout.add_argument(
        "--unpartitioned",
        action="store_true",
        help="PostgreSQL: turn a partitioned outbox_message back into one table",
    )


def add_status(commands: Commands) -> None:
    st = commands.add_parser(
        "status",
        help="pending, stuck, blocked, oldest pending age, dead, scheduled, next due and "
        "recently sent, per topic; blocked keys",
        description="Show the outbox's state per topic, and the keys blocked by a dead "
        "ordered message (its key's later messages wait for `outbox requeue` or `outbox "
        "skip`), oldest first. Pending counts every message due and not yet sent, stuck "
        "and blocked ones included; stuck: those due for longer than --sla seconds "
        "(`outbox reconcile` calls the same rows stuck); blocked: those behind a dead "
        "message of their ordered key. Scheduled ones (their deliver_at still to come, by "
        "the database clock) are counted apart, with the next due time. The dashboard and "
        "the outbox_*_messages gauges count the same way. Exit status 3 when dead messages "
        "exist.",
    )
    add_db_flag(st)
    st.add_argument(
        "--sla",
        type=SLA_SECONDS,
        default=SLA_S,
        metavar="SECONDS",
        help=f"seconds a due message may wait before it is stuck ({SLA_SECONDS.range}, "
        f"default {SLA_S:g}, as `outbox reconcile --sla`)",
    )
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.add_argument(
        "--blocked-limit",
        type=BLOCKED_LIMIT,
        default=BLOCKED_LISTED,
        metavar="N",
        help=f"blocked keys to list at most ({BLOCKED_LIMIT.range}, default {BLOCKED_LISTED}; "
        "the rest are counted)",
    )


def add_requeue(commands: Commands) -> None:
    req = commands.add_parser(
        "requeue",
        help="put dead (or selected) messages back to pending, attempts reset",
        description="Requeue messages for the sweeper. Give at least one of --dead, --topic, --id. "
        "Only dead rows are requeued, except rows named by --id (sent ones are then republished).",
    )
    add_db_flag(req)
    req.add_argument("--dead", action="store_true", help="only dead messages")
    req.add_argument("--topic", help="only this topic")
    req.add_argument(
        "--id",
        dest="ids",
        nargs="+",
        action="extend",  # --id A --id B takes both (the last one alone before)
        type=msg_id,
        default=[],
        metavar="MSG_ID",
        help="these msg_ids",
    )
    req.add_argument("--json", action="store_true", help='print {"requeued": N} on stdout instead')
    req.add_argument(
        "--consumer",
        metavar="NAME",
        help="requeue this consumer's dead letters (its inbox, outbox_inbox) instead: its "
        "`outbox consume` runs them again from the table",
    )


def cmd_migrate(args: argparse.Namespace) -> int:
    if args.model_b and args.revision != "head":
        raise UsageError("--model-b upgrades both branches to their heads: leave out --revision")
    layout = args.partitioned or args.unpartitioned
    if layout and (args.sql or args.revision != "head"):
        raise UsageError(
            "--partitioned and --unpartitioned run at head: leave out --sql and --revision"
        )
    if args.sql:
        migrate.upgrade_sql(args.db, args.revision, model_b=args.model_b)
        return EXIT_OK
    engine = database(args)
    try:
        before = migrate.upgrade(engine, args.revision, model_b=args.model_b)
        if args.revision == "head":  # at head, yet columns missing: say so
            migrate.require_schema(engine, model_b=args.model_b)
        after = migrate.current_revision(engine)
        print(f"outbox schema {migrated(before, after)} in {mask_url(args.db)}")
        if layout:
            print(relaid(engine, args.partitioned))
    finally:
        engine.dispose()
    return EXIT_OK


def relaid(engine: Engine, partitioned: bool) -> str:
    """Convert outbox_message to the layout asked for, with progress while it copies."""
    try:
        with counting("copy") as progress:
            done = partitions.convert(engine, partitioned, on_batch=progress.add)
    except partitions.PartitionError as exc:
        raise UsageError(str(exc)) from exc
    if partitioned:
        partitions.ensure(engine)
    name = "partitioned by day" if partitioned else "one table, unpartitioned"
    if not done.changed and not done.copied:
        return f"outbox_message is already {name}"
    return (f"outbox_message is now {name}: {done.moved} pending or dead message(s) moved "
            f"at once, {done.copied} settled one(s) copied after")  # fmt: skip


def migrated(before: str | None, after: str | None) -> str:
    """``upgraded 0001 -> 0003`` or ``already at 0003``, as Alembic users expect to read."""
    if before == after:
        return f"already at {after or 'none'}"
    return f"upgraded {before or 'none'} -> {after}"


def cmd_status(args: argparse.Namespace) -> int:
    with operator_on(args) as operator:
        now, backlog, settled, blocked = operator.status(args.sla, args.blocked_limit)
    topics = status_rows(backlog, settled)
    dues = [row["next_due"] for row in topics if row["next_due"] is not None]
    for row in topics:
        oldest = row.pop("oldest_pending")
        row["oldest_pending_age_s"] = round(age_seconds(now, oldest), 3) if oldest else None
        row.update(next_due_json(row.pop("next_due"), now))
    totals: dict[str, Any] = {k: sum(r[k] for r in topics) for k in COUNTS}
    ages = [r["oldest_pending_age_s"] for r in topics if r["oldest_pending_age_s"] is not None]
    totals["oldest_pending_age_s"] = max(ages) if ages else None
    totals.update(next_due_json(min(dues, default=None), now))
    keys = [blocked_json(key, now) for key in blocked]
    more = max(0, totals["blocked_keys"] - len(keys))  # a key blocked since the list: 0
    if args.json:
        report = {"now": now.isoformat(), "total": totals, "topics": topics,
                  "blocked_keys": keys, "blocked_keys_more": more}  # fmt: skip
        print(json.dumps(report, default=str))
    else:
        print_status(topics, totals)
        print_blocked(keys, more)
    return EXIT_DEAD if totals["dead"] else EXIT_OK


def status_rows(backlog: list[Backlog], settled: dict[str, dict[str, int]]) -> list[dict[str, Any]]:
    """A row per topic, by topic: its backlog (the figures the dashboard and the gauges
    show too) and its settled rows (0 where it has none)."""
    by_topic = {row.topic: row._asdict() for row in backlog}
    empty = Backlog("", 0, 0, 0, None, 0, 0, 0, None)._asdict()
    rows = []
    for topic in sorted(by_topic.keys() | settled.keys()):
        row = by_topic.get(topic) or empty | {"topic": topic}
        rows.append(row | settled.get(topic, dict.fromkeys(SETTLED, 0)))
    return rows


def next_due_json(due: datetime | None, now: datetime) -> dict[str, Any]:
    """The earliest deliver_at of a topic's scheduled messages: an ISO time, and the seconds
    until it by the database clock (``now``)."""
    if due is None:
        return {"next_due": None, "next_due_in_s": None}
    return {"next_due": due.isoformat(), "next_due_in_s": round((due - now).total_seconds(), 3)}


def blocked_json(key: BlockedKey, now: datetime) -> dict[str, Any]:
    return {
        "topic": key.topic,
        "key": key.key,
        "head_msg_id": str(key.msg_id),
        "seq": key.seq,
        "behind": key.behind,
        "head_age_s": round(age_seconds(now, key.created_at), 3),
    }


def age_seconds(now: datetime, then: datetime) -> float:
    """Seconds from ``then`` to ``now``; 0 for a time to come (a row waiting out a backoff)."""
    if then.tzinfo is None:
        then = then.replace(tzinfo=now.tzinfo)
    return max(0.0, (now - then).total_seconds())


def print_status(topics: list[dict[str, Any]], totals: dict[str, Any]) -> None:
    rows = [[safe(r["topic"]), *status_row(r, HEADER[1:])] for r in topics]
    rows.append(["TOTAL", *status_row(totals, HEADER[1:])])
    print_table(HEADER, rows)


def status_row(data: dict[str, Any], columns: Sequence[str]) -> list[str]:
    """A table row's cells: "-" for nothing, next_due as "in 12s"."""
    cells = []
    for name in columns:
        value = data.get(name)
        if name == "next_due" and value is not None:
            value = "in " + duration(data["next_due_in_s"])
        cells.append("-" if value is None else str(value))
    return cells


def print_blocked(keys: list[dict[str, Any]], more: int) -> None:
    """The blocked keys, oldest head first: what `outbox requeue` or `outbox skip` frees."""
    if not keys:
        return
    print()
    print("blocked keys (head dead; `outbox requeue --id MSG_ID` retries it, `outbox skip "
          "MSG_ID` gives it up):")  # fmt: skip
    header = ("topic", "key", "head_msg_id", "seq", "behind", "age")
    print_table(header, [blocked_row(k) for k in keys])
    if more:
        print(f"... and {more} more (--blocked-limit)")


def blocked_row(key: dict[str, Any]) -> list[str]:
    age = duration(key["head_age_s"])
    return [safe(key["topic"]), safe(key["key"]), key["head_msg_id"], str(key["seq"]),
            str(key["behind"]), age]  # fmt: skip


def print_table(header: Sequence[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip())
    for row in rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())


def cmd_requeue(args: argparse.Namespace) -> int:
    if not (args.dead or args.topic or args.ids):
        raise UsageError("give --dead, --topic or --id (refusing to requeue everything)")
    if args.consumer is not None:
        return requeue_dead_letters(args)
    with operator_on(args) as operator:
        total, overtaken = operator.requeue_plan(args.dead, args.topic, args.ids, "--id")
        warn_overtaken(overtaken)  # nothing changed yet (an unknown --id: exit 2 before)
        count = requeue_in_batches(operator, args, total)
    print(json.dumps({"requeued": count}) if args.json else f"requeued {count} message(s)")
    return EXIT_OK


def requeue_dead_letters(args: argparse.Namespace) -> int:
    with operator_on(args) as operator:
        count = operator.requeue_dead_letters(args.consumer, args.topic, args.ids)
    if args.json:
        print(json.dumps({"requeued": count}))
    else:
        print(f"requeued {count} dead letter(s) of consumer {safe(args.consumer)}")
    return EXIT_OK


def requeue_in_batches(operator: Operator, args: argparse.Namespace, total: int) -> int:
    """Requeue batch by batch, each its own transaction (Operator.requeue), with progress
    on stderr when there is more than one batch."""
    with counting("requeue", total, visible=total > REQUEUE_BATCH) as shown:
        return operator.requeue(args.dead, args.topic, args.ids, on_batch=shown.add)


def warn_overtaken(overtaken: list[Overtaken]) -> None:
    """An ordered message named by --id whose key went on without it (it was skipped, or
    sent and is republished) arrives after the key's later messages: say so, on stderr."""
    for row in overtaken:
        print(
            f"warning: {row.msg_id} is seq {row.seq} of key {safe(row.key)!r} of topic "
            f"{safe(row.topic)}, "
            f"which delivered seq {row.delivered_seq} already: requeued, it arrives out of "
            "order (and `outbox reconcile` counts it so)",
            file=sys.stderr,
        )


PARSERS = (add_migrate, add_status, add_requeue)
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "migrate": cmd_migrate,
    "status": cmd_status,
    "requeue": cmd_requeue,
}
