"""The rules send() applies before writing: each bad input names its field and rule."""

from __future__ import annotations

import json
import os
import threading
import uuid
from dataclasses import replace

import pytest

from outbox import tracing
from outbox.api import with_trace_context
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
from outbox.message import (
    MAX_HEADER_BYTES,
    Message,
    build_message,
    carried_headers,
    encode_payload,
    encoded_size,
    headers_bound,
    headers_size,
    recheck,
    uuid7,
    uuid7_text,
)


def build(topic: object = "orders.created", payload: object = b"x", **kw: object):  # type: ignore[no-untyped-def]
    return build_message(topic, payload, max_payload_bytes=kw.pop("max_payload_bytes", 1000), **kw)  # type: ignore[arg-type]


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
        ("é" * 128, "at most 255 bytes in UTF-8, got 256"),  # 128 characters
        ("orders\u00a0created", "spaces"),
        ("orders\u200bcreated", "unprintable"),
        ("orders.\ud800", "unprintable"),
        ("$JS.API.STREAM.DELETE.ORDERS", "reserves"),
        ("$SYS.REQ.SERVER.PING", "reserves"),
        ("$KV.bucket.key", "reserves"),
        ("_INBOX.abc", "reserves"),
        ("_inbox", "reserves"),
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


def test_topic_of_255_bytes_is_accepted() -> None:
    assert build("é" * 127 + "x").topic == "é" * 127 + "x"
    assert build("a.$b._INBOX").topic == "a.$b._INBOX", "only the first token is reserved"


def nested(depth: int) -> list[object]:
    value: list[object] = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("payload", [nested(100_000), "a\udc80b", {"k": "\ud83d"}, ["\udfff"]])
def test_payload_that_cannot_be_encoded_is_refused(payload: object) -> None:
    with pytest.raises(InvalidPayload) as err:
        build(payload=payload)
    assert err.value.field == "payload"


def test_size_limit_counts_payload_and_every_header_as_sent() -> None:
    msg = build(payload=b"x" * 10, key="k", tags=["a"], headers={"h": "é"})
    wire = {"h": "é", "Outbox-Key": "k", "Outbox-Tags": "a", "Nats-Msg-Id": msg.msg_id}
    block = b"NATS/1.0\r\n" + b"".join(f"{k}: {v}\r\n".encode() for k, v in wire.items())
    assert encoded_size(msg) == 10 + len(block + b"\r\n")
    exact = encoded_size(msg)
    kwargs: dict[str, object] = {"key": "k", "tags": ["a"], "headers": {"h": "é"}}
    assert build(payload=b"x" * 10, max_payload_bytes=exact, **kwargs).payload == b"x" * 10
    rule = f"at most {exact - 1} bytes once encoded, got {exact}"
    with pytest.raises(PayloadTooLarge, match=rule):
        build(payload=b"x" * 10, max_payload_bytes=exact - 1, **kwargs)


def test_an_ordered_message_carries_its_seq_and_counts_the_widest_before_it_has_one() -> None:
    unordered = build(payload=b"x" * 10, key="k")
    ordered = build(payload=b"x" * 10, key="k", ordered=True)
    widest = len("Outbox-Seq: 9223372036854775807\r\n")
    assert encoded_size(ordered) == encoded_size(unordered) + widest
    numbered = replace(ordered, seq=12)
    assert carried_headers(numbered)["Outbox-Seq"] == "12"
    assert encoded_size(numbered) == encoded_size(unordered) + len("Outbox-Seq: 12\r\n")
    with pytest.raises(PayloadTooLarge):
        build(payload=b"x" * 10, key="k", ordered=True, max_payload_bytes=encoded_size(unordered))


def test_headers_alone_can_exceed_the_limit() -> None:
    with pytest.raises(PayloadTooLarge) as err:
        build(payload=b"", headers={"big": "v" * 2000})
    assert err.value.field == "payload"


def test_headers_are_capped_at_what_jetstream_takes() -> None:
    """JetStream refuses a header block over 65,535 bytes (error 10097); RabbitMQ closes the
    connection on a header frame over frame_max, 128 KiB (FRAME_ERROR)."""
    big = 2 * 1024 * 1024
    fits = build(headers={"h": "v" * 60_000}, max_payload_bytes=big)
    assert len(fits.headers["h"]) == 60_000
    with pytest.raises(InvalidHeaders, match=f"at most {MAX_HEADER_BYTES} bytes in all"):
        build(headers={"h": "v" * MAX_HEADER_BYTES}, max_payload_bytes=big)
    with pytest.raises(InvalidHeaders, match=f"at most {MAX_HEADER_BYTES} bytes in all"):
        build(headers={f"h{i}": "v" * 1000 for i in range(70)}, max_payload_bytes=big)


def test_content_type_fits_amqps_short_string() -> None:
    assert build(headers={"Content-Type": "t" * 255}).headers["Content-Type"] == "t" * 255
    with pytest.raises(InvalidHeaders, match="at most 255 bytes"):
        build(headers={"content-type": "é" * 128})


def test_payload_limit_counts_encoded_bytes() -> None:
    plain = encoded_size(build(payload=b""))
    with pytest.raises(PayloadTooLarge):
        build(payload="é" * 51, max_payload_bytes=plain + 100)  # 51 characters, 102 bytes
    assert build(payload="é" * 50, max_payload_bytes=plain + 200).payload == "é".encode() * 50


@pytest.mark.parametrize(
    ("headers", "rule"),
    [
        ({1: "x"}, "names must be non-empty strings"),
        ({"": "x"}, "names must be non-empty strings"),
        ({"a b": "x"}, "HTTP token"),
        ({"a:b": "x"}, "HTTP token"),
        ({"a/b": "x"}, "HTTP token"),
        ({"é": "x"}, "HTTP token"),
        ({"h" * 256: "x"}, "1 to 255"),
        ({"trace": "  v  "}, "whitespace"),
        ({"trace": "v\t"}, "control"),
        ({"trace": "a\x00b"}, "control"),
        ({"trace": "a\ud800b"}, "surrogates"),
        ({"Trace": "1", "trace": "2"}, "twice"),
        ({"CC": "other.queue"}, "reserved"),
        ({"bcc": "other.queue"}, "reserved"),
        ({"Outbox-Key": "x"}, "reserved"),
        ({"trace": 1}, "must be a string"),
        ({"trace": b"x"}, "must be a string"),
        ({"trace": "a\r\nInjected: 1"}, "control"),
        ({"Nats-Msg-Id": "x"}, "reserved"),
        ({"nats-rollup": "all"}, "reserved"),
        (["a", "b"], "mapping"),
    ],
)
def test_bad_headers(headers: object, rule: str) -> None:
    with pytest.raises(InvalidHeaders, match=rule) as err:
        build(headers=headers)
    assert err.value.field == "headers"


def test_header_values_keep_inner_spaces_and_any_text() -> None:
    headers = {"a": "x  y", "b": "", "c": "żółw 🐢", "d": "=?utf-8?b?aGk=?=", "e": "a\u00a0b"}
    assert {k: v for k, v in build(headers=headers).headers.items()} == headers


@pytest.mark.parametrize("key", ["", 5, "k" * 256, "é" * 128, "a\nb", " k", "k ", "\udc00"])
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


@pytest.mark.parametrize("text", ["a", "\u00e9\u00e9", "\u4e2d\u6587", "\U0001f600x", "k" * 200])
@pytest.mark.parametrize("ordered", [False, True])
def test_the_size_checks_shortcut_never_passes_what_the_exact_rule_refuses(
    text: str, ordered: bool
) -> None:
    # check_size skips encoding the headers when 4 bytes a character fit: that count is
    # never below the exact one, so the verdict at every limit is the exact rule's.
    message = build(key=text if ordered else None, ordered=ordered, tags=[text],
                    headers={"X-Text": text})  # fmt: skip
    assert headers_bound(message) >= headers_size(message)
    exact = encoded_size(message)
    build(key=text if ordered else None, ordered=ordered, tags=[text], headers={"X-Text": text},
          max_payload_bytes=exact)  # fmt: skip
    with pytest.raises(PayloadTooLarge):
        build(key=text if ordered else None, ordered=ordered, tags=[text],
              headers={"X-Text": text}, max_payload_bytes=exact - 1)  # fmt: skip


def test_uuid7_text_is_the_canonical_text_of_a_uuid7() -> None:
    ids = [uuid7_text() for _ in range(5_000)]
    assert all(str(uuid.UUID(t)) == t and uuid.UUID(t).version == 7 for t in ids)
    assert ids == sorted(ids) and len(set(ids)) == len(ids)


def test_a_forked_child_never_reuses_the_parents_random_bits() -> None:
    uuid7()  # the parent's pool of random bytes is filled, most of it unused
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next id, then out without pytest's teardown
        os.write(write, uuid7_text().encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 64).decode()
    os.close(read)
    os.waitpid(pid, 0)
    # From the parent's pool, the child's next id would end in the parent's next bits.
    assert child[-12:] != uuid7_text()[-12:]


def stored(**fields: object) -> Message:
    good: dict[str, object] = {
        "msg_id": str(uuid7()), "topic": "t.a", "payload": b"x", "key": None, "tags": None,
        "headers": {},
    }  # fmt: skip
    return Message(**{**good, **fields})  # type: ignore[arg-type]


def test_recheck_passes_what_send_builds() -> None:
    msg = build(payload={"a": 1}, key="k", tags=["x", "y"], headers={"h": "v"})
    recheck(msg)
    recheck(msg, max_payload_bytes=encoded_size(msg))


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"msg_id": "nope"}, InvalidMessage),
        ({"msg_id": None}, InvalidMessage),
        ({"msg_id": "urn:uuid:0190a0e4-0000-7000-8000-000000000000"}, InvalidMessage),
        ({"msg_id": "0190A0E4-0000-7000-8000-000000000000"}, InvalidMessage),
        ({"topic": "$JS.API.STREAM.DELETE.X"}, InvalidTopic),
        ({"topic": 7}, InvalidTopic),
        ({"key": " k"}, InvalidKey),
        ({"key": 3}, InvalidKey),
        ({"tags": "a,,b"}, InvalidTags),
        ({"tags": ["a"]}, InvalidTags),
        ({"tags": 5}, InvalidTags),
        ({"headers": [["a", "b"]]}, InvalidHeaders),
        ({"headers": {"a": None}}, InvalidHeaders),
        ({"headers": {"a": 1}}, InvalidHeaders),
        ({"headers": {"a": {"b": "c"}}}, InvalidHeaders),
        ({"headers": {"Nats-Rollup": "all"}}, InvalidHeaders),
        ({"headers": None}, None),
        ({"headers": 5}, InvalidHeaders),
        ({"payload": "text"}, InvalidPayload),
        ({"payload": None}, InvalidPayload),
    ],
)
def test_recheck_refuses_rows_that_break_the_contract(
    fields: dict[str, object], error: type[InvalidMessage] | None
) -> None:
    if error is None:
        recheck(stored(**fields))
        return
    with pytest.raises(error):
        recheck(stored(**fields))


def test_recheck_checks_the_size_when_given_a_limit() -> None:
    msg = stored(payload=b"x" * 2000)
    recheck(msg)
    with pytest.raises(PayloadTooLarge):
        recheck(msg, max_payload_bytes=2000)
    recheck(stored(headers=None), max_payload_bytes=2000)  # a JSON null: no headers


def test_recheck_refuses_what_is_not_a_message() -> None:
    with pytest.raises(InvalidMessage):
        recheck({"topic": "t.a"})


def test_trace_context_yields_to_the_callers_header_of_any_case(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    context = {"traceparent": "00-1-2-01", "tracestate": "a=1"}
    monkeypatch.setattr(tracing, "context_headers", lambda: dict(context))
    assert with_trace_context(None) == context
    mine = {"TraceParent": "00-9-9-01"}
    merged = with_trace_context(mine)
    assert merged == {"tracestate": "a=1", "TraceParent": "00-9-9-01"}
    assert build(headers=merged).headers == merged


class Hostile:
    def __repr__(self) -> str:
        raise RuntimeError("repr")

    def __str__(self) -> str:
        raise RuntimeError("str")


@pytest.mark.parametrize(
    "override",
    [{"tags": [Hostile()]}, {"headers": {"h": Hostile()}}, {"headers": {Hostile(): "v"}}],
)
def test_errors_name_even_a_value_whose_repr_raises(override: dict[str, object]) -> None:
    with pytest.raises(InvalidMessage, match="Hostile"):
        build(**override)


def test_errors_show_a_long_value_cut_short() -> None:
    with pytest.raises(InvalidTopic) as err:
        build("a " * 100)
    assert len(str(err.value)) < 200
