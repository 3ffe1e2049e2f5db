"""Hostile request bodies for the web examples (Flask and FastAPI share the table and rules).

Each entry is (body, field): the example must answer 422 naming ``field`` and write
nothing. The values are what a careless or hostile client sends: numbers past the
INTEGER column, NUL (PostgreSQL text refuses it) and other control characters, lone
surrogates (no UTF-8 encoding), strings past the column's length, wrong types, missing
fields. ``raw`` encodes a body as JSON with ASCII escapes, so lone surrogates travel.
"""

from __future__ import annotations

import json
import unicodedata
from typing import Any

from hypothesis import strategies as st

OK = {"sku": "A-1", "quantity": 3, "dock": "D1"}


def with_(**fields: Any) -> dict[str, Any]:
    return {**OK, **fields}


def without(field: str) -> dict[str, Any]:
    return {k: v for k, v in OK.items() if k != field}


HOSTILE: list[tuple[Any, str]] = [
    (with_(quantity=2**31), "quantity"),
    (with_(quantity=10**30), "quantity"),
    (with_(quantity=-1), "quantity"),
    (with_(quantity=0), "quantity"),
    (with_(quantity=-(2**31) - 1), "quantity"),
    (with_(quantity=1.5), "quantity"),
    (with_(quantity="5"), "quantity"),
    (with_(quantity=True), "quantity"),
    (with_(quantity=None), "quantity"),
    (with_(quantity=[1]), "quantity"),
    (without("quantity"), "quantity"),
    (with_(sku="A\x00"), "sku"),
    (with_(sku="\x00"), "sku"),
    (with_(sku="A\x01B"), "sku"),
    (with_(sku="A\x1b[31m"), "sku"),
    (with_(sku="A\x7f"), "sku"),
    (with_(sku="A\x85"), "sku"),
    (with_(sku="A\nB"), "sku"),
    (with_(sku="A\ud800"), "sku"),
    (with_(sku=" A"), "sku"),
    (with_(sku=""), "sku"),
    (with_(sku="x" * 41), "sku"),
    (with_(sku="x" * 1_000_000), "sku"),
    (with_(sku=5), "sku"),
    (with_(sku=None), "sku"),
    (with_(sku={"a": 1}), "sku"),
    (without("sku"), "sku"),
    (with_(dock="D\x00"), "dock"),
    (with_(dock="D\t"), "dock"),
    (with_(dock="\udfff"), "dock"),
    (with_(dock="D" * 11), "dock"),
    (with_(dock=""), "dock"),
    (with_(dock=1), "dock"),
    (with_(dock=None), "dock"),
]


def raw(body: Any) -> bytes:
    return json.dumps(body).encode()  # ensure_ascii: "\ud800" travels as an escape


# For the property tests: a valid body, then up to two fields replaced by anything or left out.
printable = st.characters(codec="utf-8", categories=["L", "N", "P", "S"])
valid = st.fixed_dictionaries(
    {
        "sku": st.text(printable, min_size=1, max_size=40),
        "quantity": st.integers(1, 2**31 - 1),
        "dock": st.sampled_from(["D1", "D2", "D9"]),  # D9 is closed: 409
    }
)
text = st.one_of(st.text(max_size=45), st.text(printable, max_size=45).map(lambda t: f" {t}"))
anything = st.one_of(st.none(), st.booleans(), st.floats(), st.lists(st.integers(), max_size=2))
REPLACEMENTS = {
    "sku": st.one_of(text, anything, st.integers()),
    "quantity": st.one_of(st.integers(), st.integers(-(2**33), 2**33), text, anything),
    "dock": st.one_of(text, anything, st.integers()),
}


@st.composite
def bodies(draw: st.DrawFn) -> dict[str, Any]:
    body = draw(valid)
    for field in draw(st.sets(st.sampled_from(sorted(REPLACEMENTS)), max_size=2)):
        if draw(st.booleans()):
            del body[field]
        else:
            body[field] = draw(REPLACEMENTS[field])
    return body


def expected_status(body: dict[str, Any]) -> int:
    """What the examples must answer, by the rules written out again (not their code)."""
    sku, quantity, dock = body.get("sku"), body.get("quantity"), body.get("dock", "D1")
    valid = (
        storable(sku, 40)
        and storable(dock, 10)
        and type(quantity) is int
        and 1 <= quantity <= 2**31 - 1
    )
    if not valid:
        return 422
    return 409 if dock == "D9" else 201


def storable(value: object, longest: int) -> bool:
    return (
        isinstance(value, str)
        and 0 < len(value) <= longest
        and value == value.strip()
        and not any(unicodedata.category(c) in ("Cc", "Cs") for c in value)
    )
