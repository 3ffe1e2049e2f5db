"""How the NATS adapter reads an ack: the outcomes nats-py's js.publish gave."""

from __future__ import annotations

import json

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from outbox.broker import Outcome
from relay.brokers.nats import ack_result


def reply(data: bytes, headers: dict[str, str] | None = None) -> Msg:
    return Msg(Client(), subject="_INBOX.x.1", data=data, headers=headers)


def error(code: int) -> bytes:
    return json.dumps({"error": {"code": code, "err_code": 10060, "description": "no"}}).encode()


def test_an_ack_gives_the_receipt_and_the_duplicate_flag() -> None:
    first = ack_result(reply(b'{"stream":"S","seq":7}'), "t.a")
    again = ack_result(reply(b'{"stream":"S","seq":7,"duplicate":true}'), "t.a")
    assert (first.outcome, first.receipt, first.duplicate) == (Outcome.OK, "S:7", False)
    assert (again.outcome, again.receipt, again.duplicate) == (Outcome.OK, "S:7", True)


def test_no_responders_is_permanent() -> None:
    result = ack_result(reply(b"", {"Status": "503"}), "t.a")
    assert result.outcome is Outcome.PERMANENT
    assert result.error == "no JetStream stream captures subject 't.a'"


@pytest.mark.parametrize(
    ("code", "outcome", "name"),
    [
        (400, Outcome.PERMANENT, "BadRequestError"),
        (503, Outcome.RETRY, "ServiceUnavailableError"),
        (500, Outcome.RETRY, "ServerError"),
        (404, Outcome.RETRY, "NotFoundError"),
        (409, Outcome.RETRY, "APIError"),
    ],
)
def test_an_api_error_is_permanent_only_if_400(code: int, outcome: Outcome, name: str) -> None:
    result = ack_result(reply(error(code)), "t.a")
    assert result.outcome is outcome
    assert result.error == (f"{name}: nats: {name}: code={code} err_code=10060 description='no'")


@pytest.mark.parametrize("data", [b"", b"not json", b'{"seq":1}', b"\xff"])
def test_a_reply_that_is_no_ack_is_permanent(data: bytes) -> None:
    assert ack_result(reply(data), "t.a").outcome is Outcome.PERMANENT


@pytest.mark.parametrize(
    ("key", "tags", "headers"),
    [
        (None, None, {}),
        ("k", "a,b", {"h": "é", "content-type": "text/plain"}),
        ("ключ", None, {"x": "😀 v"}),
    ],
)
def test_sends_size_rule_counts_the_nats_header_block_exactly(
    key: str | None, tags: str | None, headers: dict[str, str]
) -> None:
    """outbox.message measures by the figures of the block this adapter builds."""
    from outbox.message import Message, encoded_size, uuid7
    from relay.brokers.nats import header_size, sent_headers

    message = Message(str(uuid7()), "t.a", b"payload", key, tags, headers)
    assert encoded_size(message) == len(message.payload) + header_size(sent_headers(message))
