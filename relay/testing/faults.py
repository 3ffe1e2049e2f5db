"""Reusable faults for tests, benches and `outbox compare`.

``TcpProxy(target_port)`` listens on a free loopback port and forwards to the
target. ``stop()`` closes the listener and every forwarded connection (to the client
the broker is gone); ``start()`` listens again on the same port (it came back);
``dropping = True`` swallows traffic both ways on open connections (acks silently
lost) until it is set back and the connections are cut (as a middlebox would);
``dropping_replies = True`` swallows only the server's side (what the client sends
still arrives: stored, but never acked).

``FaultyBroker(inner, faults)`` wraps any Broker and makes chosen messages fail in
the per-message path, for unit tests of the relay logic; ``stall_s`` makes each
publish block its thread first, as a broker client doing blocking I/O would.
``StalledStatements(engine, seconds)`` does the same to the relay's SQL statements.

The others: ``kill_app_after_commit`` (model A: SIGKILL with committed messages in
memory), ``kill_producer_after_commit`` (model B: SIGKILL between the local commit
and the end request), ``MarkKiller`` (the relay's DB connection terminated between
publish and mark),
``paused`` (SIGSTOP a worker, SIGCONT after).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from sqlalchemy import Engine, create_engine, event, text

from outbox.broker import Broker, PublishResult
from outbox.message import Message
from relay.testing.embedded import free_port

log = logging.getLogger("relay.testing.faults")


# A message's fault: its own answer, an exception its publish raises, or None (healthy).
Fault = PublishResult | Exception | None


class FaultyBroker(Broker):
    """Wraps ``inner`` and fails the messages ``faults`` picks (by msg_id, or a function).

    A PublishResult fault (``permanent(...)``, ``retry(...)``) is that message's answer and
    the message is not forwarded. An exception fault is raised from ``publish`` whenever
    that message is in the batch, before anything is forwarded: an adapter that lets one
    message's exception escape ``asyncio.gather`` does the same. Healthy messages go to
    ``inner`` in one call; ``forwarded`` counts how often each msg_id was handed on.
    ``stall_s``: the first publish call and every ``stall_every``-th after it first block
    the thread they run on (``time.sleep``, not an await) for that long; ``stalls`` counts
    them. The first call always stalls, so a test that asks for stalls gets one however
    the relay batches its publishes.
    """

    def __init__(
        self,
        inner: Broker,
        faults: Mapping[str, Fault] | Callable[[Message], Fault],
        stall_s: float = 0.0,
        stall_every: int = 1,
    ) -> None:
        self.inner = inner
        self._fault = faults if callable(faults) else (lambda m: faults.get(m.msg_id))
        self.forwarded: Counter[str] = Counter()
        self.raised = 0  # publish calls that raised
        self.stall_s, self.stall_every = stall_s, stall_every
        self.calls = self.stalls = 0

    async def connect(self) -> None:
        await self.inner.connect()

    async def publish(self, messages: Sequence[Message]) -> list[PublishResult]:
        self.calls += 1
        if self.stall_s and (self.calls - 1) % self.stall_every == 0:
            self.stalls += 1
            time.sleep(self.stall_s)  # blocking on purpose: whichever loop runs this stalls
        faults = [self._fault(m) for m in messages]
        for fault in faults:
            if isinstance(fault, Exception):
                self.raised += 1
                raise fault
        healthy = [m for m, fault in zip(messages, faults, strict=True) if fault is None]
        self.forwarded.update(m.msg_id for m in healthy)
        answers = iter(await self.inner.publish(healthy) if healthy else [])
        return [next(answers) if f is None else f for f in faults]  # type: ignore[misc]

    async def close(self) -> None:
        await self.inner.close()


class TcpProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self._listener: socket.socket | None = None
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.dropping = False
        self.dropping_replies = False

    def start(self) -> TcpProxy:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(
            target=self._accept, args=(listener,), name="tcp-proxy", daemon=True
        ).start()
        return self

    def stop(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, set()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def drop_for(self, seconds: float) -> None:
        """Swallow all traffic for ``seconds``, then cut the connections (clients reconnect)."""
        self.dropping = True
        time.sleep(seconds)
        self.dropping = False
        self.stop()
        self.start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # stopped
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._sockets |= {client, upstream}
            for src, dst, reply in ((client, upstream, False), (upstream, client, True)):
                threading.Thread(target=self._pump, args=(src, dst, reply), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, reply: bool) -> None:
        try:
            while data := src.recv(65536):
                if not (self.dropping or (reply and self.dropping_replies)):
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


# A model-B producer that dies by SIGKILL after its local transaction committed and
# before its end request left: check-back alone must settle the message.
_KILLED_PRODUCER = """
import os, sys
from relay.lab.halfop import SqlTransactionListener, TransactionProducer
from relay.lab.compare.workload import place_order

class DiesAfterCommit(SqlTransactionListener):
    def execute_local_transaction(self, msg, arg):
        state = super().execute_local_transaction(msg, arg)
        print(msg.msg_id, state.value, flush=True)
        os.kill(os.getpid(), 9)

listener = DiesAfterCommit(sys.argv[1], place_order, group=sys.argv[4], rollback_after_s=2)
producer = TransactionProducer(group=sys.argv[4], broker=sys.argv[2], listener=listener)
producer.start()
producer.send_in_transaction(sys.argv[3], b"x", {"sku": "K1"})
"""


def kill_producer_after_commit(
    db: str, broker: str, topic: str, group: str = "orders"
) -> tuple[str, str, int]:
    """Run such a producer in a subprocess; returns (msg_id, local state, exit code)."""
    done = subprocess.run(
        [sys.executable, "-c", _KILLED_PRODUCER, db, broker, topic, group],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    words = done.stdout.split()
    if len(words) != 2:
        raise RuntimeError(f"the producer did not report its transaction: {done.stderr[-2000:]}")
    return words[0], words[1], done.returncode


# A model-A app that is SIGKILLed right after its commit: the messages were only in
# its memory (the msgQueue), so the sweeper or a relay worker must deliver them.
_KILLED_APP = textwrap.dedent(
    """
    import sys
    from sqlalchemy.orm import Session
    from outbox import Outbox
    db, broker, topic, count, keys = sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:])
    ob = Outbox(db, broker=broker, sweeper=False)
    ob.start()
    for first in range(0, count, 10):  # transactions of 10; with keys, ordered ones
        with Session(ob.engine) as session, session.begin():
            for i in range(first, min(count, first + 10)):
                key = f"k{i % keys}" if keys else None
                ob.send(session, topic, {"i": i}, key=key, ordered=bool(keys))
    print("committed", flush=True)
    sys.stdin.read()  # wait, messages in memory, until killed
    """
)


def kill_app_after_commit(db: str, broker: str, topic: str, count: int, keys: int = 0) -> None:
    """Commit ``count`` messages in a subprocess and SIGKILL it at once; with ``keys``,
    ordered messages over that many keys (``k0``, ``k1``...)."""
    app = subprocess.Popen(
        [sys.executable, "-c", _KILLED_APP, db, broker, topic, str(count), str(keys)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert app.stdout is not None
    line = app.stdout.readline().strip()
    app.send_signal(signal.SIGKILL)
    _, err = app.communicate(timeout=10)
    if line != "committed":
        raise RuntimeError(f"the app did not commit: {err[-2000:]}")


class MarkKiller:
    """Kills the relay's DB connection between publish and mark, while it is armed.

    The fast path marks acked rows from its ack thread (``outbox-acks``). While armed,
    each statement on that thread first has its backend terminated (and waited for),
    so the mark fails on a dead connection as it would after a database restart or a
    network cut: the messages are at the broker and still pending in the table.
    ``arm()`` kills every mark until ``disarm()``.

    Make it before the relay starts: SQLAlchemy's event lists must not change while
    other threads run statements, so the listener is never removed (``close()`` leaves
    it disarmed).
    """

    THREAD = "outbox-acks"
    _ALIVE = text("SELECT 1 FROM pg_stat_activity WHERE pid = :pid")

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.kills = 0  # mark statements (tries) whose connection was terminated
        self.armed = False
        # One pooled connection (a kill costs no connect); autocommit, so that each look
        # at pg_stat_activity is a fresh snapshot, not the transaction's first one.
        self._admin = create_engine(engine.url, pool_size=1, isolation_level="AUTOCOMMIT")
        event.listen(engine, "before_cursor_execute", self._before)

    def arm(self) -> None:
        self.armed = True

    def disarm(self) -> None:
        self.armed = False

    def close(self) -> None:
        self.disarm()
        self._admin.dispose()

    def _before(self, conn: Any, cursor: Any, *_: Any) -> None:
        if not self.armed or not threading.current_thread().name.startswith(self.THREAD):
            return
        self.kills += 1  # only the one ack thread gets here
        pid = {"pid": cursor.connection.info.backend_pid}  # psycopg 3
        with self._admin.connect() as admin:
            admin.execute(text("SELECT pg_terminate_backend(:pid)"), pid)
            # Gone before the mark is sent (pg_terminate_backend's own wait polls at 100 ms).
            deadline = time.monotonic() + 5
            while admin.execute(self._ALIVE, pid).first():
                if time.monotonic() > deadline:
                    log.warning("backend %s outlived its termination: this mark may succeed", pid)
                    return
                time.sleep(0.001)


class StalledStatements:
    """Blocks the first SQL statement ``engine`` runs on the relay's threads and every
    ``every``-th after it (the first always, however few statements the relay batches into).

    The relay marks acks and re-reads rows on its own threads (named ``outbox-...``);
    a slow or locked database makes those statements wait ``seconds`` like this. On
    other threads (the app's, the test's) run at full speed. ``stalls`` counts them.
    Like ``MarkKiller``, make it before the relay starts; the listener is never removed.
    """

    THREADS = "outbox-"

    def __init__(self, engine: Engine, seconds: float, every: int = 1) -> None:
        self.seconds, self.every = seconds, every
        self.statements = self.stalls = 0
        event.listen(engine, "before_cursor_execute", self._before)

    def _before(self, *_: Any) -> None:
        if threading.current_thread().name.startswith(self.THREADS):
            self.statements += 1
            if (self.statements - 1) % self.every == 0:
                self.stalls += 1
                time.sleep(self.seconds)


@contextlib.contextmanager
def paused(pid: int) -> Iterator[None]:
    """SIGSTOP a process for the block, then SIGCONT (it resumes where it stood)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)
