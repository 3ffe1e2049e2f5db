"""ob.cancel(session, msg_id) / await ob.cancel_async(...): a scheduled message withdrawn in
the caller's transaction, and the race with a publish in flight resolved one way.

The publisher here is a plain connection holding the row ``FOR UPDATE`` and marking it
the way a relay's scheduler does (claim, publish, mark, commit): the cancel's UPDATE waits
for that lock, so it sees the publish's outcome, never a row in between.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from sqlalchemy import Engine, func, select, update
from sqlalchemy.orm import Session

from outbox import Outbox, outbox_message
from outbox.errors import ConfigError, InvalidMessage
from outbox.table import db_now
from relay import store
from tests.flavours import Flavour, maybe
from tests.helpers import migrated
from tests.locks import blocked_on_lock
from tests.scheduling import statuses

t = outbox_message


def send_committed(ob: Outbox, engine: Engine, **kw: Any) -> str:
    with Session(engine) as session, session.begin():
        return ob.send(session, "reminders", b"x", **kw)


def test_a_cancel_before_commit_means_never_written_or_canceled(flavour: Flavour) -> None:
    """In the sending transaction: a Session's row is canceled, an AsyncSession's staged
    message is never written. A second cancel finds nothing left to cancel."""
    ob, engine = flavour.ob, flavour.engine
    found: dict[str, Any] = {}

    async def cancel(session: Any, msg_id: str) -> bool:
        if flavour.is_async:
            return await ob.cancel_async(session, msg_id)
        return ob.cancel(session, msg_id)

    async def case() -> None:
        session = flavour.session()
        try:
            found["kept"] = ob.send(session, "reminders", b"kept", delay=60)
            found["gone"] = ob.send(session, "reminders", b"gone", delay=60)
            found["first"] = await cancel(session, found["gone"])
            found["again"] = await cancel(session, found["gone"])
            await maybe(session.commit())
        finally:
            await maybe(session.close())

    flavour.run(case)
    assert (found["first"], found["again"]) == (True, False)
    expected = {found["kept"]: "pending"}
    if not flavour.is_async:
        expected[found["gone"]] = "canceled"  # written at send(), canceled by the UPDATE
    assert statuses(engine) == expected


def test_a_cancel_in_a_savepoint_rolled_back_is_undone(flavour: Flavour) -> None:
    ob, engine = flavour.ob, flavour.engine
    sent: list[str] = []

    async def case() -> None:
        session = flavour.session()
        try:
            sent.append(ob.send(session, "reminders", b"x", delay=60))
            savepoint = await maybe(session.begin_nested())
            canceled = await (
                ob.cancel_async(session, sent[0])
                if flavour.is_async
                else maybe(ob.cancel(session, sent[0]))
            )
            assert canceled
            await maybe(savepoint.rollback())
            await maybe(session.commit())
        finally:
            await maybe(session.close())

    flavour.run(case)
    assert statuses(engine) == {sent[0]: "pending"}


def test_a_cancel_after_commit_and_what_cannot_be_canceled(any_db: str) -> None:
    with migrated(any_db) as engine:
        ob = Outbox(engine)
        scheduled = send_committed(ob, engine, delay=3600)
        deduped = send_committed(ob, engine, dedup_key="order-42")
        unscheduled = send_committed(ob, engine)
        unknown = str(uuid.uuid4())
        with Session(engine) as session, session.begin():
            assert ob.cancel(session, scheduled) is True
            assert ob.cancel(session, uuid.UUID(deduped)) is True  # a UUID object works too
            assert ob.cancel(session, scheduled) is False  # canceled already
            assert ob.cancel(session, unscheduled) is False  # the fast path owns it
            assert ob.cancel(session, unknown) is False
            with pytest.raises(InvalidMessage) as caught:
                ob.cancel(session, "order-42")
            assert caught.value.field == "msg_id"
            after = ob.send(session, "reminders", b"after", delay=1)  # still usable
        assert statuses(engine) == {
            scheduled: "canceled",
            deduped: "canceled",
            unscheduled: "pending",
            after: "pending",
        }
        # A second send of a canceled dedup_key writes nothing: the key is used.
        assert send_committed(ob, engine, dedup_key="order-42") == deduped
        assert statuses(engine)[deduped] == "canceled"
        # Nor does an operator's requeue by msg_id bring it back.
        with engine.begin() as conn:
            assert store.requeue(conn, False, None, [scheduled, deduped]) == 0
        assert statuses(engine)[scheduled] == statuses(engine)[deduped] == "canceled"


def test_a_cancel_rolled_back_leaves_the_message_scheduled(any_db: str) -> None:
    with migrated(any_db) as engine:
        ob = Outbox(engine)
        msg_id = send_committed(ob, engine, delay=3600)
        with Session(engine) as session:
            assert ob.cancel(session, msg_id)
            session.rollback()
        assert statuses(engine) == {msg_id: "pending"}


def test_a_staged_copy_of_a_sent_dedup_message_cannot_be_canceled(
    async_flavour: Flavour,
) -> None:
    """The dedup_key's row went out; an AsyncSession stages the same key again (it would
    write nothing) and cancels it: False, the row stays sent. A bug answered True."""
    ob, engine = async_flavour.ob, async_flavour.engine
    msg_id = send_committed(ob, engine, dedup_key="k1")
    with engine.begin() as conn:
        conn.execute(update(t).where(t.c.msg_id == uuid.UUID(msg_id)).values(status="sent"))
    found: dict[str, Any] = {}

    async def case() -> None:
        session = async_flavour.session()
        try:
            again = ob.send(session, "reminders", b"x", dedup_key="k1")
            found["same"] = again == msg_id
            found["canceled"] = await ob.cancel_async(session, again)
            await session.commit()
        finally:
            await session.close()

    async_flavour.run(case)
    assert found == {"same": True, "canceled": False}
    assert statuses(engine) == {msg_id: "sent"}


def test_a_sync_cancel_refuses_an_async_session_and_back(async_flavour: Flavour) -> None:
    ob = async_flavour.ob

    async def case() -> None:
        session = async_flavour.session()
        try:
            with pytest.raises(ConfigError, match="cancel_async"):
                ob.cancel(session, str(uuid.uuid4()))
            with (
                Session(async_flavour.engine) as sync_session,
                pytest.raises(ConfigError, match="cancel\\(\\)"),
            ):
                await ob.cancel_async(sync_session, str(uuid.uuid4()))
        finally:
            await maybe(session.close())

    async_flavour.run(case)


@pytest.mark.parametrize("outcome", ["sent", "backoff", "rollback"])
def test_a_cancel_meeting_a_publish_in_flight_waits_for_its_outcome(
    server_db: Engine, outcome: str
) -> None:
    """The publisher holds the row lock: the cancel blocks. Published (marked sent and
    committed): the cancel returns False and the row stays sent. The publish failed (a
    backoff committed, or the publisher's transaction rolled back): the cancel returns
    True and the row is canceled, so no retry publishes it."""
    ob = Outbox(server_db)
    msg_id = send_committed(ob, server_db, delay=0)
    row = t.c.msg_id == uuid.UUID(msg_id)
    marks = {
        "sent": {"status": "sent", "sent_at": db_now()},
        "backoff": {"attempts": t.c.attempts + 1, "next_attempt_at": db_now()},
    }
    with server_db.connect() as publisher:
        claim = select(t.c.id).where(row, t.c.status == "pending").with_for_update()
        assert publisher.execute(claim).scalar_one()  # due: claimed
        with blocked_on_lock(
            server_db,
            lambda session: ob.cancel(session, msg_id),
            "the cancel waiting on the publisher's row lock",
        ) as result:
            if outcome in marks:
                publisher.execute(update(t).where(row).values(**marks[outcome]))
                publisher.commit()
            else:
                publisher.rollback()
    assert result["value"] is (outcome != "sent")
    assert statuses(server_db) == {msg_id: "sent" if outcome == "sent" else "canceled"}


def test_a_canceled_message_is_not_due(any_db: str) -> None:
    """What the scheduler's claim reads (pending, deliver_at set and past) never holds a
    canceled row."""
    with migrated(any_db) as engine:
        ob = Outbox(engine)
        due = send_committed(ob, engine, delay=0)
        gone = send_committed(ob, engine, delay=0)
        with Session(engine) as session, session.begin():
            assert ob.cancel(session, gone)
        with engine.connect() as conn:
            claim = select(t.c.msg_id).where(
                t.c.status == "pending", t.c.deliver_at.is_not(None), t.c.deliver_at <= db_now()
            )
            assert [str(m) for m in conn.execute(claim).scalars()] == [due]
            total = conn.execute(select(func.count()).select_from(t)).scalar_one()
            assert total == 2
