"""Hypothesis strategies for what an app may hand to ``send()``, from broad alphabets.

Each alphabet mixes plain characters with the edges a broker, a client library or a
database column treats specially: every kind of whitespace and control character, the
NATS and AMQP wildcards and separators, non-ASCII, astral characters and surrogates.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import string
import uuid
from datetime import UTC, date, datetime, time, timedelta, timezone
from decimal import Decimal
from typing import Any

import pydantic
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from outbox.payload import JsonDefault

EDGES = (
    "\x00\t\n\r\x0b\x0c\x1c\x1f\x7f\x80\x85\x9f\xa0\u1680\u2000\u2028\u2029\u3000"
    " $.*>#,:;/\\\"'=?%&+-_~|`^!"
    "éß日本\u200b\u200d\ufeff\ufffd\uffff\U0001f422\U0010fffd\ud800\udbff\udc00\udfff"
)
TOKEN_CHARS = string.ascii_letters + string.digits + "!#$%&'*+-.^_`|~"

SAMPLE_HEADER_NAMES = (
    "content-type", "Content-Type", "traceparent", "X-Req", "cc", "BCC", "Nats-Rollup",
    "outbox-key", "a/b", "a:b", "a b", "é", "",
)  # fmt: skip

edge = st.sampled_from(EDGES)
# Characters every field takes (a dash, '#', non-ASCII, astral): most examples are clean,
# so that many reach the database and the brokers; the rest mix in the edges.
clean_char = st.sampled_from(string.ascii_letters + string.digits + "-_#éß日🐢")
char = st.one_of(st.sampled_from(string.ascii_letters + string.digits), edge, st.characters())
wild_text = st.text(char, max_size=24)
long_text = st.text(st.sampled_from("aé日\U0001f422 .$"), min_size=100, max_size=400)
clean_text = st.text(clean_char, min_size=1, max_size=16)


def mostly(clean: st.SearchStrategy[Any], *wild: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``clean`` about three times in four, else one of ``wild``."""
    other = st.one_of(*wild)
    return st.integers(0, 3).flatmap(lambda n: other if n == 0 else clean)


text = mostly(clean_text, st.one_of(wild_text, long_text))
topic_part = mostly(
    st.lists(clean_text, min_size=1, max_size=4).map(".".join),
    st.lists(st.text(char, min_size=1, max_size=12), min_size=1, max_size=4).map(".".join),
    long_text,
    wild_text,
)
keys = st.one_of(st.none(), text)
tags = st.one_of(st.none(), text, st.lists(text, max_size=4))
header_names = mostly(
    st.text(st.sampled_from(TOKEN_CHARS), min_size=1, max_size=16),
    st.sampled_from(SAMPLE_HEADER_NAMES),
    st.text(st.one_of(st.sampled_from(TOKEN_CHARS), edge), min_size=1, max_size=8),
)
header_values = mostly(
    st.text(st.one_of(clean_char, st.just(" ")), max_size=24).map(str.strip),
    wild_text,
    st.text(st.sampled_from("v é"), min_size=300, max_size=2000),
)
headers = st.one_of(st.none(), st.dictionaries(header_names, header_values, max_size=5))
json_values: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
    max_leaves=12,
)


# Values beyond JSON's types that send() encodes itself (outbox.payload, docs/input.md).
class Colour(enum.Enum):
    RED = "red"
    DEEP = ("deep", 2)


class Size(enum.IntEnum):
    L = 3


class Kind(enum.StrEnum):
    GIFT = "gift"


@dataclasses.dataclass(frozen=True)
class Pair:
    first: Any
    second: Any


class Event(pydantic.BaseModel):
    id: uuid.UUID
    at: pydantic.AwareDatetime
    amount: Decimal
    data: Any = None


class Money:
    """A type only the app's json_default encodes."""

    def __init__(self, cents: int) -> None:
        self.cents = cents


def money_default(obj: object) -> object:
    """A json_default: Money as its cents, a naive datetime taken as UTC, a NaN or infinite
    Decimal as null, nothing else."""
    if isinstance(obj, Money):
        return {"cents": obj.cents}
    if isinstance(obj, datetime):
        return obj.replace(tzinfo=UTC)
    if isinstance(obj, Decimal):
        return None
    raise TypeError(f"not mine: {type(obj).__name__}")


# Whole minutes mostly (real zones), else any offset datetime.timezone takes (to the us).
offsets = mostly(
    st.integers(-1439, 1439).map(lambda m: timezone(timedelta(minutes=m))),
    st.timedeltas(-timedelta(hours=23, minutes=59), timedelta(hours=23, minutes=59)).map(timezone),
)
aware_datetimes = st.datetimes(timezones=offsets)
finite_decimals = st.decimals(allow_nan=False, allow_infinity=False)
typed_leaves = st.one_of(
    st.uuids(),
    aware_datetimes,
    st.dates(),
    st.times(timezones=st.none() | offsets),
    finite_decimals,
    st.sampled_from([*Colour, *Size, *Kind]),
)


def typed_trees(leaves: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """JSON trees whose leaves and branches may be any of the types send() encodes."""
    return st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | text | leaves,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4),
            st.dictionaries(text, inner, max_size=4),
            st.builds(Pair, inner, inner),
            st.builds(Event, id=st.uuids(), at=aware_datetimes, amount=finite_decimals, data=inner),
        ),
        max_leaves=12,
    )


typed_values = typed_trees(typed_leaves)
# Also values a payload may not hold: naive datetimes, NaN and infinite Decimals, objects
# only money_default encodes, objects nothing encodes.
refusable_leaves = st.one_of(
    st.datetimes(),
    st.sampled_from([Decimal("NaN"), Decimal("-Infinity"), Decimal("Infinity"), Decimal("sNaN")]),
    st.builds(Money, st.integers()),
    st.builds(object),
)
typed_or_refused_values = typed_trees(st.one_of(typed_leaves, refusable_leaves))
payloads = st.one_of(st.binary(max_size=512), text, json_values, typed_values)


def reference_json(payload: object, json_default: JsonDefault | None = None) -> bytes:
    """What docs/input.md says send() makes of a (non-bytes) payload, written apart from
    outbox.payload: the documented conversions first, then json.dumps. Raises on refusal."""
    if isinstance(payload, str):
        return payload.encode("utf-8")
    text = json.dumps(
        documented(payload, json_default),
        ensure_ascii=False,
        allow_nan=False,
        separators=(",", ":"),
    )
    return text.encode("utf-8")


def documented(value: Any, json_default: JsonDefault | None) -> Any:
    """``value`` with every type docs/input.md lists turned into its JSON form."""
    if isinstance(value, dict):
        return {k: documented(v, json_default) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [documented(v, json_default) for v in value]
    if isinstance(value, str | int | float) or value is None:  # StrEnum, IntEnum included
        return value
    if isinstance(value, pydantic.BaseModel):
        return value.model_dump(mode="json")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: documented(getattr(value, f.name), json_default)
            for f in dataclasses.fields(value)
        }
    if isinstance(value, enum.Enum):
        return documented(value.value, json_default)
    if isinstance(value, datetime) and value.utcoffset() is not None:
        return value.isoformat()
    if isinstance(value, date | time) and not isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, Decimal) and value.is_finite():
        return str(value)
    if json_default is None:
        raise TypeError(f"refused: {value!r}")
    return documented(json_default(value), json_default)


PROPERTY = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,  # the same examples on every run: a failure is a bug, never luck
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
