"""The demo's consumer: an ``outbox.Inbox`` reads the run's stream and records each message
once in a table of its own, then the stream is replayed to it from the start (its durable
consumer deleted, as when a consumer's broker state is lost): every copy is acked without
running the handler again.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

from nats.js.errors import NotFoundError
from sqlalchemy import Column, Engine, MetaData, String, Table, delete, func, insert, select
from sqlalchemy.orm import Session

from outbox import Inbox, InboxMessage
from outbox.table import inbox_message
from relay.brokers.nats import connect_reader
from relay.consume.nats import NatsSubscription
from relay.consume.runner import Consumer

WAIT_S = 60.0


class Consumed(NamedTuple):
    handled: int  # distinct messages the handler committed
    twice: int  # messages the handler committed more than once (must be 0)
    replayed: int  # copies of the replay acked without running the handler


def handled_table(tag: str) -> Table:
    return Table(f"demo_handled_{tag}", MetaData(), Column("msg_id", String(36), primary_key=True),
                 Column("times", String(8)))  # fmt: skip


def consumer_name(tag: str) -> str:
    return f"demo_{tag}"


def consume(engine: Engine, broker: str, stream: str, tag: str, committed: int) -> Consumed:
    """Handle the run's messages, then the replay; the figures."""
    table = handled_table(tag)
    table.create(engine, checkfirst=True)
    inbox = Inbox(engine, consumer_name(tag))

    @inbox.handler(f"demo.{tag}.>")
    def record(session: Session, message: InboxMessage) -> None:
        session.execute(insert(table).values(msg_id=str(message.msg_id), times="1"))

    url = f"{broker}?stream={stream}"
    first = asyncio.run(until(inbox, url, lambda c: c["handled"] >= committed))
    asyncio.run(forget_consumer(broker, stream, inbox.consumer))
    again = asyncio.run(until(inbox, url, lambda c: c["duplicate"] >= committed))
    with engine.connect() as conn:
        handled = conn.execute(select(func.count()).select_from(table)).scalar_one()
    return Consumed(handled, first["handled"] + again["handled"] - handled, again["duplicate"])


async def until(inbox: Inbox, url: str, done: Callable[[Counter[str]], bool]) -> Counter[str]:
    stopping = asyncio.Event()
    consumer = Consumer(inbox, NatsSubscription(url, inbox.consumer, inbox.patterns), batch=64)
    task = asyncio.create_task(consumer.run(stopping))
    deadline = time.monotonic() + WAIT_S
    while not done(consumer.counts) and not task.done() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    stopping.set()
    await task
    return consumer.counts


async def forget_consumer(broker: str, stream: str, name: str) -> None:
    nc = await connect_reader(broker)
    try:
        await nc.jetstream(timeout=5).delete_consumer(stream, name)
    except NotFoundError:
        pass
    finally:
        await nc.close()


def clean_up(engine: Engine, tag: str) -> None:
    """The consumer's table and its inbox rows."""
    handled_table(tag).drop(engine, checkfirst=True)
    with engine.begin() as conn:
        conn.execute(delete(inbox_message).where(inbox_message.c.consumer == consumer_name(tag)))
