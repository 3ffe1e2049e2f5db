"""send(ordered=True): each (topic, key) numbers its messages 1, 2, 3... in commit order.

The number is taken under the key's row lock in ``outbox_sequence``, in the sender's
transaction: a rollback gives it back, concurrent writers of one key wait for each other.
"""

from __future__ import annotations

import random
import threading
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, event, select
from sqlalchemy.orm import Session

from outbox import Outbox, outbox_message
from outbox.errors import InvalidKey, InvalidMessage
from outbox.rows import add_to_last_seqs
from tests.flavours import Flavour, maybe
from tests.helpers import migrated

t = outbox_message


def seqs(engine: Engine) -> list[tuple[Any, ...]]:
    """(topic, key, seq) of every row, in insert order."""
    with engine.connect() as conn:
        query = select(t.c.topic, t.c.key, t.c.seq).order_by(t.c.id)
        return [tuple(r) for r in conn.execute(query)]


def test_a_key_numbers_its_committed_messages(flavour: Flavour) -> None:
    ob = flavour.ob

    async def send(*keys: str | None, commit: bool = True) -> None:
        session = flavour.session()
        try:
            for key in keys:
                ob.send(session, "orders", {"k": key}, key=key, ordered=key is not None)
            await maybe(session.commit() if commit else session.rollback())
        finally:
            await maybe(session.close())

    async def case() -> None:
        await send("a", "a", "b", None)
        await send("a", commit=False)  # rolled back: its number is given back
        await send("b", "a")

    flavour.run(case)
    assert sorted(seqs(flavour.engine), key=str) == [
        ("orders", "a", 1), ("orders", "a", 2), ("orders", "a", 3),
        ("orders", "b", 1), ("orders", "b", 2), ("orders", None, None),
    ]  # fmt: skip


def test_a_sync_ordered_message_is_written_at_commit(sqlite_url: str) -> None:
    """Like an AsyncSession's: its key is locked only through the COMMIT, and a savepoint
    rolled back takes its ordered messages with it."""
    with migrated(sqlite_url) as engine:
        ob = Outbox(engine)
        with Session(engine) as session, session.begin():
            ob.send(session, "orders", b"x", key="a", ordered=True)
            assert seqs(engine) == []  # another connection: nothing yet, and no lock held
            assert session.execute(select(t.c.id)).all() == []
            with session.begin_nested() as savepoint:
                ob.send(session, "orders", b"y", key="a", ordered=True)
                savepoint.rollback()
            ob.send(session, "orders", b"z", key="a", ordered=True)
        with engine.connect() as conn:
            query = select(t.c.payload, t.c.seq).order_by(t.c.seq)
            assert [tuple(r) for r in conn.execute(query)] == [(b"x", 1), (b"z", 2)]


def test_the_same_key_of_another_topic_counts_alone(sqlite_url: str) -> None:
    with migrated(sqlite_url) as engine:
        ob = Outbox(engine)
        with Session(engine) as session, session.begin():
            for topic in ("orders", "invoices", "orders"):
                ob.send(session, topic, b"x", key="42", ordered=True)
        assert seqs(engine) == [("orders", "42", 1), ("invoices", "42", 1), ("orders", "42", 2)]


def test_unordered_messages_of_a_key_take_no_number(sqlite_url: str) -> None:
    with migrated(sqlite_url) as engine:
        ob = Outbox(engine)
        with Session(engine) as session, session.begin():
            ob.send(session, "orders", b"x", key="42")
        assert seqs(engine) == [("orders", "42", None)]


@pytest.mark.parametrize("ordered", [True, 1, "yes"])
def test_ordered_needs_a_key_and_a_bool(sqlite_url: str, ordered: Any) -> None:
    with migrated(sqlite_url) as engine:
        ob = Outbox(engine)
        with Session(engine) as session, session.begin():
            with pytest.raises(InvalidMessage) as raised:
                ob.send(session, "orders", b"x", ordered=ordered)
            ob.send(session, "orders", b"y")  # the transaction is still usable
        if ordered is True:
            assert isinstance(raised.value, InvalidKey)
            assert (
                str(raised.value) == "key: is required with ordered=True: the order is kept per key"
            )
        else:
            assert raised.value.field == "ordered"
        assert seqs(engine) == [("orders", None, None)]


WRITERS, TRANSACTIONS = 6, 15


def test_concurrent_writers_of_a_key_take_numbers_in_commit_order(any_db: str) -> None:
    """Writers of one key wait for each other's commit: the numbers are dense whatever
    rolled back, and a row numbered n+1 was written after n's transaction committed (its
    created_at, taken by the database after the lock was granted, is later)."""
    with migrated(any_db) as engine:
        ob = Outbox(engine)
        errors: list[BaseException] = []

        def writer(seed: int) -> None:
            rng = random.Random(seed)
            own = create_engine(any_db, connect_args={"timeout": 60} if "sqlite" in any_db else {})
            try:
                for _ in range(TRANSACTIONS):
                    with Session(own) as session:
                        ob.send(session, "orders", b"x", key="hot", ordered=True)
                        ob.send(session, "orders", b"y", key=f"cold-{seed}", ordered=True)
                        session.commit() if rng.random() < 0.7 else session.rollback()
            except BaseException as exc:  # reported below: a thread's failure fails the test
                errors.append(exc)
            finally:
                own.dispose()

        threads = [threading.Thread(target=writer, args=(i,)) for i in range(WRITERS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not errors, errors
        with engine.connect() as conn:
            hot = conn.execute(
                select(t.c.seq, t.c.created_at).where(t.c.key == "hot").order_by(t.c.seq)
            ).all()
        assert [seq for seq, _ in hot] == list(range(1, len(hot) + 1)), "dense, no repeat"
        times = [created for _, created in hot]
        assert times == sorted(times), "each written after the one before committed"
        assert len(hot) > 0


def test_keys_that_differ_in_case_are_two_keys(any_db: str) -> None:
    """MariaDB's default collation compares case-insensitively: the key columns are binary."""
    with migrated(any_db) as engine:
        ob = Outbox(engine)
        for key in ("Order", "order", "ORDER", "Order"):
            with Session(engine) as session, session.begin():
                ob.send(session, "orders", b"x", key=key, ordered=True)
        got = sorted(seqs(engine), key=str)
        assert got == [
            ("orders", "ORDER", 1), ("orders", "Order", 1), ("orders", "Order", 2),
            ("orders", "order", 1),
        ]  # fmt: skip


def test_the_keys_of_a_transaction_are_numbered_by_one_statement(db_url: str) -> None:
    """One upsert for all the keys, not one per key: it runs while the keys' locks are
    held, so every writer of those keys would wait for the extra round trips."""
    with migrated(db_url) as engine:
        statements: list[str] = []
        event.listen(engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
        with engine.begin() as conn:
            last = add_to_last_seqs(conn, {("t", "a"): 1, ("t", "b"): 2, ("t", "c"): 1})
        assert last == {("t", "a"): 1, ("t", "b"): 2, ("t", "c"): 1}
        assert len(statements) == 1, statements
