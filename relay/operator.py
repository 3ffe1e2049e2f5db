"""The operator's service: what a person reads of the outbox and does to its messages.

Both faces call it and only present what it answers: the ``outbox`` command (status,
dead, show, requeue, skip, a drain's summary of what it left) and the dashboard (the
overview, the dead letters, a message, its requeue, skip and delete buttons, the
blocked keys). So the rules are written once: which statuses an action takes, how a
failing message is told from a dead one, how a msg_id is read, which msg_id is
unknown. Neither face imports relay.store; this module is their way to it.

An ``Operator`` reads through ``reading`` connections and acts in ``writing``
transactions: an engine's own by default; the dashboard passes its Database's, which
tell an outage apart. Bad input raises outbox.errors exceptions naming the field it
came from (a flag, a parameter), so each face says it in its own words.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from sqlalchemy import Connection, Engine

from outbox import partitions
from outbox.dialects import dialect_for
from outbox.errors import InvalidMsgId, UnknownMessage
from outbox.table import DEAD, PENDING, outbox_message
from relay import store
from relay.store import inbox as inbox_store

READ_TIMEOUT_S = 60.0  # an operator's read (a command, a dashboard page) waits this long at most
STUCK_AFTER_S = store.STUCK_AFTER_S  # stuck, unless a command asks for another SLA
REQUEUE_BATCH = store.REQUEUE_BATCH  # rows per requeue transaction
FAILING = store.FAILING  # not a status: a pending message whose attempts failed
KINDS = {"dead": (DEAD,), "failing": (FAILING,), "both": (DEAD, FAILING)}
# What an operator may do to a message, by its status: a dead letter may be retried,
# given up or thrown away; a pending one only given up (a relay may hold it); none else.
ACTIONS_OF: dict[str, tuple[str, ...]] = {DEAD: ("requeue", "skip", "delete"), PENDING: ("skip",)}

# The store's rows, as the faces receive them.
Backlog = store.Backlog
BlockedKey = store.BlockedKey
Failure = store.Failure
Minute = store.Minute
Overtaken = store.Overtaken
SkipOutcome = store.SkipOutcome
Opening = Callable[[], AbstractContextManager[Connection]]


def parse_msg_id(text: str, field: str) -> str:
    """A msg_id's canonical text; InvalidMsgId naming ``field`` when it is not a UUID."""
    try:
        return str(uuid.UUID(text))
    except ValueError:
        raise InvalidMsgId(field, text) from None


def actions_for(status: str) -> tuple[str, ...]:
    """The actions a message of ``status`` takes (ACTIONS_OF)."""
    return ACTIONS_OF.get(status, ())


class Status(NamedTuple):
    """The outbox's state by the database clock ``now``: the backlog per topic (pending,
    stuck, blocked, oldest pending, scheduled, dead), the settled rows per topic (when
    asked) and the blocked keys, the oldest head first."""

    now: datetime
    backlog: list[store.Backlog]
    settled: dict[str, dict[str, int]]
    blocked: list[store.BlockedKey]


class Activity(NamedTuple):
    """The overview's figures: the backlog, the sends per topic since ``since`` and per
    minute (``capped``: counted from the latest sends only)."""

    now: datetime
    backlog: list[store.Backlog]
    sent: dict[str, int]
    minutes: list[store.Minute]
    capped: bool


class DeadPage(NamedTuple):
    """A page of dead (and failing) messages, newest first; ``previews``: the start of
    each payload and its length, by row id (when asked)."""

    now: datetime
    rows: list[store.Failure]
    previews: dict[int, tuple[bytes, int]]


class RequeuePlan(NamedTuple):
    """What a requeue would take now, before it changes anything: how many rows, and the
    ordered messages named that a later message of their key overtook (requeued, they
    arrive out of order)."""

    total: int
    overtaken: list[store.Overtaken]


class Purged(NamedTuple):
    """A retention pass: how many settled rows it deleted, all older than ``older_than``
    (the database clock when the pass began, less the retention)."""

    rows: int
    older_than: datetime
    # A partitioned table (outbox.partitions): the day partitions dropped (their rows are
    # in ``rows``), the rows they held that retention keeps, moved to the default one.
    partitions: tuple[str, ...] = ()
    kept: int = 0


class Outcome(NamedTuple):
    """An action on one message: whether it was done, and what happened, in words."""

    done: bool
    said: str


class Operator:
    """The operator's reads and actions on one database."""

    def __init__(
        self, engine: Engine, reading: Opening | None = None, writing: Opening | None = None
    ) -> None:
        self.engine = engine
        self.reading = reading or engine.connect
        self.writing = writing or engine.begin

    # Reading

    def status(
        self, sla_s: float = STUCK_AFTER_S, blocked_limit: int = 20, settled: bool = True
    ) -> Status:
        """The backlog per topic (store.backlog_by_topic, as the gauges count it), the
        settled rows per topic unless ``settled`` is False, and up to ``blocked_limit``
        blocked keys."""
        with self.reading() as conn:
            now = store.db_clock(conn)
            backlog = store.backlog_by_topic(conn, now, sla_s)
            done = store.settled_by_topic(conn, now) if settled else {}
            blocked = store.dead_heads(conn, blocked_limit)
        return Status(now, backlog, done, blocked)

    def activity(self, since: timedelta, minutes: int, chart_rows: int) -> Activity:
        """The backlog, the sends per topic of the last ``since``, and the sends of the
        last ``minutes`` minutes (this one included) per minute with their commit->ack
        percentiles: by the database on PostgreSQL, elsewhere from the latest
        ``chart_rows`` sends."""
        with self.reading() as conn:
            now = store.db_clock(conn)
            backlog = store.backlog_by_topic(conn, now)
            sent = store.sent_by_topic(conn, now - since)
            first = now.replace(second=0, microsecond=0) - timedelta(minutes=minutes - 1)
            per, capped = per_minute(conn, first, chart_rows)
        return Activity(now, backlog, sent, per, capped)

    def due_count(self) -> int:
        """The pending messages a drain publishes: all of them but those scheduled for later."""
        with self.reading() as conn:
            return store.pending_count(conn) - store.scheduled_count(conn)

    def dead(
        self,
        kinds: Sequence[str],
        topic: str | None,
        limit: int,
        before: str | None = None,
        before_id: int | None = None,
        field: str = "before",
        preview_bytes: int | None = None,
    ) -> DeadPage:
        """Up to ``limit`` dead (DEAD) and/or failing (FAILING) messages, newest first,
        those before the message ``before`` (UnknownMessage naming ``field`` when no row
        has it) or the row id ``before_id``. A failing row's status reads FAILING."""
        with self.reading() as conn:
            now = store.db_clock(conn)
            if before is not None:
                before_id = store.row_id_of(conn, before)
                if before_id is None:
                    raise UnknownMessage(field, [before])
            rows = [shown(r) for r in store.failures(conn, kinds, topic, limit, before_id)]
            previews = {}
            if preview_bytes is not None:
                previews = store.payload_previews(conn, [r.id for r in rows], preview_bytes)
        return DeadPage(now, rows, previews)

    def show(self, msg_id: str, preview_bytes: int | None, field: str = "msg_id") -> dict[str, Any]:
        """One message's row (store.message: its columns, ``payload`` cut to
        ``preview_bytes`` unless None, ``size`` its length); UnknownMessage naming ``field``
        when no row has it."""
        with self.reading() as conn:
            row = store.message(conn, msg_id, preview_bytes)
        if row is None:
            raise UnknownMessage(field, [msg_id])
        return row

    def blocked_keys(self, limit: int) -> tuple[datetime, list[store.BlockedKey]]:
        """The database clock, and up to ``limit`` keys held by a dead head, oldest first."""
        with self.reading() as conn:
            return store.db_clock(conn), store.dead_heads(conn, limit)

    # Acting

    def requeue_plan(
        self, dead_only: bool, topic: str | None, msg_ids: Sequence[str], field: str = "msg_id"
    ) -> RequeuePlan:
        """What ``requeue`` would take; UnknownMessage naming ``field`` when a msg_id has
        no row (nothing is changed)."""
        with self.reading() as conn:
            unknown = store.unknown_ids(conn, msg_ids) if msg_ids else []
            if unknown:
                raise UnknownMessage(field, unknown)
            overtaken = store.overtaken(conn, msg_ids) if msg_ids else []
            return RequeuePlan(store.requeue_count(conn, dead_only, topic, msg_ids), overtaken)

    def requeue(
        self,
        dead_only: bool,
        topic: str | None,
        msg_ids: Sequence[str],
        on_batch: Callable[[int], None] | None = None,
    ) -> int:
        """Put messages back to pending, attempts reset: the dead ones (of ``topic``, of
        ``msg_ids``), or, when ``msg_ids`` name them without ``dead_only``, those and sent
        ones too; never a pending or canceled one. Batch by batch, each its own
        transaction (``on_batch`` told each one's count): stopped halfway, whole batches
        are requeued and running it again takes the rest. How many it requeued."""
        count, after = 0, 0
        while True:
            with self.writing() as conn:
                done, last = store.requeue_batch(conn, dead_only, topic, msg_ids, after)
            if last is None:
                return count
            count, after = count + done, last
            if on_batch is not None:
                on_batch(done)

    def skip(self, msg_ids: Sequence[str]) -> list[store.SkipOutcome]:
        """Give messages up: the pending or dead ones become skipped, in one transaction
        (their keys are released together); an outcome per msg_id, in the order given."""
        with self.writing() as conn:
            return store.skip(conn, msg_ids)

    def delete(self, msg_id: str) -> bool:
        """Delete a dead message's row; whether it was dead (any other is left alone)."""
        with self.writing() as conn:
            return store.delete_dead(conn, msg_id)

    def purge(
        self, retention_s: float, batch: int, on_batch: Callable[[int], None] | None = None
    ) -> Purged:
        """One retention pass: delete the sent messages sent, and the canceled ones
        written, more than ``retention_s`` ago by the database clock when the pass begins
        (never a pending, dead or skipped one), ``batch`` rows per transaction
        (``on_batch`` told each one's count) until none is left. The workers' retention
        job (relay.sweep.sweeper.Sweeper.purge) and ``outbox purge`` both run it.

        On a partitioned table the days ahead are made first, the days wholly older than
        the retention are dropped (their rows to keep moved aside), and the batched
        delete takes only the default partition's rows (outbox.partitions)."""
        with self.reading() as conn:
            older_than = store.db_clock(conn) - timedelta(seconds=retention_s)
            partitioned = partitions.is_partitioned(conn)
        table = partitions.default_table() if partitioned else outbox_message
        partitions.ensure(self.engine)
        days = partitions.drop_expired(self.engine, older_than)
        if days.rows and on_batch is not None:
            on_batch(days.rows)
        purged = days.rows
        while True:
            with self.writing() as conn:
                deleted = store.purge_sent(conn, older_than, batch, table)
            purged += deleted
            if deleted and on_batch is not None:
                on_batch(deleted)
            if deleted < batch:
                return Purged(purged, older_than, tuple(days.partitions), days.kept)

    # The consumers' inboxes (outbox.inbox.Inbox)

    def dead_letters(
        self, consumer: str, topic: str | None, limit: int
    ) -> tuple[datetime, list[inbox_store.DeadLetter]]:
        """A consumer's dead letters, newest first, and the database clock."""
        with self.reading() as conn:
            return store.db_clock(conn), inbox_store.dead_letters(conn, consumer, topic, limit)

    def consumers(self) -> dict[str, dict[str, int]]:
        """Each consumer's inbox rows by status (handled within its window, dead, requeued)."""
        with self.reading() as conn:
            return inbox_store.consumers(conn)

    def requeue_dead_letters(self, consumer: str, topic: str | None, msg_ids: Sequence[str]) -> int:
        """Give a consumer's dead letters back (its runner runs them again); how many."""
        ids = [uuid.UUID(m) for m in msg_ids]
        with self.writing() as conn:
            return inbox_store.requeue_dead_letters(conn, consumer, topic, ids)

    def act(self, action: str, msg_id: str) -> Outcome:
        """One message's ``requeue`` (a dead one), ``skip`` (a dead or pending one) or
        ``delete`` (a dead one), as the dashboard's buttons do it."""
        if action == "requeue":
            done = self.requeue(True, None, [msg_id]) == 1
            return Outcome(
                done, "requeued: pending again" if done else "not requeued: it is not dead"
            )
        if action == "skip":
            [outcome] = self.skip([msg_id])
            return Outcome(outcome.outcome == "skipped", outcome.outcome.replace("_", " "))
        if action == "delete":
            done = self.delete(msg_id)
            return Outcome(done, "deleted" if done else "not deleted: it is not dead")
        raise ValueError(f"no action {action!r}: {', '.join(ACTIONS_OF[DEAD])}")


def shown(row: store.Failure) -> store.Failure:
    """A failure as an operator reads it: dead, or failing (pending with failed attempts)."""
    return row if row.status == DEAD else row._replace(status=FAILING)


def per_minute(conn: Connection, since: datetime, most: int) -> tuple[list[store.Minute], bool]:
    """Sends per minute from ``since`` and their latency percentiles: by the database on
    PostgreSQL; elsewhere from the latest ``most`` sends (True: capped there)."""
    if dialect_for(conn).percentiles_in_sql:
        return store.sent_per_minute_pg(conn, since), False
    times = store.sent_times(conn, since, most)
    latencies: dict[datetime, list[float]] = {}
    for created, sent in times:
        minute = sent.replace(second=0, microsecond=0)
        latencies.setdefault(minute, []).append((sent - created).total_seconds() * 1000)
    minutes = [
        store.Minute(m, len(v), percentile(v, 0.5), percentile(v, 0.99))
        for m, v in latencies.items()
    ]
    return minutes, len(times) >= most


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank percentile; None for a minute without sends (a gap in the line)."""
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[max(math.ceil(q * len(ordered)) - 1, 0)], 1)
