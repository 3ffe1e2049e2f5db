"""The sweeper's per-row faults, on SQLite with the in-memory broker behind FaultyBroker.

A fault of one row (its adapter raises for it, the broker refuses it, the row breaks
the send() contract) costs that row an attempt and, at max_attempts, its life; the
other rows of its batch are published and marked exactly once.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from sqlalchemy import Engine

from outbox.broker import PublishResult, permanent, retry
from outbox.message import Message
from outbox.rows import KnownForms
from outbox.settings import Settings
from outbox.table import DEAD, PENDING, SENT
from relay import store
from relay.loop import BrokerLoop
from relay.sweep.sweeper import Sweeper, checked_message
from relay.testing.faults import Fault, FaultyBroker
from relay.testing.memory import MemoryBroker
from tests.helpers import migrated, running
from tests.planting import plant, row_of

QUICK = Settings(max_attempts=3, backoff_base_s=0.001, backoff_cap_s=0.002, sweep_batch=50)


@pytest.fixture
def engine(sqlite_url: str) -> Iterator[Engine]:
    with migrated(sqlite_url) as eng:
        yield eng


def sweeper_for(broker: FaultyBroker, engine: Engine, loops: list[BrokerLoop]) -> Sweeper:
    loop = running(broker, loops)
    assert loop.wait_connected(5)
    return Sweeper(engine, loop, QUICK)


def healthy_rows(engine: Engine, n: int) -> list[str]:
    return [plant(engine, "p.ok", f'{{"n":{i}}}'.encode()) for i in range(n)]


POISONS: list[Fault] = [
    TypeError("a client library's bug"),
    UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed"),
    permanent("MaxPayloadError: too large"),
    retry("nacked"),
]


@pytest.mark.parametrize("fault", POISONS, ids=lambda f: type(f).__name__ + str(f)[:7])
def test_a_poison_row_dies_at_the_limit_and_its_batch_is_published_once(
    engine: Engine, loops: list[BrokerLoop], fault: Fault
) -> None:
    good = healthy_rows(engine, 10)
    poison = plant(engine, "p.bad", b"{}")
    good += healthy_rows(engine, 10)
    memory = MemoryBroker()
    sweeper = sweeper_for(FaultyBroker(memory, {poison: fault}), engine, loops)
    first = sweeper.sweep(min_age_s=0, due_only=False)  # as `outbox drain` does
    assert (first.sent, first.failed, first.dead, first.aborted) == (20, 1, 0, False)
    row = row_of(engine, poison)
    expected = fault.error if isinstance(fault, PublishResult) else type(fault).__name__
    assert (row.status, row.attempts) == (PENDING, 1) and expected in row.last_error
    for _ in range(QUICK.max_attempts - 1):
        sweeper.sweep(min_age_s=0, due_only=False)
    row = row_of(engine, poison)
    assert (row.status, row.attempts) == (DEAD, QUICK.max_attempts)
    assert Counter(m.msg_id for m in memory.published) == Counter(good)
    assert {row_of(engine, m).status for m in good} == {SENT}


def test_a_refused_row_backs_off_before_it_is_taken_again(
    engine: Engine, loops: list[BrokerLoop]
) -> None:
    """The fast path leaves a PERMANENT message to the sweeper: there it costs attempts
    with backoff, not a retry on every pass."""
    poison = plant(engine, "p.bad")
    broker = FaultyBroker(MemoryBroker(), {poison: permanent("unroutable")})
    sweeper = sweeper_for(broker, engine, loops)
    sweeper.settings = Settings(max_attempts=3, backoff_base_s=30, backoff_cap_s=60)
    assert sweeper.sweep_once(min_age_s=0).failed == 1
    assert sweeper.sweep_once(min_age_s=0).claimed == 0, "not due again before its backoff"
    assert row_of(engine, poison).last_error == "permanent: unroutable"


PLANTED = {
    "headers as a JSON list": dict(headers=[["a", "b"]]),
    "a header value that is a number": dict(headers={"a": 1}),
    "a header name with a colon": dict(headers={"a:b": "v"}),
    "a header value with a line break": dict(headers={"a": "x\r\ny"}),
    "an empty tag": dict(tags="a,,b"),
    "a key with a control character": dict(key="k\x00"),
    "an empty topic": dict(topic=""),
    "a wildcard topic": dict(topic="p.>"),
}


def test_planted_rows_that_break_the_contract_fail_alone_unpublished(
    engine: Engine, loops: list[BrokerLoop]
) -> None:
    planted = {
        why: plant(engine, str(columns.pop("topic", "p.planted")), b"{}", **columns)
        for why, columns in ((w, dict(c)) for w, c in PLANTED.items())
    }
    good = healthy_rows(engine, 5)
    broker = FaultyBroker(MemoryBroker(), {})
    sweeper = sweeper_for(broker, engine, loops)
    result = sweeper.sweep(min_age_s=0, due_only=False)
    assert (result.sent, result.failed, result.aborted) == (5, len(PLANTED), False)
    assert broker.forwarded == Counter(good), "only the healthy rows reached the broker"
    for why, msg_id in planted.items():
        row = row_of(engine, msg_id)
        assert row.status == PENDING and row.attempts == 1, why
        assert row.last_error.startswith("permanent: invalid row: "), (why, row.last_error)


def test_a_null_payload_is_the_row_own_fault() -> None:
    """An older schema could hold a NULL payload: the claim has no size for it, no
    payload is loaded for it, and the row fails alone."""
    row = SimpleNamespace(
        id=7, msg_id="01a207a0-0000-7000-8000-000000000000", topic="p.x", payload=None,
        size=None, key=None, tags=None, headers=None,
    )  # fmt: skip
    assert list(store.payload_groups([row])) == []
    result = checked_message(row)  # type: ignore[arg-type]
    assert isinstance(result, PublishResult) and result.error is not None
    assert result.error.startswith("invalid row: payload: is NULL")


def test_known_forms_skip_only_what_already_passed() -> None:
    """A row of a form that passed recheck is not checked again; any other row is, and
    a form that cannot be hashed (a list among the headers) is never remembered."""
    known = KnownForms()

    def row(msg_id: object = None, topic: str = "p.x", headers: object = None) -> store.Claimed:
        return store.Claimed(
            1, msg_id or uuid.uuid4(), topic, None, None, headers, 0, None, b"{}", 2
        )

    good = row(headers={"a": "1"})
    assert isinstance(checked_message(good, None, known), Message)
    assert known.seen(row(headers={"a": "1"}))
    assert not known.seen(row(msg_id=str(uuid.uuid4()), headers={"a": "1"}))  # text: checked
    bad = checked_message(row(topic="p x", headers={"a": "1"}), None, known)
    assert isinstance(bad, PublishResult) and not bad.ok
    listed = checked_message(row(headers={"a": ["1"]}), None, known)
    assert isinstance(listed, PublishResult) and not known.seen(row(headers={"a": ["1"]}))
