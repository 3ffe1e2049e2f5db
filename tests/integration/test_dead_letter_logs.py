"""A message going dead is a WARNING with its msg_id, topic and reason: in an app's log
(the in-app sweeper) and in a worker's (its sweeps and its scheduler), against
PostgreSQL. Before, the app's sweeper said nothing and a worker's INFO line said
``dead=11`` with neither ids nor reasons: whoever alerts on WARNING never heard of it."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, create_engine, func, select
from sqlalchemy.orm import Session

from outbox import Outbox, migrate, outbox_message
from outbox.broker import PublishResult, permanent
from outbox.message import Message
from outbox.settings import Settings
from relay.runtime import Relay
from relay.testing.memory import MemoryBroker
from tests.helpers import wait_until

t = outbox_message
QUICK = {
    "sweeper_age_s": 0.3,
    "handoff_limit_s": 0.1,
    "sweep_interval_s": 0.1,
    "permanent_attempts": 1,
}


def refuse_poison(message: Message) -> PublishResult | None:
    if message.topic.endswith(".poison"):
        return permanent("no stream captures subject 'dl.poison'\n  (and a second line)")
    return None


@pytest.fixture
def engine(pg_url: str) -> Iterator[Engine]:
    migrate.upgrade(pg_url)
    eng = create_engine(pg_url, pool_size=5)
    yield eng
    eng.dispose()


def dead_count(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).where(t.c.status == "dead")).scalar_one())


def dead_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "relay.sweep.dead_letters"]


def test_an_apps_sweeper_logs_a_dead_letter_at_warning(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """The app's log (WARNING) gets one line naming the dead message; the healthy one
    goes out unsaid."""
    caplog.set_level(logging.WARNING)
    ob = Outbox(engine, broker=MemoryBroker(policy=refuse_poison), **QUICK)
    ob.start()
    try:
        with Session(engine) as session, session.begin():
            poison = ob.send(session, "dl.poison", {"n": 1})
            ob.send(session, "dl.ok", {"n": 2})
        wait_until(lambda: dead_count(engine) == 1, what="the poison row dead")
        wait_until(lambda: dead_lines(caplog), what="its WARNING line")
    finally:
        ob.stop()
    [line] = dead_lines(caplog)
    assert line.levelno == logging.WARNING
    assert line.getMessage() == (
        f"message went dead (sweeper): msg_id={poison} topic=dl.poison attempts=1 "
        "reason: permanent: no stream captures subject 'dl.poison'"
    )


def test_a_workers_sweep_line_names_the_reasons_and_each_dead_letter_is_a_warning(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker (no fast path): its sweep's INFO line says why rows went dead, and its
    sweeper and its scheduler (a scheduled message) each log the dead letter at WARNING."""
    caplog.set_level(logging.INFO)
    writer = Outbox(engine)
    with Session(engine) as session, session.begin():
        swept = [writer.send(session, "dl.poison", {"n": n}) for n in range(2)]
        scheduled = writer.send(session, "dl.poison", {"n": 3}, delay=0.3)
    relay = Relay(engine, MemoryBroker(policy=refuse_poison), Settings(**QUICK),
                  fast_path=False, name="outbox-worker")  # fmt: skip
    relay.start()
    try:
        wait_until(lambda: dead_count(engine) == 3, what="three dead rows")
    finally:
        relay.stop(5.0)
    by_id = {r.getMessage().split("msg_id=")[1].split()[0]: r for r in dead_lines(caplog)}
    assert sorted(by_id) == sorted([*swept, scheduled]), "one line per dead letter"
    assert all(r.levelno == logging.WARNING for r in by_id.values())
    assert "went dead (scheduler): " in by_id[scheduled].getMessage()
    for msg_id in swept:
        assert by_id[msg_id].getMessage().startswith("message went dead (sweeper): ")
    sweeps = [r.getMessage() for r in caplog.records if r.name == "relay.sweep.sweeper"]
    assert any(
        line.startswith("sweep: claimed=2 sent=0 retry_later=0 dead=2 (2 x permanent: no stream ")
        for line in sweeps
    ), sweeps
