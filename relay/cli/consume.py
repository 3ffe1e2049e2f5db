"""`outbox consume`: run an app's inbox (outbox.inbox.Inbox) on a broker until stopped.

``--app MODULE:ATTR`` names the app's ``Inbox`` (or a callable returning one), with its
handlers registered; the command subscribes to their topic patterns as the inbox's
consumer and handles each message in the inbox's transaction (relay.consume.runner).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable

from outbox.inbox import Inbox
from relay.cli.app import load_object
from relay.cli.common import EXIT_OK, PORT, Commands, UsageError, add_broker_flag
from relay.consume.runner import run_until_signalled

FLAG = "--app"
log = logging.getLogger("relay.cli")


def add_consume(commands: Commands) -> None:
    con = commands.add_parser(
        "consume",
        help="run an app's inbox: each message handled once, in its own transaction "
        "(until SIGTERM/SIGINT)",
        description="Consume the messages of the app's Inbox handlers' topics from the "
        "broker, as its consumer (a durable consumer per JetStream stream, a consumer "
        "group per Redis stream, a quorum queue on RabbitMQ; processes of one consumer "
        "share them). Each handler runs in a transaction that records the "
        "message in outbox_inbox; the message is acked after that commit, and a copy of "
        "one recorded before is acked without running its handler. A failing handler is "
        "retried with the inbox's backoff; past its attempts the message is the "
        "consumer's dead letter.",
        epilog="SIGTERM or SIGINT: the handler in hand finishes and its message is "
        "settled, then exit 0; a second signal exits at once (128 + the signal's number): "
        "the handler's transaction rolls back and the broker delivers the message again.",
    )
    con.add_argument(
        FLAG,
        dest="inbox_app",
        required=True,
        metavar="MODULE:ATTR",
        help="the app's Inbox (or a callable returning one), e.g. myshop.billing:inbox",
    )
    add_broker_flag(con)
    con.add_argument(
        "--metrics-port",
        type=PORT,
        help=f"serve Prometheus /metrics on this port ({PORT.range}; needs the [metrics] "
        "extra): outbox_consumer_messages_total{consumer,outcome}, "
        "outbox_consumer_lag_messages{consumer}",
    )


def load_inbox(spec: str) -> Inbox:
    """The Inbox ``spec`` names; a UsageError naming --app otherwise."""
    found = load_object(spec, Inbox, "myshop.billing:inbox")
    if not found.bound:
        raise UsageError(f"{FLAG}: the Inbox {spec!r} is not bound to a database")
    return found


def cmd_consume(args: argparse.Namespace) -> int:
    inbox = load_inbox(args.inbox_app)
    on_start = None
    if args.metrics_port is not None:
        from relay.consume.metrics import serve  # prometheus_client: the [metrics] extra

        on_start = serve(args.metrics_port).attach
    counts = run_until_signalled(inbox, args.broker, on_start=on_start)
    said = ", ".join(
        f"{name} {counts.get(name, 0)}" for name in ("handled", "duplicate", "retry", "dead")
    )
    print(f"consumer {inbox.consumer}: {said}, rejected {counts.get('rejected', 0)}")
    return EXIT_OK


PARSERS = (add_consume,)
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {"consume": cmd_consume}
