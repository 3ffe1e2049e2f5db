"""Scheduled delivery benchmark: 100,000 messages with delays spread over 30-60 s through
an in-process relay (its scheduler), beside unscheduled ones through the fast path in the
same run (PostgreSQL + nats-server on loopback).

Run with `python -m bench.delayed`. Per workload:
  - lateness: JetStream's stored time of each message (the server's clock, before its
    ack) minus its row's due time by the database clock: ``deliver_at`` for scheduled
    messages, ``created_at`` (the INSERT) for unscheduled ones, the baseline. Both
    servers run on this host (one kernel clock); the database's offset from the wall
    clock is measured and printed;
  - database statements per message, counted by a ``before_cursor_execute`` listener on
    the engine: the send side (the app threads) and the relay side (its threads).
The messages are sent with ``Outbox.send(..., delay=...)`` (deliver_at = the database's
now + the delay), 100 per transaction, through the app's own relay (``Outbox.start()``,
without the sweeper duty). Target (issue #25): p99 < 100 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import threading
import time
from collections import Counter
from datetime import datetime
from typing import Any

from sqlalchemy import Engine, create_engine, event, select
from sqlalchemy.orm import Session

from bench.fast_path import bench_schema, paced, pct, verdict
from bench.report import print_rows
from outbox import Outbox, migrate, outbox_message
from relay import store
from relay.brokers.nats import read_stream
from relay.testing.embedded import NatsServer

t = outbox_message
STREAM = "BENCH"


class Statements:
    """Statements run on ``engine``, by side: the relay's threads (all named ``outbox-...``)
    or the app's (send)."""

    def __init__(self, engine: Engine) -> None:
        self.counts: Counter[str] = Counter()
        self.lock = threading.Lock()
        event.listen(engine, "before_cursor_execute", self._count)

    def _count(self, *_: Any) -> None:
        side = "relay" if threading.current_thread().name.startswith("outbox-") else "send"
        with self.lock:
            self.counts[side] += 1

    def take(self) -> Counter[str]:
        with self.lock:
            counts, self.counts = self.counts, Counter()
        return counts


def scheduled_tx(ob: Outbox, topic: str, delays: list[float]) -> None:
    """One transaction of ``send(delay=...)``, one message per delay."""
    with Session(ob.engine) as session, session.begin():
        for delay in delays:
            ob.send(session, topic, {"d": delay}, delay=delay)


def unscheduled_tx(ob: Outbox, topic: str) -> None:
    with Session(ob.engine) as session, session.begin():
        ob.send(session, topic, {})


def due_by_db(engine: Engine, scheduled: bool) -> dict[str, datetime]:
    column = t.c.deliver_at if scheduled else t.c.created_at
    condition = t.c.deliver_at.is_not(None) if scheduled else t.c.deliver_at.is_(None)
    with engine.connect() as conn:
        return {str(m): at for m, at in conn.execute(select(t.c.msg_id, column).where(condition))}


def db_offset_ms(engine: Engine) -> float:
    """The database clock minus this host's wall clock (midpoint of the least round trip)."""
    best = (float("inf"), 0.0)
    with engine.connect() as conn:
        for _ in range(50):
            before = time.time()
            now = store.db_clock(conn).timestamp()
            after = time.time()
            best = min(best, (after - before, now - (before + after) / 2))
    return best[1] * 1000


def lateness_s(arrived: dict[str, datetime], due: dict[str, datetime]) -> list[float]:
    return [(arrived[m] - at).total_seconds() for m, at in due.items() if m in arrived]


def wait_sent(engine: Engine, expected: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with engine.connect() as conn:
        while time.monotonic() < deadline:
            sent = conn.execute(select(store.count_if(t.c.status == "sent"))).scalar_one()
            conn.rollback()
            if sent >= expected:
                return
            time.sleep(0.5)
    raise RuntimeError(f"only {sent} of {expected} sent within {timeout} s")


def main() -> None:
    parser = argparse.ArgumentParser(description="scheduled delivery benchmark")
    parser.add_argument("--messages", type=int, default=100_000, help="scheduled messages")
    parser.add_argument("--min-delay", type=float, default=30.0)
    parser.add_argument("--max-delay", type=float, default=60.0)
    parser.add_argument("--per-tx", type=int, default=100, help="scheduled messages per commit")
    parser.add_argument("--baseline", type=int, default=10_000, help="unscheduled messages")
    parser.add_argument("--rate", type=float, default=1000, help="unscheduled msg/s (paced)")
    args = parser.parse_args()
    rng = random.Random(25)
    with NatsServer() as server, bench_schema() as db:
        migrate.upgrade(db)
        engine = create_engine(db, pool_size=8)
        counted = Statements(engine)
        ob = Outbox(engine, f"{server.url}?stream={STREAM}&subjects=bench.>", sweeper=False)
        ob.start()
        assert ob.relay is not None and ob.relay.wait_connected(30)
        counted.take()

        def one_unscheduled(_: int) -> None:
            unscheduled_tx(ob, "bench.now")

        paced(4, args.rate, args.baseline / args.rate, one_unscheduled)
        wait_sent(engine, args.baseline, 120)
        baseline_counts = counted.take()
        started = time.monotonic()
        for first in range(0, args.messages, args.per_tx):
            n = min(args.per_tx, args.messages - first)
            scheduled_tx(ob, "bench.later", [rng.uniform(args.min_delay, args.max_delay)
                                             for _ in range(n)])  # fmt: skip
        send_s = time.monotonic() - started
        wait_sent(engine, args.baseline + args.messages, args.max_delay + 300)
        scheduled_counts = counted.take()
        ob.stop(10)
        offset = db_offset_ms(engine)
        due_now, due_later = due_by_db(engine, False), due_by_db(engine, True)
        engine.dispose()
        stored = asyncio.run(read_stream(server.url, STREAM))
    arrived = {m.msg_id: m.time for m in stored if m.msg_id and m.time}
    rows = [("workload", "messages", "p50 ms", "p99 ms", "max ms", "stmts/msg send",
             "stmts/msg relay", "target")]  # fmt: skip
    for name, due, counts in (
        ("unscheduled (fast path): arrival - INSERT", due_now, baseline_counts),
        ("scheduled (scheduler): arrival - deliver_at", due_later, scheduled_counts),
    ):
        late = lateness_s(arrived, due)
        target = verdict(pct(late, 99) < 100, "p99 < 100 ms") if due is due_later else ""
        rows.append((
            name, f"{len(late):,}", f"{pct(late, 50):.1f}", f"{pct(late, 99):.1f}",
            f"{max(late) * 1000:.1f}", f"{counts['send'] / len(due):.2f}",
            f"{counts['relay'] / len(due):.2f}", target,
        ))  # fmt: skip
    early = sum(1 for v in lateness_s(arrived, due_later) if v * 1000 + offset < 0)
    print_rows(
        f"scheduled delivery: {args.messages:,} messages due {args.min_delay:.0f}-"
        f"{args.max_delay:.0f} s after send ({args.per_tx} per commit, sent in {send_s:.1f} s), "
        f"{args.baseline:,} unscheduled at {args.rate:.0f}/s; {os.cpu_count()} CPUs shared by "
        f"app, PostgreSQL and NATS; database clock - wall clock {offset:+.3f} ms; "
        f"early: {early}",
        rows,
    )


if __name__ == "__main__":
    main()
