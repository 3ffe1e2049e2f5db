"""Small shared test helpers."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Engine, create_engine, func, select
from sqlalchemy.pool import NullPool

from outbox import migrate, outbox_message
from relay.brokers import Broker
from relay.fastpath.dispatcher import Dispatcher
from relay.lab.halfop import LocalTransactionState, TransactionListener, TransactionMessage
from relay.loop import BrokerLoop


def wait_until(
    condition: Callable[[], object], timeout: float = 60.0, what: str = "", every: float = 0.002
) -> None:
    """Poll ``condition`` until it is true; fail with ``what`` after ``timeout`` seconds.

    The deadline is a safety net, not a speed bound: on a loaded 2-core machine a relay
    may take many seconds for what takes milliseconds when idle."""
    if not came_within(condition, timeout, every):
        raise AssertionError(f"timed out after {timeout} s waiting for {what or condition}")


def came_within(condition: Callable[[], object], seconds: float, every: float = 0.05) -> bool:
    """Whether ``condition`` turned true within ``seconds`` (checked every ``every`` s)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(every)
    return True


def workers_until(
    command: list[str],
    env: Mapping[str, str],
    done: Callable[[], object],
    what: str,
    n: int = 4,
    started: Callable[[], object] | None = None,
) -> list[str]:
    """Run ``n`` worker processes of ``command`` until ``done``, stop them with SIGTERM;
    their stderr logs. Each must exit 0. ``started`` runs once they were launched."""
    workers = [
        subprocess.Popen(command, env=dict(env), stderr=subprocess.PIPE, text=True)
        for _ in range(n)
    ]
    try:
        if started is not None:
            started()
        wait_until(done, timeout=120, what=what)
    finally:
        for worker in workers:
            worker.send_signal(signal.SIGTERM)
        logs = [worker.communicate(timeout=30)[1] for worker in workers]
    assert all(w.returncode == 0 for w in workers), logs
    return logs


@contextmanager
def migrated(url: str) -> Iterator[Engine]:
    """An engine on ``url`` once the outbox's tables are there; disposed afterwards."""
    migrate.upgrade(url)
    # SQLite's busy handler is not fair: on a loaded machine one of ten writing threads
    # can wait past the default 5 s for the lock ("database is locked").
    eng = create_engine(url, connect_args={"timeout": 60} if url.startswith("sqlite") else {})
    try:
        yield eng
    finally:
        eng.dispose()


def unsent(db: str) -> int:
    """Rows of ``db``'s outbox not (yet) marked sent."""
    return count_rows(db, outbox_message.c.status != "sent")


def sent_count(db: str) -> int:
    """Rows of ``db``'s outbox marked sent."""
    return count_rows(db, outbox_message.c.status == "sent")


def count_rows(db: str, condition: Any) -> int:
    engine = create_engine(db, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return int(conn.execute(select(func.count()).where(condition)).scalar_one())
    finally:
        engine.dispose()


def running(broker: Broker, loops: list[BrokerLoop]) -> BrokerLoop:
    """``broker`` on a started BrokerLoop, added to ``loops`` (the fixture stops them)."""
    loop = BrokerLoop(broker)
    loop.start()
    loops.append(loop)
    return loop


class DispatcherWithLoop(Dispatcher):
    """A Dispatcher on a BrokerLoop of its own, started before and stopped after it: what
    a relay.runtime.Relay does around its fast path, for tests of the fast path alone."""

    def __init__(self, broker: Broker, *args: Any, **kwargs: Any) -> None:
        super().__init__(BrokerLoop(broker), *args, **kwargs)

    def _start(self) -> None:
        self.broker_loop.start()
        try:
            super()._start()
        except BaseException:
            self.broker_loop.stop(1.0)
            raise

    def _stop(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        finished = super()._stop(timeout)
        return self.broker_loop.stop(max(0.0, deadline - time.monotonic())) and finished


class AlwaysCommits(TransactionListener):
    """A model-B listener whose local transaction always commits (no database)."""

    def execute_local_transaction(
        self, msg: TransactionMessage, arg: object
    ) -> LocalTransactionState:
        return LocalTransactionState.COMMIT_MESSAGE

    def check_local_transaction(self, msg: TransactionMessage) -> LocalTransactionState:
        return LocalTransactionState.COMMIT_MESSAGE


@contextmanager
def logging_kept() -> Iterator[None]:
    """Run code that reconfigures logging in this process (an Alembic env.py's
    ``fileConfig``, which disables every logger that exists) and put every logger back as
    it was afterwards: a later test of this worker must still hear ``relay.*``."""
    import logging

    loggers = [logging.getLogger(), *(
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    )]  # fmt: skip
    saved = [(lg, lg.disabled, lg.level, lg.propagate, list(lg.handlers)) for lg in loggers]
    try:
        yield
    finally:
        for lg, disabled, level, propagate, handlers in saved:
            lg.disabled, lg.propagate = disabled, propagate
            lg.setLevel(level)
            lg.handlers[:] = handlers
