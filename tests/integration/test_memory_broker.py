"""``Outbox(db, broker=MemoryBroker())``: a Broker object backs an Outbox end to end,
the fast path and the sweeper alike, with no broker server (docs/testing.md)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
from sqlalchemy.orm import Session

from outbox import Outbox
from outbox.broker import PublishResult, ok
from outbox.errors import ConfigError
from outbox.message import Message
from relay.testing import MemoryBroker
from tests.helpers import migrated, unsent, wait_until


def sent_through(sqlite_url: str, broker: object, **send: Any) -> tuple[Outbox, str]:
    """One message sent by an Outbox on ``broker`` and marked sent; the Outbox (stopped)
    and the msg_id."""
    with migrated(sqlite_url):
        ob = Outbox(sqlite_url, broker=broker)
        ob.start()
        try:
            with Session(ob.engine) as session, session.begin():
                msg_id = ob.send(session, "orders.created", {"n": 1}, **send)
            wait_until(lambda: unsent(sqlite_url) == 0, what="the row marked sent")
        finally:
            ob.stop()
    return ob, msg_id


def test_send_and_the_fast_path_publish_to_a_broker_object(sqlite_url: str) -> None:
    broker = MemoryBroker()
    ob, msg_id = sent_through(sqlite_url, broker, key="k1")
    assert [m.msg_id for m in broker.published] == [msg_id]
    assert (ob.stats is not None) and ob.handed_off == 1
    entries = asyncio.run(first_chunk(broker))
    assert [(e.msg_id, e.topic, e.headers["Outbox-Key"]) for e in entries] == [
        (msg_id, "orders.created", "k1")
    ]


async def first_chunk(broker: MemoryBroker) -> list:  # type: ignore[type-arg]
    async for entries in broker.read_log():
        return entries
    return []


def test_the_sweeper_publishes_a_row_committed_while_the_relay_was_stopped(
    sqlite_url: str,
) -> None:
    broker = MemoryBroker()
    options = {"sweeper_age_s": 0.2, "handoff_limit_s": 0.1, "sweep_interval_s": 0.05}
    with migrated(sqlite_url):
        ob = Outbox(sqlite_url, broker=broker, **options)
        with Session(ob.engine) as session, session.begin():  # not started: no fast path
            msg_id = ob.send(session, "orders.created", b"late")
        assert ob.handed_off == 0 and unsent(sqlite_url) == 1
        ob.start()
        try:
            wait_until(lambda: unsent(sqlite_url) == 0, what="the sweeper's publish")
        finally:
            ob.stop()
    assert [(m.msg_id, m.payload) for m in broker.published] == [(msg_id, b"late")]


def test_an_object_broker_is_shown_by_its_class_and_a_non_broker_is_refused(
    sqlite_url: str,
) -> None:
    ob = Outbox(sqlite_url, broker=MemoryBroker())
    assert "broker='<MemoryBroker>'" in repr(ob)
    with pytest.raises(ConfigError, match="broker: must be a URL or a Broker object"):
        Outbox(sqlite_url, broker=object())  # type: ignore[arg-type]


class DuckBroker:
    """A user's own broker: the three methods, no base class."""

    def __init__(self) -> None:
        self.published: list[str] = []

    async def connect(self) -> None:
        pass

    async def publish(self, messages: Sequence[Message]) -> list[PublishResult]:
        self.published += [m.msg_id for m in messages]
        return [ok(f"duck:{len(self.published)}") for _ in messages]

    async def close(self) -> None:
        pass


def test_a_broker_class_of_the_users_own_needs_no_base_class(sqlite_url: str) -> None:
    broker = DuckBroker()
    _, msg_id = sent_through(sqlite_url, broker)
    assert broker.published == [msg_id]
