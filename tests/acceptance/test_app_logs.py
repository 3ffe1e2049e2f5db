"""An app's log at INFO holds one line from ``start()`` and one from ``stop()``: none of
APScheduler's job lines (two a second per process), Alembic's context lines or the
sweeper's batches.

The app (quiet_app.py) runs in its own process with ``logging.basicConfig(level=INFO)``,
as an app would: nothing the test runner configured can quiet it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy.orm import Session

from outbox import Outbox, migrate
from relay.brokers.nats import create_stream
from relay.testing.embedded import NatsServer

APP = Path(__file__).with_name("quiet_app.py")


def leave_a_row_pending(db: str) -> None:
    """A row another process committed and never published: the app's sweeper's to send."""
    ob = Outbox(db)
    with Session(ob.engine) as session, session.begin():
        ob.send(session, "app.orders.created", {"earlier": True})
    ob.engine.dispose()


def relay_lines(output: str) -> list[str]:
    """The log lines written between the app's start() and the end of its stop()."""
    lines = output.splitlines()
    assert "MARK start" in lines and "MARK end" in lines, output[-3000:]
    between = lines[lines.index("MARK start") + 1 : lines.index("MARK end")]
    return [line for line in between if line != "MARK stop"]


@pytest.mark.parametrize("broker", ["memory", "nats"])
def test_start_adds_one_line_to_an_app_log(
    broker: str, sqlite_url: str, stream: tuple[str, str], request: pytest.FixtureRequest
) -> None:
    migrate.upgrade(sqlite_url)
    leave_a_row_pending(sqlite_url)
    args = []
    if broker == "nats":
        server: NatsServer = request.getfixturevalue("nats_server")
        name, _ = stream
        create_stream(server.url, name, "app.>")  # beforehand: creating it logs a line
        args = [f"{server.url}?stream={name}&subjects=app.>"]
    done = subprocess.run([sys.executable, str(APP), sqlite_url, *args],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = relay_lines(done.stdout)
    started, stopped = lines[0], lines[-1]
    shown = args[0] if args else "MemoryBroker"
    assert started == f"INFO outbox: outbox relay started: broker {shown} (sweeper on)", lines
    assert stopped == "INFO outbox: outbox relay stopped", lines
    assert len(lines) == 2, lines
    assert "apscheduler" not in done.stdout + done.stderr
    assert "alembic" not in done.stdout + done.stderr
