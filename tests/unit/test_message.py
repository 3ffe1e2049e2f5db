"""The rules send() applies before writing: each bad input names its field and rule."""

from __future__ import annotations

import json
import threading
import uuid

import pytest

from outbox.errors import (
    InvalidHeaders,
    InvalidKey,
    InvalidMessage,
    InvalidPayload,
    InvalidTags,
    InvalidTopic,
    OutboxError,
    PayloadTooLarge,
)
from outbox.message import build_message, encode_payload, uuid7


def build(topic: object = "orders.created", payload: object = b"x", **kw: object):  # type: ignore[no-untyped-def]
    return build_message(topic, payload, max_payload_bytes=kw.pop("max_payload_bytes", 100), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("topic", "rule"),
    [
        ("", "non-empty"),
        (None, "non-empty"),
        (b"orders", "non-empty"),
        ("orders created", "spaces"),
        ("orders\tcreated", "spaces"),
        ("orders.*", "wildcards"),
        ("orders.>", "wildcards"),
        ("orders..created", "empty tokens"),
        (".orders", "empty tokens"),
        ("orders.", "empty tokens"),
        ("o" * 256, "at most 255"),
    ],
)
def test_bad_topic_names_field_and_rule(topic: object, rule: str) -> None:
    with pytest.raises(InvalidTopic) as err:
        build(topic)
    assert err.value.field == "topic"
    assert rule in str(err.value)
    assert isinstance(err.value, OutboxError)


def test_payload_encodings() -> None:
    assert encode_payload(b"\x00\x01") == (b"\x00\x01", None)
    assert encode_payload(bytearray(b"ab")) == (b"ab", None)
    assert encode_payload("żółw") == ("żółw".encode(), "text/plain; charset=utf-8")
    body, ctype = encode_payload({"sku": "A-1", "qty": 3})
    assert json.loads(body) == {"sku": "A-1", "qty": 3}
    assert ctype == "application/json"


def test_json_payload_gets_content_type_header_unless_given() -> None:
    assert build(payload={"a": 1}).headers == {"content-type": "application/json"}
    given = build(payload={"a": 1}, headers={"Content-Type": "application/vnd.x+json"})
    assert given.headers == {"Content-Type": "application/vnd.x+json"}


@pytest.mark.parametrize("payload", [{1, 2}, object(), {"x": float("nan")}, "\ud800"])
def test_unserialisable_payload(payload: object) -> None:
    with pytest.raises(InvalidPayload) as err:
        build(payload=payload)
    assert err.value.field == "payload"


def test_payload_limit_counts_encoded_bytes() -> None:
    assert len(build(payload=b"x" * 100).payload) == 100
    with pytest.raises(PayloadTooLarge, match="at most 100 bytes once encoded, got 101"):
        build(payload=b"x" * 101)
    with pytest.raises(PayloadTooLarge):
        build(payload="é" * 51)  # 51 characters, 102 bytes


@pytest.mark.parametrize(
    ("headers", "rule"),
    [
        ({1: "x"}, "names must be non-empty strings"),
        ({"": "x"}, "names must be non-empty strings"),
        ({"a b": "x"}, "must not contain"),
        ({"a:b": "x"}, "must not contain"),
        ({"trace": 1}, "must be a string"),
        ({"trace": b"x"}, "must be a string"),
        ({"trace": "a\r\nInjected: 1"}, "line breaks"),
        ({"Nats-Msg-Id": "x"}, "reserves"),
        (["a", "b"], "mapping"),
    ],
)
def test_bad_headers(headers: object, rule: str) -> None:
    with pytest.raises(InvalidHeaders, match=rule) as err:
        build(headers=headers)
    assert err.value.field == "headers"


@pytest.mark.parametrize("key", ["", 5, "k" * 256, "a\nb"])
def test_bad_key(key: object) -> None:
    with pytest.raises(InvalidKey) as err:
        build(key=key)
    assert err.value.field == "key"


@pytest.mark.parametrize("tags", ["", [], ["a", ""], ["a,b"], ["a b"], [1], 7])
def test_bad_tags(tags: object) -> None:
    with pytest.raises(InvalidTags) as err:
        build(tags=tags)
    assert err.value.field == "tags"


def test_tags_and_key_are_kept() -> None:
    msg = build(tags=["inbound", "eu"], key="sku-1")
    assert (msg.tags, msg.key) == ("inbound,eu", "sku-1")
    assert build(tags="inbound").tags == "inbound"


def test_errors_are_value_errors_with_field_and_rule() -> None:
    err = InvalidMessage("topic", "must be a non-empty string")
    assert isinstance(err, ValueError)
    assert str(err) == "topic: must be a non-empty string"


def test_uuid7_layout_and_order() -> None:
    ids = [uuid7() for _ in range(10_000)]
    assert all(u.version == 7 and u.variant == uuid.RFC_4122 for u in ids)
    assert ids == sorted(ids, key=lambda u: u.int), "ids from one process must increase"
    assert len(set(ids)) == len(ids)


def test_uuid7_unique_across_threads() -> None:
    seen: list[uuid.UUID] = []
    lock = threading.Lock()

    def make() -> None:
        local = [uuid7() for _ in range(2_000)]
        with lock:
            seen.extend(local)

    threads = [threading.Thread(target=make) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(seen)) == 16_000
