"""The `outbox` command line as operators run it: real processes, PostgreSQL, nats-server."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from sqlalchemy import create_engine, func, inspect, select, text, update
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from outbox import Outbox, migrate, outbox_message
from relay import cli as cli_module
from relay.brokers.nats import read_stream
from relay.testing.embedded import NatsServer
from tests.helpers import AlwaysCommits, wait_until

t = outbox_message
OUTBOX = str(Path(sys.executable).with_name("outbox"))
ROOT = Path(__file__).resolve().parents[2]


def cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [OUTBOX, *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def seed(pg_url: str, statuses: list[str], topic: str = "cli.x") -> list[str]:
    migrate.upgrade(pg_url)
    engine = create_engine(pg_url, poolclass=NullPool)
    ob = Outbox(engine)
    with Session(engine) as session, session.begin():
        ids = [ob.send(session, topic, b"x") for _ in statuses]
    with engine.begin() as conn:
        for msg_id, status in zip(ids, statuses, strict=True):
            conn.execute(
                update(t)
                .where(t.c.msg_id == uuid.UUID(msg_id))
                .values(status=status, sent_at=func.now() if status == "sent" else None, attempts=5)
            )
    engine.dispose()
    return ids


def count(pg_url: str, status: str) -> int:
    engine = create_engine(pg_url, poolclass=NullPool)
    with engine.connect() as conn:
        n = conn.execute(select(func.count()).where(t.c.status == status)).scalar_one()
    engine.dispose()
    return int(n)


@pytest.mark.parametrize(
    "command", ["migrate", "relay", "status", "requeue", "drain", "purge", "coordinator"]
)
def test_every_command_explains_itself(command: str) -> None:
    done = cli(command, "--help")
    assert done.returncode == 0 and ("--db" in done.stdout or "--broker" in done.stdout)


def test_status_reports_per_topic_and_flags_dead(pg_url: str) -> None:
    seed(pg_url, ["pending", "pending", "dead", "sent"])
    done = cli("status", "--db", pg_url, "--json")
    assert done.returncode == 3, done.stderr  # dead messages exist
    report = json.loads(done.stdout)
    [topic] = report["topics"]
    assert (topic["topic"], topic["pending"], topic["dead"], topic["sent_1m"]) == ("cli.x", 2, 1, 1)
    assert report["total"]["oldest_pending_age_s"] >= 0
    table = cli("status", "--db", pg_url)
    assert "TOTAL" in table.stdout and "cli.x" in table.stdout


def test_status_calls_pending_past_the_sla_stuck_as_the_reconciliation_does(pg_url: str) -> None:
    """A row due for longer than --sla is stuck (the reconciliation's word); pending counts
    every due row, stuck ones included; the oldest age covers them all."""
    old, *_ = seed(pg_url, ["pending", "pending", "pending"])
    engine = create_engine(pg_url, poolclass=NullPool)
    with engine.begin() as conn:
        conn.execute(
            update(t)
            .where(t.c.msg_id == uuid.UUID(old))
            .values(created_at=func.now() - text("interval '10 minutes'"))
        )
    engine.dispose()
    done = cli("status", "--db", pg_url, "--json", "--sla", "300")
    assert done.returncode == 0, done.stderr  # late, not dead: the sweeper's to deliver
    total = json.loads(done.stdout)["total"]
    assert (total["pending"], total["stuck"]) == (3, 1)
    assert total["oldest_pending_age_s"] >= 600
    table = cli("status", "--db", pg_url)
    assert table.stdout.splitlines()[0].split()[:3] == ["topic", "pending", "stuck"]
    bad = cli("status", "--db", pg_url, "--sla", "-1")
    assert bad.returncode == 2 and "argument --sla: '-1' is not a number of seconds" in bad.stderr


def test_requeue_dead_resets_attempts(pg_url: str) -> None:
    ids = seed(pg_url, ["dead", "dead", "sent"])
    refused = cli("requeue", "--db", pg_url)
    assert refused.returncode == 2 and "refusing" in refused.stderr
    done = cli("requeue", "--db", pg_url, "--dead")
    assert done.returncode == 0 and "requeued 2" in done.stdout
    engine = create_engine(pg_url, poolclass=NullPool)
    with engine.connect() as conn:
        rows = conn.execute(select(t.c.msg_id, t.c.status, t.c.attempts)).all()
    engine.dispose()
    assert {(str(m), s, a) for m, s, a in rows} == {
        (ids[0], "pending", 0),
        (ids[1], "pending", 0),
        (ids[2], "sent", 5),
    }


def test_requeue_of_an_unknown_id_is_an_error_and_changes_nothing(pg_url: str) -> None:
    [dead] = seed(pg_url, ["dead"])
    unknown = str(uuid.uuid4())
    done = cli("requeue", "--db", pg_url, "--id", dead, unknown)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert f"no message {unknown}" in done.stderr and "Traceback" not in done.stderr
    assert count(pg_url, "dead") == 1  # all or nothing: the known one stays dead too
    assert cli("requeue", "--db", pg_url, "--id", dead).returncode == 0
    assert count(pg_url, "dead") == 0


def test_drain_publishes_every_pending_row(
    pg_url: str, nats_server: NatsServer, stream: tuple[str, str]
) -> None:
    name, prefix = stream
    ids = seed(pg_url, ["pending"] * 1200, topic=f"{prefix}.backlog")
    done = cli(
        "drain", "--db", pg_url, "--broker", f"{nats_server.url}?stream={name}&subjects={prefix}.>"
    )
    assert done.returncode == 0, done.stderr
    assert "drained: sent=1200" in done.stdout
    assert count(pg_url, "pending") == 0
    stored = asyncio.run(read_stream(nats_server.url, name))
    assert sorted(m.msg_id for m in stored) == sorted(ids)


def test_bad_urls_give_one_clear_line() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("OUTBOX_DB", "OUTBOX_BROKER")}
    done = cli("drain", "--db", "sqlite://", "--broker", "kafka://h:1", env=env)
    assert done.returncode == 2 and "no supported scheme" in done.stderr  # a bad value: usage
    assert "Traceback" not in done.stderr
    missing = cli("relay", "--db", "sqlite://", env=env)
    assert missing.returncode == 2 and "--broker is required" in missing.stderr
    unmigrated = cli("status", "--db", "sqlite://", env=env)
    assert unmigrated.returncode == 1 and "run `outbox migrate` first" in unmigrated.stderr


APP = textwrap.dedent(
    """
    import os, sys
    from sqlalchemy.orm import Session
    from outbox import Outbox
    ob = Outbox(os.environ["OUTBOX_DB"], broker=os.environ["OUTBOX_BROKER"], sweeper=False)
    ob.start()
    with Session(ob.engine) as session, session.begin():
        for i in range(5000):
            ob.send(session, os.environ["TOPIC"], {"i": i})
    print("committed", flush=True)  # all 5,000 are in memory now, few published yet
    sys.stdin.read()  # wait here, messages still in memory, until killed
    """
)


def test_worker_delivers_what_a_killed_app_left_in_memory(
    pg_url: str, nats_server: NatsServer, stream: tuple[str, str]
) -> None:
    """SIGKILL right after 5,000 commits; an `outbox relay` worker must deliver every one."""
    name, prefix = stream
    migrate.upgrade(pg_url)
    broker = f"{nats_server.url}?stream={name}&subjects={prefix}.>"
    env = {**os.environ, "OUTBOX_DB": pg_url, "OUTBOX_BROKER": broker, "TOPIC": f"{prefix}.orders"}
    app = subprocess.Popen(
        [sys.executable, "-c", APP],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert app.stdout is not None and app.stdout.readline().strip() == "committed"
    app.send_signal(signal.SIGKILL)
    app.wait(10)
    left = count(pg_url, "pending")
    worker = subprocess.Popen(
        [OUTBOX, "relay", "--interval", "0.2"], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_until(lambda: count(pg_url, "pending") == 0, timeout=60, what="the worker to drain")
    finally:
        worker.send_signal(signal.SIGTERM)
        _, log = worker.communicate(timeout=30)
    assert worker.returncode == 0, log
    assert "sweep: claimed=" in log and "relay worker stopped" in log
    assert count(pg_url, "sent") == 5000
    ids = [m.msg_id for m in asyncio.run(read_stream(nats_server.url, name))]
    assert len(set(ids)) == 5000, "lost = 0"
    duplicates = len(ids) - len(set(ids))
    print(f"\nleft pending by the killed app: {left}; duplicates at the broker: {duplicates}")


def test_coordinator_command_settles_transactions(
    nats_server: NatsServer, stream: tuple[str, str]
) -> None:
    from relay.brokers.nats import create_stream
    from relay.lab.halfop import TransactionProducer

    name, prefix = stream

    create_stream(nats_server.url, name, f"{prefix}.>")

    coordinator = subprocess.Popen(
        [OUTBOX, "coordinator", "--broker", nats_server.url, "--check-interval", "0.2"],
        stderr=subprocess.PIPE,
        text=True,
    )
    producer = TransactionProducer(group="cli", broker=nats_server.url, listener=AlwaysCommits())
    producer.start()
    try:
        result = producer.send_in_transaction(f"{prefix}.orders", b"x")
        wait_until(
            lambda: (
                [m.msg_id for m in asyncio.run(read_stream(nats_server.url, name))]
                == [result.msg_id]
            ),
            timeout=60,
            what="the committed message on its real topic",
        )
    finally:
        producer.stop()
        coordinator.send_signal(signal.SIGTERM)
        _, log = coordinator.communicate(timeout=30)
    assert coordinator.returncode == 0, log
    assert "coordinator stopped" in log


def test_drain_with_the_broker_down_touches_nothing(pg_url: str) -> None:
    from relay.testing.embedded import free_port

    seed(pg_url, ["pending"] * 10)
    done = cli("drain", "--db", pg_url, "--broker", f"nats://127.0.0.1:{free_port()}", timeout=60)
    assert done.returncode == 1 and "unreachable; nothing was touched" in done.stderr
    assert count(pg_url, "pending") == 10


def execute(db: str, *statements: str) -> None:
    engine = create_engine(db, poolclass=NullPool)
    with engine.begin() as conn:
        for statement in statements:
            conn.execute(text(statement))
    engine.dispose()


def test_hint_no_table_says_migrate(db_url: str) -> None:
    execute(db_url, "SELECT 1")  # an empty database (a SQLite file that does not exist is refused)
    done = cli("status", "--db", db_url)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "no outbox tables" in done.stderr and "run `outbox migrate` first" in done.stderr
    assert cli("migrate", "--db", db_url).returncode == 0
    assert cli("status", "--db", db_url).returncode == 0, "the hint was true"


def test_hint_foreign_table_is_not_ours_to_migrate(db_url: str) -> None:
    execute(db_url, "CREATE TABLE outbox_message (id INTEGER PRIMARY KEY, body TEXT)")
    for command in ("status", "migrate", "requeue"):
        done = cli(command, "--db", db_url, *(["--dead"] if command == "requeue" else []))
        assert done.returncode == 1, done.stderr
        [line] = done.stderr.strip().splitlines()
        assert "outbox-relay did not create" in line, line
        assert "run `outbox migrate`" not in line, "advises the command that cannot fix it"
    assert "outbox_alembic_version" not in tables_of(db_url), "migrate touched nothing"


def test_hint_missing_column_is_not_ours_to_repair(db_url: str) -> None:
    migrate.upgrade(db_url)
    execute(db_url, "ALTER TABLE outbox_message DROP COLUMN receipt")
    for command in ("status", "migrate"):
        done = cli(command, "--db", db_url)
        assert done.returncode == 1, done.stderr
        [line] = done.stderr.strip().splitlines()
        assert "lacks column(s) receipt" in line and "will not repair" in line, line


def test_hint_schema_behind_says_migrate(pg_url: str) -> None:
    migrate.upgrade(pg_url, "0001")
    done = cli("status", "--db", pg_url)
    assert done.returncode == 1
    assert "at revision 0001" in done.stderr and "run `outbox migrate`" in done.stderr
    assert cli("migrate", "--db", pg_url).returncode == 0
    assert cli("status", "--db", pg_url).returncode == 0, "the hint was true"


def test_hint_schema_ahead_says_upgrade_the_package(pg_url: str) -> None:
    migrate.upgrade(pg_url)
    execute(pg_url, f"UPDATE {migrate.VERSION_TABLE} SET version_num = '0099'")
    for command in ("status", "migrate"):
        done = cli(command, "--db", pg_url)
        assert done.returncode == 1, done.stderr
        [line] = done.stderr.strip().splitlines()
        assert "at revision 0099" in line and "upgrade outbox-relay" in line, line
        assert "run `outbox migrate`" not in line


def tables_of(db: str) -> set[str]:
    engine = create_engine(db, poolclass=NullPool)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def boom(args: object) -> int:
    raise RuntimeError("the client library failed\nsecond line")


def test_an_unexpected_error_is_one_line_and_debug_shows_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(cli_module.COMMANDS, "status", boom)
    assert cli_module.main(["status", "--db", "sqlite://"]) == 1
    err = capsys.readouterr().err
    assert err == "outbox status: RuntimeError: the client library failed\n"
    assert cli_module.main(["--debug", "status", "--db", "sqlite://"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "in boom" in err
    assert err.endswith("outbox status: RuntimeError: the client library failed\n")
    assert cli_module.main(["status", "--db", "sqlite://", "--debug"]) == 1
    assert "Traceback" in capsys.readouterr().err, "--debug after the command works too"


WITHOUT = (  # `outbox ARGS` with modules made unimportable, as if never installed
    "import sys\nfor m in {mods!r}: sys.modules[m] = None\n"
    "from relay.cli import main\nsys.exit(main(sys.argv[1:]))"
)


@pytest.mark.parametrize(
    "args",
    [
        ["reconcile", "--ledger", "l.parquet", "--broker-log", "b.parquet", "--out", "r",
         "--start", "2026-01-01T00:00:00Z", "--end", "2026-01-02T00:00:00Z"],
        ["export", "ledger", "--db", "sqlite://", "--out", "x.parquet"],
    ],
    ids=["reconcile", "export"],
)  # fmt: skip
def test_a_missing_extra_is_named(args: list[str], tmp_path: Path) -> None:
    script = WITHOUT.format(mods=("pyarrow", "pyspark"))  # as if installed without [spark]
    done = subprocess.run([sys.executable, "-c", script, *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "pip install 'outbox-relay[spark]'" in done.stderr and "Traceback" not in done.stderr


def test_a_closed_stdout_ends_quietly() -> None:
    # A real pipe whose reader has gone, as `| head -1` once it has its line: closed before
    # the command writes, so every write fails (a pipe buffer could hide a later close).
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([OUTBOX, "migrate", "--sql", "--db", "postgres://u@h/x"],
                              stdout=write_end, stderr=subprocess.PIPE, text=True,
                              timeout=60, check=False)  # fmt: skip
    finally:
        os.close(write_end)
    assert done.returncode == 141, done.stderr  # 128 + SIGPIPE, as cat and git
    assert done.stderr == "", done.stderr


def test_version_is_the_installed_distributions() -> None:
    done = cli("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"outbox {importlib.metadata.version('outbox-relay')}"
