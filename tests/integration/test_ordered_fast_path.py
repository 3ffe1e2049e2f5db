"""Ordered messages through a real Outbox's fast path: a key's messages reach the broker
in seq order, and a head whose predecessor is unsettled in the table waits for it."""

from __future__ import annotations

import asyncio
import random
import threading
from typing import Any

import pytest
from sqlalchemy import Engine, update
from sqlalchemy.orm import Session

from outbox import Outbox, outbox_message
from outbox.broker import LogEntry
from outbox.table import outbox_sequence
from relay import store
from relay.testing import MemoryBroker
from relay.testing.order import gaps, key_sequences, out_of_order
from tests.helpers import migrated, unsent, wait_until
from tests.planting import plant

t = outbox_message


def log_of(broker: MemoryBroker) -> list[LogEntry]:
    async def read() -> list[LogEntry]:
        return [entry async for chunk in broker.read_log() for entry in chunk]

    return asyncio.run(read())


def test_blocked_keys_names_the_heads_with_an_earlier_row_unsettled(any_db: str) -> None:
    """One statement for a batch of heads: pending and dead rows before a head hold it;
    sent and skipped ones, later ones and other keys' do not."""
    with migrated(any_db) as engine:
        for key, seq, status in [
            ("pending", 1, "pending"),
            ("dead", 1, "sent"),
            ("dead", 2, "dead"),
            ("settled", 1, "sent"),
            ("settled", 2, "skipped"),
            ("later", 5, "pending"),
        ]:
            plant(engine, "orders", key=key, seq=seq, status=status)
        plant(engine, "invoices", key="pending", seq=1)
        plant(engine, "orders", key="unordered")  # no seq: never a predecessor
        heads = [
            ("orders", "pending", 2),
            ("orders", "dead", 3),
            ("orders", "settled", 3),
            ("orders", "later", 2),
            ("orders", "unordered", 2),
            ("orders", "new", 1),
            ("refunds", "pending", 2),
        ]
        with engine.connect() as conn:
            assert store.blocked_keys(conn, heads) == {("orders", "pending"), ("orders", "dead")}
            assert store.blocked_keys(conn, []) == set()


def send_from_threads(ob: Outbox, keys: int, per_key: int, threads: int) -> None:
    """Each thread sends ordered messages, one per transaction, to keys picked at random:
    one key's messages come from several threads at once."""
    picks = [f"k{k}" for k in range(keys) for _ in range(per_key)]
    random.Random(7).shuffle(picks)
    share = len(picks) // threads

    def worker(mine: list[str]) -> None:
        for key in mine:
            with Session(ob.engine) as session, session.begin():
                ob.send(session, "orders", {"key": key}, key=key, ordered=True)

    pool = [
        threading.Thread(target=worker, args=(picks[i * share : (i + 1) * share],))
        for i in range(threads)
    ]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()


@pytest.mark.parametrize("db", ["pg_url", "mariadb_url", "sqlite_url"])
def test_100_keys_of_20_from_4_threads_reach_the_broker_in_order(
    db: str, request: pytest.FixtureRequest
) -> None:
    url = str(request.getfixturevalue(db))
    broker = MemoryBroker()
    with migrated(url):
        ob = Outbox(url, broker=broker, sweeper=False)  # the fast path alone
        ob.start()
        try:
            send_from_threads(ob, keys=100, per_key=20, threads=4)
            wait_until(lambda: unsent(url) == 0, what="every row marked sent")
            stats = ob.stats
        finally:
            ob.stop()
    entries = log_of(broker)
    assert out_of_order(entries) == []
    assert gaps(entries) == {}
    sequences = key_sequences(entries)
    assert len(sequences) == 100
    assert all([seq for seq, _ in s] == list(range(1, 21)) for s in sequences.values())
    assert stats is not None and stats.published == 2000


def test_a_head_waits_for_a_row_another_process_holds(pg_url: str) -> None:
    """Seq 1 of the key belongs to another process (planted, pending): the app's seq 2 and
    3 wait for it, and reach the broker once it is marked sent, in order."""
    broker = MemoryBroker()
    options: dict[str, Any] = {"retry_delays_ms": (0, *[20] * 200), "sweeper": False}
    with migrated(pg_url) as engine:
        ob = Outbox(pg_url, broker=broker, **options)
        ob.start()
        try:
            with Session(ob.engine) as session, session.begin():
                ob.send(session, "orders", b"first", key="a", ordered=True)
            stats = ob.stats
            assert stats is not None
            wait_until(lambda: unsent(pg_url) == 0, what="seq 1 sent by the fast path")
            other = plant(engine, "orders", key="a", seq=2)  # "another process" took seq 2
            bump_sequence(engine, "orders", "a", 2)
            for payload in (b"third", b"fourth"):
                with Session(ob.engine) as session, session.begin():
                    ob.send(session, "orders", payload, key="a", ordered=True)
            wait_until(lambda: stats.key_waits >= 3, what="seq 3 waiting for seq 2")
            assert [m.payload for m in broker.published] == [b"first"]
            with engine.begin() as conn:
                conn.execute(update(t).where(t.c.seq == 2).values(status="sent"))
            wait_until(lambda: unsent(pg_url) == 0, what="seq 3 and 4 sent")
            assert [m.payload for m in broker.published] == [b"first", b"third", b"fourth"]
            assert other not in {m.msg_id for m in broker.published}
            assert stats.retried == 0
        finally:
            ob.stop()


def bump_sequence(engine: Engine, topic: str, key: str, last: int) -> None:
    """Take numbers up to ``last`` of the key, as another process's sends would."""
    with engine.begin() as conn:
        conn.execute(
            update(outbox_sequence)
            .where(outbox_sequence.c.topic == topic, outbox_sequence.c.key == key)
            .values(last_seq=last)
        )
