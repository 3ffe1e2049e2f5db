"""How ``send()`` turns a payload into bytes (the rules: docs/input.md, "Payloads").

bytes pass as they are, a str as UTF-8, anything else as compact JSON in UTF-8. Beyond
JSON's own types the encoder takes, anywhere in the tree and as the payload itself:
UUID (its text), aware datetime (ISO 8601 with its offset), date and time (ISO 8601),
Decimal (its exact text, as a JSON string), Enum (its value), dataclass instances (their
fields) and Pydantic v2 models (``model_dump(mode="json")``). The app's ``json_default``
takes the rest, as ``json.dumps``' ``default`` does.

A plain payload (dicts, lists, str, int, float, bool, None) never reaches the hooks
below: the C encoder handles it alone, as fast as ``json.dumps``.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import reprlib
import sys
import uuid
from collections.abc import Callable
from datetime import date, datetime, time
from decimal import Decimal
from functools import partial
from json.encoder import c_make_encoder, encode_basestring  # type: ignore[attr-defined]
from typing import Any

from outbox.errors import ConfigError, InvalidPayload

JsonDefault = Callable[[Any], Any]

TEXT_CONTENT_TYPE = "text/plain; charset=utf-8"
JSON_CONTENT_TYPE = "application/json"
NAIVE_RULE = (
    "a datetime needs a tzinfo (several app instances in different time zones would read "
    "it differently)"
)
_UNKNOWN = object()  # builtin_form() of a type the library does not encode itself
# Values in error messages: cut short, and safe from a __repr__ that raises.
_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 80
_shown = _repr.repr


class Refused(Exception):
    """Raised from inside the encoder: a value breaks ``rule``."""

    def __init__(self, rule: str) -> None:
        super().__init__(rule)
        self.rule = rule


def check_json_default(json_default: object) -> JsonDefault | None:
    """``Outbox(json_default=...)``: None, or a callable taking one object."""
    if json_default is not None and not callable(json_default):
        raise ConfigError(
            "json_default: must be a callable that takes an object and returns something "
            f"JSON can encode (like json.dumps' default), got {type(json_default).__name__}"
        )
    return json_default


def encode_payload(
    payload: object, json_default: JsonDefault | None = None
) -> tuple[bytes, str | None]:
    """bytes as they are, str as UTF-8, anything else as JSON; returns (body, content type).

    Raises ``InvalidPayload`` naming the path of the first value it cannot encode.
    """
    if isinstance(payload, bytes | bytearray | memoryview):
        try:
            return bytes(payload), None
        except (TypeError, ValueError) as exc:  # e.g. a released memoryview
            raise InvalidPayload("payload", f"cannot be read as bytes: {exc}") from None
    if isinstance(payload, str):
        return _utf8(payload, payload, json_default), TEXT_CONTENT_TYPE
    if json_default is None and (text := _fast_json(payload)) is not None:
        return _utf8(text, payload, json_default), JSON_CONTENT_TYPE
    encoder = _ENCODER if json_default is None else _encoder(json_default)
    try:
        text = encoder.encode(payload)
    except RecursionError:
        raise InvalidPayload("payload", "is nested too deeply to encode as JSON") from None
    except (Refused, TypeError, ValueError) as exc:
        raise _refusal(payload, json_default, exc) from None
    return _utf8(text, payload, json_default), JSON_CONTENT_TYPE


def _utf8(text: str, payload: object, json_default: JsonDefault | None) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _refusal(payload, json_default, exc) from None


def convert(obj: object, json_default: JsonDefault | None = None) -> object:
    """The JSON form of ``obj``, a value JSON has no type for (the encoder's ``default``).

    The types listed above first; then ``json_default``, also for the values of those
    types that are refused (a naive datetime, a NaN Decimal): it may decide for them.
    """
    try:
        value = builtin_form(obj)
    except Exception as exc:  # a tzinfo, __str__ or model_dump of the app's that raises
        raise Refused(f"a {type_name(obj)} could not be encoded: {describe(exc)}") from None
    if value is not _UNKNOWN:
        return value
    rule = refused_rule(obj)
    if json_default is not None:
        try:
            return json_default(obj)
        except Exception as exc:
            if rule:
                raise Refused(f"{rule} (json_default raised {describe(exc)})") from None
            raise Refused(f"json_default raised for a {type_name(obj)}: {describe(exc)}") from None
    raise Refused(
        rule
        or f"a {type_name(obj)} has no JSON form: convert it first, or give the Outbox a "
        "json_default= that does"
    )


def builtin_form(obj: object) -> object:
    """The JSON form of a type the library encodes itself, else ``_UNKNOWN``."""
    if isinstance(obj, datetime):
        return _UNKNOWN if obj.utcoffset() is None else obj.isoformat()
    if isinstance(obj, date | time):  # a day, or a time of day: no instant to misread
        return obj.isoformat()
    if isinstance(obj, uuid.UUID):
        return str(obj)
    if isinstance(obj, Decimal):
        # A string, exact: as a JSON number most consumers would read it as a float.
        return str(obj) if obj.is_finite() else _UNKNOWN
    if isinstance(obj, enum.Enum):
        return obj.value
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if _is_pydantic_model(obj):
        return obj.model_dump(mode="json")  # type: ignore[attr-defined]
    return _UNKNOWN


def refused_rule(obj: object) -> str | None:
    """The rule a value of a type builtin_form() knows breaks, None for other types."""
    if isinstance(obj, datetime):  # builtin_form() took every aware one
        return (
            f"{NAIVE_RULE}; got the naive {_shown(obj)}: give it one, e.g. "
            ".replace(tzinfo=UTC), or decide for naive ones in Outbox(json_default=...)"
        )
    if isinstance(obj, Decimal):
        return f"a Decimal must be finite (JSON has no NaN or Infinity), got {obj}"
    return None


def _is_pydantic_model(obj: object) -> bool:
    """A Pydantic v2 model, without importing Pydantic: an app that made one imported it."""
    pydantic = sys.modules.get("pydantic")
    base = getattr(pydantic, "BaseModel", None)
    return isinstance(base, type) and isinstance(obj, base) and hasattr(obj, "model_dump")


def _encoder(json_default: JsonDefault | None) -> json.JSONEncoder:
    """The encoder of every JSON payload: compact, UTF-8 text kept, NaN refused."""
    return json.JSONEncoder(
        ensure_ascii=False,
        allow_nan=False,
        separators=(",", ":"),
        default=partial(convert, json_default=json_default),
    )


_ENCODER = _encoder(None)  # stateless between calls: one serves every thread
# _ENCODER's C encoder, made once (JSONEncoder.encode makes one per call) and without
# the circular-reference markers (a dict per call, else shared by threads): a circular
# payload ends in RecursionError here instead.
_C_ENCODER = None
if c_make_encoder is not None:  # (markers, default, encoder, indent, separators, sort, skip, nan)
    _C_ENCODER = c_make_encoder(
        None, _ENCODER.default, encode_basestring, None, ":", ",", False, False, False
    )


def _fast_json(payload: object) -> str | None:
    """``_ENCODER.encode(payload)``, or None when it fails (or the C encoder is missing):
    then the full encoder runs again and raises what it always raised for that payload."""
    if _C_ENCODER is None:
        return None
    try:
        return "".join(_C_ENCODER(payload, 0))
    except Exception:  # RecursionError (deep or circular), Refused, TypeError, ValueError
        return None


def _refusal(payload: object, json_default: JsonDefault | None, exc: Exception) -> InvalidPayload:
    """The error for a payload the encoder refused: the path of the value and its rule."""
    try:
        found = find_refused(payload, "payload", json_default, set())
    except RecursionError:
        found = None
    if found is not None:
        path, rule = found
        return InvalidPayload("payload", f"at {path}: {rule}")
    if isinstance(exc, Refused):
        return InvalidPayload("payload", exc.rule)
    return InvalidPayload("payload", f"must be bytes, str or JSON-encodable: {exc}")


def find_refused(
    value: object, path: str, json_default: JsonDefault | None, stack: set[int]
) -> tuple[str, str] | None:
    """(path, rule) of the first value in ``value`` the encoder refuses, walking the tree
    in the encoder's own order; None when all of it encodes. Runs only after a refusal,
    and calls ``json_default`` (and ``model_dump``) again on the way."""
    if value is None or isinstance(value, bool | int):
        return None
    if isinstance(value, str):
        return _check_text(value, path)
    if isinstance(value, float):
        return None if math.isfinite(value) else (path, f"JSON has no NaN or Infinity, got {value}")
    if id(value) in stack:
        return path, "contains itself (a circular reference)"
    stack.add(id(value))
    try:
        return _find_within(value, path, json_default, stack)
    finally:
        stack.discard(id(value))


def _find_within(
    value: object, path: str, json_default: JsonDefault | None, stack: set[int]
) -> tuple[str, str] | None:
    if isinstance(value, list | tuple):
        items = ((f"{path}[{i}]", item) for i, item in enumerate(value))
        return _first_refused(items, json_default, stack)
    if isinstance(value, dict):
        for key, item in value.items():
            if not (key is None or isinstance(key, str | int | float)):
                return path, f"keys must be str, int, float, bool or None, got {_shown(key)}"
            if isinstance(key, str) and (found := _check_text(key, f"{path} key {key!r}")):
                return found
            if found := find_refused(item, f"{path}[{key!r}]", json_default, stack):
                return found
        return None
    try:
        converted = convert(value, json_default)
    except Refused as exc:
        return path, exc.rule
    if converted is value:
        return path, f"json_default returned the {type_name(value)} unchanged"
    if isinstance(converted, dict) and (
        dataclasses.is_dataclass(value) or _is_pydantic_model(value)
    ):  # their fields, as the app reads them
        fields = ((f"{path}.{name}", item) for name, item in converted.items())
        return _first_refused(fields, json_default, stack)
    return find_refused(converted, path, json_default, stack)


def _first_refused(
    items: Any, json_default: JsonDefault | None, stack: set[int]
) -> tuple[str, str] | None:
    for path, item in items:
        if found := find_refused(item, path, json_default, stack):
            return found
    return None


def _check_text(text: str, path: str) -> tuple[str, str] | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return path, f"text must be encodable as UTF-8 (no lone surrogates): {exc}"
    return None


def type_name(obj: object) -> str:
    """``set``, ``decimal.Decimal``, ``app.models.Order``: the type as an app would write it."""
    kind = type(obj)
    name = kind.__qualname__
    return name if kind.__module__ == "builtins" else f"{kind.__module__}.{name}"


def describe(exc: BaseException) -> str:
    """``ValueError: bad`` (or only ``ValueError`` when it says nothing)."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
