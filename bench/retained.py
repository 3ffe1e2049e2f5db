"""Retained-ledger benchmark: the outbox with N sent rows kept, plain and partitioned (issue 40).

Run with `python -m bench.retained --sizes 10000000,50000000 --layouts plain,partitioned`
(figures: bench/results/retained.md). Each layout and size: two fresh PostgreSQL schemas,
an empty table and one with N sent rows spread over the 3 UTC days before today (UUIDv7
msg_ids of their time, ~200-byte payloads, written 1M per statement); partitioned:
`partitions.convert` on the empty table, then a partition per seeded day. VACUUM
ANALYZE, then, in this order:
  1. heap and index sizes (summed over the partitions);
  2. `outbox status` wall time, CLI start included (median of 3 processes);
  3. `outbox drain` of 20,000 fresh pending rows into a local nats-server (msg/s);
  4. app transactions/s with send() (one message each) from 4 threads, relay running;
  5. commit->ack p50/p99 at a moderate offered rate, relay running;
  6. `outbox purge` with a retention that expires exactly the oldest day (after a VACUUM,
     so the dead tuples counted after it are the purge's own), a one-row sender beside
     it (the longest it waited);
  7. `partitions.convert` of the plain table that is left (up to --convert-max rows).
Each measure runs on the empty table, then at once on the full one, so that a ratio
compares two figures taken under the same load (the machine is shared). Ratios to the
empty table are printed next to issue 40's targets at 10M rows. Both schemas are dropped
before the next size; the run stops when free disk falls under --min-free-gb.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, create_engine, text

from bench.fast_path import business, paced, pct, receive, settle, stock, throughput
from bench.report import print_rows
from bench.sweeper import OUTBOX, drain_with_workers
from outbox import Outbox, migrate, partitions
from relay.brokers.nats import create_stream
from relay.testing import scratch_schema
from relay.testing.embedded import NatsServer

PG = os.environ.get("OUTBOX_BENCH_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
STREAM, SUBJECTS = "BENCH", "bench.>"
DAYS = 3
MARGIN_MIN = 10  # no seeded row in a day's first or last 10 minutes: the purge's cutoff
SEED_BATCH = 1_000_000
DRAIN_ROWS = 20_000
GB = 1024**3
# A UUIDv7 of ``ts`` (its milliseconds first), the rest from md5: the day partition's range.
UUID7 = "(lpad(to_hex((extract(epoch FROM {ts}) * 1000)::bigint), 12, '0') || '7' || substr(md5({salt}), 1, 19))::uuid"  # noqa: E501
PAYLOAD = (
    "convert_to('{{\"sku\": \"SKU-' || lpad((g % 100)::text, 3, '0') || '\", \"n\": ' || g || "
    "', \"note\": \"' || repeat('x', 150) || '\"}}', 'UTF8')"
)
SEED = f"""
    INSERT INTO outbox_message
        (msg_id, topic, key, payload, status, attempts, created_at, sent_at, receipt)
    SELECT {UUID7.format(ts="t.ts", salt="g::text")}, 'bench.inbound',
           'SKU-' || lpad((g % 100)::text, 3, '0'), {PAYLOAD.format()}, 'sent', 1,
           t.ts, t.ts + interval '3 ms', 'BENCH:' || g
    FROM generate_series(CAST(:lo AS bigint), CAST(:hi AS bigint)) AS g,
         LATERAL (SELECT CAST(:first AS timestamptz)
                         + ((g - 1) / :per_day) * interval '1 day'
                         + interval '{MARGIN_MIN} minutes'
                         + ((g - 1) % :per_day) * :step * interval '1 ms' AS ts) AS t"""
PENDING = f"""
    INSERT INTO outbox_message (msg_id, topic, key, payload, created_at)
    SELECT {UUID7.format(ts="now() - interval '1 minute'", salt="'drain' || g")}, 'bench.drain',
           'SKU-' || lpad((g % 100)::text, 3, '0'), {PAYLOAD.format()},
           now() - interval '1 minute'
    FROM generate_series(1, :rows) AS g"""
PROBE = f"""
    INSERT INTO outbox_message (msg_id, topic, payload)
    VALUES ({UUID7.format(ts="now()", salt="gen_random_uuid()::text")}, 'bench.probe', '\\x7b7d')"""
TODAY = "SELECT count(*) FROM outbox_message WHERE created_at >= :today AND status = 'sent'"
# The table and its partitions (a plain table: itself alone).
RELATIONS = """
    SELECT to_regclass('outbox_message') AS oid
    UNION ALL SELECT inhrelid FROM pg_inherits WHERE inhparent = to_regclass('outbox_message')"""
SIZES = f"""
    SELECT coalesce(sum(pg_table_size(oid)), 0), coalesce(sum(pg_indexes_size(oid)), 0)
    FROM ({RELATIONS}) r"""
DEAD = f"""
    SELECT coalesce(sum(n_dead_tup), 0) FROM pg_stat_user_tables
    WHERE relid IN ({RELATIONS})"""


@dataclass
class Result:
    layout: str
    rows: int
    seed_s: float = 0.0
    heap: int = 0
    indexes: int = 0
    status_s: float = 0.0
    drain_wall: float = 0.0
    drain_steady: float = 0.0
    tx_s: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    reached: float = 0.0
    purge_s: float = 0.0
    purged: int = 0
    dropped: int = 0
    dead: int = 0
    convert_s: float | None = None
    converted: int = 0
    revision: str | None = None
    send_dead: int = 0  # dead tuples the measures' sends left (before the purge's VACUUM)
    sent_today: int = 0  # the messages those measures sent
    purge_wait_ms: float = 0.0  # the longest a one-row send waited while the purge ran
    empty: Result | None = None  # the empty table measured beside this one
    beside: int = 0  # an empty table's: the rows of the one it was measured beside


def log(message: str) -> None:
    print(f"[{datetime.now(UTC):%H:%M:%S}] {message}", file=sys.stderr, flush=True)


def free_gb() -> float:
    return shutil.disk_usage("/").free / GB


def check_disk(least_gb: float) -> None:
    if free_gb() < least_gb:
        raise SystemExit(f"stopped: {free_gb():.1f} GB free on /, under {least_gb:g} GB")


def first_day() -> datetime:
    """Midnight UTC of the oldest seeded day (DAYS days before today)."""
    today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    return today - timedelta(days=DAYS)


def lay_out(engine: Engine, layout: str) -> None:
    """The empty table in ``layout``; partitioned: a partition for each seeded day too."""
    if layout == "partitioned":
        partitions.convert(engine)
        partitions.ensure(engine, since=first_day().date())


def seed(engine: Engine, rows: int, least_gb: float) -> float:
    """``rows`` sent rows over the DAYS days before today, SEED_BATCH per statement."""
    per_day = max(1, -(-rows // DAYS))
    step = (24 * 60 - 2 * MARGIN_MIN) * 60_000 / per_day  # ms between rows of a day
    started = time.monotonic()
    for lo in range(1, rows + 1, SEED_BATCH):
        check_disk(least_gb)
        hi = min(rows, lo + SEED_BATCH - 1)
        with engine.begin() as conn:
            conn.execute(
                text(SEED),
                {"lo": lo, "hi": hi, "first": first_day(), "per_day": per_day, "step": step},
            )
        log(f"seeded {hi:,} / {rows:,} rows ({time.monotonic() - started:.0f} s)")
    return time.monotonic() - started


def vacuum(engine: Engine, analyze: bool) -> None:
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f"VACUUM {'ANALYZE ' if analyze else ''}outbox_message"))


def sizes(engine: Engine) -> tuple[int, int]:
    with engine.connect() as conn:
        heap, indexes = conn.execute(text(SIZES)).one()
    return int(heap), int(indexes)


def status_times(dbs: list[str]) -> list[float]:
    """Wall seconds of an `outbox status` process on each of ``dbs``, the median of three,
    the databases taken in turn."""
    times: list[list[float]] = [[] for _ in dbs]
    for _ in range(3):
        for db, took in zip(dbs, times, strict=True):
            started = time.monotonic()
            subprocess.run([OUTBOX, "status", "--db", db], check=True, capture_output=True)
            took.append(time.monotonic() - started)
    return [statistics.median(took) for took in times]


def drain(engine: Engine, db: str, broker: str, result: Result) -> None:
    with engine.begin() as conn:
        conn.execute(text(PENDING), {"rows": DRAIN_ROWS})
    rate = drain_with_workers(db, broker, 1, 2)
    result.drain_wall, result.drain_steady = rate.wall, rate.steady


def app_figures(engine: Engine, url: str, args: argparse.Namespace, result: Result) -> None:
    """Send tx/s at full speed, then commit->ack latencies at ``args.rate``, relay running."""
    business.create_all(engine)
    with engine.begin() as conn:
        conn.execute(stock.insert(), [{"sku": f"SKU-{i:03d}", "qty": 0} for i in range(100)])
    options: dict[str, Any] = {"verify_commit": True, "sweeper": False}
    ob = Outbox(engine, broker=url, **options)
    ob.start()
    result.tx_s, _ = throughput(receive(ob, with_send=True), args.threads, args.seconds)
    ob.stop()
    ob = Outbox(engine, broker=url, **options)
    ob.start()
    result.reached = paced(args.threads, args.rate, args.seconds, receive(ob, with_send=True))
    settle(ob, int(args.rate * args.seconds))
    stats = ob.stats
    ob.stop()
    assert stats is not None
    latencies = list(stats.latencies)
    result.p50_ms, result.p99_ms = pct(latencies, 50), pct(latencies, 99)


def dead_tuples(engine: Engine) -> int:
    with engine.connect() as conn:
        conn.execute(text("SELECT pg_stat_clear_snapshot()"))
        return int(conn.execute(text(DEAD)).scalar_one())


def purge(engine: Engine, db: str, result: Result) -> None:
    """`outbox purge` with a retention ending a minute into the second seeded day: the
    oldest day expires, nothing else seeded does. Dead tuples: after a VACUUM, so the
    count read when the process has ended (its stats flushed) is the purge's. The dead
    tuples before that VACUUM are the measures' own: today's sends, each marked sent."""
    result.send_dead = dead_tuples(engine)
    with engine.connect() as conn:
        result.sent_today = conn.execute(
            text(TODAY), {"today": first_day() + timedelta(DAYS)}
        ).scalar_one()
    vacuum(engine, analyze=False)
    before = dead_tuples(engine)
    with engine.connect() as conn:
        now: datetime = conn.execute(text("SELECT now()")).scalar_one()
    cutoff = first_day() + timedelta(days=1, minutes=1)
    retention_s = (now - cutoff).total_seconds()
    stop = threading.Event()
    waits: list[float] = []
    prober = threading.Thread(target=probe, args=(engine, stop, waits))
    prober.start()
    started = time.monotonic()
    try:
        out = subprocess.run(
            [OUTBOX, "purge", "--db", db, "--retention-s", f"{retention_s:.3f}", "--json"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    finally:
        result.purge_s = time.monotonic() - started
        stop.set()
        prober.join()
    result.purge_wait_ms = max(waits, default=0.0) * 1000
    result.dead = dead_tuples(engine) - before
    done = json.loads(out)
    result.purged, result.dropped = int(done["purged"]), len(done["partitions_dropped"])
    log(f"purge: {out.strip()}; dead tuples {before:,} before, +{result.dead:,} after")


def probe(engine: Engine, stop: threading.Event, waits: list[float]) -> None:
    """A sender beside the purge: one-row transactions every 50 ms until ``stop``, each
    timed (a purge that locks the table makes them wait)."""
    while not stop.is_set():
        started = time.monotonic()
        with engine.begin() as conn:
            conn.execute(text(PROBE))
        waits.append(time.monotonic() - started)
        stop.wait(0.05)


def convert(engine: Engine, result: Result) -> None:
    """`partitions.convert` of the plain table left after the purge (it copies every row)."""
    started = time.monotonic()
    done = partitions.convert(engine)
    result.convert_s, result.converted = time.monotonic() - started, done.moved + done.copied


def prepare(db: str, layout: str, rows: int, args: argparse.Namespace) -> tuple[Engine, Result]:
    """A schema in ``layout`` with ``rows`` sent rows, vacuumed and analyzed, its sizes."""
    result = Result(layout, rows)
    engine = create_engine(db, pool_size=args.threads + 2)
    migrate.upgrade(engine)
    result.revision = migrate.current_revision(engine)
    lay_out(engine, layout)
    result.seed_s = seed(engine, rows, args.min_free_gb)
    vacuum(engine, analyze=True)
    result.heap, result.indexes = sizes(engine)
    log(f"{layout} {rows:,}: heap {result.heap / GB:.2f} GB, indexes {result.indexes / GB:.2f} GB")
    return engine, result


def measure(layout: str, rows: int, broker: str, args: argparse.Namespace) -> tuple[Result, Result]:
    """The empty table and the one with ``rows``, side by side: each measure runs on the
    empty one, then at once on the full one, so both see the machine's load of the moment."""
    with scratch_schema(PG, "bench") as empty_db, scratch_schema(PG, "bench") as db:
        empty_engine, empty = prepare(empty_db, layout, 0, args)
        engine, full = prepare(db, layout, rows, args)
        full.empty, empty.beside = empty, rows
        pairs = ((empty_engine, empty_db, empty), (engine, db, full))
        for result, seconds in zip((empty, full), status_times([empty_db, db]), strict=True):
            result.status_s = seconds
        log(f"status {empty.status_s:.2f} / {full.status_s:.2f} s")
        for e, d, r in pairs:
            drain(e, d, broker, r)
        log(f"drain {empty.drain_steady:,.0f} / {full.drain_steady:,.0f} msg/s steady")
        for e, _, r in pairs:
            app_figures(e, broker, args, r)
        log(
            f"send {empty.tx_s:,.0f} / {full.tx_s:,.0f} tx/s; "
            f"p99 {empty.p99_ms:.2f} / {full.p99_ms:.2f} ms"
        )
        check_disk(args.min_free_gb)
        for e, d, r in pairs:
            purge(e, d, r)
        if layout == "plain" and rows <= args.convert_max:
            convert(engine, full)
            log(f"convert: {full.converted:,} rows in {full.convert_s:.1f} s")
        empty_engine.dispose()
        engine.dispose()
    return empty, full


def ratio(value: float, empty: float) -> str:
    return f"{value / empty:.2f}x" if empty else "-"


def verdict(result: Result, ok: bool) -> str:
    """A target holds at 10M rows; other sizes are shown, not judged."""
    if result.rows != 10_000_000:
        return ""
    return "met" if ok else "NOT met"


def tables(results: list[Result]) -> None:
    runs = [r for r in results if r.rows]

    def base(r: Result) -> Result:
        return r.empty or r

    def name(r: Result) -> str:
        return f"{r.layout} 0 (beside {r.beside:,})" if r.beside else f"{r.layout} {r.rows:,}"

    rows: list[tuple[str, ...]] = [("layout, rows", "seconds", "x empty", "<= 1.5x at 10M")]
    for r in results:
        x = r.status_s / base(r).status_s if base(r).status_s else 0
        rows.append(
            (
                name(r),
                f"{r.status_s:.2f}",
                ratio(r.status_s, base(r).status_s),
                verdict(r, x <= 1.5),
            )
        )
    print_rows("`outbox status` wall time, CLI start included (median of 3 processes)", rows)

    rows = [("layout, rows", "msg/s", "steady msg/s", "x empty", ">= 0.9x at 10M")]
    for r in results:
        e = base(r).drain_steady
        rows.append(
            (
                name(r),
                f"{r.drain_wall:,.0f}",
                f"{r.drain_steady:,.0f}",
                ratio(r.drain_steady, e),
                verdict(r, bool(e) and r.drain_steady / e >= 0.9),
            )
        )
    print_rows(
        f"`outbox drain` of {DRAIN_ROWS:,} fresh pending rows (concurrency 2) into nats-server",
        rows,
    )

    rows = [("layout, rows", "tx/s", "x empty", ">= 0.9x at 10M")]
    for r in results:
        e = base(r).tx_s
        rows.append(
            (name(r), f"{r.tx_s:,.0f}", ratio(r.tx_s, e), verdict(r, bool(e) and r.tx_s / e >= 0.9))
        )
    print_rows("app transactions/s with send() (one message each), 4 threads, relay running", rows)

    rows = [
        ("layout, rows", "reached msg/s", "p50 ms", "p99 ms", "x empty (p99)", "<= 1.3x at 10M")
    ]
    for r in results:
        e = base(r).p99_ms
        rows.append(
            (
                name(r),
                f"{r.reached:,.0f}",
                f"{r.p50_ms:.2f}",
                f"{r.p99_ms:.2f}",
                ratio(r.p99_ms, e),
                verdict(r, bool(e) and r.p99_ms / e <= 1.3),
            )
        )
    print_rows("commit->ack latency at a moderate offered rate, relay running", rows)

    rows = [
        (
            "layout, rows",
            "removed",
            "seconds",
            "days dropped",
            "dead tuples",
            "% of removed",
            "< 1 %",
            "send waited ms",
        )
    ]
    for r in runs:
        share = r.dead / r.purged * 100 if r.purged else 0.0
        rows.append(
            (
                name(r),
                f"{r.purged:,}",
                f"{r.purge_s:.1f}",
                f"{r.dropped}",
                f"{r.dead:,}",
                f"{share:.2f} %",
                verdict(r, share < 1),
                f"{r.purge_wait_ms:,.0f}",
            )
        )
    print_rows(
        "`outbox purge` of the oldest of 3 days (the dead tuples it leaves, read right after; "
        "the longest a one-row send beside it waited)",
        rows,
    )

    rows = [("layout, rows", "heap GB", "indexes GB", "total GB", "B/row", "seeded in s")]
    for r in results:
        total = r.heap + r.indexes
        per_row = f"{total / r.rows:.0f}" if r.rows else "-"
        rows.append(
            (
                name(r),
                f"{r.heap / GB:.2f}",
                f"{r.indexes / GB:.2f}",
                f"{total / GB:.2f}",
                per_row,
                f"{r.seed_s:.0f}",
            )
        )
    print_rows(
        "table and index sizes after VACUUM ANALYZE (heap incl. TOAST/FSM/VM; every partition)",
        rows,
    )

    rows = [("layout, rows", "messages sent", "dead tuples", "per message")]
    for r in results:
        rows.append(
            (
                name(r),
                f"{r.sent_today:,}",
                f"{r.send_dead:,}",
                f"{r.send_dead / max(1, r.sent_today):.2f}",
            )
        )
    print_rows(
        "dead tuples the measures' own sends left before the purge (a send: insert, mark sent)",
        rows,
    )

    converted = [r for r in runs if r.convert_s is not None]
    if converted:
        rows = [("layout, rows", "rows copied", "seconds", "rows/s")]
        for r in converted:
            assert r.convert_s is not None
            rows.append(
                (
                    name(r),
                    f"{r.converted:,}",
                    f"{r.convert_s:.1f}",
                    f"{r.converted / r.convert_s:,.0f}",
                )
            )
        print_rows(
            "partitions.convert of the plain table left after the purge (copies every row)", rows
        )


def main() -> None:
    parser = argparse.ArgumentParser(description="the outbox with a retained ledger")
    parser.add_argument("--sizes", default="200000", help="sent rows kept, comma-separated")
    parser.add_argument("--layouts", default="plain,partitioned", help="plain, partitioned")
    parser.add_argument("--seconds", type=float, default=10, help="length of the app phases")
    parser.add_argument("--threads", type=int, default=4, help="app threads")
    parser.add_argument("--rate", type=float, default=200, help="offered msg/s (latency)")
    parser.add_argument(
        "--convert-max",
        type=int,
        default=10_000_000,
        help="largest plain table to convert (0: none)",
    )
    parser.add_argument("--min-free-gb", type=float, default=15, help="stop under this free disk")
    args = parser.parse_args()
    # Each size is measured beside an empty table of its own: a 0 in the list is that one.
    sizes_asked = sorted({int(size) for size in args.sizes.split(",")} - {0})
    if not sizes_asked:
        parser.error("--sizes: give at least one size above 0")
    layouts = args.layouts.split(",")
    results: list[Result] = []
    with NatsServer() as server:
        create_stream(server.url, STREAM, SUBJECTS)
        broker = f"{server.url}?stream={STREAM}&subjects={SUBJECTS}&timeout=5"
        for layout in layouts:
            for rows in sizes_asked:
                log(f"{layout} {rows:,}: start ({free_gb():.0f} GB free)")
                results += measure(layout, rows, broker, args)
    print(
        f"retained ledger: PostgreSQL, {os.cpu_count()} CPUs shared by app, PostgreSQL and "
        f"nats-server; {args.threads} app threads, {args.seconds:g} s per app phase, "
        f"{args.rate:g} msg/s offered for latency; sent rows over the {DAYS} days before today; "
        f"schema revision {', '.join(sorted({str(r.revision) for r in results}))}"
    )
    tables(results)


if __name__ == "__main__":
    main()
