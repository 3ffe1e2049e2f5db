"""`outbox drain`'s progress: periodic running totals without a terminal, a bar on one.

Real processes against PostgreSQL and a nats-server of the test's own; the terminal is
a pseudo-terminal (python's pty module), read to the end.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import textwrap
from pathlib import Path

from sqlalchemy import create_engine
from sqlalchemy.pool import NullPool

from bench import sweeper as bench_sweeper
from outbox import migrate
from relay.cli.common import EXIT_DATA
from relay.testing.embedded import NatsServer
from tests.planting import plant

OUTBOX = str(Path(sys.executable).with_name("outbox"))
ROWS = 3000
TOTALS = re.compile(r"^drain: (\d+)/(\d+) sent=(\d+) retry_later=(\d+) dead=(\d+) \(.* msg/s\)$")


def drain_args(pg_url: str, server: NatsServer, stream: tuple[str, str]) -> list[str]:
    name, prefix = stream
    broker = f"{server.url}?stream={name}&subjects={prefix}.>"
    return [OUTBOX, "drain", "--db", pg_url, "--broker", broker, "--sweep-batch", "50"]


def test_drain_without_a_terminal_prints_running_totals(
    pg_url: str, nats_server: NatsServer, stream: tuple[str, str]
) -> None:
    migrate.upgrade(pg_url)
    bench_sweeper.seed(pg_url, ROWS, f"{stream[1]}.backlog")
    env = {**os.environ, "OUTBOX_PROGRESS_EVERY_S": "0.01"}  # a line after nearly each batch
    done = subprocess.run(
        [*drain_args(pg_url, nats_server, stream), "--concurrency", "1"],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"drained: sent={ROWS} retry_later=0 dead=0 of {ROWS} pending")
    totals = [TOTALS.match(line) for line in done.stderr.splitlines()]
    counts = [(int(m[1]), int(m[2]), int(m[3])) for m in totals if m]
    assert len(counts) >= 2, done.stderr  # running totals, not only the end
    assert [c[0] for c in counts] == sorted(c[0] for c in counts)  # they only grow
    assert all(d <= total == ROWS and sent == d for d, total, sent in counts), counts
    assert "sweep: claimed=" not in done.stderr  # no line per batch


def test_drain_counts_a_row_tried_in_three_passes_once(
    pg_url: str, nats_server: NatsServer, stream: tuple[str, str]
) -> None:
    """Rows that fail in every pass: the summary has each once (was retry_later=15 of 5)."""
    migrate.upgrade(pg_url)
    engine = create_engine(pg_url, poolclass=NullPool)
    for _ in range(5):  # headers that break the send() contract: refused without publishing
        plant(engine, f"{stream[1]}.bad", headers={"Nats-Msg-Id": "mine"})
    engine.dispose()
    done = subprocess.run(
        drain_args(pg_url, nats_server, stream),
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    found = re.search(r"drained: sent=(\d+) retry_later=(\d+) dead=(\d+) of 5 pending", done.stdout)
    assert found, done.stdout + done.stderr
    assert sum(int(n) for n in found.groups()) == 5, done.stdout
    # Refused for good each time: dead at the third pass (permanent_attempts), exit 3.
    assert found[1] == "0" and done.returncode == EXIT_DATA


def on_a_terminal(args: list[str], env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``args`` with stdout and stderr on a pseudo-terminal; its status and output."""
    leader, follower = pty.openpty()
    size = struct.pack("HHHH", 24, 120, 0, 0)  # rows, columns: a new pty has none
    fcntl.ioctl(follower, termios.TIOCSWINSZ, size)
    proc = subprocess.Popen(args, stdout=follower, stderr=follower, env=env, close_fds=True)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: every writer closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    return proc.wait(60), b"".join(chunks).decode(errors="replace")


def screen_lines(output: str) -> list[str]:
    """What each terminal line shows at the end: the text after its last carriage return."""
    return [line.rpartition("\r")[2] for line in output.replace("\r\n", "\n").split("\n")]


def test_drain_on_a_terminal_shows_a_bar(
    pg_url: str, nats_server: NatsServer, stream: tuple[str, str]
) -> None:
    migrate.upgrade(pg_url)
    bench_sweeper.seed(pg_url, ROWS, f"{stream[1]}.backlog")
    status, output = on_a_terminal(drain_args(pg_url, nats_server, stream))
    assert status == 0, output
    assert re.search(rf"drain: 100%.*\| {ROWS}/{ROWS} \[.*msg/s", output), output
    assert f"drained: sent={ROWS} retry_later=0 dead=0 of {ROWS} pending" in output
    assert f"{ROWS + 1}/" not in output  # never past the total


BAR_AND_LOGS = textwrap.dedent(
    """
    import logging
    from outbox.events import SweepResult
    from relay.cli.progress import progress

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    with progress("drain", 40) as shown:
        for n in range(20):
            shown.add(SweepResult(2, 2, 0, 0))
            logging.getLogger("relay.test").warning("log line %d", n)
    """
)


def test_log_lines_never_share_a_line_with_the_bar() -> None:
    status, output = on_a_terminal([sys.executable, "-c", BAR_AND_LOGS])
    assert status == 0, output
    lines = screen_lines(output)
    logged = [line for line in lines if "log line" in line]
    assert len(logged) == 20, output
    assert all(re.fullmatch(r"WARNING relay.test: log line \d+\s*", line) for line in logged), lines
    assert "40/40" in output
