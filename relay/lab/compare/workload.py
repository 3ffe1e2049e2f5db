"""What `outbox compare` offers both models: the ``Workload`` (rates, faults, poison) and
a tiny business, placing an order.

``place_order`` is the local transaction a ``SqlTransactionListener`` runs; an order
with ``fail`` set is rejected and rolls back.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Column, Integer, MetaData, String, Table
from sqlalchemy.orm import Session

FAULTS = {
    "kill": ("a", "b"),
    "broker-down": ("a", "b"),
    "drop": ("a", "b"),
    "db-kill": ("a",),
    "pause": ("a",),
    "drop-ends": ("b",),
}
# With the raised limit, passes send() but exceeds nats-server's 1 MiB max_payload.
POISON = b"x" * (1024 * 1024)


@dataclass(frozen=True)
class Workload:
    transactions: int = 2000
    concurrency: int = 4
    rollback_rate: float = 0.1
    poison_rate: float = 0.0
    payload_size: int = 200
    rate: float = 200.0  # transactions per second offered, all threads together
    faults: tuple[str, ...] = ()
    fault_s: float = 3.0
    seed: int = 7
    retry_times_when_send_failed: int = 2  # model B's producer (RocketMQ's default)

    def __post_init__(self) -> None:
        unknown = [f for f in self.faults if f not in FAULTS]
        if unknown:
            raise ValueError(f"faults: unknown {unknown}; known: {sorted(FAULTS)}")
        if self.transactions < 1 or self.concurrency < 1 or self.rate <= 0:
            raise ValueError("transactions, concurrency and rate must be positive")
        for name in ("rollback_rate", "poison_rate"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1)")

    def payload(self, i: int) -> bytes:
        if self.poisoned(i):
            return POISON
        return (f'{{"order":{i},"pad":"' + "x" * self.payload_size + '"}').encode()

    def rolls_back(self, i: int) -> bool:
        return random.Random(f"{self.seed}/rollback/{i}").random() < self.rollback_rate

    def poisoned(self, i: int) -> bool:
        return random.Random(f"{self.seed}/poison/{i}").random() < self.poison_rate


business = MetaData()
orders = Table(
    "hop_orders", business, Column("id", Integer, primary_key=True), Column("sku", String(20))
)


def place_order(session: Session, msg: object, arg: Any) -> None:
    session.execute(orders.insert().values(sku=arg["sku"]))
    if arg.get("fail"):
        raise ValueError("rejected")
