"""The operator service (relay.operator) that `outbox status|dead|show|requeue|skip` and the
dashboard both call, on each database server: its rules once, whoever asks."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from sqlalchemy import Engine, select, update
from sqlalchemy.orm import Session

from outbox import Outbox, outbox_message
from outbox.errors import InvalidMsgId, UnknownMessage
from outbox.table import DEAD, PENDING, SENT, SKIPPED
from relay.operator import FAILING, Operator, actions_for, parse_msg_id

t = outbox_message


def sent(engine: Engine, topic: str, count: int, **extra: Any) -> list[str]:
    """``count`` messages committed to ``topic`` (an ordered key's, with key and ordered)."""
    ob = Outbox(engine)
    with Session(engine) as session, session.begin():
        return [ob.send(session, topic, {"n": n}, **extra) for n in range(count)]


def mark(engine: Engine, msg_ids: list[str], **values: Any) -> None:
    with engine.begin() as conn:
        ids = [uuid.UUID(m) for m in msg_ids]
        conn.execute(update(t).where(t.c.msg_id.in_(ids)).values(**values))


def statuses(engine: Engine, msg_ids: list[str]) -> list[str]:
    with engine.connect() as conn:
        rows = conn.execute(select(t.c.msg_id, t.c.status)).all()
    found = {str(m): s for m, s in rows}
    return [found[m] for m in msg_ids]


def test_requeue_takes_the_dead_rows_only(server_db: Engine) -> None:
    dead = sent(server_db, "op.a", 3)
    pending, done = sent(server_db, "op.a", 2), sent(server_db, "op.a", 1)
    mark(server_db, dead, status=DEAD, attempts=5, last_error="permanent: refused")
    mark(server_db, done, status=SENT)
    operator = Operator(server_db)
    assert operator.requeue_plan(True, "op.a", []).total == 3
    batches: list[int] = []
    assert operator.requeue(True, "op.a", [], on_batch=batches.append) == 3
    assert batches == [3]
    assert statuses(server_db, dead + pending + done) == [PENDING] * 5 + [SENT]
    assert operator.dead(("dead", FAILING), None, 10).rows == []  # attempts reset
    assert operator.act("requeue", done[0]) == (False, "not requeued: it is not dead")


def test_skip_of_a_blocked_head_releases_its_key(server_db: Engine) -> None:
    head, *behind = sent(server_db, "op.o", 3, key="k", ordered=True)
    mark(server_db, [head], status=DEAD, attempts=3, last_error="permanent: poison")
    operator = Operator(server_db)
    _, keys = operator.blocked_keys(10)
    assert [(k.key, str(k.msg_id), k.behind) for k in keys] == [("k", head, 2)]
    assert operator.status().backlog[0].blocked == 2
    [outcome] = operator.skip([head])
    assert (outcome.outcome, outcome.was, outcome.held_by_earlier) == ("skipped", DEAD, False)
    assert operator.blocked_keys(10)[1] == []
    assert statuses(server_db, [head, *behind]) == [SKIPPED, PENDING, PENDING]
    unknown = str(uuid.uuid4())
    assert [o.outcome for o in operator.skip([head, unknown])] == ["already_skipped", "unknown"]


def test_delete_takes_a_dead_row_and_refuses_a_pending_one(server_db: Engine) -> None:
    dead, pending = sent(server_db, "op.d", 2)
    mark(server_db, [dead], status=DEAD, attempts=1, last_error="permanent: no")
    operator = Operator(server_db)
    assert actions_for(DEAD) == ("requeue", "skip", "delete")
    assert actions_for(PENDING) == ("skip",)
    assert operator.act("delete", pending) == (False, "not deleted: it is not dead")
    assert operator.delete(dead) is True
    with pytest.raises(UnknownMessage, match="msg_id: no message"):
        operator.show(dead, None)
    assert operator.show(pending, 10)["status"] == PENDING


def test_dead_tells_failing_from_dead_and_names_an_unknown_before(server_db: Engine) -> None:
    dead, failing = sent(server_db, "op.f", 2)
    mark(server_db, [dead], status=DEAD, attempts=3, last_error="permanent: x")
    mark(server_db, [failing], attempts=1, last_error="retry: y")
    operator = Operator(server_db)
    page = operator.dead((DEAD, FAILING), None, 10, preview_bytes=4)
    assert [(str(r.msg_id), r.status) for r in page.rows] == [(failing, FAILING), (dead, DEAD)]
    assert all(size > 4 and len(head) == 4 for head, size in page.previews.values())
    unknown = str(uuid.uuid4())
    with pytest.raises(UnknownMessage) as raised:
        operator.dead((DEAD,), None, 10, before=unknown, field="--before")
    assert raised.value.field == "--before" and str(raised.value).startswith("--before: ")
    with pytest.raises(UnknownMessage, match=f"--id: no message {unknown}"):
        operator.requeue_plan(False, None, [dead, unknown], field="--id")


def test_a_msg_id_is_parsed_once_and_its_errors_name_the_field() -> None:
    wanted = "0190F5A0-0000-7000-8000-00000000000A"
    assert parse_msg_id(wanted, "MSG_ID") == wanted.lower()
    with pytest.raises(InvalidMsgId) as raised:
        parse_msg_id("not-a-uuid", "--before")
    error = raised.value
    assert (error.field, error.given) == ("--before", "not-a-uuid")
    assert str(error) == "--before: not a msg_id (a UUID): 'not-a-uuid'"
    assert isinstance(error, ValueError)  # a ConfigError: bad input, before any SQL
