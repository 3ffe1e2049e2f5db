"""What the inbox runner's tests share on every broker (tests/integration/test_consume_*):
running consumers in this process until a condition holds, counting their outcomes,
the business rows their handlers wrote, and `outbox consume` in a process of its own."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import Engine, func, select

from outbox.broker import Broker
from outbox.message import Message, build_message
from relay.consume.runner import Consumer
from tests import consume_app

ROOT = Path(__file__).resolve().parents[1]
OUTBOX = str(Path(sys.executable).with_name("outbox"))
DEADLINE_S = 60.0


async def run_until(
    consumers: list[Consumer], done: Callable[[list[Consumer]], bool]
) -> list[Consumer]:
    """Run ``consumers`` side by side until ``done(consumers)``, one of them ends, or the
    deadline; then stop them all."""
    stopping = asyncio.Event()
    tasks = [asyncio.create_task(c.run(stopping)) for c in consumers]
    deadline = time.monotonic() + DEADLINE_S
    while not done(consumers) and time.monotonic() < deadline:
        if any(task.done() for task in tasks):
            break
        await asyncio.sleep(0.05)
    stopping.set()
    await asyncio.gather(*tasks)
    return consumers


def total(consumers: list[Consumer], outcome: str) -> int:
    return sum(c.counts[outcome] for c in consumers)


def invoices(db: Engine) -> dict[str, int]:
    """How many invoices tests.consume_app's handler wrote, per msg_id."""
    column = consume_app.invoice.c.msg_id
    with db.connect() as conn:
        return {m: n for m, n in conn.execute(select(column, func.count()).group_by(column))}


def wait_for(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def scrape(port: int) -> str:
    """A consumer's /metrics, or "" while it serves none yet."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as answer:
            return str(answer.read().decode())
    except OSError:
        return ""


def orders(n: int, **extra: object) -> list[Message]:
    """``n`` messages of topic bill.created (tests.consume_app's handler), as send() builds them."""
    return [build_message("bill.created", {"amount": i, **extra}, max_payload_bytes=1000)
            for i in range(n)]  # fmt: skip


def publish_through(broker: Broker, messages: list[Message]) -> None:
    """Publish ``messages`` as the relay does, through its adapter ``broker``; each stored."""

    async def main() -> None:
        await broker.connect()
        try:
            results = await broker.publish(messages)
        finally:
            await broker.close()
        assert all(r.receipt for r in results), results

    asyncio.run(main())


def start_consume(
    db: Engine,
    broker: str,
    tmp_path: Path,
    *more: str,
    app: str = "tests.consume_app:inbox",
    env: dict[str, str] | None = None,
) -> subprocess.Popen[str]:
    """`outbox consume --app APP --broker BROKER` on ``db``, its handler's hold files in
    ``tmp_path`` (tests.consume_app)."""
    environ = {**os.environ, **(env or {}),
               "CONSUME_TEST_DB": db.url.render_as_string(hide_password=False),
               "CONSUME_TEST_INSIDE": str(tmp_path / "inside"),
               "CONSUME_TEST_RELEASE": str(tmp_path / "release")}  # fmt: skip
    cmd = [OUTBOX, "consume", "--app", app, "--broker", broker, *more]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
