"""The dashboard's web app: create_app() and its routes (FastAPI, Jinja2 templates)."""

from __future__ import annotations

import importlib.metadata
import ipaddress
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import plotly.offline
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from sqlalchemy import Engine
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware

from outbox.engines import engine_from
from outbox.errors import ConfigError, UnknownMessage
from outbox.table import DEAD
from relay import Page, plugins
from relay.dashboard import guard, reports
from relay.dashboard.database import Database, DatabaseDown
from relay.dashboard.overview import OVERVIEW_CACHE_S, Cached, RelayMetrics, overview
from relay.dashboard.params import MsgId, Params, Text, Whole, checker, number
from relay.dashboard.params import text as text_param
from relay.display import duration, failure_json, payload_text
from relay.operator import READ_TIMEOUT_S, Failure, Operator, actions_for

HERE = Path(__file__).parent
log = logging.getLogger("relay.dashboard")
PAGE_SIZE = 50  # dead letters per page unless ?limit=
MAX_PAGE = 500
PREVIEW_BYTES = 200  # of each payload in the dead letters' table
MESSAGE_PREVIEW_BYTES = 4096  # on one message's page
BLOCKED_SHOWN = 200
MAX_ROW_ID = 2**63 - 1  # BIGINT
TOPIC_CHARS = 255  # the topic column's size
PATH_CHARS = 1024  # of a report file's path, or a login's next page
RETRY_AFTER_S = 5  # a 503's Retry-After: the overview polls every 3 s
STARTED = time.monotonic()
ACTIONS = {
    "requeue": "put it back to pending: the relay publishes it again",
    "skip": "give it up: it is never published, and its key (if ordered) goes on without it",
    "delete": "delete its row: gone from the table, never published",
}
READ_ONLY = "the dashboard is read-only: start it with --allow-actions and a token to act"
# Pages and their scripts come from this server only: an injected inline script never runs.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; "
    "style-src 'self' 'unsafe-inline'; img-src 'self' data:; frame-ancestors 'none'; "
    "form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
# A report file runs its own scripts (its charts) in an opaque origin: never as the dashboard.
REPORT_HEADERS = {**SECURITY_HEADERS, "Content-Security-Policy": "sandbox allow-scripts"}
# The Host names a request may carry (any port): another name is refused (400), so a page
# of another site whose name was made to resolve to 127.0.0.1 (DNS rebinding) reads nothing.
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")
HOST_NAME = re.compile(r"(\*\.)?[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")


@dataclass
class Config:
    database: Database
    reports: Path | None
    metrics: RelayMetrics | None
    allow_actions: bool
    token: str | None
    sessions: guard.Sessions
    overview: Cached
    operator: Operator  # every read and action of the pages, through ``database``
    pages: Sequence[Page] = ()  # the plugins' pages, linked from the nav


def create_app(
    engine_or_url: Engine | str,
    reports: str | Path | None = None,
    metrics_url: str | None = None,
    allow_actions: bool = False,
    token: str | None = None,
    allowed_hosts: Sequence[str] = (),
    overview_cache_s: float = OVERVIEW_CACHE_S,
) -> FastAPI:
    """The dashboard on a database (an Engine, or a URL it makes one of and disposes of
    at shutdown).

    Read-only unless ``allow_actions``, which needs ``token``: requeue, skip and delete
    then take the token (Bearer header, or the login form) and, from a form, its CSRF
    token. ``reports``: a folder whose reports are listed and served read-only.
    ``allowed_hosts``: Host header names besides 127.0.0.1, localhost and [::1] (the
    bound address, a reverse proxy's name; ``*.example.com`` for its subdomains).
    ``overview_cache_s``: the overview's figures are read at most this often for all.
    """
    hosts = [*LOOPBACK_HOSTS, *(host_name(h) for h in allowed_hosts)]
    if allow_actions and not token:
        raise ConfigError("allow_actions needs a token (--token-file or OUTBOX_DASHBOARD_TOKEN)")
    folder = None if reports is None else Path(reports)
    if folder is not None and not folder.is_dir():
        raise ConfigError(f"reports: not a folder: {folder}")
    if isinstance(engine_or_url, str):  # bounded reads, as the CLI's (relay.operator)
        engine = engine_from(engine_or_url, read_timeout_s=READ_TIMEOUT_S)
    else:
        engine = engine_or_url
    metrics = None if metrics_url is None else RelayMetrics(metrics_url)
    database = Database(engine)
    operator = Operator(engine, database.reading, database.writing)  # outages: DatabaseDown
    config = Config(
        database,
        folder,
        metrics,
        allow_actions,
        token,
        guard.Sessions(),
        Cached(lambda: overview(operator, metrics), overview_cache_s),
        operator,
    )
    config.pages = plugin_pages()
    owned = engine if isinstance(engine_or_url, str) else None
    app = FastAPI(
        title="outbox dashboard",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        lifespan=lambda _app: disposing(owned),
    )
    app.state.config = config
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")
    app.middleware("http")(guarded)
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=hosts, www_redirect=False)
    app.add_exception_handler(StarletteHTTPException, error_page)  # type: ignore[arg-type]
    app.add_exception_handler(DatabaseDown, database_down_page)  # type: ignore[arg-type]
    for path, endpoint, methods, rules in ROUTES:
        app.add_api_route(
            path,
            endpoint,
            methods=[*methods, "HEAD"] if "GET" in methods else methods,
            dependencies=[Depends(checker(rules))],
            include_in_schema=False,
        )
    for extra in config.pages:
        app.add_api_route(
            extra.path,
            extra.handler,
            methods=["GET", "HEAD"],
            dependencies=[Depends(checker(NO_PARAMS))],
            include_in_schema=False,
        )
    return app


def plugin_pages() -> Sequence[Page]:
    """The registered plugins' pages (model B's /halfop); their templates join ours."""
    pages = plugins().pages()
    searchpath = templates.env.loader.searchpath  # type: ignore[union-attr]
    for folder in {str(p.templates) for p in pages} - set(searchpath):
        searchpath.append(folder)
    return pages


def host_name(wanted: str) -> str:
    """A Host name to accept: a name, an IPv4 address, an IPv6 one (brackets added), or
    ``*.domain``; no port (any port is accepted), no other wildcard."""
    bare = wanted.removeprefix("[").removesuffix("]")
    if ":" in bare:
        try:
            return f"[{ipaddress.IPv6Address(bare)}]"
        except ValueError:
            pass
    elif HOST_NAME.fullmatch(wanted):
        return wanted.lower()
    raise ConfigError(
        f"allowed host: {wanted[:60]!r} is not a host name, an IP address or *.domain "
        "(no port, no other wildcard)"
    )


@asynccontextmanager
async def disposing(engine: Engine | None) -> AsyncIterator[None]:
    """The app's lifespan: an engine it made from a URL is disposed of at shutdown."""
    try:
        yield
    finally:
        if engine is not None:
            engine.dispose()


templates = Jinja2Templates(directory=HERE / "templates")


def config_of(request: Request) -> Config:
    config: Config = request.app.state.config
    return config


async def guarded(
    request: Request, call_next: Callable[[Request], Awaitable[Response]]
) -> Response:
    """Every request: POSTs refused when read-only, the browser's session (if it has one),
    safe headers."""
    config = config_of(request)
    if request.method not in ("GET", "HEAD") and not config.allow_actions:
        response: Response = page(request, "error.html", {"status": 403, "detail": READ_ONLY}, 403)
        response.headers.update(SECURITY_HEADERS)
        return response
    cookie = request.cookies.get(guard.COOKIE)
    request.state.session = config.sessions.get(cookie) if config.allow_actions else None
    response = await call_next(request)
    for name, value in SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)
    current = request.state.session
    if current is not None and current.id != cookie:
        set_cookie(response, current.id)
    elif current is None and cookie is not None and config.allow_actions:
        response.delete_cookie(guard.COOKIE, path="/")  # logged out, forgotten or idle
    return response


def set_cookie(response: Response, session_id: str) -> None:
    response.set_cookie(guard.COOKIE, session_id, httponly=True, samesite="strict", path="/")


def form_session(request: Request) -> guard.Session | None:
    """The session a form is rendered for: the browser's, or a new one (the middleware
    sets its cookie). None for a request with the Bearer header: a script, not a browser."""
    if request.state.session is None and "authorization" not in request.headers:
        request.state.session = config_of(request).sessions.new()
    session: guard.Session | None = request.state.session
    return session


def page(request: Request, name: str, context: dict[str, Any], status: int = 200) -> Response:
    config = config_of(request)
    session = getattr(request.state, "session", None)
    shared = {
        "actions": config.allow_actions,
        "session": session,
        "logged_in": bool(session and session.logged_in),
        "has_reports": config.reports is not None,
        "plugin_pages": config.pages,
    }
    return templates.TemplateResponse(request, name, {**shared, **context}, status_code=status)


async def error_page(request: Request, exc: StarletteHTTPException) -> Response:
    """Every refusal (400, 401, 403, 404, 405...) as a page of the dashboard's layout, or
    JSON under /api/."""
    if request.url.path.startswith("/api/"):
        return JSONResponse({"error": exc.detail}, status_code=exc.status_code)
    return page(
        request, "error.html", {"status": exc.status_code, "detail": exc.detail}, exc.status_code
    )


DATABASE_DOWN = (
    "the database does not answer ({reason}): this page reloads itself until it does. "
    "The dashboard's log says why (one line per outage); /healthz tells when it is back."
)


async def database_down_page(request: Request, down: DatabaseDown) -> Response:
    """A 503 in the dashboard's layout (JSON under /api/), without the driver's text."""
    detail = DATABASE_DOWN.format(reason=down.reason)
    headers = {"Retry-After": str(RETRY_AFTER_S)}
    if request.url.path.startswith("/api/"):
        return JSONResponse({"error": detail}, status_code=503, headers=headers)
    context = {"status": 503, "detail": detail, "retry_after_s": RETRY_AFTER_S}  # reloads itself
    response = page(request, "error.html", context, 503)
    response.headers.update(headers)
    return response


def bad(detail: str) -> HTTPException:
    return HTTPException(400, detail)


# Health


def healthz(request: Request) -> Response:
    """200 and the process's and the database's state as JSON when the database answers
    (a SELECT 1), 503 when it does not: for a load balancer's or a monitor's probe."""
    database = config_of(request).database.health()
    uptime_s = round(time.monotonic() - STARTED, 1)
    process = {"pid": os.getpid(), "uptime_s": uptime_s, "version": package_version()}
    up = database["status"] == "up"
    body = {"status": "ok" if up else "unavailable", "process": process, "database": database}
    headers = {"Cache-Control": "no-store"}
    return JSONResponse(body, status_code=200 if up else 503, headers=headers)


def package_version() -> str:
    """The installed distribution's version (relay.cli's is not imported: it imports us)."""
    try:
        return importlib.metadata.version("outbox-relay")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout never installed
        return "unknown (not installed)"


def favicon() -> Response:
    """The page's icon where browsers look for it by default (base.html names it too)."""
    return FileResponse(HERE / "static" / "favicon.svg", media_type="image/svg+xml",
                        headers={"Cache-Control": "max-age=86400"})  # fmt: skip


# Reading


def overview_page(request: Request) -> Response:
    config = config_of(request)
    return page(
        request,
        "overview.html",
        {"data": config.overview.get()},
    )


def overview_api(request: Request) -> Response:
    config = config_of(request)
    return JSONResponse(config.overview.get())


def plotly_js() -> Response:
    return Response(
        PLOTLY_JS, media_type="text/javascript", headers={"Cache-Control": "max-age=86400"}
    )


PLOTLY_JS = plotly.offline.get_plotlyjs()


DEAD_PARAMS: Params = {
    "limit": Whole(1, MAX_PAGE),
    "before": MsgId(),  # as `outbox dead --before`
    # The next page's link: a row id, which stays valid when that row is deleted.
    "before_id": Whole(1, MAX_ROW_ID),
    "topic": Text(TOPIC_CHARS),
}


def dead_page(request: Request) -> Response:
    config = config_of(request)
    limit = number(request, "limit") or PAGE_SIZE
    before = text_param(request, "before")
    before_id = number(request, "before_id")
    topic = text_param(request, "topic")
    try:
        now, rows, previews = config.operator.dead(
            (DEAD,), topic, limit, before, before_id, preview_bytes=PREVIEW_BYTES
        )
    except UnknownMessage:
        raise bad(f"before: no message {before} (a typo, or purged)") from None
    listed = [dead_row(r, previews.get(r.id, (b"", 0)), now) for r in rows]
    more = rows[-1].id if len(rows) == limit else None
    context = {"rows": listed, "more": more, "limit": limit, "topic": topic, "before": before}
    return page(request, "dead.html", context)


def dead_row(row: Failure, preview: tuple[bytes, int], now: datetime) -> dict[str, Any]:
    head, size = preview
    return {
        **failure_json(row, now),
        "age": duration((now - row.created_at).total_seconds()),
        "preview": payload_text(head, len(head) < size),
        "cut": len(head) < size,
    }


def checked_msg_id(request: Request) -> str:
    """The path's msg_id, checked (MESSAGE_PARAMS): its canonical text."""
    wanted = text_param(request, "msg_id")
    assert wanted is not None
    return wanted


MESSAGE_PARAMS: Params = {"msg_id": MsgId()}
ACTION_PARAMS: Params = {"msg_id": MsgId(), "action": Text(40)}  # an unknown one: 404


def message_page(request: Request) -> Response:
    wanted = checked_msg_id(request)
    try:
        row = config_of(request).operator.show(wanted, MESSAGE_PREVIEW_BYTES)
    except UnknownMessage:
        raise HTTPException(404, f"no message {wanted} (a typo, or purged by retention)") from None
    payload = bytes(row["payload"])
    context = {
        "row": row,
        "msg_id": wanted,
        "preview": payload_text(payload, len(payload) < row["size"]),
        "cut": len(payload) < row["size"],
        "shown_bytes": len(payload),
        "possible": list(actions_for(row["status"])),
        "descriptions": ACTIONS,
    }
    return page(request, "message.html", context)


def blocked_page(request: Request) -> Response:
    now, keys = config_of(request).operator.blocked_keys(BLOCKED_SHOWN)
    rows = [
        {
            **k._asdict(),
            "msg_id": str(k.msg_id),
            "age": duration((now - k.created_at).total_seconds()),
        }
        for k in keys
    ]
    return page(request, "blocked.html", {"keys": rows, "shown": BLOCKED_SHOWN})


def reports_page(request: Request) -> Response:
    root = config_of(request).reports
    found = [] if root is None else reports.find_reports(root)
    return page(
        request,
        "reports.html",
        {"reports": found, "configured": root is not None, "most": reports.MAX_REPORTS},
    )


REPORT_PARAMS: Params = {"path": Text(PATH_CHARS)}


def report_file(request: Request) -> Response:
    root = config_of(request).reports
    path = text_param(request, "path") or ""
    served = None if root is None else reports.served_file(root, path)
    if served is None:
        raise HTTPException(404, "no such report file")
    return FileResponse(served, headers=REPORT_HEADERS)


# Acting


def login_form(request: Request) -> Response:
    if not config_of(request).allow_actions:
        raise HTTPException(403, READ_ONLY)
    form_session(request)
    return page(
        request, "login.html", {"next": safe_next(text_param(request, "next")), "wrong": False}
    )


LOGIN_PARAMS: Params = {"next": Text(PATH_CHARS)}


STALE_FORM = "the form is stale or forged (CSRF token missing or wrong): reload it"


async def checked_form(request: Request) -> guard.Session:
    """The browser's session when the POSTed form carries its CSRF token; else 403."""
    form = await request.form()
    session: guard.Session | None = request.state.session
    if session is None or not guard.same(str(form.get("csrf", "")), session.csrf):
        raise HTTPException(403, STALE_FORM)
    return session


async def login(request: Request) -> Response:
    config = config_of(request)
    session = await checked_form(request)
    form = await request.form()
    target = safe_next(str(form.get("next", "")))
    if not guard.same(str(form.get("token", "")), config.token):
        log.warning("dashboard: a wrong token from %s", client(request))
        return page(request, "login.html", {"next": target, "wrong": True}, 401)
    request.state.session = config.sessions.log_in(session)
    log.info("dashboard: logged in from %s", client(request))
    return RedirectResponse(target, status_code=303)


async def logout(request: Request) -> Response:
    session = await checked_form(request)
    config_of(request).sessions.drop(session)
    request.state.session = None
    log.info("dashboard: logged out from %s", client(request))
    return RedirectResponse("/", status_code=303)


def safe_next(target: str | None) -> str:
    """A path on this server only: never another site's URL (an open redirect)."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    return target


def confirm_page(request: Request, action: str) -> Response:
    config = config_of(request)
    session = request.state.session
    by_token = "authorization" in request.headers
    if config.allow_actions and not by_token and not (session and session.logged_in):
        wanted = checked_msg_id(request)  # the path below is made of checked parts
        if action in ACTIONS:
            return RedirectResponse(f"/login?next=/messages/{wanted}/{action}", status_code=303)
    wanted, _ = action_target(request, action)
    try:
        row = config.operator.show(wanted, PREVIEW_BYTES)
    except UnknownMessage:
        raise HTTPException(404, f"no message {wanted}") from None
    form_session(request)
    context = {"row": row, "msg_id": wanted, "action": action, "description": ACTIONS[action]}
    return page(request, "confirm.html", context)


def action_target(request: Request, action: str) -> tuple[str, str]:
    """The msg_id and the actor ('token' or 'session'), or the refusal: 404 for an unknown
    action, 401 without the token; a GET without a session login goes to the login form."""
    config = config_of(request)
    if not config.allow_actions:
        raise HTTPException(403, READ_ONLY)
    if action not in ACTIONS:
        raise HTTPException(404, f"no action {action[:40]!r}: requeue, skip or delete")
    wanted = checked_msg_id(request)
    given = guard.bearer(request.headers.get("authorization"))
    if given is not None:
        if not guard.same(given, config.token):
            raise HTTPException(401, "wrong token")
        return wanted, "token"
    if request.state.session is not None and request.state.session.logged_in:
        return wanted, "session"
    raise HTTPException(401, "log in with the dashboard's token first (/login)")


async def act(request: Request, action: str) -> Response:
    wanted, actor = action_target(request, action)
    if actor == "session":
        await checked_form(request)
    operator = config_of(request).operator
    done, said = await run_in_threadpool(operator.act, action, wanted)
    log.info("dashboard: %s msg_id=%s by %s (%s): %s", action, wanted, client(request), actor, said)
    if actor == "token":
        return JSONResponse(
            {"msg_id": wanted, "action": action, "done": done, "outcome": said},
            status_code=200 if done else 409,
        )
    context = {"msg_id": wanted, "action": action, "done": done, "said": said}
    return page(request, "done.html", context, 200 if done else 409)


def client(request: Request) -> str:
    return f"{request.client.host}:{request.client.port}" if request.client else "unknown"


NO_PARAMS: Params = {}
# Each route, its methods (HEAD is added to GET's) and its parameters' rules (params.py).
ROUTES: list[tuple[str, Callable[..., Any], list[str], Params]] = [
    ("/", overview_page, ["GET"], NO_PARAMS),
    ("/api/overview", overview_api, ["GET"], NO_PARAMS),
    ("/healthz", healthz, ["GET"], NO_PARAMS),
    ("/favicon.ico", favicon, ["GET"], NO_PARAMS),
    ("/plotly.min.js", plotly_js, ["GET"], NO_PARAMS),
    ("/dead", dead_page, ["GET"], DEAD_PARAMS),
    ("/messages/{msg_id}", message_page, ["GET"], MESSAGE_PARAMS),
    ("/messages/{msg_id}/{action}", confirm_page, ["GET"], ACTION_PARAMS),
    ("/messages/{msg_id}/{action}", act, ["POST"], ACTION_PARAMS),
    ("/blocked", blocked_page, ["GET"], NO_PARAMS),
    ("/reports", reports_page, ["GET"], NO_PARAMS),
    ("/reports/files/{path:path}", report_file, ["GET"], REPORT_PARAMS),
    ("/login", login_form, ["GET"], LOGIN_PARAMS),
    ("/login", login, ["POST"], NO_PARAMS),
    ("/logout", logout, ["POST"], NO_PARAMS),
]
