"""Small things a newcomer trips on (issue 37, class 9): each has its test here."""

from __future__ import annotations

from sqlalchemy import create_engine

from relay.cli import build_parser
from relay.runtime import Relay
from relay.testing import MemoryBroker
from relay.testing.embedded import free_port


def test_metrics_listen_on_loopback_unless_told(sqlite_url: str) -> None:
    """/metrics binds 127.0.0.1 by default, like the dashboard; --metrics-addr opens it."""
    assert build_parser().parse_args(["relay"]).metrics_addr == "127.0.0.1"
    opened = build_parser().parse_args(["relay", "--metrics-addr", "0.0.0.0"])
    assert opened.metrics_addr == "0.0.0.0"
    engine = create_engine(sqlite_url)
    relay = Relay(engine, MemoryBroker(), fast_path=False, sweeper=False,
                  metrics_port=free_port())  # fmt: skip
    relay.start()
    try:
        assert relay._metrics._server.server_address[0] == "127.0.0.1"
    finally:
        relay.stop(timeout=5)
        engine.dispose()
