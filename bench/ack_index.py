"""What migration 0006's index on sent rows costs the relay's ack batch (PostgreSQL).

`python -m bench.ack_index [--rows 100000] [--batch 200] [--rounds 2]` fills a scratch
schema at revision 0005 (the baseline: no index on sent rows) and one at head with
pending rows, then marks them sent ``--batch`` at a time, one transaction each, as the
relay's ack batcher does, and prints each schema's time per batch and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

from sqlalchemy import create_engine, text

from bench.fast_path import bench_schema, pct
from bench.report import print_rows
from outbox import migrate

FILL = """INSERT INTO outbox_message (msg_id, topic, payload)
SELECT gen_random_uuid(), 't', '\\x00'::bytea FROM generate_series(1, :n)"""
ACK = """UPDATE outbox_message SET status = 'sent', sent_at = now(), receipt = 'r'
WHERE id >= :lo AND id < :hi AND status = 'pending'"""


def ack_times(revision: str, rows: int, batch: int) -> list[float]:
    """Seconds per ack batch on a schema at ``revision``."""
    with bench_schema() as url:
        migrate.upgrade(url, revision)
        engine = create_engine(url)
        with engine.begin() as conn:
            conn.execute(text(FILL), {"n": rows})
            conn.execute(text("ANALYZE outbox_message"))
        times = []
        for lo in range(1, rows + 1, batch):
            start = time.perf_counter()
            with engine.begin() as conn:
                conn.execute(text(ACK), {"lo": lo, "hi": lo + batch})
            times.append(time.perf_counter() - start)
        engine.dispose()
        return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2, help="each schema this many times")
    args = parser.parse_args()
    found: dict[str, list[float]] = {"0005": [], "head": []}
    for _ in range(args.rounds):  # interleaved, so a drift in load hits both
        for revision, times in found.items():
            times.extend(ack_times(revision, args.rows, args.batch))
    base = statistics.median(found["0005"])
    rows = [["schema", "p50 ms", "p99 ms", "vs 0005"]]
    for revision, times in found.items():
        p50 = statistics.median(times)
        rows.append([revision, f"{p50 * 1000:.2f}", f"{pct(times, 99):.2f}", f"{p50 / base:.2f}x"])
    print_rows(f"ack batches of {args.batch} over {args.rows:,} rows, {args.rounds} rounds", rows)


if __name__ == "__main__":
    main()
