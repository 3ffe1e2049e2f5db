"""examples/relay_worker/alerts.yml: Prometheus' own `promtool check rules` accepts it
(Debian's prometheus package, installed by `make services`), and every metric it names
is one a relay really serves (scraped from a real /metrics)."""

from __future__ import annotations

import re
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from sqlalchemy.orm import Session

from outbox import Outbox, migrate
from relay.metrics import serve
from relay.testing.embedded import NatsServer, free_port

RULES = Path(__file__).resolve().parents[2] / "examples" / "relay_worker" / "alerts.yml"
# Words of PromQL the rules use, labels Prometheus adds (job, instance), and `up`, the
# series Prometheus writes for every scrape target.
PROMQL = {"max", "by", "and", "delta", "up", "job", "instance", "topic", "m", "s"}
DURATION = re.compile(r"^\d+[smhd]$")


def test_promtool_accepts_the_rules() -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: `make services` installs Debian's prometheus package"
    done = subprocess.run([promtool, "check", "rules", str(RULES)],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 6 rules found" in done.stdout


@pytest.fixture
def exported(pg_url: str, nats_server: NatsServer, stream: tuple[str, str]) -> Iterator[set[str]]:
    """The metric families a running relay serves on /metrics (names from # TYPE lines)."""
    name, prefix = stream
    migrate.upgrade(pg_url)
    ob = Outbox(pg_url, broker=f"{nats_server.url}?stream={name}&subjects={prefix}.>")
    ob.start()
    assert ob.relay is not None
    server = serve(ob.relay, free_port(), "127.0.0.1")
    try:
        with Session(ob.engine) as session, session.begin():
            ob.send(session, f"{prefix}.a", b"x")
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            lines = reply.read().decode().splitlines()
        yield {line.split()[2] for line in lines if line.startswith("# TYPE ")}
    finally:
        server.shutdown()
        ob.stop()


def rules() -> list[dict[str, object]]:
    document = yaml.safe_load(RULES.read_text())
    (group,) = document["groups"]
    assert group["name"] == "outbox"
    return list(group["rules"])


def test_every_rule_is_complete() -> None:
    names = [rule["alert"] for rule in rules()]
    assert names == ["OutboxRelayDown", "OutboxBacklogQueryFailing", "OutboxOldestPendingTooOld",
                     "OutboxBacklogGrowing", "OutboxDeadMessages", "OutboxBlockedKeys"]  # fmt: skip
    for rule in rules():
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
        assert isinstance(rule["expr"], str) and rule["expr"].strip()
        assert DURATION.match(str(rule.get("for", "0s"))), rule
        assert rule["labels"]["severity"] in ("page", "ticket"), rule  # type: ignore[index]
        assert rule["annotations"]["summary"], rule  # type: ignore[index]
        assert rule["expr"].count("(") == rule["expr"].count(")"), rule  # type: ignore[union-attr]


def test_every_metric_named_is_served(exported: set[str]) -> None:
    for rule in rules():
        expr = re.sub(r'"[^"]*"|\[[^]]*\]', "", str(rule["expr"]))  # label values, ranges
        words = set(re.findall(r"[a-z_][a-z0-9_]*", expr))
        unknown = words - PROMQL - exported
        assert not unknown, f"{rule['alert']}: {unknown} not served by the relay"
    assert {"outbox_pending_messages", "outbox_oldest_pending_age_seconds",
            "outbox_dead_messages", "outbox_blocked_keys",
            "outbox_backlog_up"} <= exported  # fmt: skip
