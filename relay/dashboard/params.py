"""The dashboard's request parameters, checked in one place before any route runs.

Each route names its query and path parameters with a rule (ROUTES in app.py): a whole
number in ASCII digits within a range, a msg_id, or text of bounded length without
control characters. A value that breaks its rule, or a parameter given twice, is a 400
naming the parameter and the rule, before anything reaches the database (where a NUL
in text is an error of PostgreSQL's, and 5,000 digits one of int()'s). Parameters a
route does not name are ignored, as a browser's or a proxy's additions are.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from fastapi import HTTPException, Request

from outbox.errors import InvalidMsgId
from relay.operator import parse_msg_id

# ASCII digits only: str.isdigit() also takes '²' (which int() refuses) and '٣' (which it
# reads as 3); 20 digits bound int()'s work (past 4,300 it raises).
DIGITS = re.compile(r"[0-9]{1,20}")
SHOWN_CHARS = 40  # of a refused value, in the 400's message


@dataclass(frozen=True)
class Whole:
    """A whole number from ``least`` to ``most``."""

    least: int
    most: int

    @property
    def rule(self) -> str:
        return f"a whole number from {self.least} to {self.most} in ASCII digits"

    def parse(self, text: str) -> int | None:
        if not DIGITS.fullmatch(text) or not self.least <= int(text) <= self.most:
            return None
        return int(text)


@dataclass(frozen=True)
class Text:
    """Text of at most ``most`` characters, none of them a control character (NUL, ESC...)."""

    most: int

    @property
    def rule(self) -> str:
        return f"text of at most {self.most} characters, without control characters"

    def parse(self, text: str) -> str | None:
        if len(text) > self.most or any(unicodedata.category(c) == "Cc" for c in text):
            return None
        return text


@dataclass(frozen=True)
class MsgId:
    """A msg_id: a UUID, as `outbox show` takes it (relay.operator.parse_msg_id); its
    canonical text."""

    rule = InvalidMsgId.rule

    def parse(self, text: str) -> str | None:
        if len(text) > 45:  # the longest a UUID is written: urn:uuid:{...}
            return None
        try:
            return parse_msg_id(text, "msg_id")
        except InvalidMsgId:
            return None


Rule = Whole | Text | MsgId
Value = int | str
Params = Mapping[str, Rule]


def checker(rules: Params) -> Callable[[Request], None]:
    """A FastAPI dependency checking a route's parameters; the values, parsed, are in
    ``request.state.params`` (an empty or missing query parameter is absent)."""

    def check(request: Request) -> None:
        found: dict[str, Value] = {}
        for name, rule in rules.items():
            if name in request.path_params:
                given = [str(request.path_params[name])]
            else:
                given = [v for v in request.query_params.getlist(name) if v != ""]
            if len(given) > 1:
                raise HTTPException(400, f"{name}: given {len(given)} times; give it once")
            if given:
                found[name] = parsed(name, rule, given[0])
        request.state.params = found

    return check


def parsed(name: str, rule: Rule, text: str) -> Value:
    value = rule.parse(text)
    if value is None:
        shown = text[:SHOWN_CHARS] + ("..." if len(text) > SHOWN_CHARS else "")
        raise HTTPException(400, f"{name}: must be {rule.rule}, not {shown!r}")
    return value


def number(request: Request, name: str) -> int | None:
    """The checked value of a Whole parameter, None when not given."""
    value = request.state.params.get(name)
    assert value is None or isinstance(value, int), name
    return value


def text(request: Request, name: str) -> str | None:
    """The checked value of a Text or MsgId parameter, None when not given."""
    value = request.state.params.get(name)
    assert value is None or isinstance(value, str), name
    return value
