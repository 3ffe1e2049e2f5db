"""Lanes: the fast path's ordered deliveries, one lane per (topic, key), in seq order.

A lane has one *head*, the delivery being checked, published or waiting in the time
wheel, and the deliveries *waiting* behind it, lowest seq first. Only the head moves:
the next one becomes the head when the broker acked the head (``acked``), never
before, so a key's messages reach the broker one at a time, in seq order. A lane is
there while it holds something; the last ack, or giving the head up (``drop``, with
everything behind it), removes it.

``Lanes`` also remembers, for the keys acked most recently (``remembered`` of them), the
last seq this process got an ack for: a head whose predecessor is that one needs no
look at the table. A dropped key is forgotten: the sweeper takes it over.

Only the broker loop touches a ``Lanes``; ``waiting`` is read from any thread (metrics).

``OrderedLanes`` is the dispatcher's ordering policy over them: what goes now, what
waits, what leaves with a head that leaves.
"""

from __future__ import annotations

import collections
import heapq
import itertools
from typing import Generic, Protocol, TypeVar

from outbox.message import Message
from relay.fastpath.delivery import Delivery, Look

ACKED_KEYS = 100_000  # keys whose last acked seq is remembered, most recently acked first

LaneKey = tuple[str, str]  # (topic, key)


class Ordered(Protocol):
    message: Message


D = TypeVar("D", bound=Ordered)


def lane_key(message: Message) -> LaneKey:
    return message.topic, message.key or ""


class Lane(Generic[D]):
    __slots__ = ("behind", "head")

    def __init__(self, head: D) -> None:
        self.head = head
        self.behind: list[tuple[int, int, D]] = []  # a heap of (seq, arrival, delivery)


class Lanes(Generic[D]):
    def __init__(self, remembered: int = ACKED_KEYS) -> None:
        self.remembered = remembered
        self._lanes: dict[LaneKey, Lane[D]] = {}
        self._acked: collections.OrderedDict[LaneKey, int] = collections.OrderedDict()
        self._arrivals = itertools.count()  # breaks ties between equal seqs (a resubmit)
        self.waiting = 0  # deliveries behind a head, in all lanes

    def __len__(self) -> int:
        return len(self._lanes)

    def arrive(self, delivery: D) -> bool:
        """Take an ordered delivery: True when it is its lane's head now (publish it),
        False when it waits behind the head."""
        key = lane_key(delivery.message)
        lane = self._lanes.get(key)
        if lane is None:
            self._lanes[key] = Lane(delivery)
            return True
        self._push(lane, delivery)
        return False

    def ahead(self, message: Message) -> tuple[D | None, int]:
        """The head of ``message``'s lane and how many wait behind it (None, 0: no lane)."""
        lane = self._lanes.get(lane_key(message))
        return (None, 0) if lane is None else (lane.head, len(lane.behind))

    def acked(self, delivery: D) -> D | None:
        """The broker acked ``delivery``, its lane's head: remember its seq; returns the
        lane's new head, or None when the lane is empty (and gone)."""
        key = lane_key(delivery.message)
        seq = delivery.message.seq
        assert seq is not None
        self._acked[key] = seq
        self._acked.move_to_end(key)
        if len(self._acked) > self.remembered:
            self._acked.popitem(last=False)
        lane = self._lanes.get(key)
        if lane is None or lane.head is not delivery:  # dropped meanwhile (stop)
            return None
        if not lane.behind:
            del self._lanes[key]
            return None
        lane.head = self._pop(lane)
        return lane.head

    def yield_to_lower(self, delivery: D) -> D | None:
        """``delivery``, a head that must wait for its key, steps back if a lower seq of
        its lane arrived after it (commits handed over out of order): returns the new
        head, which goes first, or None when ``delivery`` stays the head."""
        lane = self._lanes.get(lane_key(delivery.message))
        seq = delivery.message.seq
        if lane is None or lane.head is not delivery or not lane.behind or seq is None:
            return None
        if lane.behind[0][0] >= seq:
            return None
        lane.head = self._pop(lane)
        self._push(lane, delivery)
        return lane.head

    def drop(self, delivery: D) -> list[D]:
        """``delivery``, its lane's head, leaves the fast path: the lane goes, and with it
        the memory of its key; returns the deliveries that waited behind it."""
        key = lane_key(delivery.message)
        self._acked.pop(key, None)
        lane = self._lanes.get(key)
        if lane is None or lane.head is not delivery:
            return []
        del self._lanes[key]
        self.waiting -= len(lane.behind)
        return [d for _, _, d in sorted(lane.behind)]

    def clear(self) -> list[D]:
        """Remove every lane; returns the deliveries waiting behind the heads (at stop:
        the heads are wherever the fast path put them)."""
        behind = [d for lane in self._lanes.values() for _, _, d in lane.behind]
        self._lanes.clear()
        self._acked.clear()
        self.waiting = 0
        return behind

    def follows_ack(self, message: Message) -> bool:
        """True when this process got the ack for ``message``'s predecessor (or it has
        none): its turn is certain without a look at the table."""
        seq = message.seq
        return seq is None or seq <= 1 or self._acked.get(lane_key(message)) == seq - 1

    def last_acked(self, topic: str, key: str) -> int | None:
        return self._acked.get((topic, key))

    def remembered_keys(self) -> int:
        return len(self._acked)

    def _push(self, lane: Lane[D], delivery: D) -> None:
        seq = delivery.message.seq
        assert seq is not None
        heapq.heappush(lane.behind, (seq, next(self._arrivals), delivery))
        self.waiting += 1

    def _pop(self, lane: Lane[D]) -> D:
        self.waiting -= 1
        return heapq.heappop(lane.behind)[2]


class OrderedLanes:
    """The fast path's ordering policy, called at a few named points of the dispatcher.

    Unordered deliveries pass it untouched; an ordered one goes through its key's lane
    (``Lanes``). ``admit`` says what may be published now; ``acked`` gives the key's next
    head once its head is acked; ``leave`` lets a head go with its followers;
    ``step_back`` lets a waiting head yield to a lower seq; ``retrying`` marks a failed
    head for a new look at the table. A head whose turn the table must confirm carries
    ``Look.TURN`` (``heads``: there is a table to ask; ``verify``: retries re-read the row).
    """

    def __init__(self, remembered: int, heads: bool, verify: bool) -> None:
        self.lanes: Lanes[Delivery] = Lanes(remembered)
        self._heads = heads
        self._verify = verify

    @property
    def waiting(self) -> int:
        return self.lanes.waiting

    def admit(
        self, deliveries: list[Delivery], ready: collections.deque[Delivery], limit: int
    ) -> list[Delivery]:
        """Put on ``ready`` what may be published now (unordered ones, new heads); the
        others wait in their lane, or are returned: their key takes no more into memory
        (``limit``: how many may wait behind a head)."""
        held_back: list[Delivery] = []
        for delivery in deliveries:
            if delivery.message.seq is None:
                ready.append(delivery)
            elif self._full(delivery, limit):
                held_back.append(delivery)
            elif self.lanes.arrive(delivery):  # its lane's head: its turn may come now
                ready.append(self._turn(delivery))
        return held_back

    def acked(self, delivery: Delivery) -> Delivery | None:
        """``delivery`` was acked: its lane's next head, if any, may go now."""
        if delivery.message.seq is None:
            return None
        head = self.lanes.acked(delivery)
        return None if head is None else self._turn(head)

    def leave(self, delivery: Delivery) -> list[Delivery]:
        """``delivery`` leaves the fast path: if it heads a lane, its followers go too."""
        if delivery.message.seq is None:
            return []
        return self.lanes.drop(delivery)

    def step_back(self, delivery: Delivery) -> Delivery | None:
        """``delivery``, a head that must wait for its key, yields to a lower seq of its
        lane that arrived after it: returns that one, which goes first (None: it stays)."""
        lower = self.lanes.yield_to_lower(delivery)
        return None if lower is None else self._turn(lower)

    def retrying(self, delivery: Delivery) -> None:
        """An operator may skip a failing ordered head (`outbox skip`): its retry looks
        whether the row is still pending, or its key's next could overtake it."""
        if delivery.message.seq is not None and self._verify:
            delivery.look |= Look.COMMIT

    def clear(self) -> list[Delivery]:
        """Every lane gone (at stop); returns the deliveries that waited behind heads."""
        return self.lanes.clear()

    def _full(self, delivery: Delivery, limit: int) -> bool:
        """Whether ``delivery``'s key takes no more into memory: its head's publish failed
        (it retries from the time wheel), or its head waits for another process's row and
        ``limit`` wait behind it already. A key that does not move must not fill the
        slots every other key and unordered message share; one that moves takes what comes."""
        head, waiting = self.lanes.ahead(delivery.message)
        if head is None:
            return False
        return head.attempt > 0 or (head.waits > 0 and waiting >= limit)

    def _turn(self, delivery: Delivery) -> Delivery:
        """``delivery`` became its lane's head: look at the table unless its predecessor
        was acked by this process."""
        if self._heads and not self.lanes.follows_ack(delivery.message):
            delivery.look |= Look.TURN
        else:
            delivery.look &= ~Look.TURN
        return delivery
