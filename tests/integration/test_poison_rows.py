"""Poison rows beside healthy ones, through each real broker: NATS JetStream (a server
of the test's own), RabbitMQ and Redis (names and keys of the test's own).

Rows are planted straight into the table (as a hand or an older version would write
them) and swept, by the Sweeper in process and by the real `outbox drain`. What the
broker holds afterwards is read back: exactly one copy of each healthy message, as it
was stored; no copy of a poison row, which is pending with attempts and its
last_error, or dead at the limit.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

from outbox.message import KEY_HEADER, TAGS_HEADER, Message, uuid7
from outbox.settings import Settings
from outbox.table import DEAD, PENDING, SENT
from relay.brokers import broker_for
from relay.loop import BrokerLoop
from relay.sweep.sweeper import Sweeper
from tests.helpers import DispatcherWithLoop, migrated, wait_until
from tests.planting import plant, row_of
from tests.targets import Carried, Target, target

__all__ = ["target"]  # the fixture, one broker per parameter

OUTBOX = str(Path(sys.executable).with_name("outbox"))
QUICK = Settings(max_attempts=3, backoff_base_s=0.001, backoff_cap_s=0.002, sweep_batch=40)


@pytest.fixture
def engine(pg_url: str) -> Iterator[Engine]:
    with migrated(pg_url) as eng:
        yield eng


# Rows that break the send() contract, whatever the broker.
COMMON_POISONS: dict[str, tuple[dict[str, Any], str]] = {
    "headers stored as a JSON list": (dict(headers=[["h", "v"]]), "invalid row: headers"),
    "a lone surrogate in a header value": (dict(headers={"h": "\ud800"}), ""),
}


def plant_all(engine: Engine, target: Target) -> tuple[dict[str, Carried], dict[str, str]]:
    """40 healthy rows with the poison rows among them; (healthy by msg_id, poison by why)."""
    healthy: dict[str, Carried] = {}

    def plant_healthy(n: int) -> None:
        for i in range(n):
            topic, payload = f"{target.prefix}.ok{i % 3}", f'{{"n":{i}}}'.encode()
            headers = {"trace": f"t{i}", "content-type": "application/json"}
            msg_id = plant(engine, topic, payload, key=f"k{i}", tags="a,b", headers=headers)
            carried = {**headers, KEY_HEADER: f"k{i}", TAGS_HEADER: "a,b"}
            healthy[msg_id] = Carried(msg_id, topic, payload, carried)

    plant_healthy(20)
    poisons: dict[str, str] = {}
    for why, (columns, _) in {**COMMON_POISONS, **target.poisons}.items():
        columns = {"topic": f"{target.prefix}.poison", **columns}
        payload = columns.pop("payload", b"{}")
        poisons[why] = plant(engine, columns.pop("topic"), payload, **columns)
    plant_healthy(20)
    return healthy, poisons


def sweep_in_process(target: Target, engine: Engine) -> None:
    relay = BrokerLoop(broker_for(target.url))
    relay.start()
    try:
        assert relay.wait_connected(10), "broker not reachable"
        sweeper = Sweeper(engine, relay, QUICK)
        for _ in range(QUICK.max_attempts):
            result = sweeper.sweep(min_age_s=0, due_only=False)
            assert not result.aborted, "a poison row was taken for a broker outage"
    finally:
        relay.stop()


def drain_by_cli(target: Target, engine: Engine) -> None:
    db = engine.url.render_as_string(hide_password=False)
    done = subprocess.run(
        [OUTBOX, "drain", "--db", db, "--broker", target.url],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    # poison rows the adapter refuses for good went dead within the drain (permanent_attempts)
    assert done.returncode == 3, (done.stdout, done.stderr)
    assert "sent=40 " in done.stdout and "unreachable" not in done.stdout, done.stdout
    assert "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("sweep", [sweep_in_process, drain_by_cli], ids=["sweeper", "drain"])
def test_poison_rows_fail_alone_and_healthy_ones_arrive_once(
    target: Target, engine: Engine, sweep: Callable[[Target, Engine], None]
) -> None:
    healthy, poisons = plant_all(engine, target)
    sweep(target, engine)
    carried = target.read()
    copies = Counter(c.msg_id for c in carried)
    assert copies == Counter(list(healthy)), "each healthy message exactly once, no poison"
    for c in carried:
        assert c == healthy[c.msg_id], "carried as stored"
    assert {row_of(engine, m).status for m in healthy} == {SENT}
    expected = {**COMMON_POISONS, **target.poisons}
    for why, msg_id in poisons.items():
        row = row_of(engine, msg_id)
        if sweep is sweep_in_process:
            assert (row.status, row.attempts) == (DEAD, QUICK.max_attempts), why
        elif row.last_error and row.last_error.startswith("permanent: "):
            # drain's passes try each row again: a permanent failure is dead within one drain
            assert (row.status, row.attempts) == (DEAD, Settings().permanent_attempts), why
        else:
            assert row.status == PENDING and row.attempts >= 1, why
        assert row.last_error and expected[why][1] in row.last_error, (why, row.last_error)


def test_fast_path_keeps_a_poison_message_to_itself(target: Target) -> None:
    """The broker's own refusals, mixed into one fast-path batch: each healthy message
    is published and marked once; each poison is rejected (left to the sweeper)."""
    healthy = [Message(str(uuid7()), f"{target.prefix}.fast", f"h{i}".encode()) for i in range(20)]
    poisons = [
        Message(str(uuid7()), str(columns["topic"]), bytes(columns.get("payload", b"{}")))
        for columns, _ in target.poisons.values()
    ]
    marked: list[str] = []
    dispatcher = DispatcherWithLoop(
        broker_for(target.url),
        lambda acks: marked.extend(m for m, _ in acks) or len(acks),
        Settings(retry_delays_ms=(0, 5, 10), ack_flush_ms=2, publish_batch=64),
    )
    dispatcher.start()
    try:
        assert dispatcher.broker_loop.wait_connected(10), "broker not reachable"
        assert dispatcher.submit([*healthy[:10], *poisons, *healthy[10:]], check=False) == 20 + len(
            poisons
        )
        wait_until(lambda: len(marked) == 20, what="healthy messages marked")
        wait_until(lambda: dispatcher.stats.rejected == len(poisons), what="poisons rejected")
    finally:
        dispatcher.stop()
    assert sorted(marked) == sorted(m.msg_id for m in healthy)
    copies = Counter(c.msg_id for c in target.read())
    assert copies == Counter(m.msg_id for m in healthy)
    assert dispatcher.stats.retried == 0
