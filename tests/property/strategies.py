"""Hypothesis strategies for what an app may hand to ``send()``, from broad alphabets.

Each alphabet mixes plain characters with the edges a broker, a client library or a
database column treats specially: every kind of whitespace and control character, the
NATS and AMQP wildcards and separators, non-ASCII, astral characters and surrogates.
"""

from __future__ import annotations

import string
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

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
payloads = st.one_of(st.binary(max_size=512), text, json_values)

PROPERTY = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,  # the same examples on every run: a failure is a bug, never luck
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
