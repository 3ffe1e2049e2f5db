"""`make demo` pointed at your own database and NATS server (OUTBOX_DB, OUTBOX_BROKER) leaves
nothing behind: its stream, its business table and its outbox rows are removed, the
outbox tables too if it created them; a user's own rows and stream stay. --keep keeps."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

from sqlalchemy import create_engine, inspect, select
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from outbox import Outbox, migrate
from outbox.table import outbox_message as t
from relay.brokers.nats import connect_reader, create_stream
from relay.testing import MemoryBroker
from relay.testing.embedded import NatsServer

ROOT = Path(__file__).resolve().parents[2]


def demo(db: str, broker: str, *flags: str) -> str:
    env = {**os.environ, "OUTBOX_DB": db, "OUTBOX_BROKER": broker}
    command = [sys.executable, "-m", "examples.demo", "--requests", "40", *flags]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "lost (must be 0)" in done.stdout
    return done.stdout


def streams(url: str) -> set[str]:
    async def names() -> set[str]:
        nc = await connect_reader(url)
        try:
            return {info.config.name for info in await nc.jetstream().streams_info()}
        finally:
            await nc.close()

    return set(asyncio.run(names()))


def tables(db: str) -> set[str]:
    engine = create_engine(db, poolclass=NullPool)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def topics(db: str) -> list[str]:
    engine = create_engine(db, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return list(conn.execute(select(t.c.topic).order_by(t.c.topic)).scalars())
    finally:
        engine.dispose()


def users_message(db: str) -> None:
    """The user's schema, with one row of their own, before the demo runs."""
    migrate.upgrade(db)
    ob = Outbox(db, broker=MemoryBroker())
    with Session(ob.engine) as session, session.begin():
        ob.send(session, "shop.orders", {"order": 1})
    ob.engine.dispose()


def test_the_demo_leaves_a_users_database_and_stream_as_it_found_them(
    pg_url: str, nats_server: NatsServer
) -> None:
    users_message(pg_url)
    create_stream(nats_server.url, "SHOP", "shop.>")
    before = tables(pg_url)
    out = demo(pg_url, f"{nats_server.url}?stream=SHOP&subjects=shop.>")  # the README's own
    assert "removed: stream DEMO_" in out, out
    assert tables(pg_url) == before, "the demo's table is dropped, the outbox's kept"
    assert topics(pg_url) == ["shop.orders"], "only the demo's rows are deleted"
    assert streams(nats_server.url) == {"SHOP"}


def test_the_demo_removes_the_outbox_tables_it_created(
    pg_url: str, nats_server: NatsServer
) -> None:
    assert tables(pg_url) == set()
    demo(pg_url, nats_server.url)
    assert tables(pg_url) == set(), "the outbox tables were not there before"
    assert streams(nats_server.url) == set()


def test_keep_leaves_the_run_for_a_look(sqlite_url: str, nats_server: NatsServer) -> None:
    out = demo(sqlite_url, nats_server.url, "--keep")
    assert "kept: stream DEMO_" in out, out
    [stream] = streams(nats_server.url)
    assert stream.startswith("DEMO_")
    kept = sorted(tables(sqlite_url) - migrate.OWNED_TABLES)
    assert [name[: name.rindex("_") + 1] for name in kept] == ["demo_handled_", "demo_inbound_"]
    assert topics(sqlite_url) and all(topic.startswith("demo.") for topic in topics(sqlite_url))
