"""The inbox (outbox.inbox.Inbox) on PostgreSQL, MariaDB and SQLite: a message's handler
commits once with its inbox row, whatever the copies; a failure rolls everything back
and asks for a retry after the backoff; past the attempts the message is the consumer's
dead letter, and a requeued one runs again from the table; two copies at once run one
handler to the commit; consumers are independent.

The handlers write a business row of their own (``invoice``) in the session they get,
so each test can count what the handler committed beside the inbox row.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import (
    Column,
    Engine,
    Integer,
    MetaData,
    String,
    Table,
    delete,
    insert,
    select,
    update,
)
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from outbox.errors import ConfigError
from outbox.inbox import Inbox, InboxMessage, Outcome
from outbox.message import uuid7
from outbox.table import DEAD, HANDLED, REQUEUED, db_now, inbox_message
from relay.testing import scratch_schema
from tests.conftest import PG_URL, scratch_mariadb
from tests.helpers import migrated

business = MetaData()
invoice = Table(
    "inbox_test_invoice",
    business,
    Column("msg_id", String(36), primary_key=True),
    Column("amount", Integer, nullable=False),
)
DEADLINE_S = 30.0


@pytest.fixture(scope="module", params=["postgresql", "mariadb", "sqlite"])
def database(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    """A migrated database per kind for the module, with the handlers' business table."""
    with contextlib.ExitStack() as stack:
        if request.param == "sqlite":
            url = f"sqlite:///{tmp_path_factory.mktemp('inbox') / Path('inbox.sqlite')}"
        elif request.param == "postgresql":
            url = stack.enter_context(scratch_schema(PG_URL, "inbox"))
        else:
            url = stack.enter_context(scratch_mariadb("inbox"))
        engine = stack.enter_context(migrated(url))
        business.create_all(engine)
        yield engine


@pytest.fixture
def db(database: Engine) -> Engine:
    with database.begin() as conn:
        conn.execute(delete(inbox_message))
        conn.execute(delete(invoice))
    return database


def billing(db: Engine, consumer: str = "billing", **options: object) -> Inbox:
    """An inbox whose handler of ``orders.*`` writes an invoice of the order's amount
    (an amount below 0 raises after the invoice is written: it must not stay)."""
    inbox = Inbox(db, consumer, **options)  # type: ignore[arg-type]

    @inbox.handler("orders.*")
    def bill(session: Session, message: InboxMessage) -> None:
        amount = message.json()["amount"]
        session.execute(insert(invoice).values(msg_id=str(message.msg_id), amount=amount))
        if amount < 0:
            raise ValueError("a negative amount")

    return inbox


def order(amount: int, topic: str = "orders.created") -> InboxMessage:
    payload = f'{{"amount": {amount}}}'.encode()
    return InboxMessage.from_broker(str(uuid7()), topic, payload, {"Outbox-Key": "o-1"})


def invoices(db: Engine) -> list[int]:
    with db.connect() as conn:
        return sorted(conn.execute(select(invoice.c.amount)).scalars())


def inbox_rows(db: Engine) -> list[tuple[str, str, int]]:
    query = select(inbox_message.c.consumer, inbox_message.c.status, inbox_message.c.attempts)
    with db.connect() as conn:
        return sorted((c, s, a) for c, s, a in conn.execute(query))


def test_a_message_is_handled_once_whatever_its_copies(db: Engine) -> None:
    inbox, message = billing(db), order(12)
    assert message.key == "o-1" and message.headers == {} and message.seq is None
    assert inbox.handle(message).outcome is Outcome.HANDLED
    for attempt in (1, 2, 3):  # the broker's redeliveries, a requeue at the outbox
        assert inbox.handle(message, attempt).outcome is Outcome.DUPLICATE
    assert invoices(db) == [12]
    assert inbox_rows(db) == [("billing", HANDLED, 1)]


def test_a_failing_handler_leaves_nothing_and_is_retried_after_the_backoff(db: Engine) -> None:
    inbox = billing(db, backoff_s=(0.5, 3.0), max_attempts=5)
    failing = order(-1)
    first = inbox.handle(failing, attempt=1)
    assert (first.outcome, first.delay_s) == (Outcome.RETRY, 0.5)
    assert first.error == "ValueError: a negative amount"
    assert inbox.handle(failing, attempt=3).delay_s == 3.0  # the last wait repeats
    assert invoices(db) == [] and inbox_rows(db) == []  # rolled back, nothing recorded
    neighbour = order(7)
    assert inbox.handle(neighbour).outcome is Outcome.HANDLED  # the next one goes on
    assert invoices(db) == [7]


def test_past_its_attempts_a_message_is_the_consumers_dead_letter(db: Engine) -> None:
    inbox = billing(db, max_attempts=3)
    poison = order(-5)
    dead = inbox.handle(poison, attempt=3)
    assert (dead.outcome, dead.error) == (Outcome.DEAD, "ValueError: a negative amount")
    assert inbox.handle(poison, attempt=4).outcome is Outcome.DUPLICATE  # acked, not rerun
    with db.connect() as conn:
        row = conn.execute(select(inbox_message)).one()
    assert (row.status, row.attempts, row.last_error) == (DEAD, 3, dead.error)
    assert (row.topic, row.payload, row.headers) == (
        poison.topic,
        poison.payload,
        {"Outbox-Key": "o-1"},
    )
    assert invoices(db) == []

    # An operator fixed the cause and gave it back: the runner runs it from the table.
    with db.begin() as conn:
        conn.execute(update(inbox_message).values(status=REQUEUED))
    fixed = Inbox(db, "billing", max_attempts=3)

    @fixed.handler("orders.*")
    def bill_anyway(session: Session, message: InboxMessage) -> None:
        session.execute(insert(invoice).values(msg_id=str(message.msg_id), amount=5))

    [again] = fixed.requeued()
    assert again == poison
    assert fixed.handle_requeued(again).outcome is Outcome.HANDLED
    assert fixed.handle_requeued(again).outcome is Outcome.DUPLICATE
    assert invoices(db) == [5] and inbox_rows(db) == [("billing", HANDLED, 4)]


def test_a_message_no_handler_matches_is_a_dead_letter(db: Engine) -> None:
    result = billing(db).handle(order(1, topic="payments.taken"))
    assert result.outcome is Outcome.DEAD
    assert result.error == "no handler of consumer 'billing' matches topic 'payments.taken'"


def test_consumers_are_independent(db: Engine) -> None:
    message = order(3)
    assert billing(db, "billing").handle(message).outcome is Outcome.HANDLED
    other = Inbox(db, "audit")
    other.handler(">")(lambda session, m: None)
    assert other.handle(message).outcome is Outcome.HANDLED
    assert other.handle(message).outcome is Outcome.DUPLICATE
    assert [c for c, _, _ in inbox_rows(db)] == ["audit", "billing"]


def test_two_copies_at_once_run_one_handler_to_the_commit(db: Engine) -> None:
    """The second copy waits on the first one's inbox row (its row lock; SQLite's one
    writer), then finds it committed."""
    inbox = Inbox(db, "billing")
    inside, release = threading.Event(), threading.Event()
    runs: list[int] = []

    @inbox.handler("orders.*")
    def slow(session: Session, message: InboxMessage) -> None:
        runs.append(1)
        session.execute(insert(invoice).values(msg_id=str(message.msg_id), amount=1))
        inside.set()
        assert release.wait(DEADLINE_S)

    message = order(1)
    results: list[Outcome] = []
    first = threading.Thread(target=lambda: results.append(inbox.handle(message).outcome))
    first.start()
    assert inside.wait(DEADLINE_S)
    second = threading.Thread(target=lambda: results.append(inbox.handle(message).outcome))
    second.start()  # waits on the first one's inbox row
    second.join(0.5)
    assert second.is_alive(), "the second copy did not wait for the first one's commit"
    release.set()
    for thread in (first, second):
        thread.join(DEADLINE_S)
    assert sorted(results) == [Outcome.DUPLICATE, Outcome.HANDLED] and runs == [1]
    assert invoices(db) == [1]


ASYNC_DRIVERS = {"postgresql": "psycopg_async", "mysql": "asyncmy", "sqlite": "aiosqlite"}


def test_an_async_handler_gets_an_async_session(db: Engine) -> None:
    url = db.url.set(drivername=f"{db.dialect.name}+{ASYNC_DRIVERS[db.dialect.name]}")
    inbox = Inbox(url.render_as_string(hide_password=False), "billing")

    @inbox.handler("orders.*")
    async def bill(session: AsyncSession, message: InboxMessage) -> None:
        await session.execute(insert(invoice).values(msg_id=str(message.msg_id), amount=9))

    message = order(9)

    async def twice() -> list[Outcome]:
        return [(await inbox.handle_async(message)).outcome for _ in range(2)]

    assert asyncio.run(twice()) == [Outcome.HANDLED, Outcome.DUPLICATE]
    assert invoices(db) == [9]


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"consumer": "bad name"}, "consumer: "),
        ({"consumer": "ok", "max_attempts": 0}, "max_attempts: must be a whole number"),
        ({"consumer": "ok", "backoff_s": ()}, "backoff_s: must be a non-empty sequence"),
        ({"consumer": "ok", "keep_days": 0}, "keep_days: must be a number of days above 0"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(options: dict[str, object], said: str) -> None:
    with pytest.raises(ConfigError, match=said):
        Inbox(None, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize("pattern", ["", "orders.", "orders.>.x", "ord*rs", "a..b"])
def test_bad_patterns_are_refused(pattern: str) -> None:
    with pytest.raises(ConfigError, match="pattern: "):
        Inbox(None, "ok").handler(pattern)


def test_a_message_the_outbox_did_not_send_is_refused() -> None:
    with pytest.raises(Exception, match="not a message of the outbox"):
        InboxMessage.from_broker("no-uuid", "t", b"", {})
    assert InboxMessage.from_broker(str(uuid.uuid4()), "t", b"", {"Outbox-Seq": "4"}).seq == 4


def test_the_inbox_forgets_handled_msg_ids_past_its_window_and_keeps_dead_letters(
    db: Engine,
) -> None:
    inbox = billing(db, keep_days=1)
    old, recent, dead = order(1), order(2), order(-1)
    for message in (old, recent):
        assert inbox.handle(message).outcome is Outcome.HANDLED
    assert inbox.handle(dead, attempt=5).outcome is Outcome.DEAD
    with db.begin() as conn:  # handled and buried two days ago, by the database's clock
        two_days_ago = conn.execute(select(db_now())).scalar_one() - timedelta(days=2)
        stale = inbox_message.c.msg_id.in_([old.msg_id, dead.msg_id])
        conn.execute(update(inbox_message).where(stale).values(created_at=two_days_ago))
    assert inbox.purge(batch=1) == 1
    with db.connect() as conn:
        left = set(conn.execute(select(inbox_message.c.msg_id)).scalars())
    assert left == {recent.msg_id, dead.msg_id}
    assert billing(db, "other", keep_days=1).purge() == 0  # another consumer's rows: not its


# Order: an ordered message's key and seq (the Outbox-Seq header)


def ordered(seq: int, key: str = "k1", amount: int = 1) -> InboxMessage:
    headers = {"Outbox-Key": key, "Outbox-Seq": str(seq)}
    return InboxMessage.from_broker(
        str(uuid7()), "orders.created", f'{{"amount": {amount}}}'.encode(), headers
    )


def seen_in(inbox: Inbox) -> list[int | None]:
    """Register a handler that notes the seqs it ran (committed or not)."""
    seqs: list[int | None] = []

    @inbox.handler("orders.*")
    def note(session: Session, message: InboxMessage) -> None:
        seqs.append(message.seq)
        if message.json()["amount"] < 0:
            raise ValueError("a negative amount")

    return seqs


def test_a_keys_next_message_waits_for_the_one_before_it(db: Engine) -> None:
    inbox = Inbox(db, "billing", gap_wait_s=600)
    seqs = seen_in(inbox)
    one, two, three = ordered(1), ordered(2), ordered(3)
    other_key = ordered(7, key="k2")  # a key first seen mid-way starts there
    assert inbox.handle(one).outcome is Outcome.HANDLED
    held = inbox.handle(three)
    assert (held.outcome, held.error) == (
        Outcome.HELD,
        "seq 3 of key 'k1' of orders.created waits for seq 2",
    )
    assert held.delay_s == 1.0
    assert inbox.handle(other_key).outcome is Outcome.HANDLED  # other keys go on
    assert inbox.handle(two) == (Outcome.HANDLED, 0.0, None, None)
    assert inbox.handle(three, attempt=2) == (Outcome.HANDLED, 0.0, None, None)
    assert seqs == [1, 7, 2, 3]


def test_a_gap_is_held_for_a_bounded_time_then_reported_never_silently(db: Engine) -> None:
    inbox = Inbox(db, "billing", gap_wait_s=0, max_attempts=2)
    seqs = seen_in(inbox)
    inbox.handle(ordered(1))
    three = inbox.handle(ordered(3), attempt=5)  # past the wait: runs, and says why
    assert three.outcome is Outcome.HANDLED
    assert (
        three.out_of_order == "seq 3 of key 'k1' of orders.created handled without seq 2, after 0 s"
    )
    late = inbox.handle(ordered(2))
    assert late.out_of_order == "seq 2 of key 'k1' of orders.created came after seq 3"
    assert seqs == [1, 3, 2]


def test_deliveries_it_was_held_for_are_no_failures_and_a_dead_one_lets_its_key_go_on(
    db: Engine,
) -> None:
    inbox = Inbox(db, "billing", gap_wait_s=600, max_attempts=2)
    seen_in(inbox)
    inbox.handle(ordered(1))
    waiting = ordered(3)
    for attempt in (1, 2, 3):
        assert inbox.handle(waiting, attempt).outcome is Outcome.HELD
    assert inbox.handle(ordered(2, amount=-1), attempt=2).outcome is Outcome.DEAD
    assert inbox.handle(waiting, attempt=4).outcome is Outcome.HANDLED  # not dead: 1 try
