"""An ordered key's rules, in one place: which row is its key's head, which keys are
blocked behind a dead message, which rows wait behind another.

A key's rows go out in seq order: a row may be published only when no earlier row of
its (topic, key) is unsettled (pending or dead; sent and skipped ones are settled).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    BigInteger,
    Connection,
    Select,
    String,
    and_,
    func,
    or_,
    select,
)

from outbox.dialects import Dialect, dialect_for
from outbox.table import DEAD, PENDING, outbox_message

t = outbox_message

# The statuses that hold an ordered key: a message not settled yet (sent or skipped are).
UNSETTLED = (PENDING, DEAD)


Head = tuple[str, str, int]  # (topic, key, seq) of an ordered message


def unsettled_before(
    topic: Any, key: Any, seq: Any, rows: Any = t, statuses: tuple[str, ...] = UNSETTLED
) -> Any:
    """The rows of ``rows`` that an ordered message at (topic, key, seq) waits for: those
    of its key with a lower seq that are unsettled (or in ``statuses``: dead ones alone
    say it is blocked). Each of topic, key and seq is a value or a column (a correlated
    subquery, PostgreSQL's heads as arrays).

    A short range of ix_outbox_message_key_seq (topic, key, status, seq): the key's
    retained sent rows are never read.
    """
    return _of_key(rows, topic, key, statuses, rows.c.seq < seq)


def unsettled_after(topic: Any, key: Any, seq: Any, rows: Any = t) -> Any:
    """The rows of ``rows`` that wait for an ordered message at (topic, key, seq): those of
    its key with a higher seq, unsettled (the same index range, the other way)."""
    return _of_key(rows, topic, key, UNSETTLED, rows.c.seq > seq)


def _of_key(rows: Any, topic: Any, key: Any, statuses: tuple[str, ...], seqs: Any) -> Any:
    status = rows.c.status == statuses[0] if len(statuses) == 1 else rows.c.status.in_(statuses)
    return and_(
        rows.c.topic == topic,
        rows.c.key == key,
        status,
        rows.c.seq.is_not(None),  # the index's own condition
        seqs,
    )


def is_head(row: Any = t) -> Any:
    """Whether an ordered row may be published: no earlier row of its (topic, key) is
    pending or dead (the others are sent, skipped or purged). Unordered rows always may.
    """
    prior = t.alias("prior")
    earlier = (
        select(prior.c.id)
        .where(unsettled_before(row.c.topic, row.c.key, row.c.seq, prior))
        .correlate(row)
    )
    return or_(row.c.seq.is_(None), ~earlier.exists())


def still_heads(conn: Connection, row_ids: Sequence[int]) -> set[int]:
    """-- still_heads -- which of these ordered rows are their key's head now.

    InnoDB reads the subquery of a locking statement in a snapshot that may predate the
    rows it locked (a predecessor committed just before its follower is then unseen):
    this separate statement, at READ COMMITTED (the sweeper's, see relay.sweep.sweeper), sees
    every row committed before the claim, so each locked row's predecessors.
    """
    found = conn.execute(select(t.c.id).where(t.c.id.in_(list(row_ids)), is_head()))
    return set(found.scalars())


def earlier_unsettled(conn: Connection, row: Any) -> bool:
    """-- earlier_unsettled -- an earlier message of the row's key is pending or dead."""
    query = select(t.c.id).where(unsettled_before(row.topic, row.key, row.seq))
    return conn.execute(query.limit(1)).first() is not None


def blocked_keys(conn: Connection, heads: Sequence[Head]) -> set[tuple[str, str]]:
    """-- blocked_keys -- the (topic, key) of those heads that must wait: a row of the same
    key with a lower seq is pending or dead (not yet acked, or given up but not skipped).

    One statement for the batch, each head a range of ix_outbox_message_key_seq. Run it
    alone, in a snapshot taken after the heads committed (a new transaction): a head
    visible there has its predecessors visible too (seq order is commit order). Never
    inside a SKIP LOCKED claim, which may pass over a locked predecessor.
    """
    if not heads:
        return set()
    dialect = dialect_for(conn)
    if dialect.binds_arrays:
        topics, keys, seqs = (list(column) for column in zip(*heads, strict=True))
        params = {"head_topics": topics, "head_keys": keys, "head_seqs": seqs}
        arrays = dialect.built(blocked_keys_arrays)
        return {(topic, key) for topic, key in conn.execute(arrays, params)}
    earlier = or_(*(unsettled_before(topic, key, seq) for topic, key, seq in heads))
    query = select(t.c.topic, t.c.key).where(earlier).distinct()
    return {(topic, key) for topic, key in conn.execute(query)}


def blocked_keys_arrays(dialect: Dialect) -> Select[Any]:
    """blocked_keys where the database binds arrays (PostgreSQL): the heads as three
    arrays, one statement compiled once (an OR per head is a new statement, compiled
    anew, for every batch size)."""
    head = dialect.rows_of_arrays(
        "head",
        [
            ("topic", "head_topics", String()),
            ("key", "head_keys", String()),
            ("seq", "head_seqs", BigInteger()),
        ],
    )
    earlier = select(t.c.id).where(unsettled_before(head.c.topic, head.c.key, head.c.seq))
    return select(head.c.topic, head.c.key).where(earlier.exists()).distinct()


def blocking_head() -> Any:
    """The row is a dead ordered message at the head of its key (is_head): the key's later
    messages wait for it, until `outbox requeue` or `outbox skip`. Cheap conditions
    first: the subquery runs for dead ordered rows only."""
    return and_(t.c.status == DEAD, t.c.seq.is_not(None), is_head())


def behind_dead(row: Any = t) -> Any:
    """The ordered row has a dead message of its key before it (a lower seq): it is
    blocked, waiting until that one is requeued or skipped. The subquery runs for
    ordered rows only."""
    prior = t.alias("prior")
    earlier_dead = (
        select(prior.c.id)
        .where(unsettled_before(row.c.topic, row.c.key, row.c.seq, prior, (DEAD,)))
        .correlate(row)
    )
    return and_(row.c.seq.is_not(None), earlier_dead.exists())


def held_behind() -> Any:
    """How many messages of the row's key after it are unsettled (held while it blocks)."""
    later = t.alias("later")
    return (
        select(func.count())
        .where(unsettled_after(t.c.topic, t.c.key, t.c.seq, later))
        .scalar_subquery()
    )
