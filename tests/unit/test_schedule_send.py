"""send()'s scheduling arguments: what build_message accepts, what it refuses, and why."""

from __future__ import annotations

import uuid
from datetime import UTC, date, datetime, timedelta, timezone
from typing import Any

import pytest

from outbox.errors import InvalidMessage, InvalidSchedule
from outbox.message import DEDUP_NAMESPACE, MAX_DELAY_S, build_message, check_cancel_id

LIMIT = 2**20
LEVELS = ("1s", "5s", "10s", "30s", "1m", "2m", "3m", "4m", "5m", "6m", "7m", "8m", "9m", "10m",
          "20m", "30m", "1h", "2h")  # fmt: skip


def build(**kw: Any) -> Any:
    topic = kw.pop("topic", "orders.created")
    return build_message(topic, b"x", max_payload_bytes=LIMIT, **kw)


def refused(field: str, **kw: Any) -> str:
    """The rule of the InvalidSchedule that build(**kw) raises, naming ``field``."""
    with pytest.raises(InvalidSchedule) as caught:
        build(**kw)
    assert caught.value.field == field, caught.value
    assert isinstance(caught.value, InvalidMessage)
    return caught.value.rule


def seconds(level_text: str) -> int:
    return int(level_text[:-1]) * {"s": 1, "m": 60, "h": 3600}[level_text[-1]]


def test_an_unscheduled_message_has_no_due_time() -> None:
    message = build()
    assert (message.delay_s, message.deliver_at, message.scheduled) == (None, None, False)
    assert uuid.UUID(message.msg_id).version == 7


@pytest.mark.parametrize(
    ("delay", "expected"),
    [(timedelta(minutes=30), 1800.0), (timedelta(0), 0.0), (5, 5.0), (0.25, 0.25), (0, 0.0)],
)
def test_a_delay_is_a_timedelta_or_seconds(delay: object, expected: float) -> None:
    message = build(delay=delay)
    assert (message.delay_s, message.deliver_at, message.scheduled) == (expected, None, True)


@pytest.mark.parametrize("delay", [-1, -0.001, timedelta(microseconds=-1)])
def test_a_negative_delay_is_refused(delay: object) -> None:
    assert "must not be negative" in refused("delay", delay=delay)


@pytest.mark.parametrize(
    ("delay", "words"),
    [
        (True, "timedelta or a number"),
        ("5", "timedelta or a number"),
        (float("nan"), "finite"),
        (float("inf"), "finite"),
        pytest.param(10**400, "finite", id="10**400"),
        pytest.param(-(10**400), "negative", id="-10**400"),
        (float("-inf"), "negative"),
        (MAX_DELAY_S + 1, "at most"),
        (timedelta(days=999_999), "at most"),
    ],
)
def test_a_delay_that_is_no_time_is_refused(delay: object, words: str) -> None:
    assert words in refused("delay", delay=delay)


def test_deliver_at_is_kept_in_utc() -> None:
    at = datetime(2030, 1, 1, 12, 0, tzinfo=timezone(timedelta(hours=5)))
    message = build(deliver_at=at)
    assert message.deliver_at == at and message.deliver_at.tzinfo is UTC
    assert (message.deliver_at.hour, message.delay_s) == (7, None)


def test_a_past_deliver_at_is_kept_as_given() -> None:
    past = datetime(2001, 2, 3, tzinfo=UTC)
    assert build(deliver_at=past).deliver_at == past


def test_a_naive_deliver_at_is_refused_with_the_fix() -> None:
    assert "give it a time zone" in refused("deliver_at", deliver_at=datetime(2030, 1, 1))


@pytest.mark.parametrize(
    "at",
    [
        date(2030, 1, 1),
        "2030-01-01T00:00:00Z",
        1_900_000_000,
        datetime(999, 12, 31, tzinfo=UTC),
        datetime(9999, 12, 31, 23, tzinfo=timezone(timedelta(hours=-5))),  # past 9999 in UTC
    ],
)
def test_a_deliver_at_that_is_no_instant_is_refused(at: object) -> None:
    refused("deliver_at", deliver_at=at)


def test_the_delay_levels_are_rocketmqs() -> None:
    assert [build(delay_level=n).delay_s for n in range(1, 19)] == [seconds(x) for x in LEVELS]


@pytest.mark.parametrize("level", [0, 19, -1, True, 1.0, "1"])
def test_a_delay_level_outside_1_to_18_is_refused(level: object) -> None:
    assert "1 to 18" in refused("delay_level", delay_level=level)


@pytest.mark.parametrize(
    ("kw", "field", "other"),
    [
        ({"delay": 1, "deliver_at": datetime.now(UTC)}, "deliver_at", "delay"),
        ({"delay": 1, "delay_level": 2}, "delay_level", "delay"),
        ({"deliver_at": datetime.now(UTC), "delay_level": 2}, "delay_level", "deliver_at"),
    ],
)
def test_one_due_time_at_most(kw: dict[str, Any], field: str, other: str) -> None:
    assert f"cannot be combined with {other}" in refused(field, **kw)


@pytest.mark.parametrize(
    "kw",
    [
        {"delay": 0},
        {"deliver_at": datetime(2030, 1, 1, tzinfo=UTC)},
        {"delay_level": 1},
        {"dedup_key": "k"},
    ],
)
def test_ordered_with_a_schedule_is_refused(kw: dict[str, Any]) -> None:
    rule = refused("ordered", key="k", ordered=True, **kw)
    assert "cannot be combined with a delay" in rule and next(iter(kw)) in rule


def test_a_dedup_key_makes_the_msg_id_and_schedules_for_now() -> None:
    first, again = build(dedup_key="remind-42"), build(dedup_key="remind-42")
    expected = uuid.uuid5(DEDUP_NAMESPACE, "orders.created\x00remind-42")
    assert first.msg_id == again.msg_id == str(expected)
    assert (first.delay_s, first.deliver_at, first.scheduled) == (0.0, None, True)
    assert build(dedup_key="remind-42", topic="orders.paid").msg_id != first.msg_id
    assert build(dedup_key="remind-43").msg_id != first.msg_id
    # With a due time, the key still makes the id; the namespace never changes.
    assert build(dedup_key="remind-42", delay=60).msg_id == first.msg_id
    assert str(DEDUP_NAMESPACE) == "6f0d3c55-8a1e-4c2b-9d41-3b1f2d7e9a10"


@pytest.mark.parametrize(
    ("key", "words"),
    [
        ("", "non-empty"),
        (42, "non-empty string"),
        (b"k", "non-empty string"),
        ("é" * 128, "at most 255 bytes"),
        ("a\nb", "control characters"),
        ("a\x00b", "control characters"),
        ("\ud800", "valid Unicode"),
    ],
)
def test_a_bad_dedup_key_is_refused(key: object, words: str) -> None:
    assert words in refused("dedup_key", dedup_key=key)


def test_a_dedup_key_of_255_bytes_with_spaces_is_accepted() -> None:
    assert build(dedup_key=" " + "é" * 127).scheduled


def test_cancel_takes_a_uuid_in_any_case() -> None:
    msg_id = uuid.uuid4()
    assert check_cancel_id(msg_id) == check_cancel_id(str(msg_id).upper()) == str(msg_id)
    for bad in ("", "not-a-uuid", str(msg_id).replace("-", ""), None, 42):
        with pytest.raises(InvalidMessage) as caught:
            check_cancel_id(bad)
        assert caught.value.field == "msg_id"
