"""Whatever an app hands to send(): a msg_id for a row stored byte for byte, or an
OutboxError with the transaction still usable. And recheck() holds stored rows to the
same contract, raising nothing but InvalidMessage."""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import event, given
from hypothesis import strategies as st
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from outbox import Outbox, outbox_message
from outbox.errors import ConfigError, InvalidMessage, OutboxError
from outbox.message import Message, build_message, encoded_size, recheck
from outbox.rows import message_of
from outbox.settings import Settings
from tests.property import strategies as s

anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.complex_numbers(),
    st.binary(max_size=16),
    st.builds(bytearray, st.binary(max_size=8)),
    st.builds(object),
    st.tuples(s.wild_text),
    st.sets(st.integers(), max_size=3),
    st.lists(st.one_of(s.wild_text, st.integers(), st.none()), max_size=3),
    st.dictionaries(
        st.one_of(s.wild_text, st.integers()), st.one_of(s.wild_text, st.integers(), st.none())
    ),
    s.json_values,
    s.typed_or_refused_values,
)


def stored(engine: Engine, msg_id: str) -> Message:
    query = select(outbox_message).where(outbox_message.c.msg_id == uuid.UUID(msg_id))
    with engine.connect() as conn:
        return message_of(conn.execute(query).one())


def assert_stored_as_given(row: Message, topic: str, payload: object, **kw: Any) -> None:
    """The row holds exactly what send() was given (the relay reads it back like this)."""
    built = build_message(topic, payload, **kw, max_payload_bytes=2**30)  # same encoding
    assert (row.topic, row.key, row.tags, row.payload) == (
        built.topic, built.key, built.tags, built.payload,
    )  # fmt: skip
    assert row.headers == built.headers
    if isinstance(payload, bytes | str):
        assert row.payload == (payload if isinstance(payload, bytes) else payload.encode())
    elif not isinstance(payload, bytearray | memoryview):
        assert row.payload == s.reference_json(payload), "the encoding docs/input.md gives"
    recheck(row, max_payload_bytes=Settings().max_payload_bytes)  # the relay's check agrees


@s.PROPERTY
@given(
    topic=s.mostly(s.topic_part, anything),
    payload=s.mostly(s.payloads, anything),
    key=s.mostly(s.keys, anything),
    tags=s.mostly(s.tags, anything),
    headers=s.mostly(s.headers, anything),
)
def test_send_gives_a_msg_id_or_an_outbox_error(
    sqlite_engine: Engine, topic: Any, payload: Any, key: Any, tags: Any, headers: Any
) -> None:
    ob = Outbox(sqlite_engine)
    with Session(sqlite_engine) as session, session.begin():
        try:
            msg_id: str | None = ob.send(
                session, topic, payload, key=key, tags=tags, headers=headers
            )
        except OutboxError as exc:
            event(f"refused: {type(exc).__name__}")
            msg_id = None
        after = ob.send(session, "after.refusal", b"ok")  # the transaction is still usable
    assert stored(sqlite_engine, after).payload == b"ok"
    if msg_id is not None:
        event("accepted")
        kw = {"key": key, "tags": tags, "headers": headers}
        assert_stored_as_given(stored(sqlite_engine, msg_id), topic, payload, **kw)


@s.PROPERTY
@given(topic=s.topic_part, payload=s.payloads, key=s.keys, tags=s.tags, headers=s.headers)
def test_what_send_accepts_is_stored_byte_for_byte(
    any_engine: Engine, topic: str, payload: object, key: Any, tags: Any, headers: Any
) -> None:
    """PostgreSQL, MariaDB and SQLite columns hold every accepted value unchanged."""
    ob = Outbox(any_engine)
    try:
        with Session(any_engine) as session, session.begin():
            msg_id = ob.send(session, topic, payload, key=key, tags=tags, headers=headers)
    except InvalidMessage as exc:
        event(f"refused: {type(exc).__name__}")
        return
    event("accepted")
    kw = {"key": key, "tags": tags, "headers": headers}
    assert_stored_as_given(stored(any_engine, msg_id), topic, payload, **kw)


uuids = st.uuids().map(str)


@s.PROPERTY
@given(
    msg_id=s.mostly(uuids, anything),
    topic=s.mostly(s.topic_part, anything),
    payload=s.mostly(st.binary(max_size=64), anything),
    key=s.mostly(s.keys, anything),
    tags=s.mostly(st.none() | st.lists(s.clean_text, min_size=1).map(",".join), s.text, anything),
    headers=s.mostly(
        st.dictionaries(s.header_names, s.mostly(s.header_values, anything), max_size=4),
        anything,
    ),
)
def test_recheck_raises_only_invalid_message_and_agrees_with_send(
    msg_id: Any, topic: Any, payload: Any, key: Any, tags: Any, headers: Any
) -> None:
    """A stored row (planted by hand, or by an older version) is judged like send()'s input."""
    row = Message(msg_id, topic, payload, key, tags, headers)
    try:
        recheck(row, max_payload_bytes=4096)
    except InvalidMessage as exc:
        event(f"refused: {type(exc).__name__}")
        return
    event("accepted")
    split_tags = tags.split(",") if tags is not None else None
    built = build_message(
        topic, payload, key=key, tags=split_tags, headers=headers, max_payload_bytes=4096
    )
    assert (built.topic, built.key, built.tags, built.headers, built.payload) == (
        topic, key, tags, headers or {}, payload,
    )  # fmt: skip
    assert encoded_size(built) == encoded_size(replace(row, headers=built.headers))


@s.PROPERTY
@given(session=anything)
def test_send_refuses_what_is_not_a_session(sqlite_engine: Engine, session: Any) -> None:
    with pytest.raises(ConfigError, match="session: must be a "):
        Outbox(sqlite_engine).send(session, "t.a", b"x")
