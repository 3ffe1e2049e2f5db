"""`outbox requeue` of many rows: batches of relay.store.REQUEUE_BATCH, each counted,
running totals on stderr without a terminal, an exact `requeued N` at the end."""

from __future__ import annotations

import json
import os
import re
import uuid

from sqlalchemy import create_engine, update
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from outbox import Outbox, migrate
from outbox.table import outbox_message as t
from tests.acceptance.test_cli import cli, count

DEAD, SENT = 2500, 10  # dead rows over three batches of 1000; sent rows stay sent


def seed_dead(db: str) -> None:
    """DEAD dead rows and SENT sent ones, written through the app's API in one transaction."""
    migrate.upgrade(db)
    engine = create_engine(db, poolclass=NullPool)
    outbox = Outbox(engine)
    with Session(engine) as session, session.begin():
        sent = [outbox.send(session, "requeue.many", b"x") for _ in range(SENT)]
        for _ in range(DEAD):
            outbox.send(session, "requeue.many", b"x")
    with engine.begin() as conn:
        conn.execute(update(t).values(status="dead", attempts=3, last_error="permanent: x"))
        ids = [uuid.UUID(m) for m in sent]
        conn.execute(update(t).where(t.c.msg_id.in_(ids)).values(status="sent", last_error=None))
    engine.dispose()


def test_requeue_of_many_prints_running_totals(pg_url: str) -> None:
    seed_dead(pg_url)
    env = {**os.environ, "OUTBOX_PROGRESS_EVERY_S": "0"}  # a line after every batch
    done = cli("requeue", "--db", pg_url, "--dead", env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"requeued {DEAD} message(s)\n"
    shown = re.findall(rf"^requeue: (\d+)/{DEAD} \([\d,]+ rows/s\)$", done.stderr, re.M)
    assert shown == ["1000", "2000", str(DEAD)], done.stderr
    assert count(pg_url, "pending") == DEAD and count(pg_url, "sent") == SENT


def test_requeue_json_counts_every_batch_on_mariadb(mariadb_url: str) -> None:
    seed_dead(mariadb_url)
    done = cli("requeue", "--db", mariadb_url, "--topic", "requeue.many", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"requeued": DEAD}
    assert count(mariadb_url, "pending") == DEAD and count(mariadb_url, "dead") == 0
