"""The check service's bookkeeping: removeMap, isNeedCheck, the op consume offset, and
the end request's match with its half."""

from __future__ import annotations

import pytest

from outbox.errors import ConfigError
from relay.lab.halfop.coordinator import CoordinatorSettings, end_refusal
from relay.lab.halfop.oplog import (
    Op,
    build_remove_map,
    fill_remove_map,
    missing_offsets,
    need_check,
    next_op_offset,
)


def test_ops_out_of_order_and_in_batches() -> None:
    # op offset -> half offset; ops arrive in a different order than their halfs
    first_batch = [(1, 12), (2, 10), (3, 15)]
    second_batch = [(4, 11), (5, 9), (6, 14)]
    remove, done = build_remove_map([*first_batch, *second_batch], half_offset=10)
    assert remove == {12: [1], 10: [2], 15: [3], 11: [4], 14: [6]}
    assert done == [5], "the op of half 9 concerns a half already walked past"


def test_batches_give_the_same_map_as_one_pass() -> None:
    ops = [(i, 100 - i) for i in range(1, 70)]
    whole = build_remove_map(ops, half_offset=50)
    chunks = [ops[i : i + 32] for i in range(0, len(ops), 32)]
    merged: dict[int, list[int]] = {}
    done: list[int] = []
    for chunk in chunks:
        part, part_done = build_remove_map(chunk, half_offset=50)
        for half, op_offsets in part.items():
            merged.setdefault(half, []).extend(op_offsets)
        done += part_done
    assert (merged, done) == whole


def test_op_offset_advances_only_over_a_contiguous_done_run() -> None:
    assert next_op_offset(1, [1, 2, 3, 5]) == 4
    assert next_op_offset(1, [2, 3]) == 1, "op 1 is not done yet: nothing may be skipped"
    assert next_op_offset(7, []) == 7


def test_two_ops_for_one_half_are_both_consumed() -> None:
    """An end request and a check answer may both settle a half: both ops must count."""
    remove, done = build_remove_map([(1, 5), (2, 5)], half_offset=5)
    assert remove == {5: [1, 2]}
    done += remove.pop(5)  # the walk passes half 5
    assert next_op_offset(1, done) == 3, "a stuck op offset would re-read every op forever"


def test_pulls_add_to_one_map_and_messages_that_are_no_op_count_done() -> None:
    remove: dict[int, list[int]] = {}
    done: list[int] = []
    fill_remove_map(remove, done, [Op(1, 10, 0.0), Op(2, None, 0.0)], half_offset=10)
    fill_remove_map(remove, done, [Op(3, 10, 0.0), Op(4, 9, 0.0)], half_offset=10)
    assert remove == {10: [1, 3]}
    assert done == [2, 4], "a message that names no half must not hold the op offset back"


NOW = 1_000_000.0


def test_need_check_when_the_op_stream_is_exhausted_and_the_half_is_old_enough() -> None:
    old = dict(age_s=10.0, immunity_s=6.0, round_started=NOW, timeout_s=6.0)
    assert need_check(last_op_born=None, **old)
    assert not need_check(last_op_born=None, **{**old, "age_s": 6.0})


def test_no_check_while_later_ops_may_still_hold_the_halfs_op() -> None:
    """The last pulled op was born before round start + timeout: pull more first."""
    args = dict(age_s=10.0, immunity_s=6.0, round_started=NOW, timeout_s=6.0)
    assert not need_check(last_op_born=NOW - 30, **args)
    assert not need_check(last_op_born=NOW + 6.0, **args)
    assert need_check(last_op_born=NOW + 6.5, **args), "ops born after the timeout: ask"


def test_a_half_born_in_the_future_is_checked() -> None:
    assert need_check(
        last_op_born=NOW - 30, age_s=-5.0, immunity_s=6.0, round_started=NOW, timeout_s=6.0
    )


HALF = {"PGROUP": "orders", "__transactionId__": "t1", "UNIQ_KEY": "m1"}


@pytest.mark.parametrize(
    ("half", "group", "tid", "mid", "why"),
    [
        (HALF, "orders", "t1", "m1", None),
        (None, "orders", "t1", "m1", "no half at this offset"),
        (HALF, "other", "t1", "m1", "producer group does not match"),
        (HALF, "orders", "t2", "m1", "transaction id does not match"),
        (HALF, "orders", "t1", "m2", "msg id does not match"),
    ],
)
def test_an_end_request_must_match_its_half(
    half: dict[str, str] | None, group: str, tid: str, mid: str, why: str | None
) -> None:
    assert end_refusal(half, group, tid, mid) == why


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_round_s", 0.0), ("check_interval_s", -1.0), ("half_read_retries", -1), ("check_max", 0)],
)
def test_settings_refuse_bad_values_naming_the_field(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=field):
        CoordinatorSettings(**{field: value})


def test_round_limit_and_half_retries_default_to_rocketmqs() -> None:
    settings = CoordinatorSettings()
    assert (settings.max_round_s, settings.half_read_retries) == (60.0, 1)


def test_op_offsets_the_stream_no_longer_holds_count_as_done() -> None:
    ops = [Op(12, 3, 0.0), Op(14, 4, 0.0), Op(15, None, 0.0)]
    assert missing_offsets(10, ops) == [10, 11, 13]
    assert missing_offsets(10, []) == []
    done = [*missing_offsets(10, ops), 12, 14, 15]
    assert next_op_offset(10, done) == 16, "the op offset moves past a deleted op"
