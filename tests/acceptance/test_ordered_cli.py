"""The operator's side of ordered delivery: blocked keys in `outbox status`, `outbox dead`
and /metrics, `outbox skip` releasing a key, `outbox requeue` retrying its head.

Real processes against PostgreSQL, MariaDB and SQLite; ordered rows are planted with
their seq straight into the table (no relay runs here).
"""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, select, text, update
from sqlalchemy.pool import NullPool

from outbox.broker import retry
from outbox.table import outbox_message as t
from relay.loop import BrokerLoop
from relay.metrics import Backlog
from relay.sweep.sweeper import Sweeper
from relay.testing.memory import MemoryBroker
from tests.acceptance.test_failures_cli import OUTBOX, cli
from tests.helpers import migrated, running, wait_until
from tests.integration.test_backlog_metrics import gauges
from tests.integration.test_ordered_sweeper import (
    age_rows,
    quick,
    send_ordered,
    sequences,
    sweep_until,
)
from tests.locks import innodb_lock_waits
from tests.planting import plant


@pytest.fixture
def engine(any_db: str) -> Iterator[Engine]:
    with migrated(any_db) as eng:
        yield eng


def key_rows(engine: Engine, topic: str, key: str, *statuses: str) -> list[str]:
    """One ordered row per status, seq 1, 2, 3... in that order; their msg_ids."""
    return [
        plant(engine, topic, key=key, seq=seq, status=status, attempts=3 * (status == "dead"))
        for seq, status in enumerate(statuses, start=1)
    ]


def statuses(engine: Engine, msg_ids: list[str]) -> list[str]:
    with engine.connect() as conn:
        found = dict(conn.execute(select(t.c.msg_id, t.c.status)).all())
    return [found[uuid.UUID(m)] for m in msg_ids]


def blocked_world(engine: Engine) -> dict[str, list[str]]:
    """Keys in every state a head can be in, and an unordered dead row."""
    return {
        "k1": key_rows(engine, "ord.a", "k1", "dead", "pending", "pending"),  # blocked, 2 held
        "k2": key_rows(engine, "ord.a", "k2", "sent", "dead", "pending"),  # blocked at seq 2
        "k3": key_rows(engine, "ord.b", "k3", "pending", "dead"),  # head pending: not blocked
        "k4": key_rows(engine, "ord.b", "k4", "skipped", "dead"),  # skipped: seq 2 is the head
        "plain": [plant(engine, "ord.b", status="dead", attempts=3)],  # unordered
    }


def status_json(db: str, *flags: str) -> dict[str, Any]:
    done = cli("status", "--db", db, "--json", *flags)
    assert done.returncode == 3, done.stderr  # dead rows exist
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def test_status_lists_the_blocked_keys_oldest_head_first(any_db: str, engine: Engine) -> None:
    world = blocked_world(engine)
    report = status_json(any_db)
    listed = [(k["topic"], k["key"], k["head_msg_id"], k["seq"], k["behind"])
              for k in report["blocked_keys"]]  # fmt: skip
    assert listed == [
        ("ord.a", "k1", world["k1"][0], 1, 2),
        ("ord.a", "k2", world["k2"][1], 2, 1),
        ("ord.b", "k4", world["k4"][1], 2, 0),
    ]
    assert all(k["head_age_s"] >= 0 for k in report["blocked_keys"])
    assert report["blocked_keys_more"] == 0
    topics = {r["topic"]: r for r in report["topics"]}
    assert (topics["ord.a"]["blocked_keys"], topics["ord.b"]["blocked_keys"]) == (2, 1)
    assert (topics["ord.a"]["skipped"], topics["ord.b"]["skipped"]) == (0, 1)
    assert (report["total"]["blocked_keys"], report["total"]["skipped"]) == (3, 1)

    one = status_json(any_db, "--blocked-limit", "1")
    assert [k["key"] for k in one["blocked_keys"]] == ["k1"]
    assert one["blocked_keys_more"] == 2
    table = cli("status", "--db", any_db, "--blocked-limit", "2").stdout.splitlines()
    at = table.index("topic  key  head_msg_id                           seq  behind  age")
    assert table[at - 1].startswith("blocked keys (head dead;")
    assert table[at + 1].split()[:5] == ["ord.a", "k1", world["k1"][0], "1", "2"]
    assert table[at + 2].split()[:5] == ["ord.a", "k2", world["k2"][1], "2", "1"]
    assert table[at + 3:] == ["... and 1 more (--blocked-limit)"]  # fmt: skip


def test_status_without_blocked_keys_has_no_such_section(any_db: str, engine: Engine) -> None:
    key_rows(engine, "ord.c", "k1", "sent", "pending")
    done = cli("status", "--db", any_db)
    assert done.returncode == 0, done.stderr
    assert "blocked keys" not in done.stdout
    report = json.loads(cli("status", "--db", any_db, "--json").stdout)
    assert (report["blocked_keys"], report["blocked_keys_more"]) == ([], 0)


def test_the_gauge_counts_blocked_keys_per_topic(engine: Engine) -> None:
    world = blocked_world(engine)
    backlog = Backlog(engine, cache_s=0)
    seen = gauges(backlog)
    assert seen['outbox_blocked_keys{topic="ord.a"}'] == 2
    assert seen['outbox_blocked_keys{topic="ord.b"}'] == 1
    with engine.begin() as conn:  # k1's head sent: k1 flows; k2 still waits
        conn.execute(update(t).where(t.c.msg_id == uuid.UUID(world["k1"][0])).values(status="sent"))
    assert gauges(backlog)['outbox_blocked_keys{topic="ord.a"}'] == 1


def test_dead_marks_a_dead_head_with_the_key_it_blocks(any_db: str, engine: Engine) -> None:
    world = blocked_world(engine)
    report = json.loads(cli("dead", "--db", any_db, "--json", "--status", "dead").stdout)
    listed = {m["msg_id"]: m for m in report["messages"]}
    head = listed[world["k1"][0]]
    assert (head["key"], head["seq"], head["blocks_behind"]) == ("k1", 1, 2)
    assert listed[world["k3"][1]]["blocks_behind"] is None  # an earlier row is pending
    assert (listed[world["k4"][1]]["seq"], listed[world["k4"][1]]["blocks_behind"]) == (2, 0)
    plain = listed[world["plain"][0]]
    assert (plain["key"], plain["seq"], plain["blocks_behind"]) == (None, None, None)

    lines = cli("dead", "--db", any_db, "--status", "dead").stdout.splitlines()
    [k1] = [line for line in lines if line.startswith(world["k1"][0])]
    assert k1.split()[1:5] == ["dead", "ord.a", "k1", "1"]
    assert "[blocks key k1 (2 behind)]" in k1
    [k3] = [line for line in lines if line.startswith(world["k3"][1])]
    assert "blocks" not in k3

    show = cli("show", "--db", any_db, world["k2"][1]).stdout.splitlines()
    assert "key:             k2" in show and "seq:             2" in show
    assert json.loads(cli("show", "--db", any_db, world["k2"][1], "--json").stdout)["seq"] == 2


def test_skip_releases_a_blocked_key_and_says_what_it_did(any_db: str, engine: Engine) -> None:
    world = blocked_world(engine)
    unknown = str(uuid.uuid4())
    sent = world["k2"][0]
    asked = [world["k1"][0], sent, world["k3"][1], world["plain"][0], unknown]
    done = cli("skip", "--db", any_db, *asked)
    assert done.returncode == 2, done.stderr  # an unknown msg_id; the others are done
    lines = done.stdout.splitlines()
    assert lines == [
        f"{world['k1'][0]}  skipped (was dead; topic ord.a, key k1, seq 1)",
        f"{sent}  already sent (left alone: it reached the broker; a sent message is never "
        "skipped)",
        f"{world['k3'][1]}  skipped (was dead; topic ord.b, key k3, seq 2)",
        f"{world['plain'][0]}  skipped (was dead; topic ord.b)",
        f"{unknown}  unknown (no such message: a typo, or purged by retention)",
    ]
    assert done.stderr.splitlines() == [
        "warning: key k1 of topic ord.a released: its next message goes now "
        "(seq 1 will not be delivered)",
        "warning: key k3 of topic ord.b: seq 2 skipped; an earlier message still holds the key",
    ]
    assert statuses(engine, world["k1"]) == ["skipped", "pending", "pending"]
    assert statuses(engine, world["k2"]) == ["sent", "dead", "pending"]
    assert statuses(engine, world["plain"]) == ["skipped"]
    assert [k["key"] for k in status_json(any_db)["blocked_keys"]] == ["k2", "k4"]

    again = cli("skip", "--db", any_db, world["k1"][0], world["k2"][1], "--json")
    assert again.returncode == 0, again.stderr
    outcomes = json.loads(again.stdout)["messages"]
    assert outcomes == [
        {"msg_id": world["k1"][0], "outcome": "already_skipped", "was": "skipped",
         "topic": "ord.a", "key": "k1", "seq": 1, "key_released": None},
        {"msg_id": world["k2"][1], "outcome": "skipped", "was": "dead",
         "topic": "ord.a", "key": "k2", "seq": 2, "key_released": True},
    ]  # fmt: skip
    assert "key k2 of topic ord.a released" in again.stderr


def test_a_skipped_head_lets_the_sweeper_publish_the_rest_of_its_key(
    any_db: str, engine: Engine, loops: list[BrokerLoop]
) -> None:
    send_ordered(engine, keys=2, per_key=5)
    with engine.connect() as conn:
        poison = conn.execute(select(t.c.msg_id).where(t.c.key == "k0", t.c.seq == 2))
        poison_id = str(poison.scalar_one())
    broker = MemoryBroker(policy=lambda m: retry("refused") if m.msg_id == poison_id else None)
    age_rows(engine)
    sweeper = Sweeper(engine, running(broker, loops), quick())
    sweep_until(sweeper, lambda: statuses(engine, [poison_id]) == ["dead"])
    assert [k["key"] for k in status_json(any_db)["blocked_keys"]] == ["k0"]
    assert sequences(broker.published)["k0"] == [1]

    done = cli("skip", "--db", any_db, poison_id)
    assert done.returncode == 0 and "key k0 of topic o.x released" in done.stderr, done
    with engine.connect() as conn:
        key_rows_left = select(t.c.msg_id).where(t.c.key == "k0", t.c.status == "pending")
        pending = [str(m) for m in conn.execute(key_rows_left).scalars()]
    sweep_until(sweeper, lambda: statuses(engine, pending) == ["sent"] * len(pending))
    assert sequences(broker.published) == {"k0": [1, 3, 4, 5], "k1": [1, 2, 3, 4, 5]}
    assert cli("status", "--db", any_db).returncode == 0  # nothing dead, nothing blocked


def test_skip_of_a_pending_message_warns_it_may_be_on_its_way(any_db: str, engine: Engine) -> None:
    [head, _] = key_rows(engine, "ord.p", "k1", "pending", "pending")
    done = cli("skip", "--db", any_db, head)
    assert done.returncode == 0, done.stderr
    assert done.stdout == (
        f"{head}  skipped (was pending: a relay may be publishing it right now; "
        "topic ord.p, key k1, seq 1)\n"
    )
    assert statuses(engine, [head]) == ["skipped"]


def lock_waits(engine: Engine, name: str) -> int:
    """Statements of the database session called ``name`` waiting for a row lock."""
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            query = ("SELECT count(*) FROM pg_stat_activity WHERE application_name = :name "
                     "AND wait_event_type = 'Lock'")  # fmt: skip
            return int(conn.execute(text(query), {"name": name}).scalar_one())
        # MariaDB: the session's database is its own (the fixture's)
        query = "SELECT ID FROM information_schema.PROCESSLIST WHERE DB = :name"
        sessions = set(conn.execute(text(query), {"name": name}).scalars())
        return len(sessions & innodb_lock_waits(conn))


@pytest.mark.parametrize("sweeper_ends", ["sent", "rolled back"])
@pytest.mark.parametrize("db", ["pg_url", "mariadb_url"])
def test_skip_waits_for_a_sweeper_holding_the_row(
    db: str, sweeper_ends: str, request: pytest.FixtureRequest
) -> None:
    url = str(request.getfixturevalue(db))
    name = uuid.uuid4().hex  # PostgreSQL: the CLI's application_name
    if db == "pg_url":
        url += f"{'&' if '?' in url else '?'}application_name={name}"
    with migrated(url) as engine:
        if db == "mariadb_url":
            name = str(engine.url.database)  # MariaDB: the database the CLI uses
        [head, _] = key_rows(engine, "ord.w", "k1", "pending", "pending")
        sweeper = create_engine(url, poolclass=NullPool)
        with sweeper.connect() as conn:
            claim = select(t.c.id).where(t.c.msg_id == uuid.UUID(head)).with_for_update()
            conn.execute(claim).one()  # the sweeper's claim: the row is locked
            command = [OUTBOX, "skip", "--db", url, head, "--json"]
            skip = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            try:
                waiting = lambda: skip.poll() is not None or lock_waits(engine, name) > 0  # noqa: E731
                wait_until(waiting, 40, "skip waiting for the row", every=0.2)
                assert skip.poll() is None, skip.communicate()
                if sweeper_ends == "sent":  # published and acked meanwhile
                    conn.execute(update(t).where(t.c.msg_id == uuid.UUID(head))
                                 .values(status="sent"))  # fmt: skip
                    conn.commit()
                else:
                    conn.rollback()
                out, err = skip.communicate(timeout=60)
            finally:
                if skip.poll() is None:
                    skip.kill()
        sweeper.dispose()
        assert skip.returncode == 0, err
        [outcome] = json.loads(out)["messages"]
        if sweeper_ends == "sent":
            assert outcome["outcome"] == "already_sent"
            assert statuses(engine, [head]) == ["sent"]
        else:
            assert (outcome["outcome"], outcome["was"]) == ("skipped", "pending")
            assert statuses(engine, [head]) == ["skipped"]


def test_requeue_retries_a_dead_head_and_leaves_skipped_rows(any_db: str, engine: Engine) -> None:
    world = blocked_world(engine)
    done = cli("requeue", "--db", any_db, "--id", world["k1"][0])
    assert done.returncode == 0 and "requeued 1" in done.stdout, done.stderr
    with engine.connect() as conn:
        head = conn.execute(select(t).where(t.c.msg_id == uuid.UUID(world["k1"][0]))).one()
    assert (head.status, head.attempts, head.seq, head.key) == ("pending", 0, 1, "k1")
    assert [k["key"] for k in status_json(any_db)["blocked_keys"]] == ["k2", "k4"]

    by_topic = cli("requeue", "--db", any_db, "--topic", "ord.b", "--json")
    assert json.loads(by_topic.stdout) == {"requeued": 3}  # k3's, k4's and the plain dead row
    assert statuses(engine, world["k4"]) == ["skipped", "pending"]  # a skip is a decision
    assert json.loads(cli("requeue", "--db", any_db, "--dead", "--json").stdout) == {
        "requeued": 1  # k2's head; never a skipped row
    }
    assert statuses(engine, world["k4"]) == ["skipped", "pending"]
    back = cli("requeue", "--db", any_db, "--id", world["k4"][0], "--json")
    assert json.loads(back.stdout) == {"requeued": 1}  # named: a skip undone
    assert statuses(engine, world["k4"]) == ["pending", "pending"]
    assert cli("status", "--db", any_db).returncode == 0  # nothing dead, nothing blocked


def test_requeue_of_a_message_its_key_went_past_warns_it_arrives_out_of_order(
    any_db: str, engine: Engine
) -> None:
    skipped, _, _ = key_rows(engine, "ord.c", "k5", "skipped", "sent", "sent")
    dead, _ = key_rows(engine, "ord.c", "k6", "dead", "pending")
    done = cli("requeue", "--db", any_db, "--id", skipped, "--id", dead)  # repeated: both
    assert done.returncode == 0 and "requeued 2" in done.stdout, done.stderr
    [warning] = done.stderr.strip().splitlines()
    assert warning == (
        f"warning: {skipped} is seq 1 of key 'k5' of topic ord.c, which delivered seq 3 "
        "already: requeued, it arrives out of order (and `outbox reconcile` counts it so)"
    )


def test_skip_explains_itself_and_wants_a_msg_id() -> None:
    done = cli("skip", "--help")
    assert done.returncode == 0 and "--db" in done.stdout and "--json" in done.stdout
    assert cli("skip", "--db", "sqlite://").returncode == 2  # no MSG_ID
    assert cli("skip", "--db", "sqlite://", "not-a-uuid").returncode == 2
