"""One meaning of pending, stuck and blocked: a dead ordered head with 6 messages of its
key behind it, 10 minutes old, counted alike by `outbox status` (text and --json), the
dashboard's /api/overview, the backlog gauges and `outbox drain`.

Before: status said pending 0, stuck 6 (pending was "due for less than the SLA") while
the dashboard and outbox_pending_messages said pending 6; nothing counted the 6 as
blocked; drain printed `sent=0 retry_later=0 dead=0 of 6 pending` and exited 0, with no
word of the dead head. Real processes against PostgreSQL, MariaDB and SQLite."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from relay.dashboard.app import create_app
from relay.metrics import Backlog
from relay.testing.embedded import NatsServer
from tests.acceptance.test_failures_cli import cli
from tests.helpers import migrated
from tests.integration.test_backlog_metrics import gauges
from tests.integration.test_ordered_sweeper import age_rows
from tests.planting import plant

BEHIND = 6


@pytest.fixture
def engine(any_db: str) -> Iterator[Engine]:
    with migrated(any_db) as eng:
        yield eng


def dead_head_and_six_behind(engine: Engine, topic: str) -> str:
    """Seq 1 dead (its attempts spent), seq 2..7 pending behind it, all 10 minutes old
    (past the 60 s SLA): the head's msg_id."""
    head = plant(engine, topic, key="k", seq=1, status="dead", attempts=3,
                 last_error="permanent: too large")  # fmt: skip
    for seq in range(2, 2 + BEHIND):
        plant(engine, topic, key="k", seq=seq)
    age_rows(engine, 600)
    return head


def status_json(db: str) -> dict[str, Any]:
    done = cli("status", "--db", db, "--json")
    assert done.returncode == 3, done.stderr  # a dead message exists
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def status_table(db: str) -> dict[str, str]:
    """The TOTAL row of `outbox status`, by column."""
    done = cli("status", "--db", db)
    assert done.returncode == 3, done.stderr
    lines = done.stdout.splitlines()
    header = lines[0].split()
    total = next(line for line in lines if line.startswith("TOTAL")).split()
    return dict(zip(header[1:], total[1:], strict=True))


def test_status_dashboard_and_gauges_count_blocked_rows_alike(any_db: str, engine: Engine) -> None:
    topic = "blk.orders"
    head = dead_head_and_six_behind(engine, topic)
    expected = {"pending": BEHIND, "stuck": BEHIND, "blocked": BEHIND, "dead": 1,
                "blocked_keys": 1}  # fmt: skip

    report = status_json(any_db)
    assert {k: report["total"][k] for k in expected} == expected
    [row] = report["topics"]
    assert {k: row[k] for k in expected} == expected
    assert report["blocked_keys"][0]["head_msg_id"] == head
    assert report["blocked_keys"][0]["behind"] == BEHIND

    table = status_table(any_db)
    assert {k: int(table[k]) for k in expected} == expected

    with TestClient(create_app(engine), base_url="http://127.0.0.1") as browser:
        overview = browser.get("/api/overview").json()
    assert {k: overview["total"][k] for k in expected} == expected

    samples = gauges(Backlog(engine))
    label = f'{{topic="{topic}"}}'
    shown = {
        "pending": samples[f"outbox_pending_messages{label}"],
        "stuck": samples[f"outbox_stuck_messages{label}"],
        "blocked": samples[f"outbox_blocked_messages{label}"],
        "dead": samples[f"outbox_dead_messages{label}"],
        "blocked_keys": samples[f"outbox_blocked_keys{label}"],
    }
    assert shown == expected


def test_drain_names_the_rows_it_left_behind_a_dead_head(
    pg_url: str, nats_server: NatsServer, stream: tuple[str, str]
) -> None:
    """The 6 cannot be published by any drain: it says so, names the head and how to
    release it, and exits 3 as `outbox status` does for the same dead head."""
    name, prefix = stream
    broker = f"{nats_server.url}?stream={name}&subjects={prefix}.>"
    with migrated(pg_url) as engine:
        head = dead_head_and_six_behind(engine, f"{prefix}.orders")

    done = cli("drain", "--db", pg_url, "--broker", broker)
    assert done.returncode == 3, (done.stdout, done.stderr)
    summary, *rest = done.stdout.splitlines()
    assert summary.startswith(f"drained: sent=0 retry_later=0 dead=0 of {BEHIND} pending in ")
    assert summary.endswith(f"; {BEHIND} blocked behind a dead message, left")
    assert rest[0].startswith(f"left {BEHIND} message(s) of 1 key(s) behind a dead message")
    assert "`outbox requeue --id HEAD`" in rest[0] and "`outbox skip HEAD`" in rest[0]
    assert rest[1] == f"  head {head}: topic {prefix}.orders, key 'k', seq 1, {BEHIND} behind"

    as_json = cli("drain", "--db", pg_url, "--broker", broker, "--json")
    assert as_json.returncode == 3, as_json.stderr
    report = json.loads(as_json.stdout)
    assert (report["pending_at_start"], report["sent"], report["dead"]) == (BEHIND, 0, 0)
    assert (report["blocked"], report["blocked_keys"]) == (BEHIND, 1)
    [key] = report["blocked_heads"]
    assert (key["head_msg_id"], key["seq"], key["behind"]) == (head, 1, BEHIND)

    skipped = cli("skip", "--db", pg_url, head)
    assert skipped.returncode == 0, skipped.stderr
    released = cli("drain", "--db", pg_url, "--broker", broker)
    assert released.returncode == 0, (released.stdout, released.stderr)
    assert released.stdout.startswith(f"drained: sent={BEHIND} retry_later=0 dead=0 of {BEHIND} ")
    assert "blocked" not in released.stdout
