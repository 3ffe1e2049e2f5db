"""`outbox dashboard` over HTTP (FastAPI's TestClient) against a real PostgreSQL schema:
pages, escaping, paging, bad input, read-only refusals, token + CSRF actions, reports."""

from __future__ import annotations

import contextlib
import html
import json
import logging
import os
import queue
import re
import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote, urlencode

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from markupsafe import escape
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from sqlalchemy import Engine, create_engine, delete, make_url, select, update
from sqlalchemy import text as sql
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from outbox import Inbox, InboxMessage, Outbox, migrate
from outbox.errors import ConfigError
from outbox.message import uuid7
from outbox.table import outbox_message as t
from relay.cli.dashboard import is_loopback
from relay.dashboard import create_app, guard
from relay.dashboard.app import ROUTES
from relay.dashboard.params import Rule, Text, Whole
from relay.dashboard.reports import served_file
from relay.testing import scratch_schema
from relay.testing.embedded import free_port
from tests.acceptance.test_cli import OUTBOX
from tests.conftest import PG_URL
from tests.helpers import wait_until

PASSWORD = "pw-" + uuid.uuid4().hex[:12]  # PostgreSQL here trusts: the password is ignored
TOKEN = "token-" + uuid.uuid4().hex
HOSTILE = "<script>window.__pwned=1</script>"
DEAD_ROWS = 120
# Payloads around the dead letters' 200-byte preview: exactly 200, a character cut in two,
# not UTF-8.
PAYLOADS = [b"x" * 200, b"x" * 199 + "é".encode(), b"\x00\xff\xfe" * 70]


class Seeded:
    def __init__(self, url: str, engine: Engine) -> None:
        self.url, self.engine = url, engine
        self.dead: list[str] = []  # oldest first
        self.hostile = ""
        self.head = ""

    def status(self, msg_id: str) -> str | None:
        with self.engine.connect() as conn:
            found = conn.execute(select(t.c.status).where(t.c.msg_id == uuid.UUID(msg_id)))
            return found.scalar()


def send(engine: Engine, topic: str, n: int, **options: Any) -> list[str]:
    ob = Outbox(engine)
    with Session(engine) as session, session.begin():
        return [ob.send(session, topic, b'{"n": 1}', **options) for _ in range(n)]


def mark(engine: Engine, ids: list[str], **values: Any) -> None:
    with engine.begin() as conn:
        conn.execute(update(t).where(t.c.msg_id.in_([uuid.UUID(i) for i in ids])).values(**values))


@pytest.fixture(scope="module")
def seeded() -> Iterator[Seeded]:
    """One schema for the module: pending, sent, dead (paged), a blocked key, a hostile row."""
    with scratch_schema(PG_URL, "dash") as url:
        url = make_url(url).set(password=PASSWORD).render_as_string(hide_password=False)
        migrate.upgrade(url)
        engine = create_engine(url)
        data = Seeded(url, engine)
        send(engine, "shop.orders", 3)
        mark(engine, send(engine, "shop.orders", 2), status="sent", sent_at=t.c.created_at)
        data.dead = send(engine, "shop.dead", DEAD_ROWS)
        mark(engine, data.dead, status="dead", attempts=5, last_error="broker said no")
        head, _follower = send(engine, "shop.ordered", 2, key="k1", ordered=True)
        mark(engine, [head], status="dead", attempts=3, last_error="boom")
        data.head = head
        for payload in PAYLOADS:
            mark(engine, send(engine, "shop.bytes", 1), payload=payload, status="dead")
        [data.hostile] = send(engine, "shop.hostile", 1)
        mark(
            engine,
            [data.hostile],
            topic=HOSTILE,
            key=HOSTILE,
            seq=1,
            payload=HOSTILE.encode(),
            status="dead",
            last_error=HOSTILE,
        )  # fmt: skip  (a dead head: a blocked key)
        yield data
        engine.dispose()


def browse(app: FastAPI, host: str = "127.0.0.1") -> TestClient:
    """A client of ``app`` as a browser on this machine sees it (Host 127.0.0.1)."""
    return TestClient(app, base_url=f"http://{host}")


@pytest.fixture(scope="module")
def reader(seeded: Seeded) -> Iterator[TestClient]:
    with browse(create_app(seeded.url)) as client:
        yield client


@pytest.fixture(scope="module")
def actor(seeded: Seeded) -> Iterator[TestClient]:
    with browse(create_app(seeded.url, allow_actions=True, token=TOKEN)) as client:
        yield client


PAGES = [
    "/",
    "/api/overview",
    "/dead",
    "/dead?limit=5",
    "/blocked",
    "/halfop",
    "/reports",
    "/dead?limit=0",
]


def test_pages_answer_without_any_secret(
    seeded: Seeded, reader: TestClient, actor: TestClient
) -> None:
    host = make_url(seeded.url).host or ""
    for client in (reader, actor):
        for path in [*PAGES, f"/messages/{seeded.head}", "/login"]:
            reply = client.get(path)
            expected = (
                400 if "limit=0" in path else 403 if path == "/login" and client is reader else 200
            )
            assert reply.status_code == expected, (path, reply.text[-300:])
            assert PASSWORD not in reply.text and f"{host}:" not in reply.text, path
            assert "script-src 'self'" in reply.headers["content-security-policy"]


def test_only_known_host_names_are_answered(seeded: Seeded, reader: TestClient) -> None:
    """DNS rebinding: a hostile page's name resolving to 127.0.0.1 is refused by name."""
    for host in ["evil.example", "evil.example:8080", "127.0.0.1.evil.example"]:
        reply = reader.get("/api/overview", headers={"Host": host})
        assert reply.status_code == 400 and "topics" not in reply.text, host
    for host in ["localhost:8080", "[::1]:8080", "127.0.0.1"]:
        assert reader.get("/api/overview", headers={"Host": host}).status_code == 200, host
    proxied = create_app(seeded.url, allowed_hosts=["dash.example.com", "::"])
    with browse(proxied, "dash.example.com") as client:
        assert client.get("/dead?limit=1").status_code == 200
        assert client.get("/", headers={"Host": "[::]:80"}).status_code == 200
        assert client.get("/", headers={"Host": "other.example.com"}).status_code == 400
    for wrong in ["dash.example.com:443", "*", "a.*.example.com"]:
        with pytest.raises(ConfigError, match="allowed host"):
            create_app(seeded.url, allowed_hosts=[wrong])


def test_overview_counts_per_topic(reader: TestClient) -> None:
    data = reader.get("/api/overview").json()
    topics = {row["topic"]: row for row in data["topics"]}
    orders = topics["shop.orders"]
    assert (orders["pending"], orders["sent_1h"], orders["dead"]) == (3, 2, 0)
    assert orders["oldest_pending_age_s"] >= 0
    assert topics["shop.ordered"]["blocked_keys"] == 1
    assert topics["shop.dead"]["dead"] >= DEAD_ROWS - 5  # the action tests take a few
    sent = data["charts"]["throughput"]["data"][0]["y"]
    assert sum(sent) == 2 and len(sent) == 60
    page = reader.get("/").text
    assert 'data-topic="shop.orders"' in page and "/plotly.min.js" in page


def test_hostile_topics_payloads_and_errors_are_escaped(
    seeded: Seeded, reader: TestClient, actor: TestClient
) -> None:
    log_in(actor)
    pages = [
        (reader, p) for p in ["/", "/dead?limit=500", f"/messages/{seeded.hostile}", "/blocked"]
    ]
    pages.append((actor, f"/messages/{seeded.hostile}/requeue"))  # the confirm step
    for client, path in pages:
        page = client.get(path).text
        assert HOSTILE not in page, path
        assert "&lt;script&gt;window.__pwned=1&lt;/script&gt;" in page, path
    assert 'id="confirm"' in page


def test_blocked_keys_show_each_head_and_what_waits_behind_it(
    seeded: Seeded, reader: TestClient
) -> None:
    page = reader.get("/blocked").text
    found = re.search(r"<tr><td>shop\.ordered</td>.*?</tr>", page, re.S)
    assert found, page
    topic, key, head, seq, behind, _age = re.findall(r"<td[^>]*>(.*?)</td>", found.group(0))
    assert (topic, key, seq, behind) == ("shop.ordered", "k1", "1", "1")
    assert f'href="/messages/{seeded.head}"' in head


def test_overview_on_sqlite(sqlite_url: str) -> None:
    """The charts' other path: per-minute sends and percentiles computed in Python."""
    migrate.upgrade(sqlite_url)
    engine = create_engine(sqlite_url)
    try:
        send(engine, "a", 3)
        mark(engine, send(engine, "a", 2), status="sent", sent_at=t.c.created_at)
        mark(engine, send(engine, "b", 1), status="dead")
        with browse(create_app(engine)) as client:
            data = client.get("/api/overview").json()
    finally:
        engine.dispose()
    topics = {row["topic"]: row for row in data["topics"]}
    assert (topics["a"]["pending"], topics["a"]["sent_1h"], topics["b"]["dead"]) == (3, 2, 1)
    assert sum(data["charts"]["throughput"]["data"][0]["y"]) == 2
    p50 = [v for v in data["charts"]["latency"]["data"][0]["y"] if v is not None]
    assert p50 and set(p50) == {0.0}  # sent as created: no latency (one minute, or two)


def test_overview_shows_the_consumers_inboxes(sqlite_url: str) -> None:
    migrate.upgrade(sqlite_url)
    engine = create_engine(sqlite_url)
    try:
        inbox = Inbox(engine, "billing", max_attempts=1)
        inbox.handler("orders.*")(lambda session, message: message.json()["ok"] or 1 / 0)
        for ok in (True, True, False):
            body = json.dumps({"ok": ok}).encode()
            inbox.handle(InboxMessage.from_broker(str(uuid7()), "orders.created", body, {}))
        with browse(create_app(engine)) as client:
            data = client.get("/api/overview").json()
            page = client.get("/").text
    finally:
        engine.dispose()
    assert data["consumers"] == [{"consumer": "billing", "handled": 2, "dead": 1, "requeued": 0}]
    assert '<tr data-consumer="billing"><td>billing</td><td>2</td><td>1</td><td>0</td></tr>' in page


def test_dead_letters_page_by_keyset_newest_first(seeded: Seeded, reader: TestClient) -> None:
    seen: list[str] = []
    path: str | None = "/dead?limit=50&topic=shop.dead"
    while path:
        page = reader.get(path).text
        seen += re.findall(r'<td class="id"><a href="/messages/([0-9a-f-]{36})">', page)
        found = re.search(r'id="next" href="([^"]+)"', page)
        path = found.group(1).replace("&amp;", "&") if found else None
    still_dead = [m for m in seeded.dead if seeded.status(m) == "dead"]
    assert seen == still_dead[::-1]
    first = reader.get("/dead?limit=10&topic=shop.dead").text
    listed = re.findall(r'<td class="id"><a href="/messages/([0-9a-f-]{36})">', first)
    with seeded.engine.begin() as conn:  # the page's last row goes (deleted, purged)
        conn.execute(delete(t).where(t.c.msg_id == uuid.UUID(listed[-1])))
    found = re.search(r'id="next" href="([^"]+)"', first)
    assert found
    after = reader.get(found.group(1).replace("&amp;", "&"))
    assert after.status_code == 200
    shown = re.findall(r'<td class="id"><a href="/messages/([0-9a-f-]{36})">', after.text)
    assert shown == still_dead[::-1][10:20]
    assert "broker said no" in reader.get("/dead?limit=1&topic=shop.dead").text


def test_payload_previews_are_cut_whole_and_bytes_escaped(reader: TestClient) -> None:
    page = reader.get("/dead?topic=shop.bytes").text
    cells = re.findall(r'<td class="text payload">(.*?)</td>', page, re.S)
    binary = str(escape(repr(PAYLOADS[2][:200]))) + "…"
    assert sorted(cells) == sorted(["x" * 200, "x" * 199 + "…", binary])


@pytest.mark.parametrize(
    ("path", "status", "says"),
    [
        ("/dead?limit=0005", 200, "Dead letters"),  # leading zeros: still ASCII digits
        ("/dead?limit=&topic=", 200, "Dead letters"),  # empty: not given
        (f"/dead?before={uuid.UUID(int=7)}", 400, "before: no message"),
        ("/dead?limit=1&limit=2", 400, "limit: given 2 times; give it once"),
        (f"/messages/{uuid.UUID(int=7)}", 404, "no message"),
        ("/no/such/page", 404, "Not Found"),
    ],
)
def test_query_params_given_well_or_naming_no_row(
    reader: TestClient, path: str, status: int, says: str
) -> None:
    reply = reader.get(path)
    assert reply.status_code == status and says in reply.text
    assert 'href="/static/dashboard.css"' in reply.text  # a page of the dashboard's layout


VALID = {"msg_id": str(uuid.UUID(int=7)), "action": "requeue", "path": "nightly/report.html"}


def bad_values(rule: Rule) -> list[tuple[str, str]]:
    """(what is wrong, the value) for each class of bad value of a rule."""
    if isinstance(rule, Whole):
        return [("a Unicode digit", "\u00b2"), ("an Arabic-Indic digit", "\u0663"),
                ("5,000 digits", "9" * 5000), ("negative", "-1"), ("zero", "0"),
                ("past its most", str(rule.most + 1)), ("a fraction", "1.5"),
                ("a space first", " 1"), ("NUL", "1\x00")]  # fmt: skip
    if isinstance(rule, Text):
        return [("NUL", "a\x00b"), ("ESC", "a\x1b[2Jb"), ("a newline", "a\nb"),
                ("too long", "x" * (rule.most + 1))]  # fmt: skip
    return [("NUL", "\x00"), ("5,000 digits", "9" * 5000), ("a Unicode digit", "\u00b2"),
            ("not a UUID", "1;DROP TABLE outbox_message")]  # fmt: skip


def bad_parameter_cases() -> Iterator[Any]:
    """Every parameter of every GET route (ROUTES, as the app is built from it) with each
    class of bad value of its rule: in the path or in the query."""
    for route, _endpoint, methods, rules in ROUTES:
        if "GET" not in methods:
            continue
        for name, rule in rules.items():
            for what, value in bad_values(rule):
                path = route.replace("{path:path}", "{path}")
                wanted = {**VALID, name: value}
                filled = path.format(**{k: quote(v, safe="") for k, v in wanted.items()})
                if f"{{{name}}}" not in path:
                    filled += "?" + urlencode({name: value})
                # Starlette's {path:path} stops at a line break: no route, a 404 page.
                status = 404 if ":path}" in route and "\n" in value else 400
                yield pytest.param(filled, name, rule, status, id=f"{route} {name}: {what}")


@pytest.mark.parametrize(("path", "name", "rule", "status"), list(bad_parameter_cases()))
def test_a_bad_parameter_is_a_400_naming_it_and_its_rule(
    reader: TestClient, path: str, name: str, rule: Rule, status: int
) -> None:
    """Before the fix: a Unicode digit passed isdigit() and int() refused it (500), 5,000
    digits made int() raise (500), and a NUL in a topic was PostgreSQL's error (500)."""
    reply = reader.get(path)
    assert reply.status_code == status, reply.text[-300:]
    said = html.unescape(reply.text)
    if status == 400:
        assert f"{name}: must be {rule.rule}, not " in said
    assert 'href="/static/dashboard.css"' in reply.text  # the dashboard's own page


def test_read_only_refuses_every_post(seeded: Seeded, reader: TestClient) -> None:
    msg_id = seeded.dead[0]
    for path in [f"/messages/{msg_id}/requeue", "/login", "/anything"]:
        reply = reader.post(path, headers={"Authorization": f"Bearer {TOKEN}"})
        assert reply.status_code == 403 and "read-only" in reply.text
    assert reader.get(f"/messages/{msg_id}/requeue").status_code == 403
    assert seeded.status(msg_id) == "dead"


def csrf(page: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', page)
    assert found, page
    return found.group(1)


def test_actions_need_the_token_and_the_csrf_token(
    seeded: Seeded, caplog: pytest.LogCaptureFixture
) -> None:
    app = create_app(seeded.url, allow_actions=True, token=TOKEN)
    msg_id = seeded.dead[1]
    with browse(app) as browser:
        # not logged in: the confirm page sends to the login form; a POST is refused
        confirm = browser.get(f"/messages/{msg_id}/requeue", follow_redirects=False)
        assert confirm.status_code == 303 and confirm.headers["location"].startswith("/login")
        assert browser.post(f"/messages/{msg_id}/requeue", data={"csrf": "x"}).status_code == 401
        form = browser.get("/login").text
        forged = browser.post("/login", data={"token": TOKEN, "csrf": "forged"})
        assert forged.status_code == 403
        wrong = browser.post("/login", data={"token": "wrong-token-xxxxxxxx", "csrf": csrf(form)})
        assert wrong.status_code == 401 and 'id="wrong"' in wrong.text
        logged = browser.post(
            "/login", data={"token": TOKEN, "csrf": csrf(form), "next": "//evil.example"}
        )
        assert logged.status_code == 200 and logged.url.path == "/"  # no open redirect
        page = browser.get(f"/messages/{msg_id}/requeue").text  # the confirm step
        assert browser.post(f"/messages/{msg_id}/requeue", data={}).status_code == 403
        assert (
            browser.post(f"/messages/{msg_id}/requeue", data={"csrf": csrf(form)}).status_code
            == 403
        )
        assert seeded.status(msg_id) == "dead"
        with caplog.at_level(logging.INFO, logger="relay.dashboard"):
            done = browser.post(f"/messages/{msg_id}/requeue", data={"csrf": csrf(page)})
        assert done.status_code == 200 and "requeued" in done.text
    assert seeded.status(msg_id) == "pending"
    [line] = [r.getMessage() for r in caplog.records if "requeue" in r.getMessage()]
    assert f"msg_id={msg_id}" in line and "testclient" in line and TOKEN not in line


def log_in(browser: TestClient) -> None:
    form = browser.get("/login").text
    assert browser.post("/login", data={"token": TOKEN, "csrf": csrf(form)}).status_code == 200


def test_anonymous_requests_never_log_the_operator_out(
    seeded: Seeded, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pages, API calls and Bearer calls make no session; login forms do, and past the
    limit the least recently used anonymous ones go first. Then the operator logs out."""
    monkeypatch.setattr(guard, "MAX_SESSIONS", 4)
    app = create_app(seeded.url, allow_actions=True, token=TOKEN)
    sessions = app.state.config.sessions
    msg_id, bearer = seeded.dead[4], {"Authorization": f"Bearer {TOKEN}"}
    with browse(app) as operator, browse(app) as curl:
        log_in(operator)
        for path in ["/", "/api/overview", "/dead?limit=1", f"/messages/{msg_id}"] * 3:
            assert curl.get(path).status_code == 200 and not curl.cookies, path
        assert curl.get(f"/messages/{msg_id}/skip", headers=bearer).status_code == 200
        assert len(sessions) == 1
        for _ in range(3 * guard.MAX_SESSIONS):  # each a new form, a new cookie-less browser
            assert 'name="csrf"' in curl.get("/login").text
            curl.cookies.clear()
        assert len(sessions) == guard.MAX_SESSIONS
        page = operator.get(f"/messages/{msg_id}/skip")  # still logged in: the confirm step
        assert 'id="confirm"' in page.text and 'id="logout"' in page.text
        assert operator.post("/logout", data={"csrf": "forged"}).status_code == 403
        out = operator.post("/logout", data={"csrf": csrf(page.text)})
        assert out.status_code == 200 and "log in to act" in out.text
        again = operator.get(f"/messages/{msg_id}/skip", follow_redirects=False)
        assert again.status_code == 303 and again.headers["location"].startswith("/login")
    assert seeded.status(msg_id) == "dead"


def test_sessions_least_recently_used_go_first_and_idle_logins_expire(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(guard, "MAX_SESSIONS", 3)
    now = [0.0]
    sessions = guard.Sessions(clock=lambda: now[0])
    operator = sessions.log_in(sessions.new())
    first, second = sessions.new(), sessions.new()
    assert sessions.get(first.id) is first  # used: now the most recent anonymous one
    sessions.new()
    assert sessions.get(second.id) is None and sessions.get(first.id) is first
    assert sessions.get(operator.id) is operator
    now[0] += guard.IDLE_S - 1
    assert sessions.get(operator.id) is operator  # used: idle from now on
    now[0] += guard.IDLE_S + 1
    assert sessions.get(operator.id) is None and sessions.get(first.id) is first


def test_skip_and_delete_with_the_bearer_token(seeded: Seeded, actor: TestClient) -> None:
    skipped, deleted = seeded.dead[2], seeded.dead[3]
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    wrong = {"Authorization": "Bearer not-the-token-at-all"}
    assert actor.post(f"/messages/{skipped}/skip", headers=wrong).status_code == 401
    assert actor.post(f"/messages/{skipped}/explode", headers=bearer).status_code == 404
    assert actor.post(f"/messages/{skipped}/skip", headers=bearer).json()["done"] is True
    assert seeded.status(skipped) == "skipped"
    assert actor.post(f"/messages/{deleted}/delete", headers=bearer).json()["done"] is True
    assert seeded.status(deleted) is None
    refused = actor.post(f"/messages/{skipped}/delete", headers=bearer)  # only dead ones
    assert refused.status_code == 409 and seeded.status(skipped) == "skipped"


def test_reports_are_listed_and_served_only_from_their_folder(
    seeded: Seeded, tmp_path: Path
) -> None:
    root = tmp_path / "reports"
    (root / "nightly").mkdir(parents=True)
    (root / "nightly" / "summary.json").write_text(
        json.dumps({"total": {"committed": 10, "lost": 2}})
    )
    (root / "nightly" / "report.html").write_text("<p>report</p>")
    (root / "cmp").mkdir()
    models = {"a": {"committed": 5, "lost": 0}, "b": {"committed": 5, "stuck": 1}}
    (root / "cmp" / "compare.json").write_text(json.dumps({"models": models}))
    for folder, name, text in [("list", "summary.json", "[1, 2]"),
                               ("scalar", "compare.json", '{"models": {"a": 3}}'),
                               ("broken", "summary.json", "{")]:  # fmt: skip
        (root / folder).mkdir()
        (root / folder / name).write_text(text)
    (tmp_path / "secret.txt").write_text("outside")
    (root / "link.txt").symlink_to(tmp_path / "secret.txt")
    with browse(create_app(seeded.url, reports=root)) as client:
        listing = client.get("/reports").text
        assert "DISCREPANCIES" in listing and "STUCK" in listing and "OK" in listing
        assert 'href="/reports/files/nightly/report.html"' in listing
        assert listing.count("not a reconciliation summary") == 2 and "unreadable" in listing
        report = client.get("/reports/files/nightly/report.html")
        assert report.status_code == 200 and report.text == "<p>report</p>"
        assert report.headers["content-security-policy"] == "sandbox allow-scripts"
        for path in ["%2e%2e/secret.txt", "nightly/%2e%2e/%2e%2e/secret.txt", "/etc/passwd",
                     "%2Fetc%2Fpasswd", "link.txt", "nightly", "nope.html"]:  # fmt: skip
            reply = client.get(f"/reports/files/{path}")
            assert reply.status_code == 404 and "outside" not in reply.text, path
    for wanted in [
        "../secret.txt",
        str(tmp_path / "secret.txt"),
        "nightly/../../secret.txt",
        "link.txt",
    ]:
        assert served_file(root, wanted) is None, wanted


def test_overview_shows_a_relays_metrics(seeded: Seeded) -> None:
    registry = CollectorRegistry()
    sent = Counter("outbox_messages_sent", "sent", ["path"], registry=registry)
    sent.labels("fast").inc(40)
    sent.labels("sweeper").inc(2)
    latency = Histogram(
        "outbox_commit_to_ack_seconds", "lat", buckets=(0.005, 0.05, 1), registry=registry
    )
    for seconds in [0.001] * 98 + [0.5] * 2:
        latency.observe(seconds)
    port = free_port()
    server, thread = start_http_server(port, "127.0.0.1", registry)
    try:
        app = create_app(
            seeded.url, metrics_url=f"http://127.0.0.1:{port}/metrics?token={PASSWORD}"
        )
        with browse(app) as client:
            metrics = client.get("/api/overview").json()["metrics"]
            page = client.get("/").text
    finally:
        server.shutdown()
        thread.join()
    rows = {row["name"]: row["value"] for row in metrics["rows"]}
    assert rows["sent (since the relay started)"] == 42
    assert rows["commit to ack p50 (ms, at most)"] == 5.0
    assert rows["commit to ack p99 (ms, at most)"] == 1000.0
    assert PASSWORD not in json.dumps(metrics) and PASSWORD not in page
    gone = create_app(seeded.url, metrics_url=f"http://127.0.0.1:{free_port()}/metrics")
    with browse(gone) as client:
        assert "could not read it" in client.get("/api/overview").json()["metrics"]["error"]


def test_cli_serves_the_dashboard_and_prints_no_password(seeded: Seeded, tmp_path: Path) -> None:
    env = {**os.environ, "OUTBOX_DASHBOARD_TOKEN": ""}
    command = [OUTBOX, "dashboard", "--db", seeded.url]
    refused = subprocess.run(
        [*command, "--allow-actions"], capture_output=True, text=True, env=env, timeout=60
    )
    assert refused.returncode == 2 and "--allow-actions needs a token" in refused.stderr
    port = free_port()
    server = subprocess.Popen(
        [*command, "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**env, "OUTBOX_DASHBOARD_TOKEN": TOKEN},
    )  # fmt: skip
    try:
        assert server.stdout is not None
        line = first_line(server.stdout, timeout=60)
        assert f"dashboard on http://127.0.0.1:{port}/ (read-only" in line and PASSWORD not in line
        wait_until(lambda: answers(port), timeout=30, what="the dashboard to answer")
        assert 'id="topics"' in httpx.get(f"http://127.0.0.1:{port}/", timeout=10).text
    finally:
        server.terminate()
        _, err = server.communicate(timeout=30)
    assert PASSWORD not in err and TOKEN not in err
    assert "warning: a token was given" in err and "without --allow-actions" in err
    assert [is_loopback(a) for a in ["127.0.0.1", "::1", "localhost", "0.0.0.0", "10.1.2.3"]] == [
        True, True, True, False, False,
    ]  # fmt: skip


def first_line(stream: IO[str], timeout: float) -> str:
    """The stream's first line, read on a thread: a server that prints nothing fails the
    test after ``timeout`` instead of hanging it."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(stream.readline()), daemon=True).start()
    return lines.get(timeout=timeout)


def answers(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/api/overview", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_head_answers_every_page_as_get_without_a_body(seeded: Seeded, reader: TestClient) -> None:
    for path in [*PAGES[:-1], f"/messages/{seeded.head}", "/healthz", "/favicon.ico"]:
        got, head = reader.get(path), reader.head(path)
        assert head.status_code == 200 and head.content == b"", path
        assert head.headers["content-type"] == got.headers["content-type"], path
        assert int(head.headers["content-length"]) > 0, path


def test_favicon_is_served_and_named_by_every_page(reader: TestClient) -> None:
    for path in ["/favicon.ico", "/static/favicon.svg"]:
        icon = reader.get(path)
        assert icon.status_code == 200 and icon.headers["content-type"].startswith("image/svg")
        assert icon.text.startswith("<svg"), path
    for path in ["/", "/dead", "/dead?limit=0"]:  # a 400 page too
        assert '<link rel="icon" href="/static/favicon.svg"' in reader.get(path).text, path


def test_healthz_says_process_and_database(reader: TestClient) -> None:
    reply = reader.get("/healthz")
    assert reply.status_code == 200, reply.text
    health = reply.json()
    assert health["status"] == "ok" and health["database"]["status"] == "up"
    assert health["process"]["pid"] == os.getpid() and health["process"]["uptime_s"] >= 0
    assert reply.headers["cache-control"] == "no-store"


def nothing_listening() -> str:
    """A PostgreSQL URL on a free port: connecting is refused, as when the server is down."""
    return f"postgresql+psycopg://outbox:{PASSWORD}@127.0.0.1:{free_port()}/gone"


DOWN_PAGES = ["/", "/dead", "/dead?topic=a", "/blocked", "/halfop", f"/messages/{uuid.UUID(int=7)}"]


def test_a_database_down_is_a_styled_503_and_one_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before the fix: a bare "Internal Server Error" and a traceback per request."""
    url = nothing_listening()
    port = str(make_url(url).port)
    with caplog.at_level(logging.INFO), browse(create_app(url)) as client:
        for _ in range(3):
            for path in DOWN_PAGES:
                reply = client.get(path)
                assert reply.status_code == 503, (path, reply.text[-300:])
                assert 'href="/static/dashboard.css"' in reply.text and "<nav>" in reply.text
                assert "the database does not answer" in reply.text, path
                assert port not in reply.text and PASSWORD not in reply.text, path
                assert reply.headers["retry-after"] == "5"
                assert '<meta http-equiv="refresh" content="5">' in reply.text  # reloads itself
            api = client.get("/api/overview")
            assert api.status_code == 503 and "does not answer" in api.json()["error"]
            health = client.get("/healthz")
            assert health.status_code == 503 and health.json()["status"] == "unavailable"
            assert health.json()["database"]["status"] == "down"
    lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    [line] = lines
    assert line.name == "relay.dashboard" and line.exc_info is None
    assert "unreachable" in line.getMessage() and port in line.getMessage()
    assert PASSWORD not in line.getMessage()


@contextlib.contextmanager
def scratch_database() -> Iterator[tuple[str, Engine]]:
    """A PostgreSQL database of its own (URL, and a superuser's engine to admit or refuse
    its connections), dropped afterwards."""
    name = "dash_" + uuid.uuid4().hex[:12]
    admin = create_engine(PG_URL, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    with admin.connect() as conn:
        conn.execute(sql(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(PG_URL).set(database=name).render_as_string(hide_password=False), admin
    finally:
        with admin.connect() as conn:
            conn.execute(sql(f'DROP DATABASE "{name}" WITH (FORCE)'))
        admin.dispose()


def admit(admin: Engine, url: str, allowed: bool) -> None:
    """Let the database take connections again, or refuse them and end those it has."""
    name = make_url(url).database
    with admin.connect() as conn:
        conn.execute(sql(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS {str(allowed).lower()}'))
        if not allowed:
            conn.execute(
                sql("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"),
                {"n": name},
            )


def test_an_outage_is_logged_when_it_starts_and_when_it_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The database goes away under a running dashboard and comes back: one WARNING line
    for its requests while it is away, one INFO line when it answers again."""
    with scratch_database() as (url, admin):
        migrate.upgrade(url)
        with (
            caplog.at_level(logging.INFO, logger="relay.dashboard"),
            browse(create_app(url, overview_cache_s=0)) as client,
        ):
            assert client.get("/api/overview").status_code == 200
            admit(admin, url, False)
            for _ in range(4):
                for path in ["/api/overview", "/dead", "/healthz"]:
                    assert client.get(path).status_code == 503, path
            admit(admin, url, True)
            for path in ["/api/overview", "/dead", "/healthz"]:
                assert client.get(path).status_code == 200, path
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "relay.dashboard"]
    assert [level for level, _ in said] == ["WARNING", "INFO"], said
    assert "unreachable" in said[0][1] and "recovered" in said[1][1]
    assert "12 failed attempt(s)" in said[1][1]
