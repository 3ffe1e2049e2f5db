"""`--json` on `outbox drain` and `outbox requeue`: one JSON document on stdout."""

from __future__ import annotations

import json

from relay.testing.embedded import NatsServer
from tests.acceptance.test_cli import cli, count, seed


def test_drain_json_gives_the_summary_as_one_document(
    pg_url: str, nats_server: NatsServer, stream: tuple[str, str]
) -> None:
    name, prefix = stream
    seed(pg_url, ["pending"] * 7, topic=f"{prefix}.json")
    broker = f"{nats_server.url}?stream={name}&subjects={prefix}.>"
    done = cli("drain", "--db", pg_url, "--broker", broker, "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)  # the whole of stdout: nothing else printed there
    assert report["sent"] == 7 and report["retry_later"] == 0 and report["dead"] == 0
    assert report["pending_at_start"] == 7
    assert report["stopped_by"] is None and report["broker_unreachable"] is False
    assert report["seconds"] >= 0
    assert count(pg_url, "pending") == 0


def test_requeue_json_counts_what_went_back(pg_url: str) -> None:
    seed(pg_url, ["dead", "dead", "sent"])
    done = cli("requeue", "--db", pg_url, "--dead", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"requeued": 2}
    assert count(pg_url, "pending") == 2
