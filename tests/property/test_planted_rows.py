"""Planted rows, generated: whatever lies in the table, one sweep either publishes a
row byte-exact (everything read back from the real broker equals what was stored) or
records it as failed (attempts, last_error) without publishing it; the healthy row
planted beside it is published exactly once.

Rows are written straight into outbox_message (PostgreSQL), as a hand or an older
version would: broad alphabets, JSON headers with surrogate escapes, non-string
values, non-object JSON. One broker per parameter (tests.targets).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine

from outbox.message import KEY_HEADER, TAGS_HEADER
from outbox.settings import Settings
from outbox.table import PENDING, SENT
from relay.brokers import broker_for
from relay.loop import BrokerLoop
from relay.sweep.sweeper import Sweeper
from tests.helpers import migrated
from tests.planting import plant, row_of
from tests.targets import Carried, Target, target

__all__ = ["target"]  # the fixture, one broker per parameter

# A failed row must not be taken again by a later example's sweep.
ONCE = Settings(backoff_base_s=3600, backoff_cap_s=3600)

# Broad: PostgreSQL text columns hold neither NUL nor lone surrogates; JSON holds both.
column_text = st.text(
    st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), max_size=40
)
json_text = st.text(st.characters(exclude_categories=()), max_size=20)
json_value = st.one_of(
    json_text, json_text, st.integers(), st.none(), st.booleans(), st.lists(json_text, max_size=2)
)
# Plausible: what apps write, non-ASCII letters included, so many rows are publishable.
letters = st.characters(categories=["L", "N"], include_characters="-_")
token = st.text(letters, min_size=1, max_size=12)
tags = st.lists(token, min_size=1, max_size=3).map(",".join)
header_name = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9-]{0,11}", fullmatch=True)
header_value = st.one_of(
    st.from_regex(r"[!-~]([ -~]{0,20}[!-~])?", fullmatch=True), token, json_text
)
headers = st.one_of(
    st.none(),
    st.dictionaries(header_name, header_value, max_size=4),
    st.dictionaries(header_name, header_value, max_size=4),
    st.dictionaries(json_text, json_value, max_size=4),
    st.lists(json_text, max_size=2),
)
payload = st.one_of(
    st.binary(max_size=300),
    st.text(max_size=100).map(lambda s: s.encode("utf-8", "surrogatepass")),
)


@st.composite
def rows(draw: st.DrawFn, prefix: str) -> dict[str, Any]:
    tokens = st.lists(token, min_size=1, max_size=3).map(".".join)
    topic = draw(
        st.one_of(
            tokens.map(lambda s: f"{prefix}.{s}"),  # under the captured prefix
            tokens.map(lambda s: f"{prefix}.{s}"),
            column_text.map(lambda s: f"{prefix}.{s}"),
            column_text,
        )
    )
    return {
        "topic": topic,
        "payload": draw(payload),
        "key": draw(st.one_of(st.none(), token, column_text)),
        "tags": draw(st.one_of(st.none(), tags, column_text)),
        "headers": draw(headers),
    }


@pytest.fixture
def engine(pg_url: str) -> Iterator[Engine]:
    with migrated(pg_url) as eng:
        yield eng


@pytest.fixture
def sweeper(target: Target, engine: Engine) -> Iterator[Sweeper]:
    relay = BrokerLoop(broker_for(target.url))
    relay.start()
    assert relay.wait_connected(10), "broker not reachable"
    yield Sweeper(engine, relay, ONCE)
    relay.stop()


def carried_as(msg_id: str, row: dict[str, Any]) -> Carried:
    """What the broker must hold for a published row."""
    headers = dict(row["headers"] or {})
    if row["key"] is not None:
        headers[KEY_HEADER] = row["key"]
    if row["tags"] is not None:
        headers[TAGS_HEADER] = row["tags"]
    return Carried(msg_id, row["topic"], row["payload"], headers)


def test_a_planted_row_is_published_byte_exact_or_fails_alone(
    target: Target, engine: Engine, sweeper: Sweeper
) -> None:
    outcomes: Counter[str] = Counter()

    @settings(
        max_examples=100,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(row=rows(target.prefix))
    def one_sweep(row: dict[str, Any]) -> None:
        planted = plant(engine, **row)
        healthy = plant(engine, f"{target.prefix}.ok", b"healthy", headers={"h": "v"})
        result = sweeper.sweep_once(min_age_s=0)
        assert result.claimed == 2 and not result.aborted
        held = Counter(c.msg_id for c in target.read())
        stored = row_of(engine, planted)
        if stored.status == SENT:
            found = [c for c in target.read() if c.msg_id == planted]
            assert found == [carried_as(planted, row)], "published, so carried byte-exact"
        else:
            assert stored.status == PENDING and stored.attempts == 1 and stored.last_error
            assert held[planted] == 0, "a failed row is not published"
        outcomes[stored.status] += 1
        assert row_of(engine, healthy).status == SENT and held[healthy] == 1

    one_sweep()
    assert outcomes[SENT] and outcomes[PENDING], f"both outcomes were drawn: {outcomes}"
