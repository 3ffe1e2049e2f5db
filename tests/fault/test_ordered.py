"""Ordered delivery end to end: what each real broker holds, per key, in commit order.

The checks read the broker's own log back (relay.testing.order): each key's messages
arrive in seq order, with no gap, whatever the relay went through (the broker taken
away and back mid-run, an app SIGKILLed with ordered messages in its memory).
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from outbox import Outbox, migrate, outbox_message
from relay.testing.faults import kill_app_after_commit
from relay.testing.harness import BrokerUnderTest, broker_under_test
from relay.testing.order import gaps, key_sequences, out_of_order
from tests.helpers import sent_count, wait_until

t = outbox_message
# The sweeper takes over within about a second: a broker outage spans both paths.
QUICK: dict[str, Any] = dict(
    handoff_limit_s=1.0, sweeper_age_s=1.5, sweep_interval_s=0.2,
    backoff_base_s=0.05, backoff_cap_s=0.5,
)  # fmt: skip
THREADS, TRANSACTIONS, KEYS = 4, 40, 12


@pytest.fixture(params=["nats", "redis", "rabbitmq"])
def restartable(request: pytest.FixtureRequest) -> Iterator[BrokerUnderTest]:
    with broker_under_test(request.param, restartable=True) as h:
        yield h


def assert_in_order(held: list[Any], committed: set[str], keys: int) -> None:
    assert not out_of_order(held), out_of_order(held)[:5]
    assert not gaps(held), gaps(held)
    sequences = key_sequences(held)
    assert len(sequences) == keys
    assert {m for s in sequences.values() for _, m in s} == committed, "every one arrived"


def test_each_broker_gets_each_key_in_commit_order_through_a_restart(
    pg_url: str, restartable: BrokerUnderTest
) -> None:
    """App threads commit ordered messages over a few hot keys while the broker goes away
    and comes back: the fast path's lanes fail, leave their keys to the sweeper, and
    take them back; the broker must hold each key in order anyway."""
    h = restartable
    assert h.url is not None and h.server is not None
    migrate.upgrade(pg_url)
    ob = Outbox(pg_url, broker=h.url, **QUICK)
    ob.start()
    committed: set[str] = set()
    lock = threading.Lock()
    outage = {"down_at": THREADS * TRANSACTIONS // 4, "up_at": THREADS * TRANSACTIONS // 2}
    went_down, came_back = threading.Event(), threading.Event()

    def app(thread: int) -> None:
        for i in range(TRANSACTIONS):
            with Session(ob.engine) as session, session.begin():
                sent = [
                    ob.send(session, f"{h.prefix}.orders", {"t": thread, "i": i, "j": j},
                            key=f"k{(thread + i + j) % KEYS}", ordered=True)
                    for j in range(3)
                ]  # fmt: skip
            with lock:
                committed.update(sent)
                done = len(committed) // 3
            if done == outage["down_at"]:
                went_down.set()
            if done >= outage["up_at"]:
                assert came_back.wait(60), "the broker came back"

    threads = [threading.Thread(target=app, args=(k,)) for k in range(THREADS)]
    try:
        for thread in threads:
            thread.start()
        assert went_down.wait(60)
        h.server.stop()
        wait_until(lambda: len(committed) // 3 >= outage["up_at"], what="commits while down")
        h.server.start()
        came_back.set()
        for thread in threads:
            thread.join(120)
        wait_until(lambda: sent_count(pg_url) == len(committed), 120, "every message sent")
    finally:
        came_back.set()
        ob.stop()
    assert_in_order(h.read(), committed, KEYS)


KILLED = 200


@pytest.mark.parametrize("db", ["pg_url", "mariadb_url"])
def test_an_app_killed_with_ordered_messages_in_memory_is_resumed_in_order(
    db: str, request: pytest.FixtureRequest
) -> None:
    """The app commits 200 ordered messages over 5 keys and is SIGKILLed at once: its
    fast path had published some. A relay in another process publishes the rest, each
    key from where the broker left it."""
    url = str(request.getfixturevalue(db))
    migrate.upgrade(url)
    with broker_under_test("nats") as h:
        assert h.url is not None
        kill_app_after_commit(url, h.url, f"{h.prefix}.orders", KILLED, keys=5)
        engine = create_engine(url, poolclass=NullPool)
        with engine.connect() as conn:
            committed = {str(m) for m in conn.execute(select(t.c.msg_id)).scalars()}
        engine.dispose()
        assert len(committed) == KILLED
        ob = Outbox(url, broker=h.url, **QUICK)
        ob.start()
        try:
            wait_until(lambda: sent_count(url) == KILLED, 120, "the sweeper sent the rest")
        finally:
            ob.stop()
        assert_in_order(h.read(), committed, 5)


# An app process: its own fast path and sweeper, committing ordered messages to keys that
# the other processes write too; it stops its relay when its stdin closes.
_APP = """
import random, sys
from sqlalchemy.orm import Session
from outbox import Outbox
db, broker, topic, seed = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
rng = random.Random(seed)
ob = Outbox(db, broker=broker, handoff_limit_s=1.0, sweeper_age_s=1.5, sweep_interval_s=0.2)
ob.start()
for i in range(60):
    with Session(ob.engine) as session, session.begin():
        for key in rng.sample(range(6), 2):
            ob.send(session, topic, {"app": seed, "i": i}, key=f"k{key}", ordered=True)
print("committed", flush=True)
sys.stdin.read()
ob.stop()
"""


@pytest.mark.parametrize("db", ["pg_url", "mariadb_url"])
def test_three_app_processes_writing_the_same_keys_deliver_each_key_in_order(
    db: str, request: pytest.FixtureRequest
) -> None:
    """Three processes, each with its fast path and sweeper, commit ordered messages to
    the same six keys at once: a head whose predecessor another process holds waits for
    its row to be marked; the broker holds each key in commit order."""
    url = str(request.getfixturevalue(db))
    migrate.upgrade(url)
    with broker_under_test("nats") as h:
        assert h.url is not None
        apps = [
            subprocess.Popen(
                [sys.executable, "-c", _APP, url, h.url, f"{h.prefix}.orders", str(seed)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for seed in range(3)
        ]
        try:
            for app in apps:
                assert app.stdout is not None and app.stdout.readline().strip() == "committed"
            wait_until(lambda: sent_count(url) == 3 * 60 * 2, 120, "every message sent")
        finally:
            errors = [app.communicate(timeout=30)[1] for app in apps]
        assert all(app.returncode == 0 for app in apps), errors
        engine = create_engine(url, poolclass=NullPool)
        with engine.connect() as conn:
            committed = {str(m) for m in conn.execute(select(t.c.msg_id)).scalars()}
        engine.dispose()
        assert_in_order(h.read(), committed, 6)
