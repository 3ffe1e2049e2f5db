"""Payloads beyond JSON's own types: each encodes to the exact text docs/input.md gives,
anywhere in the tree and as the payload itself; a naive datetime and what has no JSON
form are refused naming the path of the value; json_default takes the rest."""

from __future__ import annotations

import enum
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import pydantic
import pytest
from sqlalchemy import Engine, create_engine, select
from sqlalchemy.orm import Session

from outbox import Outbox, migrate, outbox_message
from outbox.errors import ConfigError, InvalidPayload
from outbox.message import build_message
from outbox.payload import NAIVE_RULE, encode_payload

ID = uuid.UUID("0193c2a4-5b6e-7c3d-8e9f-0a1b2c3d4e5f")
AT = datetime(2026, 11, 28, 5, 0, tzinfo=UTC)


def body(payload: object, **kw: Any) -> bytes:
    return build_message("orders.created", payload, max_payload_bytes=10_000, **kw).payload


def refusal(payload: object, **kw: Any) -> str:
    with pytest.raises(InvalidPayload) as err:
        body(payload, **kw)
    assert err.value.field == "payload"
    return err.value.rule


class Colour(enum.Enum):
    RED = "red"
    DEEP = ("deep", 2)


class Size(enum.IntEnum):
    L = 3


class Kind(enum.StrEnum):
    GIFT = "gift"


@dataclass
class Line:
    sku: str
    qty: int
    price: Decimal
    at: datetime = AT


@dataclass(frozen=True, slots=True)
class Order:
    id: uuid.UUID
    lines: list[Line] = field(default_factory=list)


class Customer(pydantic.BaseModel):
    id: uuid.UUID
    since: date
    credit: Decimal
    seen: datetime


CUSTOMER = Customer(id=ID, since=date(2020, 2, 29), credit=Decimal("12.50"), seen=AT)
CUSTOMER_JSON = (
    '{"id":"0193c2a4-5b6e-7c3d-8e9f-0a1b2c3d4e5f","since":"2020-02-29","credit":"12.50",'
    '"seen":"2026-11-28T05:00:00Z"}'
)


@pytest.mark.parametrize(
    ("value", "text"),
    [
        pytest.param(ID, '"0193c2a4-5b6e-7c3d-8e9f-0a1b2c3d4e5f"', id="uuid"),
        pytest.param(AT, '"2026-11-28T05:00:00+00:00"', id="datetime-utc"),
        pytest.param(
            datetime(2026, 11, 28, 10, 30, 0, 250, tzinfo=timezone(timedelta(hours=5, minutes=30))),
            '"2026-11-28T10:30:00.000250+05:30"',
            id="datetime-offset-and-microseconds",
        ),
        pytest.param(date(2026, 11, 28), '"2026-11-28"', id="date"),
        pytest.param(time(9, 0), '"09:00:00"', id="time"),
        pytest.param(
            time(9, 0, 1, 5, tzinfo=timezone(-timedelta(hours=3))),
            '"09:00:01.000005-03:00"',
            id="time-aware",
        ),
        pytest.param(Decimal("1.10"), '"1.10"', id="decimal-keeps-its-zeros"),
        pytest.param(Decimal("1E+2"), '"1E+2"', id="decimal-exponent"),
        pytest.param(Decimal("-0"), '"-0"', id="decimal-negative-zero"),
        pytest.param(
            Decimal("0.1000000000000000055511151231257827"),
            '"0.1000000000000000055511151231257827"',
            id="decimal-beyond-float",
        ),
        pytest.param(Colour.RED, '"red"', id="enum"),
        pytest.param(Colour.DEEP, '["deep",2]', id="enum-tuple-value"),
        pytest.param(Size.L, "3", id="int-enum"),
        pytest.param(Kind.GIFT, '"gift"', id="str-enum"),
        pytest.param(
            Line("A-1", 2, Decimal("9.99")),
            '{"sku":"A-1","qty":2,"price":"9.99","at":"2026-11-28T05:00:00+00:00"}',
            id="dataclass",
        ),
        pytest.param(CUSTOMER, CUSTOMER_JSON, id="pydantic"),
    ],
)
def test_each_type_encodes_to_its_documented_text(value: object, text: str) -> None:
    assert body({"v": value}) == f'{{"v":{text}}}'.encode()
    assert body([value]) == f"[{text}]".encode()
    if not isinstance(value, str):  # a str (StrEnum) payload is text, not JSON
        assert body(value) == text.encode(), "as the payload itself"
        assert encode_payload(value)[1] == "application/json"


def test_dataclasses_and_models_nest_in_each_other() -> None:
    order = Order(ID, [Line("A-1", 1, Decimal("0.5")), Line("é", 2, Decimal("1"), at=AT)])
    got = body({"order": order, "customer": CUSTOMER, "when": [AT, date(2026, 1, 2)]})
    assert (
        got
        == (
            '{"order":{"id":"0193c2a4-5b6e-7c3d-8e9f-0a1b2c3d4e5f","lines":['
            '{"sku":"A-1","qty":1,"price":"0.5","at":"2026-11-28T05:00:00+00:00"},'
            '{"sku":"é","qty":2,"price":"1","at":"2026-11-28T05:00:00+00:00"}]},'
            f'"customer":{CUSTOMER_JSON},"when":["2026-11-28T05:00:00+00:00","2026-01-02"]}}'
        ).encode()
    )


def test_a_model_with_nested_models_is_encoded_by_pydantic() -> None:
    class Basket(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(populate_by_name=True)
        owner: Customer
        total: Decimal = pydantic.Field(alias="sum")

    assert body(Basket(owner=CUSTOMER, sum=Decimal("3"))) == (
        f'{{"owner":{CUSTOMER_JSON},"total":"3"}}'.encode()
    ), "model_dump(mode='json'): field names, not aliases, as model_dump gives them"


def test_a_sqlmodel_row_is_a_pydantic_model() -> None:
    import sqlmodel

    class Hero(sqlmodel.SQLModel):  # type: ignore[misc]
        id: uuid.UUID
        name: str
        born: date

    assert body(Hero(id=ID, name="Ada", born=date(1815, 12, 10))) == (
        b'{"id":"0193c2a4-5b6e-7c3d-8e9f-0a1b2c3d4e5f","name":"Ada","born":"1815-12-10"}'
    )


@pytest.mark.parametrize(
    ("payload", "path"),
    [
        ({"at": datetime(2026, 11, 28, 5)}, "payload['at']"),
        ({"a": [1, {"b": datetime(2026, 11, 28, 5)}]}, "payload['a'][1]['b']"),
        (datetime(2026, 11, 28, 5), "payload"),
        (
            Order(ID, [Line("A-1", 1, Decimal(1), at=datetime(2026, 11, 28, 5))]),
            "payload.lines[0].at",
        ),
    ],
)
def test_a_naive_datetime_is_refused_naming_its_path(payload: object, path: str) -> None:
    rule = refusal(payload)
    assert rule.startswith(f"at {path}: {NAIVE_RULE}; got the naive datetime.datetime(2026, 11")
    assert "json_default" in rule, "says how to decide for naive datetimes"


@pytest.mark.parametrize(
    ("payload", "says"),
    [
        ({"x": {1, 2}}, "at payload['x']: a set has no JSON form"),
        ({"x": [b"\x00"]}, "at payload['x'][0]: a bytes has no JSON form"),
        ({"x": timedelta(1)}, "at payload['x']: a datetime.timedelta has no JSON form"),
        ({"d": Decimal("NaN")}, "at payload['d']: a Decimal must be finite"),
        ([Decimal("-Infinity")], "at payload[0]: a Decimal must be finite"),
        ({"f": [1.0, float("inf")]}, "at payload['f'][1]: JSON has no NaN or Infinity, got inf"),
        ({"k": {ID: 1}}, "at payload['k']: keys must be str, int, float, bool or None, got UUID("),
        ({"t": ["ok", "a\ud800"]}, "at payload['t'][1]: text must be encodable as UTF-8"),
        ({"t\udfff": 1}, "at payload key 't\\udfff': text must be encodable as UTF-8"),
        (Line("\ud800", 1, Decimal(1)), "at payload.sku: text must be encodable as UTF-8"),
    ],
)
def test_what_has_no_json_form_is_refused_naming_its_path(payload: object, says: str) -> None:
    assert refusal(payload).startswith(says)


def test_a_circular_payload_is_refused() -> None:
    loop: dict[str, object] = {}
    loop["self"] = [loop]
    assert (
        refusal({"a": loop}) == "at payload['a']['self'][0]: contains itself (a circular reference)"
    )


def test_a_model_that_pydantic_cannot_dump_is_refused_naming_its_type() -> None:
    class Loose(pydantic.BaseModel):
        value: Any

    rule = refusal({"m": Loose(value=object())})
    assert rule.startswith("at payload['m']: a tests.unit.test_payload_types.")
    assert "Loose could not be encoded: PydanticSerializationError" in rule


class Money:
    def __init__(self, cents: int) -> None:
        self.cents = cents


def money(obj: object) -> object:
    if isinstance(obj, Money):
        return {"cents": obj.cents}
    if isinstance(obj, set):
        return sorted(obj)
    raise TypeError(f"{type(obj).__name__} is not mine")


def test_json_default_encodes_the_rest_recursively() -> None:
    got = body({"price": Money(999), "ids": {3, 1}, "at": AT}, json_default=money)
    assert got == b'{"price":{"cents":999},"ids":[1,3],"at":"2026-11-28T05:00:00+00:00"}'
    assert body(Money(5), json_default=money) == b'{"cents":5}', "as the payload itself"
    assert body({"m": [Money(1)]}, json_default=lambda o: Line("x", o.cents, Decimal(o.cents)))


def test_json_default_is_called_only_for_what_the_library_does_not_encode() -> None:
    seen: list[object] = []

    def spy(obj: object) -> object:
        seen.append(obj)
        return str(obj)

    known = {
        "a": [1, 2.5, "s", None, True],
        "u": ID,
        "d": Decimal(1),
        "l": Line("a", 1, Decimal(2)),
    }
    body(known, json_default=spy)
    assert seen == []
    assert body({"m": Money(1)}, json_default=spy).startswith(b'{"m":"<tests.unit')
    assert [type(o) for o in seen] == [Money]


def test_json_default_raising_is_refused_naming_the_type_and_path() -> None:
    rule = refusal({"a": [Money(1), object()]}, json_default=money)
    assert (
        rule
        == "at payload['a'][1]: json_default raised for a object: TypeError: object is not mine"
    )
    rule = refusal({"m": Money(1)}, json_default=lambda o: 1 / 0)
    assert rule == (
        "at payload['m']: json_default raised for a tests.unit.test_payload_types.Money: "
        "ZeroDivisionError: division by zero"
    )


def test_json_default_returning_its_argument_is_refused() -> None:
    assert refusal({"m": Money(1)}, json_default=lambda o: o) == (
        "at payload['m']: json_default returned the tests.unit.test_payload_types.Money unchanged"
    )


def test_json_default_may_decide_for_naive_datetimes() -> None:
    def as_utc(obj: object) -> object:
        if isinstance(obj, datetime):
            return obj.replace(tzinfo=UTC)
        raise TypeError(type(obj).__name__)

    assert body({"at": datetime(2026, 11, 28, 5)}, json_default=as_utc) == (
        b'{"at":"2026-11-28T05:00:00+00:00"}'
    )
    rule = refusal({"at": datetime(2026, 11, 28, 5)}, json_default=money)
    assert rule.startswith(f"at payload['at']: {NAIVE_RULE}; got the naive")
    assert rule.endswith("(json_default raised TypeError: datetime is not mine)")


@pytest.fixture
def sqlite_engine(sqlite_url: str) -> Iterator[Engine]:
    migrate.upgrade(sqlite_url)
    engine = create_engine(sqlite_url)
    yield engine
    engine.dispose()


def test_send_uses_the_outboxs_json_default(sqlite_engine: Engine) -> None:
    ob = Outbox(sqlite_engine, json_default=money)
    plain = Outbox(sqlite_engine)
    with Session(sqlite_engine) as session, session.begin():
        msg_id = ob.send(session, "orders.paid", {"price": Money(5), "order": Order(ID)})
        with pytest.raises(InvalidPayload, match=r"at payload\['price'\]: a tests\.unit"):
            plain.send(session, "orders.paid", {"price": Money(5)})
    with sqlite_engine.connect() as conn:
        query = select(outbox_message.c.payload, outbox_message.c.headers)
        payload, headers = conn.execute(
            query.where(outbox_message.c.msg_id == uuid.UUID(msg_id))
        ).one()
    assert (
        payload
        == b'{"price":{"cents":5},"order":{"id":"0193c2a4-5b6e-7c3d-8e9f-0a1b2c3d4e5f","lines":[]}}'
    )
    assert headers["content-type"] == "application/json"


@pytest.mark.parametrize("bad", [3, "module:func", Money(1)])
def test_json_default_must_be_callable(bad: object) -> None:
    with pytest.raises(ConfigError, match="json_default: must be a callable"):
        Outbox(json_default=bad)


def test_the_library_does_not_import_pydantic() -> None:
    """Encoding every other type leaves Pydantic unimported (an app without it pays nothing)."""
    code = (
        "import sys, uuid, decimal, datetime as d, dataclasses\n"
        "from outbox import Outbox\n"
        "from outbox.message import build_message\n"
        "@dataclasses.dataclass\n"
        "class A:\n"
        "    x: object\n"
        "p = {'u': uuid.uuid4(), 'd': decimal.Decimal(1), 'a': A(d.datetime.now(d.UTC)), 's': A}\n"
        "try:\n"
        "    build_message('t.a', p, max_payload_bytes=9999)\n"
        "except Exception as e:\n"
        "    print(type(e).__name__)\n"
        "print('pydantic' in sys.modules)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.split() == ["InvalidPayload", "False"]


def test_the_examples_of_docs_input_run() -> None:
    """docs/input.md, Payloads: its Python blocks, in order, in one namespace."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "input.md").read_text()
    section = doc.split("\n## Payloads\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 2
    namespace: dict[str, Any] = {}
    for block in blocks:
        exec(compile(block, "docs/input.md", "exec"), namespace)


def test_the_refusal_docs_input_shows_is_the_one_raised() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "input.md").read_text()
    naive = Order(ID, [Line("A-1", 1, Decimal(1), at=datetime(2026, 11, 28, 5))])
    with pytest.raises(InvalidPayload) as err:
        body({"order": naive})
    assert f"\n{err.value}\n" in doc
    with pytest.raises(InvalidPayload) as err:
        body({"tags": {"a"}})
    assert f"\n{err.value}\n" in doc


def test_json_default_may_decide_for_nan_decimals() -> None:
    assert body([Decimal("NaN")], json_default=lambda o: None) == b"[null]"
    rule = refusal([Decimal("-Infinity")], json_default=money)
    assert rule == (
        "at payload[0]: a Decimal must be finite (JSON has no NaN or Infinity), got -Infinity "
        "(json_default raised TypeError: Decimal is not mine)"
    )
