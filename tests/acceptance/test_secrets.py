"""No password or token in any output: every command, the library's repr, errors and logs.

The password holds every URL-reserved character and a space. It goes in percent-encoded
(the form drivers understand) and, where a driver can still parse it, raw; markers at
its start, middle and end catch a partial leak too (a parser that stops at a '/' or
'#' prints the rest). PostgreSQL trusts every local login, so the success paths run
with it; elsewhere the wrong password fails, and the failure's output is what counts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import pytest
from sqlalchemy.engine import make_url

from outbox import Outbox, migrate
from outbox.engines import check_broker_url
from outbox.errors import ConfigError
from outbox.secrets import mask_url
from relay.testing.embedded import NatsServer, free_port
from tests.helpers import wait_until

OUTBOX = str(Path(sys.executable).with_name("outbox"))
PASSWORD = "Zx9Head:/?#Zx9Mid[]@!$&'()*+,;=% Zx9Tail"
ENCODED = quote(PASSWORD, safe="")
RAW = PASSWORD.replace("@", "").replace("%", "")  # what SQLAlchemy's URL parser still splits right
MARKERS = ("Zx9Head", "Zx9Mid", "Zx9Tail", PASSWORD, ENCODED, RAW)
ENV = {k: v for k, v in os.environ.items() if k not in ("OUTBOX_DB", "OUTBOX_BROKER")}


def clean(output: str) -> None:
    leaked = [m for m in MARKERS if m in output]
    assert leaked == [], f"{leaked} in:\n{output}"


def with_password(db: str, password: str = PASSWORD) -> str:
    return make_url(db).set(password=password).render_as_string(hide_password=False)


def raw_password(db: str) -> str:
    """The URL as a careless user writes it: the password not percent-encoded."""
    url = make_url(db)
    return with_password(db, "PLACEHOLDER").replace("PLACEHOLDER", RAW) if url else db


def run(*args: str, timeout: float = 120) -> str:
    done = subprocess.run(
        [OUTBOX, *args], capture_output=True, text=True, timeout=timeout, env=ENV, check=False
    )
    output = done.stdout + done.stderr
    assert "Traceback" not in output, output
    clean(output)
    return output


def test_migrate_status_requeue_on_a_database_that_lets_them_in(pg_url: str) -> None:
    for db in (with_password(pg_url), raw_password(pg_url)):
        assert "0011 in postgresql+psycopg://postgres:***@" in run("migrate", "--db", db)
        assert "TOTAL" in run("status", "--db", db)
        assert "requeued 0" in run("requeue", "--db", db, "--dead")


def test_errors_name_the_host_not_the_password(tmp_path: Path, mariadb_url: str) -> None:
    pg_down = f"postgresql+psycopg://app:{ENCODED}@127.0.0.1:{free_port()}/x"
    assert "app:***@127.0.0.1" in run("status", "--db", pg_down)
    assert "app:***@127.0.0.1" in run("status", "--db", raw_password(pg_down))
    assert "Access denied" in run("migrate", "--db", with_password(mariadb_url))
    assert "Access denied" in run("requeue", "--db", with_password(mariadb_url), "--dead")
    assert "cannot use" in run("status", "--db", f"nosuchdb://u:{ENCODED}@h/x")
    out = str(tmp_path / "x.parquet")
    assert "app:***@127.0.0.1" in run("export", "ledger", "--db", pg_down, "--out", out)
    for broker, flag in [
        (f"amqp://guest:{ENCODED}@127.0.0.1:5672/", "--queue"),
        (f"redis://:{ENCODED}@127.0.0.1:{free_port()}/0", "--topic"),
        (f"nats://{ENCODED}@127.0.0.1:{free_port()}", "--stream"),
        (f"nats://u:{PASSWORD}@127.0.0.1:{free_port()}", "--stream"),
    ]:
        assert "outbox export:" in run("export", "broker", "--broker", broker, flag, "S",
                                       "--out", out)  # fmt: skip
    assert not Path(out).exists()


def test_drain_with_a_password_on_both_sides(
    pg_url: str, nats_server: NatsServer, stream: tuple[str, str]
) -> None:
    name, prefix = stream
    db = with_password(pg_url)
    migrate.upgrade(pg_url)
    port = nats_server.url.rsplit(":", 1)[1]
    broker = f"nats://u:{ENCODED}@127.0.0.1:{port}?stream={name}&subjects={prefix}.>"
    assert "drained: sent=0" in run("drain", "--db", db, "--broker", broker)
    down = f"redis://:{ENCODED}@127.0.0.1:{free_port()}/0?password={ENCODED}"
    assert "unreachable" in run("drain", "--db", db, "--broker", down)


def long_running(args: list[str], started: str, log: Path) -> str:
    """Start a command, wait for its start-up line, stop it by SIGTERM: its whole output."""
    with log.open("w") as sink:
        proc = subprocess.Popen([OUTBOX, *args], stdout=sink, stderr=sink, env=ENV)
        try:
            wait_until(lambda: started in log.read_text(), timeout=60, what=started)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    output = log.read_text()
    assert proc.returncode == 0, output
    clean(output)
    return output


def test_relay_and_coordinator_logs(
    pg_url: str, nats_server: NatsServer, stream: tuple[str, str], tmp_path: Path
) -> None:
    name, prefix = stream
    migrate.upgrade(pg_url)
    port = nats_server.url.rsplit(":", 1)[1]
    token = f"nats://{ENCODED}@127.0.0.1:{port}"
    broker = f"{token}?stream={name}&subjects={prefix}.>"
    db = with_password(pg_url)
    output = long_running(
        ["relay", "--db", db, "--broker", broker, "--interval", "0.2"],
        "relay worker started",
        tmp_path / "relay.log",
    )
    assert "broker=nats://***@127.0.0.1" in output and "relay worker stopped" in output
    output = long_running(["coordinator", "--broker", token], "coordinator started",
                          tmp_path / "coordinator.log")  # fmt: skip
    assert "coordinator stopped" in output


def test_reconcile_from_a_database_with_a_password(tmp_path: Path) -> None:
    """Spark reads the ledger over JDBC; its failure must not print the password either."""
    ledger = f"postgresql+psycopg://postgres:{ENCODED}@127.0.0.1:{free_port()}/x"
    broker = tmp_path / "broker.parquet"
    broker.write_bytes(b"")
    output = run("reconcile", "--ledger", ledger, "--broker-log", str(broker),
                 "--out", str(tmp_path / "report"), "--start", "2026-03-01",
                 "--end", "2026-03-02", "--master", "local[1]", timeout=300)  # fmt: skip
    assert "outbox reconcile:" in output


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql+psycopg://app:{ENCODED}@db.example:5432/x?sslmode=require",
        f"postgresql+psycopg://app:{RAW}@db.example:5432/x",
        f"postgresql+psycopg://app:{PASSWORD}@db.example:5432/x",  # unparseable: a raw '@'
        f"postgresql+psycopg://app@db.example/x?password={ENCODED}",
        f"mysql+pymysql://app:{ENCODED}@db.example/x",
        f"nats://{ENCODED}@nats.example:4222",
        f"nats://{PASSWORD}@nats.example:4222",
        f"nats://u:{PASSWORD}@nats.example:4222?stream=S",
        f"amqp://guest:{PASSWORD}@mq.example:5672/vhost",
        f"redis://:{ENCODED}@redis.example:6379/0",
        f"redis://redis.example:6379/0?password={ENCODED}&token={ENCODED}",
        f"rediss://u:{PASSWORD}@redis.example:6379/0?auth_token={ENCODED}",
        f"kafka://{ENCODED}@kafka.example:9092",
    ],
)
def test_mask_url_keeps_the_host_and_hides_the_secret(url: str) -> None:
    masked = mask_url(url)
    clean(masked)
    assert ".example" in masked or "***" in masked


def test_the_library_repr_errors_and_logs(pg_url: str, caplog: pytest.LogCaptureFixture) -> None:
    db = with_password(pg_url) + f"&password={ENCODED}"
    broker = f"nats://u:{ENCODED}@127.0.0.1:{free_port()}"
    ob = Outbox(db, broker=broker, sweeper=False)
    clean(repr(ob))
    assert "127.0.0.1" in repr(ob)
    with pytest.raises(ConfigError) as refused:
        Outbox(f"nosuchdb://u:{ENCODED}@h/x")
    clean(str(refused.value))
    with pytest.raises(ConfigError) as refused:
        Outbox("sqlite://", broker=f"kafka://u:{PASSWORD}@h:1")
    clean(str(refused.value))
    with pytest.raises(ConfigError) as refused:
        check_broker_url(f"kafka://{ENCODED}@h:1")
    clean(str(refused.value))
    ob.start()  # the broker is down: the adapter logs its failed connects
    try:
        wait_until(lambda: "nats://***@127.0.0.1" in caplog.text, timeout=60, what="a log line")
    finally:
        ob.stop()
    clean(caplog.text)


def test_metrics_carry_no_url(pg_url: str) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from relay.metrics import register

    migrate.upgrade(pg_url)
    # a broker that never answers: the relay keeps connecting in the background
    ob = Outbox(with_password(pg_url), broker=f"redis://u:{ENCODED}@127.0.0.1:1", sweeper=True)
    registry = CollectorRegistry()
    register(ob, registry)
    ob.start()
    try:
        clean(generate_latest(registry).decode())
    finally:
        ob.stop()


def test_compare_report_options_are_masked() -> None:
    from relay.cli import build_parser
    from relay.lab.compare.report import report_args

    args = build_parser().parse_args(
        ["compare", "--db", f"postgresql+psycopg://app:{ENCODED}@h/x",
         "--broker", f"nats://{ENCODED}@h:1"]
    )  # fmt: skip
    options = report_args(args)
    clean(str(options))
    assert options["db"] == "postgresql+psycopg://app:***@h/x" and options["transactions"] == 2000
    assert "command" not in options, "only compare's own options go into compare.json"


@pytest.mark.parametrize(
    ("url", "secret"),
    [
        ("postgresql://postgres:postgres@db/app", "postgres"),  # the password is in the scheme
        ("redis://:redis@cache:6379/0", "redis"),
        ("postgres://app:sql@db/app", "sql"),
    ],
)
def test_a_password_that_is_part_of_the_scheme_is_scrubbed_and_the_scheme_kept(
    url: str, secret: str
) -> None:
    from outbox.secrets import scrub

    text = scrub(f"connect to {url} failed: password {secret!r} refused", [url])
    scheme = url.partition("://")[0]
    assert text.startswith(f"connect to {scheme}://") and f"'{secret}'" not in text
    assert secret not in text.partition("://")[2], text
