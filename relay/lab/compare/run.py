"""The workload of `outbox compare`: the same transactions through model A and model B.

Each model gets the same business (``relay.lab.compare.workload``: an order row per transaction),
the same offered rate, the same rollback rate and payload size, and the same faults
at the same moments of its run. A run leaves its own streams at the broker and its
own rows in the database; ``relay.lab.compare.report`` exports and reconciles them.

Faults (``FAULTS``), each lasting ``fault_s`` where it has a length:
- ``kill``: SIGKILL of an app right after it committed (model A: 50 messages still in
  its memory; model B: between the local commit and the end request);
- ``broker-down``: the nats-server stopped and started again (embedded server), or
  every connection cut at the proxy (an external broker);
- ``drop``: the proxy swallows all traffic (publishes and acks silently lost), then
  cuts the connections;
- ``db-kill``: model A's relay connection terminated between publish and mark, for
  every mark during the fault (``MarkKiller``): the acked rows stay pending and the
  sweeper publishes them again (JetStream drops the copies);
- ``pause``: an `outbox relay` worker SIGSTOPped, then SIGCONTed (model A);
- ``drop-ends``: end-transaction requests never leave the producer (model B).
A fault that does not exist in a model is skipped there and reported as "n/a".

Poison (``poison_rate``): that share of the transactions, all through the run, carries
a payload the broker refuses for good (1 MiB: with the headers over nats-server's
max_payload of 1 MiB; the run's outbox raises ``max_payload_bytes`` to 2 MiB, as an app
may, so that ``send()`` takes it). Model A commits it and dead-letters
it after ``permanent_attempts``; model B's half send fails, so the transaction never runs.
Only those dead rows are excused: any other dead row counts as lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

import nats.js.errors
from sqlalchemy import Engine, event, func, select
from sqlalchemy.orm import Session

from outbox import Outbox
from outbox.engines import engine_from, with_query
from outbox.settings import Settings, environment_of
from outbox.table import DEAD, outbox_message, transaction_record
from relay.brokers.nats import create_stream, read_stream, stream_bytes
from relay.lab.compare.workload import FAULTS, POISON, Workload, business, orders, place_order
from relay.lab.halfop import (
    CHECK_MAX_TOPIC,
    OP_TOPIC,
    Coordinator,
    CoordinatorSettings,
    LocalTransactionState,
    SendStatus,
    SqlTransactionListener,
    TransactionProducer,
)
from relay.lab.halfop.protocol import UNIQ_KEY
from relay.testing.embedded import NatsServer
from relay.testing.faults import (
    MarkKiller,
    TcpProxy,
    kill_app_after_commit,
    kill_producer_after_commit,
    paused,
)

# count(what, total) -> a context giving what to tell each transaction done (progress).
Counter = Callable[[str, int], AbstractContextManager[Callable[[int], None]]]

log = logging.getLogger("relay.lab.compare.run")

KILLED_APP_MESSAGES = 50
SETTLE_TIMEOUT_S = 180.0
# Short intervals, so that a quick run settles every fault within seconds.
QUICK_OUTBOX: dict[str, Any] = {
    "sweeper_age_s": 2.0,
    "handoff_limit_s": 1.5,
    "sweep_interval_s": 0.5,
    "backoff_base_s": 0.2,
    "backoff_cap_s": 2.0,
    "publish_timeout_s": 2.0,
    "max_attempts": 8,  # a retryable failure: dead about 10 s after its commit (poison: sooner)
    "max_payload_bytes": 2 * 1024 * 1024,  # so that send() takes the poison (see POISON)
}
QUICK_COORDINATOR = CoordinatorSettings(check_interval_s=0.5, transaction_timeout_s=1.0)


@dataclass
class FaultRecord:
    name: str
    ended_at: float = 0.0  # time.time() when it was over
    settle_s: float | None = None  # until everything committed by then was at the broker
    skipped: bool = False


@dataclass
class RunResult:
    model: str
    stream: str  # where the real messages are
    started: datetime
    ended: datetime = field(default_factory=lambda: datetime.now(UTC))
    committed_seen: int = 0  # transactions the workload saw commit
    rolled_back: int = 0
    failed: int = 0  # the transaction raised for another reason (a fault)
    poisoned: int = 0  # transactions offered with a poison payload
    dead: int = 0  # committed messages dead-lettered (model A)
    statements: int = 0  # DB statements issued by this process for the run
    check_backs: int = 0
    op_log_bytes: int | None = None  # what the run added to the op stream (model B)
    half_retries: int = 0  # model B: half sends attempted again
    faults: list[FaultRecord] = field(default_factory=list)


class Delivered:
    """msg_id -> first time seen at the broker, read incrementally by sequence."""

    def __init__(self, url: str, stream: str) -> None:
        self.url, self.stream = url, stream
        self.first_seen: dict[str, float] = {}
        self._next_seq = 1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="delivered", daemon=True)

    def start(self) -> Delivered:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _poll(self) -> None:
        while not self._stop.wait(0.1):
            try:
                asyncio.run(self._read_new())
            except Exception:  # the broker may be down on purpose: try again
                log.debug("delivered poll failed", exc_info=True)

    async def _read_new(self) -> None:
        for msg in await read_stream(self.url, self.stream, first_seq=self._next_seq):
            if msg.msg_id:
                self.first_seen.setdefault(msg.msg_id, time.time())
            self._next_seq = msg.seq + 1

    def settled_at(self, msg_ids: set[str]) -> float | None:
        seen = self.first_seen
        if not msg_ids <= seen.keys():
            return None
        return max((seen[m] for m in msg_ids), default=0.0)


def count_statements(engine: Engine) -> Callable[[], int]:
    counter = [0]

    @event.listens_for(engine, "before_cursor_execute")
    def count(*_: Any) -> None:
        counter[0] += 1

    return lambda: counter[0]


def port_of(url: str) -> int:
    return urlsplit(url).port or 4222


class Run:
    """What both models share: the proxy, the engine, the delivered log, paced threads,
    faults, and the run itself; a model adds its parts through the hooks below."""

    ledger: Any  # the msg_id column of the model's ledger (its committed transactions)

    def __init__(
        self, model: str, db: str, nats_url: str, server: NatsServer | None, w: Workload
    ) -> None:
        self.model, self.db, self.w, self.server = model, db, w, server
        self.nats_url = nats_url
        self.proxy = TcpProxy(port_of(nats_url)).start()
        self.stream = f"CMP_{model.upper()}"
        self.subject = f"cmp.{model}.orders"
        self.app_name = f"outbox-compare-{model}"
        self.result = RunResult(model, self.stream, datetime.now(UTC))
        self.delivered = Delivered(nats_url, self.stream)
        self._lock = threading.Lock()
        self._pending_settles: list[tuple[FaultRecord, set[str]]] = []
        self.engine = engine_from(
            with_query(db, application_name=self.app_name),
            pool_size=w.concurrency + 4,
            pool_pre_ping=True,
        )
        self.statements = count_statements(self.engine)
        self.finished: Callable[[int], None] = lambda n: None  # progress: transactions done

    @property
    def via_proxy(self) -> str:
        return f"nats://127.0.0.1:{self.proxy.port}"

    def drive(self, transaction: Callable[[int], str], inject: Callable[[str], None]) -> None:
        """Offer the transactions at the set rate while the faults happen one after another."""
        faults = threading.Thread(target=self._faults, args=(inject,), name="faults")
        faults.start()
        interval = self.w.concurrency / self.w.rate
        with ThreadPoolExecutor(self.w.concurrency) as pool:
            for lane in range(self.w.concurrency):
                pool.submit(self._lane, lane, interval, transaction)
        faults.join()

    def _lane(self, lane: int, interval: float, transaction: Callable[[int], str]) -> None:
        next_at = time.monotonic()
        for i in range(lane, self.w.transactions, self.w.concurrency):
            next_at += interval
            outcome = transaction(i)
            with self._lock:
                self.result.poisoned += self.w.poisoned(i)
                if outcome == "committed":
                    self.result.committed_seen += 1
                elif outcome == "rolled back":
                    self.result.rolled_back += 1
                else:
                    self.result.failed += 1
            self.finished(1)
            time.sleep(max(0.0, next_at - time.monotonic()))

    def _faults(self, inject: Callable[[str], None]) -> None:
        """Faults spread over the run's expected length, one at a time."""
        length = self.w.transactions / self.w.rate
        gap = length / (len(self.w.faults) + 1)
        for n, name in enumerate(self.w.faults, start=1):
            time.sleep(max(0.0, gap * n - (time.time() - self.result.started.timestamp())))
            record = FaultRecord(name)
            self.result.faults.append(record)
            if self.model not in FAULTS[name]:
                record.skipped = True
                continue
            log.info("model %s: fault %s", self.model, name)
            inject(name)
            record.ended_at = time.time()
            self._pending_settles.append((record, self.committed_ids_soon()))

    def broker_down(self) -> None:
        if self.server is not None:
            self.server.stop()
            time.sleep(self.w.fault_s)
            self.server.start()
        else:
            self.proxy.stop()
            time.sleep(self.w.fault_s)
            self.proxy.start()

    def inject_common(self, name: str) -> bool:
        if name == "broker-down":
            self.broker_down()
        elif name == "drop":
            self.proxy.drop_for(self.w.fault_s)
        else:
            return False
        return True

    def committed_ids(self) -> set[str]:
        """msg_ids of the committed transactions, by the model's own ledger."""
        with self.engine.connect() as conn:
            return {str(m) for m in conn.execute(select(self.ledger)).scalars()}

    def dead_ids(self) -> set[str]:
        """msg_ids of the poison messages given up for good (model A's dead poison rows)."""
        return set()

    def committed_ids_soon(self) -> set[str]:
        """committed_ids, retried while a fault's aftermath still breaks connections."""
        for _ in range(20):
            try:
                return self.committed_ids()
            except Exception:
                time.sleep(0.1)
        return self.committed_ids()

    def wait_settled(self) -> None:
        """Until every committed message is at the broker or dead (or the timeout)."""
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while self.delivered.settled_at(self.committed_ids() - self.dead_ids()) is None:
            if time.monotonic() > deadline:
                log.warning("model %s: not everything settled in time", self.model)
                return
            time.sleep(0.2)

    def run(self) -> RunResult:
        business.create_all(self.engine)
        create_stream(self.nats_url, self.stream, f"cmp.{self.model}.>")
        self.start_parts()
        self.delivered.start()
        try:
            self.drive(self.transaction, self.inject)
            self.wait_settled()
            self.wait_resolved()
        finally:
            self.stop_parts()
            self.delivered.stop()
            self.proxy.stop()
        self.record_settles()
        self.result.dead = len(self.dead_ids())
        self.result.statements = self.statements()
        self.result.ended = datetime.now(UTC)
        self.engine.dispose()
        return self.result

    def start_parts(self) -> None:
        """Start the model's own parts (relay, worker, producer, coordinator)."""

    def stop_parts(self) -> None:
        """Stop them; runs even when the workload failed."""

    def wait_resolved(self) -> None:
        """After every message settled: wait for what else the model must finish."""

    def transaction(self, i: int) -> str:
        """Run business transaction ``i``: committed, rolled back or failed."""
        raise NotImplementedError

    def inject(self, name: str) -> None:
        """Inject fault ``name`` (one the model has) and return when it is over."""
        raise NotImplementedError

    def record_settles(self) -> None:
        dead = self.dead_ids()
        for record, ids in self._pending_settles:
            at = self.delivered.settled_at(ids - dead)
            record.settle_s = None if at is None else max(0.0, at - record.ended_at)


class ModelA(Run):
    ledger = outbox_message.c.msg_id

    def __init__(self, db: str, nats_url: str, server: NatsServer | None, w: Workload) -> None:
        super().__init__("a", db, nats_url, server, w)
        self.broker = f"{self.via_proxy}?stream={self.stream}&subjects=cmp.a.>"
        self.killer = MarkKiller(self.engine)  # before the relay starts: see its docstring
        self.ob = Outbox(self.engine, broker=self.broker, **QUICK_OUTBOX)
        self.worker: subprocess.Popen[bytes] | None = None

    def dead_ids(self) -> set[str]:
        poison = func.length(outbox_message.c.payload) == len(POISON)
        query = select(self.ledger).where(outbox_message.c.status == DEAD, poison)
        with self.engine.connect() as conn:
            return {str(m) for m in conn.execute(query).scalars()}

    def transaction(self, i: int) -> str:
        try:
            with Session(self.engine) as session, session.begin():
                session.execute(orders.insert().values(sku=f"A{i}"))
                self.ob.send(session, self.subject, self.w.payload(i))
                if self.w.rolls_back(i):
                    raise Rejected
        except Rejected:
            return "rolled back"
        except Exception:
            log.debug("transaction %d failed", i, exc_info=True)
            return "failed"
        return "committed"

    def inject(self, name: str) -> None:
        if self.inject_common(name):
            return
        if name == "kill":
            kill_app_after_commit(self.db, self.broker, self.subject, KILLED_APP_MESSAGES)
        elif name == "db-kill":
            self.killer.arm()
            time.sleep(self.w.fault_s)
            self.killer.disarm()
            log.info("model a: %d mark statement(s) killed", self.killer.kills)
        elif name == "pause" and self.worker is not None:
            with paused(self.worker.pid):
                time.sleep(self.w.fault_s)

    def start_parts(self) -> None:
        if "pause" in self.w.faults:
            self.worker = start_worker(self.db, self.broker, self.ob.settings)
        self.ob.start()

    def stop_parts(self) -> None:
        self.ob.stop()
        self.killer.close()
        stop_worker(self.worker)


class ModelB(Run):
    ledger = transaction_record.c.msg_id

    def __init__(self, db: str, nats_url: str, server: NatsServer | None, w: Workload) -> None:
        super().__init__("b", db, nats_url, server, w)
        self.halfs = 0  # halfs stored: each must end in an op or a discard
        self.half_ids: set[str] = set()
        listener = SqlTransactionListener(
            self.engine, place_order, group="compare", rollback_after_s=5.0
        )
        self.producer = TransactionProducer(
            group="compare",
            broker=self.via_proxy,
            listener=listener,
            max_payload_bytes=QUICK_OUTBOX["max_payload_bytes"],
            retry_times_when_send_failed=w.retry_times_when_send_failed,
        )
        self.coordinator = Coordinator(self.via_proxy, QUICK_COORDINATOR)
        self.op_bytes_before = 0  # the op stream outlives a run on a broker of --broker

    def transaction(self, i: int) -> str:
        arg = {"sku": f"B{i}", "fail": self.w.rolls_back(i)}
        try:
            result = self.producer.send_in_transaction(self.subject, self.w.payload(i), arg)
        except Exception:
            log.debug("transaction %d failed", i, exc_info=True)
            return "failed"
        if result.send_status is not SendStatus.SEND_OK:
            return "failed"
        with self._lock:
            self.halfs += 1
            self.half_ids.add(result.msg_id)
        if result.local_state is LocalTransactionState.ROLLBACK_MESSAGE:
            return "rolled back"
        return "committed"

    def inject(self, name: str) -> None:
        if self.inject_common(name):
            return
        if name == "kill":
            msg_id, _, _ = kill_producer_after_commit(
                self.db, self.via_proxy, self.subject, group="compare"
            )
            with self._lock:
                self.halfs += 1
                self.half_ids.add(msg_id)
        elif name == "drop-ends":
            self.producer.drop_end_requests = True
            time.sleep(self.w.fault_s)
            self.producer.drop_end_requests = False

    def start_parts(self) -> None:
        self.op_bytes_before = stream_bytes(self.nats_url, OP_TOPIC)
        self.coordinator.start()
        self.producer.start()

    def stop_parts(self) -> None:
        self.producer.stop()
        self.coordinator.stop()
        self.result.check_backs = self.coordinator.stats.check_requests
        self.result.half_retries = self.producer.half_retries
        try:
            self.result.op_log_bytes = stream_bytes(self.nats_url, OP_TOPIC) - self.op_bytes_before
        except Exception:  # a figure of the report: never the run's failure
            log.warning("model b: the op stream's size is unknown", exc_info=True)

    def wait_resolved(self) -> None:
        """Until every half has its op or was discarded, so that none counts as unresolved
        (by transaction: a half may have several ops, one per copy answered)."""
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while (open_ := len(self.half_ids - self.resolved_ids())) and time.monotonic() < deadline:
            time.sleep(0.5)
        if open_:
            log.warning("model b: %d halfs still unresolved after %d s", open_, SETTLE_TIMEOUT_S)

    def resolved_ids(self) -> set[str]:
        """The msg ids with an op or a discard record."""
        found: set[str] = set()
        for stream in (OP_TOPIC, CHECK_MAX_TOPIC):
            with contextlib.suppress(nats.js.errors.NotFoundError):  # no discard yet
                found.update(
                    m.headers.get(UNIQ_KEY, "")
                    for m in asyncio.run(read_stream(self.nats_url, stream))
                )
        return found


class Rejected(Exception):
    """The workload's rollback: an exception inside the transaction, as a handler raises."""


def start_worker(db: str, broker: str, settings: Settings) -> subprocess.Popen[bytes]:
    """An `outbox relay` worker with the app's settings (OUTBOX_<FIELD>, as a deployment
    shares them), so that its sweeper age and backoff are the app's."""
    env = {**os.environ, **environment_of(settings), "OUTBOX_DB": db, "OUTBOX_BROKER": broker}
    cmd = [sys.executable, "-c", "from relay.cli import main; raise SystemExit(main())"]
    cmd += ["relay"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop_worker(worker: subprocess.Popen[bytes] | None) -> None:
    if worker is None:
        return
    worker.send_signal(signal.SIGTERM)
    try:
        worker.wait(30)
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.wait()


def run_models(
    db: str,
    nats_url: str,
    server: NatsServer | None,
    w: Workload,
    step: Callable[[str], None] = lambda _: None,
    count: Counter = lambda what, total: nullcontext(lambda n: None),
) -> Iterator[RunResult]:
    """Model A's run, then model B's, on the same database and broker; ``step`` is told
    as each starts and ``count(what, total)`` gives what is told each transaction done
    (progress)."""
    for name, model in (("a", ModelA), ("b", ModelB)):
        step(f"running model {name}")
        run = model(db, nats_url, server, w)
        with count(f"model {name}", w.transactions) as finished:
            run.finished = finished
            result = run.run()
        yield result
