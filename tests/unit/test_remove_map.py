"""The check service's bookkeeping: removeMap and the op consume offset."""

from __future__ import annotations

from relay.coordinator import build_remove_map, next_op_offset


def test_ops_out_of_order_and_in_batches() -> None:
    # op offset -> half offset; ops arrive in a different order than their halfs
    first_batch = [(1, 12), (2, 10), (3, 15)]
    second_batch = [(4, 11), (5, 9), (6, 14)]
    remove, done = build_remove_map([*first_batch, *second_batch], half_offset=10)
    assert remove == {12: 1, 10: 2, 15: 3, 11: 4, 14: 6}
    assert done == [5], "the op of half 9 concerns a half already walked past"


def test_batches_give_the_same_map_as_one_pass() -> None:
    ops = [(i, 100 - i) for i in range(1, 70)]
    whole = build_remove_map(ops, half_offset=50)
    chunks = [ops[i : i + 32] for i in range(0, len(ops), 32)]
    merged: dict[int, int] = {}
    done: list[int] = []
    for chunk in chunks:
        part, part_done = build_remove_map(chunk, half_offset=50)
        merged.update(part)
        done += part_done
    assert (merged, done) == whole


def test_op_offset_advances_only_over_a_contiguous_done_run() -> None:
    assert next_op_offset(1, [1, 2, 3, 5]) == 4
    assert next_op_offset(1, [2, 3]) == 1, "op 1 is not done yet: nothing may be skipped"
    assert next_op_offset(7, []) == 7
