"""Subjects in NATS's wildcard syntax (``*`` one token, ``>`` one or more at the end):
the subjects two patterns both match."""

from __future__ import annotations


def intersection(a: str, b: str) -> str | None:
    """The pattern of the subjects both ``a`` and ``b`` match; None when there are none."""
    left, right = a.split("."), b.split(".")
    out: list[str] = []
    for i in range(max(len(left), len(right))):
        if i >= len(left) or i >= len(right):
            return None  # one has more tokens, the other no '>' to take them
        x, y = left[i], right[i]
        if x == ">" or y == ">":
            rest = [">"] if x == y else right[i:] if x == ">" else left[i:]
            return ".".join(out + rest)
        if x != y and "*" not in (x, y):
            return None
        out.append(y if x == "*" else x)
    return ".".join(out)
