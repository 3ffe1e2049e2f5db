"""The check service's bookkeeping: removeMap and the op consume offset."""

from __future__ import annotations

from relay.halfop.coordinator import build_remove_map, next_op_offset


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
