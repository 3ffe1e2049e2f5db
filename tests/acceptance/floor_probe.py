"""What the package must do on the lowest versions of its dependencies it claims, run by
test_install_floors.py with that virtualenv's python:
``python floor_probe.py PINS_JSON PG_URL FOLDER``.

PINS_JSON maps each distribution to the version pinned; PG_URL is a scratch PostgreSQL
schema; FOLDER a scratch folder. It imports only what the wheel installed and fails with
an AssertionError saying what broke.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from contextlib import suppress
from importlib.metadata import version


class Failed(Exception):
    """The app's own failure after send()."""


def wait_until(condition: Callable[[], object], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def main(pins: dict[str, str], pg_url: str, folder: str) -> None:
    for name, pinned in pins.items():
        assert release(version(name)) == release(pinned), f"{name} {version(name)} installed"
    relayed(pg_url)
    relayed(f"sqlite:///{folder}/floor.sqlite")
    in_callers_transaction(f"sqlite:///{folder}/caller.sqlite")
    print("floor probe ok:", ", ".join(f"{k}=={v}" for k, v in sorted(pins.items())))


def release(text: str) -> tuple[int, ...]:
    """A plain release number without its trailing zeros: 2.0 and 2.0.0 are one."""
    parts = [int(part) for part in text.split(".")]
    while parts and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def relayed(db: str) -> None:
    """migrate; a started relay publishes a committed message, never a rolled-back one;
    the row reads back as sent."""
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from outbox import Outbox, migrate, outbox_message
    from relay.testing import MemoryBroker

    migrate.upgrade(db)
    broker = MemoryBroker()
    ob = Outbox(db, broker=broker, sweep_interval_s=0.2)
    ob.start()
    try:
        with Session(ob.engine) as session, session.begin():
            sent = ob.send(session, "floor.sent", {"n": 1}, key="k")
        with suppress(Failed), Session(ob.engine) as session, session.begin():
            ob.send(session, "floor.rolled_back", {"n": 2})
            raise Failed("the request failed after send(): its transaction rolls back")
        wait_until(lambda: [m.msg_id for m in broker.published] == [sent], "the message")
        wait_until(lambda: status_of(ob.engine, sent) == "sent", "the row marked sent")
        with ob.engine.connect() as conn:
            topics = conn.execute(select(outbox_message.c.topic)).scalars().all()
        assert topics == ["floor.sent"], topics
    finally:
        ob.stop()


def status_of(engine: object, msg_id: str) -> str | None:
    from sqlalchemy import Engine, select

    from outbox import outbox_message as t

    assert isinstance(engine, Engine)
    with engine.connect() as conn:
        found = conn.execute(select(t.c.status, t.c.msg_id)).all()
    return next((status for status, m in found if str(m) == msg_id), None)


def in_callers_transaction(db: str) -> None:
    """``migrate.upgrade(conn)`` inside the caller's transaction (an app's own revision)."""
    from sqlalchemy import create_engine, inspect

    from outbox import migrate

    engine = create_engine(db)
    with engine.begin() as conn:
        migrate.upgrade(conn)
    assert "outbox_message" in inspect(engine).get_table_names()
    engine.dispose()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), sys.argv[2], sys.argv[3])
