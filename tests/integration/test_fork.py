"""An Outbox across os.fork(): real PostgreSQL or MariaDB, a real nats-server, real forks.

The parent starts its relay, then forks (what gunicorn --preload, multiprocessing with
fork and Celery prefork do). The child sends and stops; the parent goes on sending on
the connections it pooled before the fork. Only the fast path can deliver (the sweeper
takes no row younger than an hour), and a listener tells which path published what.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import time
import traceback
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session, sessionmaker

from outbox import Outbox, migrate
from outbox.events import Path as RelayPath
from outbox.events import RelayListener, Sent
from relay.brokers.nats import read_stream
from relay.testing.embedded import NatsServer
from tests.helpers import unsent, wait_until

pytestmark = pytest.mark.filterwarnings(
    "ignore:This process .* is multi-threaded:DeprecationWarning"  # Python 3.12+ on fork
)

CHILD_DEADLINE_S = 90.0
NO_SWEEP = {"sweeper_age_s": 3600.0}  # the sweeper runs, but takes no row of this test


class FastPath(RelayListener):
    """The msg_ids the fast path published. No lock: a lock held by a relay thread at the
    fork would stay held in the child (set.update is atomic under the GIL)."""

    def __init__(self) -> None:
        self.ids: set[str] = set()

    def published(self, sent: Sequence[Sent], path: RelayPath) -> None:
        if path == "fast":
            self.ids.update(s.msg_id for s in sent)


def in_child(work: Callable[[], Any], out: Path, timeout: float = CHILD_DEADLINE_S) -> Any:
    """Run ``work`` in a forked child and return what it returned (JSON through ``out``).

    The child never returns into pytest (os._exit); one that hangs is killed at ``timeout``.
    """
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            out.write_text(json.dumps({"result": work()}))
            code = 0
        except BaseException:
            out.write_text(json.dumps({"error": traceback.format_exc()}))
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"the child did not finish within {timeout} s")
        time.sleep(0.02)
    report = json.loads(out.read_text()) if out.exists() else {"error": "no report"}
    assert os.waitstatus_to_exitcode(done[1]) == 0 and "result" in report, report.get("error")
    return report["result"]


def sender(ob: Outbox, topic: str) -> Callable[[int], str]:
    @ob.transactional
    def send(session: Session, n: int) -> str:
        return ob.send(session, topic, {"n": n, "pid": os.getpid()})

    return send


@pytest.fixture(params=["postgresql", "mariadb", "postgresql-app-engine"])
def target(request: pytest.FixtureRequest) -> Iterator[tuple[str, str | Engine]]:
    """(URL, what the Outbox is given): a URL, or the app's own Engine."""
    url = str(request.getfixturevalue("mariadb_url" if request.param == "mariadb" else "pg_url"))
    migrate.upgrade(url)
    if request.param.endswith("app-engine"):
        engine = create_engine(url)
        yield url, engine
        engine.dispose()
    else:
        yield url, url


def test_a_child_sends_by_the_fast_path_and_the_parent_goes_on(
    target: tuple[str, str | Engine],
    nats_server: NatsServer,
    stream: tuple[str, str],
    tmp_path: Path,
) -> None:
    """The parent's pooled connections survive the child's sends and stop() (the bug:
    "server closed the connection unexpectedly" in the parent), and every message of
    both processes is in the stream once, published by its own process's fast path."""
    url, db = target
    name, prefix = stream
    fast = FastPath()
    broker = f"{nats_server.url}?stream={name}&subjects={prefix}.>"
    ob = Outbox(db, broker, listener=fast, **NO_SWEEP)
    ob.start()
    send = sender(ob, f"{prefix}.fork")
    try:
        before = [send(n) for n in range(20)]
        wait_until(lambda: fast.ids >= set(before), timeout=30, what="the parent's first sends")
        assert ob.engine.pool.checkedin() > 0, "the fork must copy pooled connections"

        def child() -> dict[str, Any]:
            ids = [send(100 + n) for n in range(30)]
            wait_until(lambda: fast.ids >= set(ids), timeout=60, what="the child's fast path")
            assert ob.stats is not None and ob.stats.published >= len(ids)
            ob.stop()
            return {"ids": ids, "handed_off": ob.handed_off}

        from_child = in_child(child, tmp_path / "child.json")
        assert from_child["handed_off"] == 30, "the child's relay took every commit"

        after = [send(200 + n) for n in range(20)]  # on the connections pooled before the fork
        wait_until(lambda: fast.ids >= set(after), timeout=30, what="the parent's later sends")
        wait_until(lambda: unsent(url) == 0, timeout=30, what="every row marked sent")
    finally:
        ob.stop()
    committed = before + from_child["ids"] + after
    delivered = [m.msg_id for m in asyncio.run(read_stream(nats_server.url, name))]
    assert sorted(delivered) == sorted(committed), "each message exactly once"
    assert ob.handed_off == len(before) + len(after)


def test_a_child_of_a_stopped_outbox_starts_no_relay(
    pg_url: str, nats_server: NatsServer, stream: tuple[str, str], tmp_path: Path
) -> None:
    """Only a relay that ran in the parent restarts in the child; stop() before the first
    send() in the child keeps it stopped."""
    migrate.upgrade(pg_url)
    name, prefix = stream
    ob = Outbox(pg_url, f"{nats_server.url}?stream={name}&subjects={prefix}.>", **NO_SWEEP)
    send = sender(ob, f"{prefix}.fork")

    def never_started() -> bool:
        send(1)
        return ob.stats is None

    assert in_child(never_started, tmp_path / "a.json") is True
    ob.start()
    try:

        def stopped_first() -> bool:
            ob.stop()
            send(2)
            return ob.stats is None

        assert in_child(stopped_first, tmp_path / "b.json") is True
        assert ob.stats is not None  # the parent's relay still runs
    finally:
        ob.stop()
    assert unsent(pg_url) == 2  # both rows wait for a sweeper


def test_a_child_whose_relay_failed_to_start_tries_again(
    pg_url: str,
    nats_server: NatsServer,
    stream: tuple[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The child's first start fails (a broker blip, a missing module): its message waits
    for a sweeper, and a later send() starts the relay after all. A bug: the child never
    tries again and runs with no fast path for its whole life."""
    migrate.upgrade(pg_url)
    name, prefix = stream
    fast = FastPath()
    ob = Outbox(pg_url, f"{nats_server.url}?stream={name}&subjects={prefix}.>",
                listener=fast, **NO_SWEEP)  # fmt: skip
    send = sender(ob, f"{prefix}.fork")
    ob.start()
    try:

        def fail_once_then_start() -> list[Any]:
            from relay import runtime

            real, calls = runtime.Relay.start, []

            def flaky(relay: runtime.Relay) -> Any:
                calls.append(1)
                if len(calls) == 1:
                    raise ConnectionError("broker blip")
                return real(relay)

            monkeypatch.setattr(runtime.Relay, "start", flaky)
            monkeypatch.setattr("outbox.lifecycle.START_RETRY_S", 0.0)
            first = send(1)  # the start fails: this row waits for a sweeper
            second = send(2)  # tried again: the relay starts
            wait_until(lambda: second in fast.ids, what="the second by the fast path")
            ob.stop()
            return [len(calls), first in fast.ids]

        assert in_child(fail_once_then_start, tmp_path / "c.json") == [2, False]
    finally:
        ob.stop()
    assert unsent(pg_url) == 1  # the first child row waits for a sweeper


def test_a_session_factorys_engine_gets_a_fresh_pool_in_a_child(
    pg_url: str, tmp_path: Path
) -> None:
    """The app's sessions come from its own engine (``session_factory=``): that pool is
    the parent's too, so the child gets a new one."""
    app = create_engine(pg_url)
    with app.connect():
        pass  # a pooled connection of the parent's
    ob = Outbox(pg_url, session_factory=sessionmaker(app))
    parents = id(app.pool)
    try:
        assert in_child(lambda: id(app.pool) != parents, tmp_path / "d.json") is True
        assert id(app.pool) == parents
    finally:
        ob.stop()
        app.dispose()


def test_the_fork_hook_keeps_no_outbox_alive(pg_url: str) -> None:
    ob = Outbox(pg_url)
    gone = weakref.ref(ob)
    del ob
    gc.collect()
    assert gone() is None


def test_an_async_outbox_in_a_child_sends_by_the_fast_path(
    pg_url: str, nats_server: NatsServer, stream: tuple[str, str], tmp_path: Path
) -> None:
    """asyncpg: the child's AsyncSessions get connections of their own (a fresh async pool)."""
    migrate.upgrade(pg_url)
    name, prefix = stream
    fast = FastPath()
    db = pg_url.replace("postgresql+psycopg://", "postgresql+asyncpg://")
    broker = f"{nats_server.url}?stream={name}&subjects={prefix}.>"
    ob = Outbox(db, broker, listener=fast, **NO_SWEEP)
    ob.start()

    @ob.transactional
    async def send(session: AsyncSession, n: int) -> str:
        return ob.send(session, f"{prefix}.fork", {"n": n})

    async def send_all(first: int) -> list[str]:
        ids = [await send(first + n) for n in range(10)]
        await ob.async_engine.dispose()  # its connections belong to this event loop
        return ids

    try:
        before = asyncio.run(send_all(0))

        def child() -> list[str]:
            ids = asyncio.run(send_all(100))
            wait_until(lambda: fast.ids >= set(ids), timeout=60, what="the child's fast path")
            ob.stop()
            return ids

        from_child = in_child(child, tmp_path / "child.json")
        after = asyncio.run(send_all(200))
        wait_until(lambda: fast.ids >= set(before + after), timeout=30, what="the parent's sends")
        wait_until(lambda: unsent(pg_url) == 0, timeout=30, what="every row marked sent")
    finally:
        ob.stop()
    delivered = [m.msg_id for m in asyncio.run(read_stream(nats_server.url, name))]
    assert sorted(delivered) == sorted(before + from_child + after)
