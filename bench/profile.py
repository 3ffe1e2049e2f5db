"""Where the fast path's time goes: a workload to run under py-spy, and a summary of its
collapsed stacks per thread (share of samples per function, self and inclusive).

    py-spy record --threads --idle -r 250 -f raw -o /tmp/fast.txt -- \\
        python -m bench.profile run --rate 1000 --seconds 10
    python -m bench.profile summary /tmp/fast.txt

The app threads, the broker loop (``outbox-relay``) and its DB threads (``outbox-acks``,
``outbox-verify``) appear as separate threads; idle samples (waiting in epoll, a lock or
the database) are left out of the shares unless ``--idle`` is given.
"""

from __future__ import annotations

import argparse
import collections
import re

from sqlalchemy import create_engine

from bench.fast_path import bench_schema, business, paced, receive, settle, stock
from outbox import Outbox, migrate
from relay.testing.embedded import NatsServer

IDLE = re.compile(
    r"\b(select|poll|epoll|wait|_wait_for_tstate_lock|acquire|sleep|recv_into|"
    r"_worker|read|pgconn_execute|execute_command|PQexec|_fetch_many|wait_c)\b"
)


def run(rate: float, seconds: float, threads: int) -> None:
    with NatsServer() as server, bench_schema() as db:
        migrate.upgrade(db)
        engine = create_engine(db, pool_size=threads + 2)
        business.create_all(engine)
        with engine.begin() as conn:
            conn.execute(stock.insert(), [{"sku": f"SKU-{i:03d}", "qty": 0} for i in range(100)])
        ob = Outbox(engine, broker=f"{server.url}?stream=BENCH&subjects=bench.>", sweeper=False)
        ob.start()
        paced(threads, rate, seconds, receive(ob, with_send=True))
        settle(ob, int(rate * seconds))
        ob.stop()
        engine.dispose()


def summary(path: str, top: int, idle: bool) -> None:
    """Per thread group: its samples, then the functions with the most samples."""
    own: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    inclusive: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    totals: collections.Counter[str] = collections.Counter()
    with open(path, encoding="utf-8") as lines:
        samples = [line.rstrip().rpartition(" ") for line in lines]
    for stack, _, count in samples:
        frames = stack.split(";")
        group = thread_group(frames[0])
        leaf = frames[-1] if len(frames) > 1 else "?"
        if not idle and IDLE.search(leaf.split(" (")[0]):
            continue
        n = int(count)
        totals[group] += n
        own[group][short(leaf)] += n
        for frame in set(frames[1:]):
            inclusive[group][short(frame)] += n
    for group, total in totals.most_common():
        print(f"\n== {group}: {total} busy samples")
        print("  self:")
        for name, n in own[group].most_common(top):
            print(f"    {n / total:6.1%}  {name}")
        print("  inclusive:")
        for name, n in inclusive[group].most_common(top):
            print(f"    {n / total:6.1%}  {name}")


def thread_group(frame: str) -> str:
    """'thread (8839): outbox-acks_0' -> 'outbox-acks'; app threads go together."""
    name = frame.split(": ", 1)[-1]
    name = re.sub(r"_\d+$", "", name)
    return re.sub(r"Thread-\d+.*", "app threads", name)


def short(frame: str) -> str:
    """'publish (nats/js/client.py:170)' -> 'publish (nats/js/client.py)'."""
    return re.sub(r":\d+\)$", ")", re.sub(r"\(.*/site-packages/", "(", frame))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="the paced fast-path workload")
    r.add_argument("--rate", type=float, default=1000)
    r.add_argument("--seconds", type=float, default=10)
    r.add_argument("--threads", type=int, default=4)
    s = sub.add_parser("summary", help="shares per function from py-spy's raw output")
    s.add_argument("path")
    s.add_argument("--top", type=int, default=25)
    s.add_argument("--idle", action="store_true", help="count idle samples too")
    args = parser.parse_args()
    if args.cmd == "run":
        run(args.rate, args.seconds, args.threads)
    else:
        summary(args.path, args.top, args.idle)


if __name__ == "__main__":
    main()
