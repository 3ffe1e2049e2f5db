"""The operator's side of scheduled messages: `outbox status` and the backlog gauges count
a message whose deliver_at is still to come as scheduled (with the next due time), never
as pending; once due it is pending, aged from its due time; canceled ones are counted;
`outbox show` prints deliver_at.

Real processes against PostgreSQL, MariaDB and SQLite. Rows are planted straight into the
table, their times set from the database's clock, and once written by send() and cancel()
themselves (no relay runs here).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from outbox import Outbox
from relay import store
from relay.metrics import Backlog
from tests.acceptance.test_failures_cli import cli
from tests.helpers import migrated, wait_until
from tests.integration.test_backlog_metrics import gauges
from tests.planting import plant

# How far a row planted "now" may be from the clock read at the test's start, on a
# loaded 2-core machine (the ages asserted below allow this much).
SLACK_S = 30.0


@pytest.fixture
def engine(any_db: str) -> Iterator[Engine]:
    with migrated(any_db) as eng:
        yield eng


def db_now(engine: Engine) -> datetime:
    with engine.connect() as conn:
        return store.db_clock(conn)


def scheduled_world(engine: Engine) -> dict[str, Any]:
    """Topic sch.a: two scheduled rows (in 10 min and 1 h), one due 60 s ago that was
    created 2 h ago, one canceled; topic sch.b: one plain pending row."""
    now = db_now(engine)
    soon, later = now + timedelta(minutes=10), now + timedelta(hours=1)
    return {
        "now": now,
        "soon": soon,
        "soon_id": plant(engine, "sch.a", deliver_at=soon),
        "later_id": plant(engine, "sch.a", deliver_at=later),
        "due_id": plant(
            engine,
            "sch.a",
            created_at=now - timedelta(hours=2),
            deliver_at=now - timedelta(seconds=60),
        ),
        "canceled_id": plant(engine, "sch.a", deliver_at=later, status="canceled"),
        "plain_id": plant(engine, "sch.b"),
    }


def status_json(db: str) -> dict[str, Any]:
    # An SLA past the due row's minute of waiting: it is pending, not stuck.
    done = cli("status", "--db", db, "--json", "--sla", "600")
    assert done.returncode == 0, done.stderr  # nothing dead
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def test_status_counts_scheduled_apart_from_pending(any_db: str, engine: Engine) -> None:
    world = scheduled_world(engine)
    report = status_json(any_db)
    topics = {r["topic"]: r for r in report["topics"]}
    a, b = topics["sch.a"], topics["sch.b"]
    assert (a["pending"], a["stuck"], a["scheduled"], a["canceled"], a["dead"]) == (1, 0, 2, 1, 0)
    # the due row waits since its deliver_at, not since its creation two hours ago
    assert 60 <= a["oldest_pending_age_s"] < 60 + SLACK_S, a
    assert datetime.fromisoformat(a["next_due"]) == world["soon"]
    assert 600 - SLACK_S < a["next_due_in_s"] <= 600, a
    assert (b["pending"], b["scheduled"], b["canceled"]) == (1, 0, 0)
    assert (b["next_due"], b["next_due_in_s"]) == (None, None)
    total = report["total"]
    assert (total["pending"], total["scheduled"], total["canceled"]) == (2, 2, 1)
    assert datetime.fromisoformat(total["next_due"]) == world["soon"]

    table = cli("status", "--db", any_db, "--sla", "600").stdout.splitlines()
    header = table[0].split()
    assert header[8:11] == ["scheduled", "next_due", "canceled"], header
    rows = {line.split()[0]: line.split() for line in table[1:]}
    assert rows["sch.a"][8:12] == ["2", "in", "10m", "1"], rows["sch.a"]
    assert rows["sch.b"][8:11] == ["0", "-", "0"], rows["sch.b"]
    assert rows["TOTAL"][1] == "2" and rows["TOTAL"][8:12] == ["2", "in", "10m", "1"]


def test_gauges_count_scheduled_apart_from_pending(engine: Engine) -> None:
    scheduled_world(engine)
    seen = gauges(Backlog(engine, cache_s=0))
    assert seen['outbox_pending_messages{topic="sch.a"}'] == 1
    assert seen['outbox_scheduled_messages{topic="sch.a"}'] == 2
    assert 600 - SLACK_S < seen['outbox_next_due_seconds{topic="sch.a"}'] <= 600
    assert 60 <= seen['outbox_oldest_pending_age_seconds{topic="sch.a"}'] < 60 + SLACK_S
    assert seen['outbox_scheduled_messages{topic="sch.b"}'] == 0
    assert 'outbox_next_due_seconds{topic="sch.b"}' not in seen  # none scheduled: no sample


def test_a_scheduled_row_becomes_pending_when_its_time_comes(engine: Engine) -> None:
    """By the database clock: the row is scheduled until its deliver_at, then pending and
    aged from it (not from its creation, an hour before)."""
    now = db_now(engine)
    due_at = now + timedelta(seconds=2)
    plant(engine, "sch.c", created_at=now - timedelta(hours=1), deliver_at=due_at)
    backlog = Backlog(engine, cache_s=0)
    seen = gauges(backlog)
    if db_now(engine) < due_at:  # the machine may have been slower than 2 s
        assert seen['outbox_scheduled_messages{topic="sch.c"}'] == 1
        assert seen['outbox_pending_messages{topic="sch.c"}'] == 0
    wait_until(
        lambda: gauges(backlog)['outbox_pending_messages{topic="sch.c"}'] == 1,
        what="the scheduled row to come due",
        every=0.05,
    )
    seen = gauges(backlog)
    assert seen['outbox_scheduled_messages{topic="sch.c"}'] == 0
    assert 'outbox_next_due_seconds{topic="sch.c"}' not in seen
    assert seen['outbox_oldest_pending_age_seconds{topic="sch.c"}'] < SLACK_S


def test_show_prints_deliver_at(any_db: str, engine: Engine) -> None:
    world = scheduled_world(engine)
    done = cli("show", "--db", any_db, world["soon_id"], "--json")
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert datetime.fromisoformat(shown["deliver_at"]) == world["soon"]
    lines = cli("show", "--db", any_db, world["soon_id"]).stdout.splitlines()
    line = next(x for x in lines if x.startswith("deliver_at:"))
    assert datetime.fromisoformat(line.split(None, 1)[1]) == world["soon"]
    plain = cli("show", "--db", any_db, world["plain_id"]).stdout.splitlines()
    assert [x.split() for x in plain if x.startswith("deliver_at:")] == [["deliver_at:", "-"]]
    canceled = json.loads(cli("show", "--db", any_db, world["canceled_id"], "--json").stdout)
    assert canceled["status"] == "canceled"


def test_status_counts_what_send_and_cancel_wrote(any_db: str, engine: Engine) -> None:
    """Rows written by the API itself (deliver_at computed by the database): a delay of an
    hour is scheduled, a deliver_at in the past is due now, a canceled one is counted."""
    ob = Outbox(engine)
    with Session(engine) as session, session.begin():
        ob.send(session, "sch.api", b"x", delay=timedelta(hours=1))
        ob.send(session, "sch.api", b"x", deliver_at=db_now(engine) - timedelta(minutes=5))
        gone = ob.send(session, "sch.api", b"x", delay=3600)
    with Session(engine) as session, session.begin():
        assert ob.cancel(session, gone)
    [topic] = status_json(any_db)["topics"]
    assert (topic["pending"], topic["scheduled"], topic["canceled"]) == (1, 1, 1)
    assert 3600 - SLACK_S < topic["next_due_in_s"] <= 3600, topic
