"""examples/webapp's own tests, as a Flask-SQLAlchemy app's suite has them.

One test database for the whole run (a PostgreSQL schema of its own), made the way a
deploy makes it (``outbox migrate``, then ``flask db upgrade``); an app per test from
the factory; the module-level ``ob`` started on a ``MemoryBroker`` without the sweeper
(``ob.start(broker=..., sweeper=False)``), and ``ob.recording()`` for what a request
sent, committed or not.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import delete, func, select
from sqlalchemy.orm import scoped_session, sessionmaker

from examples.warehouse import TOPIC
from examples.webapp import views
from examples.webapp.app import create_app, prepare
from examples.webapp.extensions import db, ob
from examples.webapp.models import Inbound
from outbox.table import outbox_message
from relay.testing import MemoryBroker, scratch_schema
from tests.conftest import PG_URL
from tests.helpers import wait_until

MIGRATIONS = Path(__file__).resolve().parents[2] / "examples" / "webapp" / "migrations"


@pytest.fixture(scope="module")
def database() -> Iterator[str]:
    """The suite's test database: made once, by the app's own migrations."""
    with scratch_schema(PG_URL, "webapp") as url:
        prepare({"SQLALCHEMY_DATABASE_URI": url})  # outbox migrate; flask db upgrade
        yield url


@pytest.fixture
def app(database: str) -> Iterator[Flask]:
    """An app from the factory on the test database; its rows are gone after the test."""
    app = create_app({"TESTING": True, "SQLALCHEMY_DATABASE_URI": database})
    yield app
    ob.stop()
    with app.app_context():
        db.session.execute(delete(Inbound))
        db.session.execute(delete(outbox_message))
        db.session.commit()
        db.engine.dispose()


@pytest.fixture
def broker(app: Flask) -> MemoryBroker:
    """The app's relay, started on a MemoryBroker: no broker server, no sweeper."""
    broker = MemoryBroker()
    ob.start(broker=broker, sweeper=False)
    return broker


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    return app.test_client()


def stored(app: Flask) -> tuple[int, int]:
    """How many deliveries and outbox rows the database holds."""
    with app.app_context():
        rows = db.session.scalar(select(func.count()).select_from(Inbound))
        messages = db.session.scalar(select(func.count()).select_from(outbox_message))
    return int(rows or 0), int(messages or 0)


def test_a_delivery_is_stored_and_its_message_published(
    app: Flask, client: FlaskClient, broker: MemoryBroker
) -> None:
    reply = client.post("/inbound", json={"sku": "A-100", "quantity": 12, "dock": "D1"})
    assert reply.status_code == 201, reply.get_json()
    body = reply.get_json()
    wait_until(lambda: broker.published, timeout=30, what="the message published")
    [message] = broker.published
    assert (message.msg_id, message.topic, message.key) == (body["msg_id"], TOPIC, "A-100")
    assert message.payload == b'{"id":%d,"sku":"A-100","quantity":12}' % body["id"]
    assert stored(app) == (1, 1)


def test_a_closed_dock_rolls_back_the_row_and_the_message(
    app: Flask, client: FlaskClient, broker: MemoryBroker
) -> None:
    """send() ran (the recording shows it), then the request failed: nothing is kept."""
    with ob.recording() as sent:
        reply = client.post("/inbound", json={"sku": "A-1", "quantity": 5, "dock": "D9"})
    assert reply.status_code == 409 and "closed" in reply.get_json()["error"]
    assert [m.key for m in sent] == ["A-1"]
    assert stored(app) == (0, 0)
    # A good request after it: only its own message is ever published.
    assert client.post("/inbound", json={"sku": "OK", "quantity": 1}).status_code == 201
    wait_until(lambda: broker.published, timeout=30, what="the good message")
    assert [m.key for m in broker.published] == ["OK"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"sku": "", "quantity": 1}, "sku"),
        ({"sku": "A-1", "quantity": 0}, "quantity"),
        ({"sku": "A-1", "quantity": True}, "quantity"),
        ([1, 2], "body"),
        ({"sku": "A-1\x00", "quantity": 1}, "sku"),
        ({"sku": "A-1", "quantity": 2**31}, "quantity"),
        ({"sku": "A-1", "quantity": 1, "dock": " D1"}, "dock"),
    ],
)
def test_a_bad_request_is_refused_naming_the_field_and_sends_nothing(
    app: Flask, client: FlaskClient, body: Any, field: str
) -> None:
    with ob.recording() as sent:
        reply = client.post("/inbound", json=body)
    assert reply.status_code == 422 and reply.get_json()["field"] == field, reply.get_json()
    assert sent == [] and stored(app) == (0, 0)


def test_a_database_error_past_the_validation_is_a_422_not_a_500(
    app: Flask, client: FlaskClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the validation switched off, PostgreSQL's refusal of a NUL and of 2**31 is
    answered 422 (logged as a validation bug), never a 500, and nothing is kept."""
    monkeypatch.setattr(views, "parse", lambda body: views.Delivery(**body))
    for body in ({"sku": "A\x00", "quantity": 1, "dock": "D1"},
                 {"sku": "A", "quantity": 2**31, "dock": "D1"}):  # fmt: skip
        reply = client.post("/inbound", json=body)
        assert reply.status_code == 422, reply.get_data(as_text=True)
        assert "database refused" in reply.get_json()["error"]
        assert "\x00" not in reply.get_data(as_text=True)  # nothing of the SQL echoed
    assert stored(app) == (0, 0)


def test_metrics_count_what_the_apps_own_relay_published(
    client: FlaskClient, broker: MemoryBroker
) -> None:
    assert client.get("/health").get_json() == {"relay": "up"}
    assert client.post("/inbound", json={"sku": "A-7", "quantity": 3}).status_code == 201

    def sent_fast() -> float:
        text = client.get("/metrics").get_data(as_text=True)
        found = re.search(r'^outbox_messages_sent_total\{path="fast"\} (\S+)$', text, re.M)
        return float(found.group(1)) if found else 0.0

    wait_until(lambda: sent_fast() == 1.0, timeout=30, what="sent_total{path=fast} 1.0")


@pytest.fixture
def rolled_back(app: Flask, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The test runs inside one transaction, rolled back at its end: the view's commit
    releases a savepoint (``join_transaction_mode="create_savepoint"``)."""
    with app.app_context():
        connection = db.engine.connect()
    outer = connection.begin()
    factory = sessionmaker(bind=connection, join_transaction_mode="create_savepoint")
    monkeypatch.setattr(db, "session", scoped_session(factory))
    try:
        yield
    finally:
        outer.rollback()
        connection.close()


def test_in_a_transaction_that_rolls_back_the_recording_shows_what_was_sent(
    app: Flask, client: FlaskClient, rolled_back: None
) -> None:
    with ob.recording() as sent:
        reply = client.post("/inbound", json={"sku": "R-1", "quantity": 2})
    assert reply.status_code == 201, reply.get_json()
    msg_id = reply.get_json()["msg_id"]
    assert [(m.msg_id, m.topic, m.key) for m in sent] == [(msg_id, TOPIC, "R-1")]


def test_the_relay_starts_only_where_it_is_wanted(
    app: Flask, caplog: pytest.LogCaptureFixture
) -> None:
    """The factory's start() with no OUTBOX_BROKER (as in this suite) starts nothing."""
    caplog.set_level("INFO", logger="outbox")
    create_app({"SQLALCHEMY_DATABASE_URI": app.config["SQLALCHEMY_DATABASE_URI"]})
    assert ob.relay is None or not ob.relay.running
    assert "relay not started" in caplog.text


# --- the app's own Alembic history (Flask-Migrate) beside the outbox's tables ---------


def test_flask_db_migrate_proposes_nothing_with_the_outbox_tables_present(
    app: Flask, tmp_path: Path
) -> None:
    """The test database has the outbox's tables and the app's at head: autogenerate
    (``flask db migrate``, the filter in ``Migrate(include_object=...)``) finds nothing
    to do, so it writes no revision, and ``flask db check`` passes."""
    migrations = shutil.copytree(MIGRATIONS, tmp_path / "migrations")
    before = sorted(p.name for p in (migrations / "versions").glob("*.py"))
    runner = app.test_cli_runner()
    done = runner.invoke(args=["db", "migrate", "-d", str(migrations), "-m", "probe"])
    assert done.exit_code == 0, done.output
    assert sorted(p.name for p in (migrations / "versions").glob("*.py")) == before
    checked = runner.invoke(args=["db", "check", "-d", str(migrations)])
    assert checked.exit_code == 0, checked.output


def test_without_the_filter_autogenerate_would_drop_the_outbox_tables(app: Flask) -> None:
    """The control: the same comparison without ``include_object`` proposes drops."""
    with app.app_context(), db.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), db.metadata)
    dropped = {op[1].name for op in diff if op[0] == "remove_table"}
    assert "outbox_message" in dropped, diff
