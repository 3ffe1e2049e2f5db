"""The backlog gauges (relay.metrics.Backlog) against PostgreSQL: they move with the table,
age a requeued row from its requeue, and cost one query per cache interval."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import create_engine, event, text, update
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from outbox import Outbox
from outbox.table import outbox_message as t
from relay import store
from relay.metrics import Backlog
from tests.acceptance.test_cli import cli
from tests.helpers import migrated


@pytest.fixture
def engine(pg_url: str) -> Iterator[Engine]:
    with migrated(pg_url) as eng:
        yield eng


def gauges(backlog: Backlog) -> dict[str, float]:
    """Sample name with labels -> value, as /metrics shows them."""
    samples = {}
    for family in backlog.collect():
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items())
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def send(engine: Engine, topic: str, n: int) -> list[str]:
    ob = Outbox(engine)
    with Session(engine) as session, session.begin():
        return [ob.send(session, topic, b"x") for _ in range(n)]


def set_status(engine: Engine, msg_ids: list[str], **values: Any) -> None:
    with engine.begin() as conn:
        conn.execute(
            update(t).where(t.c.msg_id.in_([uuid.UUID(m) for m in msg_ids])).values(**values)
        )


def age_rows(engine: Engine, minutes: int) -> None:
    with engine.begin() as conn:
        conn.execute(
            update(t).values(created_at=t.c.created_at - text(f"interval '{minutes} minutes'"))
        )


def test_gauges_follow_rows_added_sent_dead_and_requeued(engine: Engine, pg_url: str) -> None:
    backlog = Backlog(engine, cache_s=0)
    assert gauges(backlog) == {"outbox_backlog_up": 1}  # an empty table: no topic yet

    a = send(engine, "bk.a", 3)
    send(engine, "bk.b", 1)
    age_rows(engine, 10)
    seen = gauges(backlog)
    assert seen['outbox_pending_messages{topic="bk.a"}'] == 3
    assert seen['outbox_pending_messages{topic="bk.b"}'] == 1
    assert seen['outbox_dead_messages{topic="bk.a"}'] == 0
    assert 600 <= seen['outbox_oldest_pending_age_seconds{topic="bk.a"}'] < 700

    set_status(engine, a[:2], status="sent", sent_at=text("now()"))
    set_status(engine, a[2:], status="dead", attempts=20, last_error="permanent: too big")
    seen = gauges(backlog)
    assert seen['outbox_pending_messages{topic="bk.a"}'] == 0  # the topic stays, at 0
    assert seen['outbox_dead_messages{topic="bk.a"}'] == 1
    assert seen['outbox_oldest_pending_age_seconds{topic="bk.a"}'] == 0

    with engine.begin() as conn:  # `outbox requeue --dead`'s statement
        assert store.requeue(conn, True, None, []) == 1
    seen = gauges(backlog)
    assert seen['outbox_pending_messages{topic="bk.a"}'] == 1
    assert seen['outbox_dead_messages{topic="bk.a"}'] == 0
    # Created ten minutes ago, requeued just now: its age counts from the requeue.
    assert seen['outbox_oldest_pending_age_seconds{topic="bk.a"}'] < 60
    report = json.loads(cli("status", "--db", pg_url, "--json").stdout)
    by_topic = {row["topic"]: row for row in report["topics"]}
    assert by_topic["bk.a"]["oldest_pending_age_s"] < 60  # `outbox status` agrees
    assert by_topic["bk.b"]["oldest_pending_age_s"] >= 600


def test_a_row_waiting_out_its_backoff_is_not_overdue(engine: Engine) -> None:
    ids = send(engine, "bk.retry", 1)
    age_rows(engine, 10)
    set_status(engine, ids, attempts=1, next_attempt_at=text("now() + interval '5 minutes'"))
    seen = gauges(Backlog(engine, cache_s=0))
    assert seen['outbox_pending_messages{topic="bk.retry"}'] == 1
    assert seen['outbox_oldest_pending_age_seconds{topic="bk.retry"}'] == 0


def test_one_query_per_cache_interval_however_many_scrapes(engine: Engine) -> None:
    send(engine, "bk.c", 2)
    statements: list[str] = []
    event.listen(engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
    backlog = Backlog(engine, cache_s=60)
    first = gauges(backlog)
    send(engine, "bk.c", 5)
    statements.clear()
    for _ in range(5):
        assert gauges(backlog) == first  # cached: the 5 new rows show after the interval
    assert statements == []


def test_an_unreachable_database_is_a_value_not_a_failed_scrape() -> None:
    down = create_engine("postgresql+psycopg://postgres@127.0.0.1:1/test", poolclass=NullPool)
    assert gauges(Backlog(down, cache_s=0)) == {"outbox_backlog_up": 0}
