"""Which messages of model B's op stream name a real half (relay.lab.halfop.oplog), and how
long a settlement's record surely lives (relay.lab.halfop.coordinator)."""

from __future__ import annotations

from typing import Any

import pytest
from nats.aio.msg import Msg

from relay.lab.halfop.coordinator import TAGS_HEADER, record_ttl
from relay.lab.halfop.oplog import Op, no_real_half, op_of
from relay.lab.halfop.protocol import OP_TAG


def stored(body: bytes, **headers: str) -> Msg:
    """A message as a batched direct get hands it over: sequence 7, tagged unless told."""
    fields = {"Nats-Sequence": "7", TAGS_HEADER: OP_TAG, **headers}
    client: Any = None
    return Msg(client, data=body, headers={k: v for k, v in fields.items() if v})


def test_an_op_names_the_half_its_body_gives() -> None:
    op = op_of(stored(b"42"), TAGS_HEADER, OP_TAG)
    assert (op.offset, op.half, op.problem) == (7, 42, "")
    assert no_real_half(op, last_half=42) == ""


@pytest.mark.parametrize(
    ("body", "tag", "why"),
    [
        (b"42", "", "not an op"),
        (b"42", "x", "not an op"),
        (b"", OP_TAG, "is no half offset"),
        (b"-1", OP_TAG, "is no half offset"),
        (b"+1", OP_TAG, "is no half offset"),
        (b" 1", OP_TAG, "is no half offset"),
        (b"1_0", OP_TAG, "is no half offset"),
        ("\u0661".encode(), OP_TAG, "is no half offset"),  # a Unicode digit
        (b"9" * 5000, OP_TAG, "is no half offset"),  # past int()'s 4,300 digits
        (b"0", OP_TAG, "below 1"),
        (b"99999999999999999999", OP_TAG, "past the half stream's last, 1000"),
        (b"1001", OP_TAG, "past the half stream's last, 1000"),
    ],
)
def test_a_message_that_cannot_name_a_real_half_says_why(body: bytes, tag: str, why: str) -> None:
    op = op_of(stored(body, **{TAGS_HEADER: tag}), TAGS_HEADER, OP_TAG)
    assert why in no_real_half(op, last_half=1000)


def test_a_half_below_the_half_offset_is_real_if_walked_past() -> None:
    """Ops of halfs already walked past are done, not skipped (fill_remove_map)."""
    assert no_real_half(Op(3, 1, 0.0), last_half=1000) == ""


@pytest.mark.parametrize(
    ("setting", "bucket", "lives"),
    [(3600.0, 3600.0, 3600.0), (3600.0, 60.0, 60.0), (60.0, 3600.0, 60.0), (60.0, 0.0, 60.0)],
)
def test_a_record_lives_the_shorter_of_the_setting_and_the_buckets_ttl(
    setting: float, bucket: float, lives: float
) -> None:
    assert record_ttl(setting, bucket) == lives
    assert record_ttl(setting, None) == setting
