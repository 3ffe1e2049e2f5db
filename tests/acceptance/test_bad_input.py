"""Bad input at every entry point: one clear line naming what is wrong, nothing half-written.

Each test runs the real `outbox` command. A bug looks like a Python traceback, a
message that names neither the flag nor the value, a command that hangs on an
unreachable host, or an output file left behind by a run that failed.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import nats
import nats.js.errors
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from outbox import Outbox, migrate
from outbox.broker import BROKER_SCHEMES
from outbox.errors import ConfigError
from relay.brokers import broker_for
from relay.brokers.nats import create_stream, read_stream
from relay.lab.halfop import HALF_TOPIC, TransactionProducer
from relay.lab.halfop.coordinator import OFFSETS_BUCKET
from relay.lab.halfop.protocol import BORN_TIMESTAMP, PGROUP, TRAN_MSG, UNIQ_KEY
from relay.testing.embedded import NatsServer, free_port
from spark_jobs.schema import BROKER, LEDGER
from tests.helpers import AlwaysCommits, wait_until

OUTBOX = str(Path(sys.executable).with_name("outbox"))
ENV = {k: v for k, v in os.environ.items() if k not in ("OUTBOX_DB", "OUTBOX_BROKER")}
T0 = datetime(2026, 3, 1, tzinfo=UTC)
WINDOW = ["--start", T0.isoformat(), "--end", (T0 + timedelta(hours=1)).isoformat()]


def outbox(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [OUTBOX, *args], capture_output=True, text=True, timeout=timeout, env=ENV, check=False
    )


def refused(done: subprocess.CompletedProcess[str], code: int, *named: str) -> str:
    """The error line, once the run failed with ``code``, without a traceback, naming ``named``."""
    assert done.returncode == code, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    for text in named:
        assert text in line, line
    return line


def ledger_row(i: int, msg_id: str | None) -> dict[str, Any]:
    at = T0 + timedelta(seconds=i)
    return {"id": i, "msg_id": msg_id, "topic": "t.a", "status": "sent", "created_at": at,
            "sent_at": at, "attempts": 1, "receipt": str(i)}  # fmt: skip


def broker_row(i: int, msg_id: str) -> dict[str, Any]:
    return {"msg_id": msg_id, "topic": "t.a", "seq": str(i),
            "broker_ts": T0 + timedelta(seconds=i, milliseconds=5)}  # fmt: skip


def write(
    path: Path, rows: list[dict[str, Any]], schema: pa.Schema, drop: tuple[str, ...] = ()
) -> str:
    pq.write_table(pa.Table.from_pylist(rows, schema=schema).drop_columns(list(drop)), path)
    return str(path)


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["drain", "--db", "sqlite://", "--broker", "kafka://h:1"], "kafka://h:1"),
        (["coordinator", "--broker", "kafka://h:1"], "kafka://h:1"),
        # the test double has no scheme: a product command never drops messages silently
        (["drain", "--db", "sqlite://", "--broker", "memory://"], "memory://"),
        (["relay", "--db", "sqlite://", "--broker", "memory://"], "memory://"),
        (["status", "--db", "foo://x"], "foo://x"),
        (["migrate", "--db", "foo://x"], "foo://x"),
        (["export", "ledger", "--db", "foo://x", "--out", "{tmp}/x.parquet"], "foo://x"),
    ],
)
def test_unknown_schemes_name_the_url(args: list[str], named: str, tmp_path: Path) -> None:
    refused(outbox(*[a.format(tmp=tmp_path) for a in args]), 2, named)  # a bad value: usage
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("url", ["memory://", "memory://u:p@x", "Memory://"])
def test_a_product_outbox_refuses_the_memory_broker(url: str, sqlite_url: str) -> None:
    with pytest.raises(
        ConfigError, match=r"(?i)broker: .*memory://.* no supported scheme; use one of"
    ):
        Outbox(sqlite_url, broker=url)


def test_every_product_scheme_has_an_adapter() -> None:
    """One table of schemes: what the app accepts is what the relay can connect to."""
    for scheme in BROKER_SCHEMES:
        broker = broker_for(f"{scheme}://127.0.0.1:1")
        assert type(broker).__module__ == f"relay.brokers.{BROKER_SCHEMES[scheme]}"
    with pytest.raises(ConfigError, match="memory://"):
        broker_for("memory://")


@pytest.mark.parametrize(
    "args",
    [
        ["status"],
        ["migrate"],
        ["requeue", "--dead"],
        ["export", "ledger", "--out", "{tmp}/ledger.parquet"],
    ],
)
def test_an_unreachable_database_fails_fast(args: list[str], tmp_path: Path) -> None:
    db = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/x"
    began = time.monotonic()
    done = outbox(*[a.format(tmp=tmp_path) for a in args], "--db", db, timeout=30)
    assert time.monotonic() - began < 15, "a refused connection must not be retried for long"
    refused(done, 1, "127.0.0.1", "refused")
    assert list(tmp_path.iterdir()) == [], "no Parquet file from a failed export"


@pytest.mark.parametrize(
    ("scheme", "flag"), [("nats", "--stream"), ("redis", "--topic"), ("amqp", "--queue")]
)
def test_a_broker_export_from_an_unreachable_broker(scheme: str, flag: str, tmp_path: Path) -> None:
    url = f"{scheme}://127.0.0.1:{free_port()}"
    out = tmp_path / "broker.parquet"
    began = time.monotonic()
    done = outbox("export", "broker", "--broker", url, flag, "S", "--out", str(out), timeout=60)
    assert time.monotonic() - began < 20, "an export has nothing to wait for"
    refused(done, 1, url, "unreachable", "nothing was written")
    assert list(tmp_path.iterdir()) == []


def test_drain_with_an_unreachable_broker_says_so_once(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path}/outbox.sqlite"
    migrate.upgrade(db)
    url = f"nats://127.0.0.1:{free_port()}"
    done = outbox("drain", "--db", db, "--broker", url, timeout=60)
    refused(done, 1, url, "unreachable; nothing was touched")
    retries = [line for line in done.stderr.splitlines() if "Connect call failed" in line]
    assert len(retries) <= 1, "the adapter's retry warning repeated every 0.2 s"


def test_an_export_into_a_missing_folder(tmp_path: Path) -> None:
    out = tmp_path / "nosuch" / "ledger.parquet"
    refused(outbox("export", "ledger", "--db", "sqlite://", "--out", str(out)), 2, "--out")


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["export", "ledger", "--db", "sqlite://", "--since", "yesterday", "--out", "x"],
         ("--since", "'yesterday'", "ISO 8601")),
        (["reconcile", "--ledger", "l", "--broker-log", "b", "--out", "o",
          "--start", "yesterday", "--end", "2026-03-01"], ("--start", "'yesterday'")),
        (["reconcile", "--ledger", "l", "--broker-log", "b", "--out", "o", *WINDOW,
          "--sla", "soon"], ("--sla", "'soon'")),
        (["reconcile", "--ledger", "l", "--broker-log", "b", "--out", "o",
          "--start", "2026-03-02", "--end", "2026-03-01"], ("--end", "--start")),
        (["drain", "--db", "sqlite://", "--broker", "nats://h:1", "--concurrency", "many"],
         ("--concurrency", "'many'")),
        (["compare", "--faults", "nosuch"], ("faults", "nosuch")),
        (["compare", "--rollback-rate", "2"], ("--rollback-rate", "0 to 0.99")),
    ],
)  # fmt: skip
def test_bad_flag_values_are_usage_errors(args: list[str], named: tuple[str, ...]) -> None:
    refused(outbox(*args), 2, *named)


def test_reconcile_with_a_ledger_that_does_not_exist(tmp_path: Path) -> None:
    broker = write(tmp_path / "broker.parquet", [broker_row(1, "m1")], BROKER)
    ledger, out = tmp_path / "nosuch.parquet", tmp_path / "report"
    done = outbox("reconcile", "--ledger", str(ledger), "--broker-log", broker,
                  "--out", str(out), *WINDOW)  # fmt: skip
    refused(done, 1, "--ledger", str(ledger), "no such file")
    assert not out.exists()


@pytest.mark.parametrize(
    ("which", "drop"),
    [("ledger", ("created_at",)), ("broker", ("msg_id",)), ("broker", ("msg_id", "broker_ts"))],
)
def test_reconcile_inputs_missing_columns_fail_before_spark(
    which: str, drop: tuple[str, ...], tmp_path: Path
) -> None:
    """Checked from the Parquet footer: exit 1 (2 would mean "discrepancies found")."""
    ledger = write(tmp_path / "ledger.parquet", [ledger_row(1, "m1")], LEDGER,
                   drop if which == "ledger" else ())  # fmt: skip
    broker = write(tmp_path / "broker.parquet", [broker_row(1, "m1")], BROKER,
                   drop if which == "broker" else ())  # fmt: skip
    out = tmp_path / "report"
    began = time.monotonic()
    done = outbox("reconcile", "--ledger", ledger, "--broker-log", broker,
                  "--out", str(out), *WINDOW)  # fmt: skip
    flag, path = ("--ledger", ledger) if which == "ledger" else ("--broker-log", broker)
    refused(done, 1, flag, path, "missing column(s) " + ", ".join(drop))
    assert time.monotonic() - began < 8, "the check must not wait for a Spark session"
    assert not out.exists()


def test_malformed_ledger_rows_are_counted_not_fatal(tmp_path: Path) -> None:
    """Spark: two ledger rows without a usable msg_id among five good ones."""
    good = [f"m{i}" for i in range(5)]
    rows = [ledger_row(i, m) for i, m in enumerate(good)]
    rows += [ledger_row(5, None), ledger_row(6, "")]
    ledger = write(tmp_path / "ledger.parquet", rows, LEDGER)
    broker = write(tmp_path / "broker.parquet", [broker_row(i, m) for i, m in enumerate(good)],
                   BROKER)  # fmt: skip
    out = tmp_path / "report"
    done = outbox("reconcile", "--ledger", ledger, "--broker-log", broker, "--out", str(out),
                  *WINDOW, "--master", "local[1]", timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    total = json.loads((out / "summary.json").read_text())["total"]
    assert (total["malformed"], total["committed"], total["delivered"]) == (2, 5, 5)
    kinds = pq.read_table(out / "discrepancies").column("kind").to_pylist()
    assert kinds == ["malformed", "malformed"]


def test_reconcile_from_an_unreachable_database_is_one_line(tmp_path: Path) -> None:
    """Spark: the JDBC ledger read fails inside Spark; a Java stack must not reach the user."""
    broker = write(tmp_path / "broker.parquet", [broker_row(1, "m1")], BROKER)
    db = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/x"
    done = outbox("reconcile", "--ledger", db, "--broker-log", broker,
                  "--out", str(tmp_path / "report"), *WINDOW, "--master", "local[1]",
                  timeout=300)  # fmt: skip
    line = refused(done, 1, "JDBC")
    assert line.startswith("outbox reconcile: ")
    assert "\tat " not in done.stderr, "a Java stack trace"


def stored(url: str, stream: str) -> list[str | None]:
    """The msg_ids a stream holds (a discarded half's is in its UNIQ_KEY)."""
    found = asyncio.run(read_stream(url, stream))
    return [m.msg_id or m.headers.get(UNIQ_KEY) for m in found]


def test_a_half_without_real_topic_does_not_stop_the_coordinator(
    nats_server: NatsServer, stream: tuple[str, str]
) -> None:
    """A half nobody's producer wrote (no REAL_TOPIC) is skipped, with a warning.

    A bug: the coordinator dies, stops settling the good transaction behind it, or
    publishes the bad half somewhere.
    """
    name, prefix = stream
    url = nats_server.url

    async def inject() -> None:
        nc = await nats.connect(url)
        headers = {PGROUP: "bad-input", TRAN_MSG: "true", UNIQ_KEY: "no-real-topic",
                   BORN_TIMESTAMP: str(int(time.time() * 1000))}  # fmt: skip
        await nc.jetstream().publish(HALF_TOPIC, b"x", headers=headers)
        await nc.close()

    producer = TransactionProducer(group="bad-input", broker=url, listener=AlwaysCommits())
    producer.start()  # creates the half stream and answers the coordinator's checks
    coordinator = subprocess.Popen(
        [OUTBOX, "coordinator", "--broker", url, "--check-interval", "0.2",
         "--transaction-timeout", "0.3", "--check-max", "2"],
        stderr=subprocess.PIPE, text=True, env=ENV,
    )  # fmt: skip
    try:
        create_stream(url, name, f"{prefix}.>")
        asyncio.run(inject())
        good = producer.send_in_transaction(f"{prefix}.orders", b"y")
        wait_until(lambda: stored(url, name) == [good.msg_id], timeout=60, what="the good one")
        wait_until(lambda: half_offset(url) > 2, timeout=20, what="a round past both halfs")
        assert coordinator.poll() is None, "the coordinator ended"
    finally:
        producer.stop()
        coordinator.send_signal(signal.SIGTERM)
        _, log = coordinator.communicate(timeout=30)
    assert coordinator.returncode == 0, log
    assert "half 1 skipped: no half" in log, log
    assert stored(url, name) == [good.msg_id], "the bad half reached a real topic"


def half_offset(url: str) -> int:
    """The coordinator's saved half consume offset (1 before its first round)."""

    async def read() -> int:
        nc = await nats.connect(url)
        try:
            kv = await nc.jetstream().key_value(OFFSETS_BUCKET)
            return int((await kv.get("half")).value or b"1")
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.KeyNotFoundError):
            return 1
        finally:
            await nc.close()

    return asyncio.run(read())


class SilentServer:
    """A TCP server that accepts connections and never says a word (a hung host)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)

    def _accept(self) -> None:
        while True:
            try:
                self.held.append(self.sock.accept()[0])
            except OSError:  # closed: the test is over
                return

    def __enter__(self) -> SilentServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()
        self.thread.join(5)
        for conn in self.held:
            conn.close()


SILENT_URLS = {
    "postgresql": "postgresql+psycopg://app:pw@127.0.0.1:{port}/x",
    "mariadb": "mysql+pymysql://app:pw@127.0.0.1:{port}/x",
}


@pytest.mark.parametrize("backend", sorted(SILENT_URLS))
def test_a_host_that_never_answers_fails_fast(backend: str) -> None:
    """`outbox status` against a host that accepts TCP and then hangs: one line, exit 1, soon."""
    with SilentServer() as server:
        db = SILENT_URLS[backend].format(port=server.port)
        began = time.monotonic()
        done = outbox("status", "--db", db, "--connect-timeout", "2", timeout=30)
        took = time.monotonic() - began
    assert took < 12, f"took {took:.1f} s: --connect-timeout 2 was not applied"
    line = refused(done, 1, "OperationalError", f"app:***@127.0.0.1:{server.port}")
    assert done.stderr.strip() == line, "one line"
    assert "pw" not in line.replace("app:***", "")


@pytest.mark.parametrize("backend", sorted(SILENT_URLS))
def test_the_library_engine_gives_up_on_a_silent_host(backend: str) -> None:
    from sqlalchemy.exc import OperationalError

    from outbox import Outbox

    with SilentServer() as server:
        ob = Outbox(SILENT_URLS[backend].format(port=server.port), connect_timeout_s=1)
        began = time.monotonic()
        with pytest.raises(OperationalError):
            ob.engine.connect()
        took = time.monotonic() - began
        ob.stop()
    assert took < 8, f"took {took:.1f} s"


# aiomysql is left out: it reads the server's greeting with no timeout at all, so a
# silent host hangs it for ever (docs/configuration.md); the async extra omits it.
ASYNC_SILENT_URLS = {
    "asyncpg": "postgresql+asyncpg://app:{secret}@127.0.0.1:{port}/x",
    "psycopg_async": "postgresql+psycopg_async://app:{secret}@127.0.0.1:{port}/x",
    "asyncmy": "mysql+asyncmy://app:{secret}@127.0.0.1:{port}/x",
}


@pytest.mark.parametrize("driver", sorted(ASYNC_SILENT_URLS))
def test_an_async_engine_gives_up_on_a_silent_host(driver: str) -> None:
    """The first statement fails within connect_timeout_s (libpq: 2 s at least), no secret."""
    from sqlalchemy import text

    secret = "s3cret-Pass"

    async def first_statement(ob: Outbox) -> BaseException:
        try:
            async with ob.async_engine.connect() as conn:
                await conn.execute(text("SELECT 1"))
        except Exception as exc:  # each driver raises its own kind
            return exc
        finally:
            await ob.stop_async()
        raise AssertionError("a silent host answered")

    with SilentServer() as server:
        url = ASYNC_SILENT_URLS[driver].format(secret=secret, port=server.port)
        ob = Outbox(url, connect_timeout_s=1)
        began = time.monotonic()
        error = asyncio.run(asyncio.wait_for(first_statement(ob), 30))
        took = time.monotonic() - began
    assert took < 8, f"took {took:.1f} s"
    said = "".join(traceback.format_exception(error))
    assert "timeout" in said.lower() and secret not in said
    # asyncpg raises a bare TimeoutError (no text); the others name the timeout themselves.
    assert isinstance(error, TimeoutError) or "timeout" in str(error).lower()


def test_asyncmy_reads_wait_for_long_queries_once_connected(mariadb_url: str) -> None:
    """Its handshake is bounded by a read timeout, lifted once connected."""
    from sqlalchemy import text

    async def slow_query(ob: Outbox) -> object:
        try:
            async with ob.async_engine.connect() as conn:
                return (await conn.execute(text("SELECT SLEEP(1.5)"))).scalar()
        finally:
            await ob.stop_async()

    url = mariadb_url.replace("mysql+pymysql://", "mysql+asyncmy://")
    assert asyncio.run(slow_query(Outbox(url, connect_timeout_s=1))) == 0


def test_the_connect_timeout_comes_from_the_environment_too() -> None:
    with SilentServer() as server:
        db = SILENT_URLS["postgresql"].format(port=server.port)
        began = time.monotonic()
        done = subprocess.run(
            [OUTBOX, "status", "--db", db], capture_output=True, text=True, timeout=30,
            env={**ENV, "OUTBOX_CONNECT_TIMEOUT": "2"}, check=False,
        )  # fmt: skip
        took = time.monotonic() - began
    refused(done, 1, "OperationalError")
    assert took < 10, f"took {took:.1f} s: the default 10 s, not the environment's 2 s"


def test_a_msg_id_that_is_no_uuid_is_a_usage_error() -> None:
    line = refused(outbox("requeue", "--db", "sqlite://", "--id", "not-a-uuid"), 2, "--id")
    assert "'not-a-uuid'" in line and "UUID" in line
