"""Payloads holding the types send() encodes beyond JSON's own (UUID, datetime, date, time,
Decimal, Enum, dataclasses, Pydantic models), and an app's json_default: each encodes to
exactly what docs/input.md says (its conversions, then json.dumps with send()'s options),
or is refused with an InvalidPayload whose path leads to a value refused on its own.

The brokers carry these payloads byte for byte too: strategies.payloads holds them, so
test_broker_roundtrip and test_send_input send them through every broker and database.
"""

from __future__ import annotations

from typing import Any

from hypothesis import event, given, settings
from hypothesis import strategies as st

from outbox.errors import InvalidPayload
from outbox.payload import encode_payload
from tests.property import strategies as s


@settings(s.PROPERTY, max_examples=400)  # no database, no broker: quick
@given(payload=s.typed_or_refused_values, with_default=st.booleans())
def test_a_payload_encodes_to_the_documented_json_or_is_refused(
    payload: Any, with_default: bool
) -> None:
    json_default = s.money_default if with_default else None
    try:
        expected: bytes | None = s.reference_json(payload, json_default)
    except Exception:  # json.dumps, model_dump or UTF-8: any refusal
        expected = None
    try:
        body, content_type = encode_payload(payload, json_default)
    except InvalidPayload as exc:
        event(f"refused{' with json_default' if with_default else ''}")
        assert expected is None, f"the reference encodes it, send() refused it: {exc}"
        assert exc.rule.startswith("at payload"), exc.rule
        if not with_default:
            assert_path_leads_to_a_refused_value(payload, exc.rule)
        return
    event(f"encoded{' with json_default' if with_default else ''}")
    assert body == expected
    text = isinstance(payload, str)
    assert content_type == ("text/plain; charset=utf-8" if text else "application/json")


def assert_path_leads_to_a_refused_value(payload: Any, rule: str) -> None:
    """``at payload['a'][0].b: ...``: the value there is refused as a payload of its own."""
    path = rule.removeprefix("at ").split(": ", 1)[0]
    if " key " in path:
        event("refused: a dict key")
        return
    try:
        value = eval(path, {"payload": payload})  # the path the encoder named
    except (AttributeError, KeyError, IndexError, TypeError):
        event("refused inside what a Pydantic model dumped")  # its own output, not the model's
        return
    try:
        encode_payload(value)
    except InvalidPayload:
        return
    raise AssertionError(f"{path} is {value!r}, which encodes on its own")
