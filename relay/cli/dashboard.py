"""`outbox dashboard`: the operator's web page (relay.dashboard), served by uvicorn."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from collections.abc import Callable
from pathlib import Path

from outbox.errors import ConfigError
from outbox.secrets import mask_url
from relay.cli.common import EXIT_OK, PORT, Commands, UsageError, add_db_flag, database

TOKEN_ENV = "OUTBOX_DASHBOARD_TOKEN"
MIN_TOKEN = 16  # characters: a token short enough to guess is refused


def add_dashboard(commands: Commands) -> None:
    dashboard = commands.add_parser(
        "dashboard",
        help="serve a web page of the backlog, dead letters, blocked keys and reports",
        description="Serve the operator dashboard: per topic pending, oldest pending age, "
        "scheduled, dead and sent in the last hour with throughput and commit->ack charts "
        "(updated live); dead letters a page at a time; blocked ordered keys; model B's "
        "transaction records; reconciliation and comparison reports under --reports; /healthz "
        "(200, or 503 while the database does not answer) for a probe. Read-only unless "
        "--allow-actions.",
        epilog="It binds 127.0.0.1 unless --bind says otherwise; it serves plain HTTP, so "
        "put a TLS proxy in front of it before binding another address. It answers only "
        "requests whose Host is 127.0.0.1, localhost, [::1], the --bind address or an "
        "--allowed-host (others get 400: a hostile page's DNS rebinding reads nothing). With "
        f"--allow-actions, requeue, skip and delete take the token (--token-file or ${TOKEN_ENV}; "
        f"at least {MIN_TOKEN} characters): as 'Authorization: Bearer TOKEN' or through the "
        "page's login form; each action is logged with the msg_id and the client. Needs the "
        "'dashboard' extra.",
    )
    add_db_flag(dashboard)
    dashboard.add_argument(
        "--bind", default="127.0.0.1", help="address to listen on (default 127.0.0.1)"
    )
    dashboard.add_argument(
        "--port", type=PORT, default=8080, help=f"port ({PORT.range}, default 8080)"
    )
    dashboard.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a Host name to answer besides the loopback ones and --bind, e.g. a reverse "
        "proxy's dashboard.example.com or *.example.com (repeatable)",
    )
    dashboard.add_argument(
        "--reports", metavar="DIR", help="folder of reconcile/compare outputs to list and serve"
    )
    dashboard.add_argument(
        "--metrics",
        metavar="URL",
        help="a relay's /metrics URL (outbox relay --metrics-port) to show its counters",
    )
    dashboard.add_argument(
        "--allow-actions",
        action="store_true",
        help="allow requeue, skip and delete of dead messages (needs a token)",
    )
    dashboard.add_argument(
        "--token-file",
        metavar="FILE",
        help=f"file holding the actions' token (default: ${TOKEN_ENV})",
    )


def read_token(args: argparse.Namespace) -> str | None:
    """The actions' token, read only with --allow-actions (a token given without it warns:
    the dashboard stays read-only)."""
    if not args.allow_actions:
        if args.token_file or os.environ.get(TOKEN_ENV, "").strip():
            warn(f"a token was given (--token-file or ${TOKEN_ENV}) without --allow-actions: "
                 "it is not read and the dashboard is read-only")  # fmt: skip
        return None
    if args.token_file:
        try:
            token = Path(args.token_file).read_text().strip()
        except OSError as exc:
            raise UsageError(f"--token-file: cannot read it ({exc.strerror})") from None
    else:
        token = os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        raise UsageError(f"--allow-actions needs a token: --token-file FILE or ${TOKEN_ENV}")
    if len(token) < MIN_TOKEN:
        raise UsageError(f"the token must have at least {MIN_TOKEN} characters")
    return token


def warn(text: str) -> None:
    print(f"warning: {text}", file=sys.stderr, flush=True)


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return address == "localhost"


def cmd_dashboard(args: argparse.Namespace) -> int:
    import uvicorn

    from relay.dashboard import create_app

    token = read_token(args)
    if args.reports and not Path(args.reports).is_dir():
        raise UsageError(f"--reports: not a folder: {args.reports}")
    if not is_loopback(args.bind):
        warn(f"--bind {args.bind}: other machines can reach the dashboard over plain HTTP; "
             "put a TLS proxy in front of it")  # fmt: skip
    engine = database(args, reads=True)
    try:
        hosts = [args.bind, *args.allowed_host]
        try:
            app = create_app(engine, args.reports, args.metrics, args.allow_actions, token, hosts)
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
        host = f"[{args.bind}]" if ":" in args.bind else args.bind
        mode = "actions allowed with the token" if args.allow_actions else "read-only"
        shown_db = mask_url(engine.url.render_as_string(hide_password=True))
        print(f"dashboard on http://{host}:{args.port}/ ({mode}; database {shown_db})", flush=True)
        uvicorn.run(app, host=args.bind, port=args.port, log_level="warning")
    finally:
        engine.dispose()
    return EXIT_OK


PARSERS = (add_dashboard,)
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {"dashboard": cmd_dashboard}
