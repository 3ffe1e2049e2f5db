"""SIGINT and SIGTERM stop `outbox drain` and `outbox relay` on a large backlog.

Real processes, PostgreSQL and a nats-server of the test's own. What must hold after
the signal: the process ends within its stop timeout (plus a margin for a loaded
machine) with the documented status and its summary, without a traceback; no row is
marked sent unless it is in the stream; rows published but still pending are allowed
(at least once: the next drain publishes them again, JetStream drops the copy) and
counted; a second drain delivers the rest.
"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, select, text
from sqlalchemy.pool import NullPool

from bench import sweeper as bench_sweeper
from outbox import migrate, outbox_message
from relay.brokers.nats import read_stream
from relay.testing.embedded import NatsServer
from tests.helpers import came_within, wait_until

OUTBOX = str(Path(sys.executable).with_name("outbox"))
ROWS = 30_000  # seconds of work even on a fast machine; the signal comes after the first batch
STOP_TIMEOUT = 10.0
MARGIN = 30.0  # start-up of the summary and the exit on a loaded machine, not a speed target
t = outbox_message


@pytest.fixture
def db(pg_url: str) -> Iterator[Engine]:
    migrate.upgrade(pg_url)
    engine = create_engine(pg_url, poolclass=NullPool)
    yield engine
    engine.dispose()


def seed(engine: Engine, topic: str, rows: int = ROWS) -> set[str]:
    """``rows`` pending rows, a minute old (due for a worker's sweeper too); their msg_ids."""
    return bench_sweeper.seed(engine.url.render_as_string(hide_password=False), rows, topic)


def by_status(engine: Engine) -> dict[str, set[str]]:
    with engine.connect() as conn:
        rows = conn.execute(select(t.c.msg_id, t.c.status)).all()
    found: dict[str, set[str]] = {"pending": set(), "sent": set(), "dead": set()}
    for msg_id, status in rows:
        found[status].add(str(msg_id))
    return found


def sent_count(engine: Engine) -> int:
    with engine.connect() as conn:
        query = text("SELECT count(*) FROM outbox_message WHERE status = 'sent'")
        return int(conn.execute(query).scalar_one())


def poll(condition: Callable[[], object], timeout: float, what: str) -> None:
    """wait_until, checking every 50 ms: a check may be a query."""
    wait_until(condition, timeout, what, every=0.05)


class Command:
    """An `outbox` process, its output in files (a pipe nobody reads could fill up)."""

    def __init__(self, tmp: Path, *args: str) -> None:
        self.out, self.err = tmp / f"{args[0]}.out", tmp / f"{args[0]}.err"
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = subprocess.Popen([OUTBOX, *args], stdout=out, stderr=err)

    def stdout(self) -> str:
        return self.out.read_text()

    def stderr(self) -> str:
        return self.err.read_text()

    def alive(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"exited {self.proc.returncode}: {self.stderr()[-2000:]}")
        return True

    def wait_for(self, condition: Callable[[], object], what: str) -> None:
        """Poll ``condition`` while the process runs; kill it when that fails."""
        try:
            poll(lambda: self.alive() and condition(), 60, what)
        except BaseException:
            self.kill()
            raise

    def stop_with(self, signum: int, timeout: float) -> float:
        """Send ``signum``; the seconds until the process ended (fails past ``timeout``)."""
        self.proc.send_signal(signum)
        signalled = time.monotonic()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"still running {timeout} s after {signum!r}: {self.stderr()[-2000:]}"
            ) from None
        return time.monotonic() - signalled

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def in_stream(server: NatsServer, name: str) -> set[str]:
    return {str(m.msg_id) for m in asyncio.run(read_stream(server.url, name))}


def check_stream(
    engine: Engine, server: NatsServer, name: str, ids: set[str]
) -> tuple[dict[str, set[str]], int]:
    """No row marked sent without being in the stream; the stream holds only our rows;
    every row sent or pending. The table by status, and how many pending rows are in
    the stream already (published, not marked: at least once)."""
    table = by_status(engine)
    stored = in_stream(server, name)
    missing = table["sent"] - stored
    assert not missing, f"{len(missing)} row(s) marked sent but not in the stream"
    assert stored <= ids
    assert not table["dead"]
    assert len(table["sent"]) + len(table["pending"]) == len(ids)
    return table, len(stored & table["pending"])


def not_all_sent(sent: int) -> None:
    assert sent < ROWS, (
        f"all {ROWS} rows were sent before the signal took effect, so it stopped nothing "
        "here: seed a larger backlog"
    )


def drain_the_rest(
    engine: Engine, server: NatsServer, name: str, ids: set[str], *drain: str
) -> None:
    again = subprocess.run(
        [OUTBOX, *drain], capture_output=True, text=True, timeout=300, check=False
    )
    assert again.returncode == 0, again.stderr[-2000:]
    table, _ = check_stream(engine, server, name, ids)
    assert len(table["sent"]) == ROWS
    assert in_stream(server, name) == ids, "every message in the stream at least once"


@contextmanager
def frozen_mid_publish(server: NatsServer, db: Engine) -> Iterator[None]:
    """The nats-server stopped (SIGSTOP) with a publish sent to it and unanswered: bytes
    wait in its socket. The sweep that sent them waits for acks (the sweeper's publish
    timeout, 10 s, with the URL's ``timeout`` longer) and cannot finish its batch.

    A stop can land after the server read a whole batch and before it acked it: the drain
    then waits for acks and sends nothing. So the server runs on until the drain has marked
    another batch (stopped again at once, a busy machine might not run it in between, and
    every stop would find the same wait), and is stopped again until bytes do wait."""
    assert server.proc is not None
    deadline = time.monotonic() + 60
    try:
        while True:
            server.proc.send_signal(signal.SIGSTOP)
            if came_within(lambda: unread_bytes(server.port) > 0, 2.0):
                break
            marked = sent_count(db)
            server.proc.send_signal(signal.SIGCONT)
            came_within(lambda n=marked: sent_count(db) > n, 10.0)
            assert time.monotonic() < deadline, "no publish waited at the frozen broker in 60 s"
        yield
    finally:
        server.proc.send_signal(signal.SIGCONT)


def unread_bytes(port: int) -> int:
    """Bytes received and not yet read by the established sockets on local ``port``."""
    total = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, state, queues = fields[1], fields[3], fields[4]
        if state == "01" and int(local.split(":")[1], 16) == port:
            total += int(queues.split(":")[1], 16)
    return total


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_a_drain_between_batches(
    db: Engine,
    pg_url: str,
    nats_server: NatsServer,
    stream: tuple[str, str],
    tmp_path: Path,
    signum: signal.Signals,
) -> None:
    name, prefix = stream
    ids = seed(db, f"{prefix}.backlog")
    drain = (
        "drain",
        "--db",
        pg_url,
        "--broker",
        f"{nats_server.url}?stream={name}&subjects={prefix}.>",
    )
    cmd = Command(tmp_path, *drain, "--stop-timeout", str(STOP_TIMEOUT))
    cmd.wait_for(lambda: sent_count(db) > 0, "the drain's first batch marked sent")
    took = cmd.stop_with(signum, STOP_TIMEOUT + MARGIN)

    assert cmd.proc.returncode == 128 + signum, cmd.stderr()[-2000:]  # 130, 143
    assert "Traceback" not in cmd.stderr(), cmd.stderr()[-2000:]
    summary = re.search(
        rf"drained: sent=(\d+) retry_later=0 dead=0 of {ROWS} pending in .* "
        rf"\(stopped by {signum.name}\)$",
        cmd.stdout(),
    )
    assert summary is not None, cmd.stdout()
    table, published_pending = check_stream(db, nats_server, name, ids)
    not_all_sent(len(table["sent"]))
    assert int(summary[1]) == len(table["sent"]), "the summary counts what was marked sent"
    print(
        f"\n{signum.name}: exited {took:.1f} s after the signal; sent {len(table['sent'])} "
        f"of {ROWS}; pending but already in the stream (at least once): {published_pending}"
    )
    drain_the_rest(db, nats_server, name, ids, *drain)


def test_past_the_stop_timeout_a_drain_leaves_its_batches_pending(
    db: Engine, pg_url: str, nats_server: NatsServer, stream: tuple[str, str], tmp_path: Path
) -> None:
    """The broker stops answering mid-batch: the drain still exits at its stop timeout,
    and the unanswered batch is rolled back (pending), not marked."""
    name, prefix = stream
    ids = seed(db, f"{prefix}.backlog")
    broker = f"{nats_server.url}?stream={name}&subjects={prefix}.>"
    cmd = Command(tmp_path, "drain", "--db", pg_url, "--broker", f"{broker}&timeout=60",
                  "--stop-timeout", "2")  # fmt: skip
    cmd.wait_for(lambda: sent_count(db) > 0, "the drain's first batch marked sent")
    with frozen_mid_publish(nats_server, db):
        took = cmd.stop_with(signal.SIGTERM, 2 + MARGIN)
    assert cmd.proc.returncode == 143, cmd.stderr()[-2000:]
    assert "Traceback" not in cmd.stderr(), cmd.stderr()[-2000:]
    summary = re.search(
        r"drained: sent=(\d+) .*\(stopped by SIGTERM; stop timeout passed: the batches in "
        r"flight stay pending\)$",
        cmd.stdout(),
    )
    assert summary is not None, cmd.stdout()
    poll(lambda: not rows_locked(db), 30, "the database to roll back the drain's batch")
    table, published_pending = check_stream(db, nats_server, name, ids)
    not_all_sent(len(table["sent"]))
    assert int(summary[1]) <= len(table["sent"])  # a batch answered just before may commit
    print(f"\nexited {took:.1f} s after SIGTERM (stop timeout 2 s); pending but in the stream: "
          f"{published_pending}")  # fmt: skip
    drain_the_rest(db, nats_server, name, ids, "drain", "--db", pg_url, "--broker", broker)


def test_a_second_signal_exits_at_once(
    db: Engine, pg_url: str, nats_server: NatsServer, stream: tuple[str, str], tmp_path: Path
) -> None:
    """Ctrl-C twice: the first waits for a batch the frozen broker never answers, the
    second exits at once (130), that batch rolled back."""
    name, prefix = stream
    ids = seed(db, f"{prefix}.backlog")
    broker = f"{nats_server.url}?stream={name}&subjects={prefix}.>"
    cmd = Command(tmp_path, "drain", "--db", pg_url, "--broker", f"{broker}&timeout=60",
                  "--stop-timeout", "120")  # fmt: skip
    cmd.wait_for(lambda: sent_count(db) > 0, "the drain's first batch marked sent")
    with frozen_mid_publish(nats_server, db):
        cmd.proc.send_signal(signal.SIGINT)
        cmd.wait_for(lambda: "SIGINT: stopping" in cmd.stderr(), "the first SIGINT taken")
        took = cmd.stop_with(signal.SIGINT, MARGIN)
    assert cmd.proc.returncode == 130, cmd.stderr()[-2000:]
    assert "outbox drain: second SIGINT, exiting now" in cmd.stderr(), cmd.stderr()[-2000:]
    assert "Traceback" not in cmd.stderr(), cmd.stderr()[-2000:]
    poll(lambda: not rows_locked(db), 30, "the database to roll back the drain's batch")
    check_stream(db, nats_server, name, ids)
    print(f"\nexited {took:.1f} s after the second SIGINT")
    drain_the_rest(db, nats_server, name, ids, "drain", "--db", pg_url, "--broker", broker)


def rows_locked(engine: Engine) -> int:
    """Rows a transaction still holds (the killed drain's, until the server rolls it back)."""
    with engine.connect() as conn:
        free = text(
            "SELECT count(*) FROM (SELECT id FROM outbox_message FOR UPDATE SKIP LOCKED) AS f"
        )
        return ROWS - int(conn.execute(free).scalar_one())


def test_sigterm_stops_a_relay_worker_with_its_summary(
    db: Engine, pg_url: str, nats_server: NatsServer, stream: tuple[str, str], tmp_path: Path
) -> None:
    name, prefix = stream
    ids = seed(db, f"{prefix}.backlog")
    broker = f"{nats_server.url}?stream={name}&subjects={prefix}.>"
    cmd = Command(tmp_path, "relay", "--db", pg_url, "--broker", broker, "--interval", "0.2",
                  "--stop-timeout", str(STOP_TIMEOUT))  # fmt: skip
    cmd.wait_for(lambda: sent_count(db) > 0, "the worker's first batch marked sent")
    took = cmd.stop_with(signal.SIGTERM, STOP_TIMEOUT + MARGIN)

    assert cmd.proc.returncode == 0, cmd.stderr()[-2000:]  # SIGTERM is how a worker stops
    assert "Traceback" not in cmd.stderr(), cmd.stderr()[-2000:]
    summary = re.search(
        r"relay worker stopped by SIGTERM: sent=(\d+) retry_later=0 dead=0 in \d+ s",
        cmd.stderr(),
    )
    assert summary is not None, cmd.stderr()[-2000:]
    table, published_pending = check_stream(db, nats_server, name, ids)
    not_all_sent(len(table["sent"]))
    assert int(summary[1]) == len(table["sent"])
    print(f"\nworker exited {took:.1f} s after SIGTERM; sent {len(table['sent'])} of {ROWS}; "
          f"pending but in the stream: {published_pending}")  # fmt: skip
