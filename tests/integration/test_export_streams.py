"""`outbox export broker` reads the whole broker by default (every JetStream stream,
every topic's Redis stream under the prefix), ``--stream`` and ``--topic`` narrow it,
and each row says which stream it came from; the Parquet's metadata holds what each
stream captures. ``export ledger --topic`` keeps the matching topics only."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from sqlalchemy.orm import Session

from outbox import Outbox, migrate
from relay.brokers import nats as nats_adapter
from relay.brokers.nats import NatsBroker
from relay.cli import main
from relay.testing.embedded import NatsServer
from relay.testing.harness import BrokerUnderTest, broker_under_test
from spark_jobs.topics import SOURCES_KEY, matches
from tests.integration.test_export import messages, publish


@pytest.mark.parametrize(
    ("patterns", "topic", "matched"),
    [
        (["shop.*"], "shop.order", True),
        (["shop.*"], "shop.order.paid", False),
        (["shop.>"], "shop.order.paid", True),
        (["shop.>"], "shop", False),
        (["a.b", "c.*"], "c.d", True),
        (["a.b"], "a.bc", False),
        (["a_b.%"], "axb.x", False),
        ([], "anything", True),
    ],
)
def test_topic_patterns_match_as_nats_subjects(
    patterns: list[str], topic: str, matched: bool
) -> None:
    assert matches(patterns, topic) is matched


def export(*args: str) -> list[dict[str, object]]:
    out = args[args.index("--out") + 1]
    assert main(["export", *args]) == 0
    return list(pq.read_table(out).to_pylist())


@pytest.fixture
def two_streams(nats_server: NatsServer) -> Iterator[tuple[str, str, str]]:
    """Two JetStream streams of this test's own, WAREHOUSE_<tag> (w<tag>.>) and
    SHOP_<tag> (s<tag>.*), with 3 and 2 messages: (tag, warehouse, shop)."""
    tag = uuid.uuid4().hex[:8]
    warehouse, shop = f"WAREHOUSE_{tag}", f"SHOP_{tag}"
    nats_adapter.create_stream(nats_server.url, warehouse, f"w{tag}.>")
    nats_adapter.create_stream(nats_server.url, shop, f"s{tag}.*")
    publish(NatsBroker(nats_server.url), messages(f"w{tag}.in.x", 3), messages(f"s{tag}.order", 2))
    yield tag, warehouse, shop


def test_nats_export_reads_every_stream_and_names_it(
    nats_server: NatsServer, two_streams: tuple[str, str, str], tmp_path: Path
) -> None:
    tag, warehouse, shop = two_streams
    out = tmp_path / "all.parquet"
    got = export("broker", "--broker", nats_server.url, "--out", str(out))
    assert sorted((r["stream"], r["topic"]) for r in got) == sorted(
        [(warehouse, f"w{tag}.in.x")] * 3 + [(shop, f"s{tag}.order")] * 2
    )
    captures = json.loads(pq.read_schema(out).metadata[SOURCES_KEY])
    assert captures == {shop: [f"s{tag}.*"], warehouse: [f"w{tag}.>"]}

    both = tmp_path / "both.parquet"  # both --stream, not the last one only
    got = export("broker", "--broker", nats_server.url, "--stream", warehouse,
                 "--stream", shop, "--out", str(both))  # fmt: skip
    assert sorted({str(r["stream"]) for r in got}) == sorted([warehouse, shop]) and len(got) == 5

    one = tmp_path / "shop.parquet"
    got = export("broker", "--broker", nats_server.url, "--topic", f"s{tag}.*", "--out", str(one))
    assert [r["stream"] for r in got] == [shop, shop]


def test_with_db_the_export_reads_only_the_streams_of_the_ledgers_topics(
    nats_server: NatsServer, two_streams: tuple[str, str, str], sqlite_url: str, tmp_path: Path
) -> None:
    """Another app's stream at the same server (here SHOP, whose topics this ledger never
    wrote) is not read: its entries would be this audit's phantoms."""
    tag, warehouse, _ = two_streams
    migrate.upgrade(sqlite_url)
    ob = Outbox(sqlite_url)
    with Session(ob.engine) as session, session.begin():
        ob.send(session, f"w{tag}.in.x", {"n": 1})
    ob.engine.dispose()
    out = tmp_path / "ours.parquet"
    got = export("broker", "--broker", nats_server.url, "--db", sqlite_url, "--out", str(out))
    assert {r["stream"] for r in got} == {warehouse} and len(got) == 3
    assert json.loads(pq.read_schema(out).metadata[SOURCES_KEY]) == {warehouse: [f"w{tag}.>"]}


def test_a_missing_stream_is_named(nats_server: NatsServer, tmp_path: Path) -> None:
    out = tmp_path / "x.parquet"
    assert main(["export", "broker", "--broker", nats_server.url, "--stream", "NOPE",
                 "--out", str(out)]) == 1  # fmt: skip
    assert not out.exists()


@pytest.fixture
def redis_keys() -> Iterator[BrokerUnderTest]:
    with broker_under_test("redis") as under_test:
        yield under_test


def test_redis_export_reads_every_topic_under_the_prefix(
    redis_keys: BrokerUnderTest, tmp_path: Path
) -> None:
    publish(redis_keys.make(), messages("shop.order", 2), messages("warehouse.in", 3))
    url = redis_keys.url
    got = export("broker", "--broker", url, "--out", str(tmp_path / "all.parquet"))
    assert sorted((r["stream"], r["topic"]) for r in got) == sorted(
        [("shop.order", "shop.order")] * 2 + [("warehouse.in", "warehouse.in")] * 3
    )
    got = export("broker", "--broker", url, "--topic", "shop.*", "--out", str(tmp_path / "s.pq"))
    assert [r["topic"] for r in got] == ["shop.order"] * 2


def test_ledger_export_keeps_the_matching_topics(sqlite_url: str, tmp_path: Path) -> None:
    from sqlalchemy.orm import Session

    from outbox import Outbox

    migrate.upgrade(sqlite_url)
    ob = Outbox(sqlite_url)
    with Session(ob.engine) as session, session.begin():
        for topic in ("shop.order", "shop.order.paid", "shop_x.order", "warehouse.in"):
            ob.send(session, topic, {"t": topic})
    out = str(tmp_path / "ledger.parquet")
    got = export("ledger", "--db", sqlite_url, "--topic", "shop.*", "--topic", "warehouse.>",
                 "--out", out)  # fmt: skip
    assert sorted(str(r["topic"]) for r in got) == ["shop.order", "warehouse.in"]
