"""Model B's coordinator under a long run: `python -m bench.halfop --soak`.

200,000 transactions (``--soak-transactions``) at a steady rate (``--soak-rate``)
through TransactionProducer into an embedded nats-server, with `outbox coordinator`
in its own process (1 s check interval, 1 s transaction timeout). The mix makes the op
log interesting: most commit with their end request, 5 % roll back, 1 % go through a
second producer of the group whose end requests are dropped (check-back settles
them), and one in 10,000 stays UNKNOW for the whole run (its check answers UNKNOW),
so every round has a half waiting for check-back while later ops pile up.

The listener keeps its outcomes in a dict, without a database: with
SqlTransactionListener the database, not the coordinator, would set the pace.

The coordinator logs one line per round (round time, ops read); each line is matched
with the op log's size (the server's /jsz) and the coordinator's VmRSS at that moment.
The table shows, when the op log holds 5 %, 25 %, 50 % and 100 % of the transactions'
count, the median of the 5 rounds nearest that size (during the workload).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.report import print_rows
from relay.brokers.nats import create_stream
from relay.lab.halfop import (
    OP_TOPIC,
    LocalTransactionState,
    TransactionListener,
    TransactionMessage,
    TransactionProducer,
)
from relay.testing.embedded import NatsServer

COMMIT, ROLLBACK, UNKNOW = (
    LocalTransactionState.COMMIT_MESSAGE,
    LocalTransactionState.ROLLBACK_MESSAGE,
    LocalTransactionState.UNKNOW,
)
ROUND_LINE = re.compile(r"check round: ([\d.]+) ms, (\d+) ops read in (\d+) requests")
NEAREST = 5  # rounds per mark


def add_soak_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--soak", action="store_true", help="the coordinator's soak instead")
    parser.add_argument("--soak-transactions", type=int, default=200_000)
    parser.add_argument("--soak-rate", type=float, default=500.0, help="transactions a second")


def kind(i: int) -> str:
    if i % 10_000 == 1:
        return "stuck"
    if i % 100 == 50:
        return "lossy"
    return "rollback" if i % 20 == 7 else "commit"


class Outcomes(TransactionListener):
    """Answers from memory: the transaction's kind, in a header."""

    def execute_local_transaction(self, msg: TransactionMessage, arg: Any) -> LocalTransactionState:
        return self.outcome(msg)

    def check_local_transaction(self, msg: TransactionMessage) -> LocalTransactionState:
        return self.outcome(msg)

    @staticmethod
    def outcome(msg: TransactionMessage) -> LocalTransactionState:
        what = msg.headers.get("kind")
        return {"stuck": UNKNOW, "rollback": ROLLBACK}.get(what or "", COMMIT)


@dataclass
class Round:
    ms: float
    ops_read: int
    op_log: int
    rss_kb: int


class Watcher:
    """Reads the coordinator's round lines; notes the op log's size and its RSS."""

    def __init__(self, proc: subprocess.Popen[str], monitor: str) -> None:
        self.proc, self.monitor = proc, monitor
        self.rounds: list[Round] = []
        self.workload_done = False
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            found = ROUND_LINE.search(line)
            if found and not self.workload_done:
                ms, ops, _ = found.groups()
                self.rounds.append(Round(float(ms), int(ops), self.op_log(), self.rss_kb()))
            elif " ERROR " in line or "Traceback" in line:
                self.errors.append(line.rstrip())

    def op_log(self) -> int:
        with urllib.request.urlopen(f"{self.monitor}/jsz?streams=true", timeout=5) as answer:
            jsz = json.load(answer)
        for account in jsz.get("account_details", []):
            for stream in account.get("stream_detail", []):
                if stream["name"] == OP_TOPIC:
                    return int(stream["state"]["messages"])
        return 0

    def rss_kb(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0


def run_producers(url: str, total: int, rate: float, threads: int) -> dict[str, int]:
    listener = Outcomes()
    steady = TransactionProducer("soak", url, listener, check_threads=2)
    lossy = TransactionProducer("soak", url, listener, drop_end_requests=True)
    steady.start()
    lossy.start()
    counts: dict[str, int] = dict.fromkeys(("commit", "rollback", "lossy", "stuck", "failed"), 0)
    numbers = itertools.count()
    lock = threading.Lock()
    started = time.monotonic()

    def work() -> None:
        while (i := next(numbers)) < total:
            delay = started + i / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)  # the pace, not a wait for an outcome
            what = kind(i)
            producer = lossy if what == "lossy" else steady
            result = producer.send_in_transaction("real.soak", b"x" * 64, headers={"kind": what})
            with lock:
                counts["failed" if result.half_offset is None else what] += 1

    pool = [threading.Thread(target=work) for _ in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    counts["seconds"] = int(time.monotonic() - started)
    steady.stop()
    lossy.stop()
    return counts


def near(rounds: list[Round], mark: int) -> list[Round]:
    return sorted(rounds, key=lambda r: abs(r.op_log - mark))[:NEAREST]


def label(n: int) -> str:
    return f"{n // 1000}k" if n % 1000 == 0 else str(n)


def soak(total: int, rate: float, threads: int) -> None:
    outbox = str(Path(sys.executable).with_name("outbox"))
    with NatsServer(monitor=True) as server:
        create_stream(server.url, "REAL", "real.>")
        command = [outbox, "coordinator", "--broker", server.url, "--check-interval", "1",
                   "--transaction-timeout", "1", "--check-max", "100000"]  # fmt: skip
        proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
        watcher = Watcher(proc, f"http://127.0.0.1:{server.http_port}")
        try:
            counts = run_producers(server.url, total, rate, threads)
            watcher.workload_done = True
            final_log = watcher.op_log()
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    marks = [total // 20, total // 4, total // 2, total]
    rows = [("op log holds", "rounds (op log)", "round ms", "ops read/round", "RSS MB")]
    medians: list[tuple[float, float]] = []
    for mark in marks:
        picked = near(watcher.rounds, mark)
        ms = statistics.median(r.ms for r in picked)
        rss = statistics.median(r.rss_kb for r in picked) / 1024
        medians.append((ms, rss))
        rows.append(
            (f"{mark:,}", f"{len(picked)} ({min(r.op_log for r in picked):,}-"
             f"{max(r.op_log for r in picked):,})", f"{ms:.1f}",
             f"{statistics.median(r.ops_read for r in picked):.0f}", f"{rss:.1f}")
        )  # fmt: skip
    done = ", ".join(f"{k} {v:,}" for k, v in counts.items() if k != "seconds")
    print_rows(
        f"model B coordinator soak: {total:,} transactions at {rate:.0f}/s "
        f"({counts['seconds']} s: {done}), {len(watcher.rounds)} rounds, "
        f"op log {final_log:,} at the end, {os.cpu_count()} CPUs",
        rows,
    )
    for line in watcher.errors[:5]:
        print(f"coordinator: {line}")
    (first_ms, first_rss), (last_ms, last_rss) = medians[0], medians[-1]
    print(
        f"soak: round time {label(marks[-1])}/{label(marks[0])} = {last_ms / first_ms:.2f}, "
        f"rss {label(marks[-1])}/{label(marks[0])} = {last_rss / first_rss:.2f}"
    )
