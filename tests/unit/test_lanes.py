"""relay.fastpath.lanes alone: one head per (topic, key), the rest behind it in seq order."""

from __future__ import annotations

from dataclasses import dataclass, replace

from outbox.message import Message, build_message
from relay.fastpath.lanes import Lanes


@dataclass
class D:
    message: Message


def ordered(key: str, seq: int, topic: str = "t.x") -> D:
    message = build_message(topic, b"x", key=key, ordered=True, max_payload_bytes=1000)
    return D(replace(message, seq=seq))


def test_the_first_of_a_key_is_its_head_and_the_rest_wait_in_seq_order() -> None:
    lanes: Lanes[D] = Lanes()
    one, two, three = ordered("a", 1), ordered("a", 2), ordered("a", 3)
    assert lanes.arrive(one)
    assert not lanes.arrive(three) and not lanes.arrive(two)
    assert lanes.waiting == 2
    assert lanes.acked(one) is two
    assert lanes.acked(two) is three
    assert lanes.acked(three) is None
    assert len(lanes) == 0 and lanes.waiting == 0
    assert lanes.last_acked("t.x", "a") == 3


def test_keys_and_topics_have_lanes_of_their_own() -> None:
    lanes: Lanes[D] = Lanes()
    assert lanes.arrive(ordered("a", 1))
    assert lanes.arrive(ordered("b", 1))
    assert lanes.arrive(ordered("a", 1, topic="t.y"))
    assert len(lanes) == 3


def test_a_lane_follows_its_own_acks_only() -> None:
    lanes: Lanes[D] = Lanes()
    first, fifth = ordered("a", 1), ordered("a", 5)
    assert lanes.follows_ack(first.message)  # no predecessor
    assert not lanes.follows_ack(fifth.message)
    lanes.arrive(first)
    lanes.acked(first)
    assert lanes.follows_ack(ordered("a", 2).message)
    assert not lanes.follows_ack(ordered("a", 3).message)


def test_a_waiting_head_steps_back_for_a_lower_seq_that_came_later() -> None:
    lanes: Lanes[D] = Lanes()
    six, five, seven = ordered("a", 6), ordered("a", 5), ordered("a", 7)
    lanes.arrive(six)
    assert lanes.yield_to_lower(six) is None  # nothing lower behind it
    lanes.arrive(seven)
    assert lanes.yield_to_lower(six) is None
    lanes.arrive(five)
    assert lanes.yield_to_lower(six) is five
    assert lanes.acked(five) is six
    assert lanes.acked(six) is seven


def test_dropping_a_head_takes_its_followers_and_forgets_the_key() -> None:
    lanes: Lanes[D] = Lanes()
    one, two, three, four = (ordered("a", s) for s in (1, 2, 3, 4))
    lanes.arrive(one)
    lanes.arrive(two)
    lanes.acked(one)
    lanes.arrive(four)
    lanes.arrive(three)
    assert lanes.drop(three) == []  # not the head: nothing to drop
    assert lanes.drop(two) == [three, four]
    assert len(lanes) == 0 and lanes.waiting == 0
    assert lanes.last_acked("t.x", "a") is None
    assert lanes.acked(two) is None  # a late ack of a dropped head changes no lane


def test_clear_returns_what_waits_behind_the_heads() -> None:
    lanes: Lanes[D] = Lanes()
    heads = [ordered(k, 1) for k in "abc"]
    behind = [ordered(k, 2) for k in "ab"]
    for d in [*heads, *behind]:
        lanes.arrive(d)
    assert sorted(map(id, lanes.clear())) == sorted(map(id, behind))
    assert len(lanes) == 0 and lanes.waiting == 0 and lanes.remembered_keys() == 0


def test_the_memory_of_acks_keeps_the_most_recently_acked_keys() -> None:
    lanes: Lanes[D] = Lanes(remembered=3)
    for key in "abcde":
        d = ordered(key, 1)
        lanes.arrive(d)
        lanes.acked(d)
    assert lanes.remembered_keys() == 3
    assert [lanes.last_acked("t.x", k) for k in "abcde"] == [None, None, 1, 1, 1]
    again = ordered("c", 2)
    lanes.arrive(again)
    lanes.acked(again)  # c is the most recent now: f pushes d out, not c
    f = ordered("f", 1)
    lanes.arrive(f)
    lanes.acked(f)
    assert [lanes.last_acked("t.x", k) for k in "cdef"] == [2, None, 1, 1]
