"""Small things a newcomer trips on (issue 37, class 9): each has its test here."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from sqlalchemy import create_engine, select

from outbox.table import outbox_message as t
from relay.brokers.nats import read_stream
from relay.cli import build_parser, command_settings, main
from relay.cli.common import UsageError
from relay.runtime import Relay
from relay.testing import MemoryBroker
from relay.testing.embedded import free_port


def test_metrics_listen_on_loopback_unless_told(sqlite_url: str) -> None:
    """/metrics binds 127.0.0.1 by default, like the dashboard; --metrics-addr opens it."""
    assert build_parser().parse_args(["relay"]).metrics_addr == "127.0.0.1"
    opened = build_parser().parse_args(["relay", "--metrics-addr", "0.0.0.0"])
    assert opened.metrics_addr == "0.0.0.0"
    engine = create_engine(sqlite_url)
    relay = Relay(engine, MemoryBroker(), fast_path=False, sweeper=False,
                  metrics_port=free_port())  # fmt: skip
    relay.start()
    try:
        assert relay._metrics._server.server_address[0] == "127.0.0.1"
    finally:
        relay.stop(timeout=5)
        engine.dispose()


@pytest.mark.parametrize(
    "command",
    [["status"], ["dead"], ["requeue", "--dead"], ["show", "0" * 32], ["dashboard"],
     ["relay", "--broker", "nats://127.0.0.1:1"], ["drain", "--broker", "nats://127.0.0.1:1"],
     ["export", "ledger", "--out", "x.parquet"]],
    ids=lambda command: command[0],
)  # fmt: skip
def test_a_command_that_reads_never_creates_a_sqlite_file(
    command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """`outbox status --db sqlite:///typo.sqlite` made an empty file: a usage error naming
    the path now, the file left unmade; `outbox migrate` still creates the database."""
    monkeypatch.chdir(tmp_path)
    typo = tmp_path / "typo.sqlite"
    assert main([command[0], "--db", "sqlite:///typo.sqlite", *command[1:]]) == 2
    err = capsys.readouterr().err
    assert f"--db: no SQLite database at {typo}" in err and "outbox migrate" in err, err
    assert not typo.exists()
    assert main(["migrate", "--db", "sqlite:///typo.sqlite"]) == 0 and typo.exists()
    assert main(["status", "--db", "sqlite:///typo.sqlite"]) == 0


# What only the fast path (or send()) reads: a worker runs the sweeper and the scheduler.
FAST_PATH_ONLY = ["--queue-size", "--retry-delays-ms", "--tick-ms", "--handoff-limit-s",
                  "--publish-batch", "--max-in-flight", "--ack-batch-size", "--ack-flush-ms",
                  "--verify-commit", "--max-payload-bytes"]  # fmt: skip


@pytest.mark.parametrize("command", ["relay", "drain"])
def test_a_workers_help_lists_no_fast_path_flag(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`outbox relay --help` listed flags a worker ignores; they are still taken, from a
    flag or an environment an app shares, checked and harmless."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    shown = capsys.readouterr().out
    assert "--sweeper-age-s" in shown and "--max-attempts" in shown
    assert [flag for flag in FAST_PATH_ONLY if flag in shown] == []
    monkeypatch.setenv("OUTBOX_QUEUE_SIZE", "5")
    monkeypatch.setenv("OUTBOX_HANDOFF_LIMIT_S", "3")
    args = build_parser().parse_args([command, "--tick-ms", "2", "--sweeper-age-s", "4"])
    settings = command_settings(args, None)
    assert (settings.queue_size, settings.handoff_limit_s, settings.tick_ms) == (5, 3, 2)
    monkeypatch.setenv("OUTBOX_HANDOFF_LIMIT_S", "20")  # still checked against sweeper_age_s
    with pytest.raises(
        UsageError, match=r"handoff_limit_s \(OUTBOX_HANDOFF_LIMIT_S\): must be below"
    ):
        command_settings(build_parser().parse_args([command]), None)


FORGETS_STOP = """
import sys
from sqlalchemy.orm import Session
from outbox import Outbox, migrate
from relay.testing import MemoryBroker

db, broker = sys.argv[1], sys.argv[2]
ob = Outbox(db, broker=broker or MemoryBroker())
migrate.upgrade(ob.engine)
ob.start()
with Session(ob.engine) as session, session.begin():
    print(ob.send(session, "forgot.stop", {"n": 1}))
# no ob.stop(): the interpreter exits with the relay running
"""


@pytest.mark.parametrize("kind", ["memory", "nats"])
def test_a_script_without_stop_exits_quietly_and_loses_nothing(
    kind: str, sqlite_url: str, request: pytest.FixtureRequest
) -> None:
    """A script that forgot ob.stop() printed "Task was destroyed but it is pending!" (the
    relay's loop thread was killed at exit): the relay is stopped at exit now, quietly,
    and the committed message is published, or left pending for a sweeper."""
    broker = ""
    if kind == "nats":
        server = request.getfixturevalue("nats_server")
        name, _ = request.getfixturevalue("stream")
        broker = f"{server.url}?stream={name}&subjects=forgot.>"
    done = subprocess.run([sys.executable, "-c", FORGETS_STOP, sqlite_url, broker],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Task was destroyed" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    msg_id = done.stdout.strip()
    engine = create_engine(sqlite_url)
    with engine.connect() as conn:
        [status] = conn.execute(select(t.c.status).where(t.c.msg_id == uuid.UUID(msg_id))).scalars()
    engine.dispose()
    assert status in ("sent", "pending"), status
    if kind == "nats":
        assert status == "sent"
        at_broker = asyncio.run(read_stream(server.url, name))
        assert [m.msg_id for m in at_broker] == [msg_id]
