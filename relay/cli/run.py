"""`outbox relay` (a long-running worker) and `outbox drain` (one pass over a backlog)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import NamedTuple, NoReturn

from sqlalchemy import Engine

from outbox import migrate
from outbox.errors import OutboxError
from outbox.events import SweepResult
from outbox.secrets import mask_url
from relay.cli.app import add_app_flag
from relay.cli.common import (
    EXIT_DATA,
    EXIT_FAILED,
    EXIT_OK,
    PORT,
    Commands,
    add_broker_flag,
    add_db_flag,
    database,
)
from relay.cli.progress import Progress, progress
from relay.cli.schema import blocked_json
from relay.cli.settings_flags import add_settings_flags
from relay.cli.stopping import STOP_SIGNALS, StopSignals, exit_status, signals_blocked
from relay.display import safe
from relay.operator import BlockedKey, Operator
from relay.runtime import Relay
from relay.sweep.scheduler import publish_due
from relay.sweep.sweeper import Sweeper
from spark_jobs.flags import DAY_S, bounded_int, bounded_seconds

DRAIN_PASSES = 3
CONNECT_WAIT_S = 10.0
SIGNAL_CHECK_S = 0.1  # drain's main thread looks for a stop signal this often
SWEEPS = bounded_int(1, 256)  # --concurrency: a thread and a database connection each
STOP_TIMEOUT = bounded_seconds(0, DAY_S)
log = logging.getLogger("relay.cli")


def add_relay(commands: Commands) -> None:
    rel = commands.add_parser(
        "relay",
        help="run a relay worker: sweeper and retention (until SIGTERM/SIGINT)",
        description="Publish pending messages older than the sweeper age and purge old sent "
        "rows. Run any number of workers, on any number of machines, against one database.",
        epilog="SIGTERM or SIGINT: the sweep in hand finishes its batch (or, past "
        "--stop-timeout, its rows stay pending for the next worker), the worker logs "
        "'relay worker stopped by SIGTERM: sent=N retry_later=N dead=N', then one line per "
        "failure reason ('5 x permanent: ... (dead)'), and exits 0. A second "
        "signal exits at once with 130 (SIGINT) or 143 (SIGTERM); rows in flight stay pending.",
    )
    add_db_flag(rel)
    add_broker_flag(rel)
    rel.add_argument(
        "--concurrency",
        type=SWEEPS,
        default=1,
        help=f"sweeps side by side ({SWEEPS.range}, default 1)",
    )
    add_stop_timeout_flag(rel)
    add_app_flag(rel)
    add_settings_flags(rel)  # every Settings field: --sweep-interval-s (--interval), ...
    rel.add_argument(
        "--metrics-port",
        type=PORT,
        help=f"serve Prometheus /metrics on this port ({PORT.range}; needs the [metrics] extra)",
    )
    rel.add_argument(
        "--metrics-addr",
        default="127.0.0.1",
        help="address /metrics listens on (default 127.0.0.1, this machine only, like the "
        "dashboard; 0.0.0.0 for a Prometheus on another machine)",
    )


def add_drain(commands: Commands) -> None:
    drn = commands.add_parser(
        "drain",
        help="publish everything pending now, once, with progress",
        description="One-shot sweep of every pending message regardless of age and backoff, "
        "for recovering a large backlog.",
        epilog="The summary line is followed by one line per failure reason, e.g. '5 x "
        "permanent: ... (dead)'; `outbox dead` lists the messages. "
        "Messages behind a dead message of their ordered key (blocked) are left pending: "
        "the summary counts them and names the dead heads to `outbox requeue --id` or "
        "`outbox skip`. "
        "Exit status: 0 all sent, 3 some went dead or some are left blocked behind a dead "
        "message (`outbox status`), else 1 some "
        "failed and stay pending (retried later) or the broker became unreachable, 130 stopped "
        "by SIGINT (Ctrl-C), 143 stopped by SIGTERM. On either signal the batches in flight are "
        "finished (published and marked) or left pending, never half-marked; no new batch is "
        "claimed; the summary so far is printed. Past --stop-timeout, or on a second signal, "
        "it exits at once and the batches in flight stay pending (published again later: "
        "at least once).",
    )
    add_db_flag(drn)
    add_broker_flag(drn)
    drn.add_argument(
        "--concurrency",
        type=SWEEPS,
        default=2,
        help=f"sweeps side by side ({SWEEPS.range}, default 2)",
    )
    add_stop_timeout_flag(drn)
    drn.add_argument(
        "--json", action="store_true", help="print the summary as one JSON document on stdout"
    )
    add_app_flag(drn)
    add_settings_flags(drn)


def add_stop_timeout_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--stop-timeout",
        type=STOP_TIMEOUT,
        default=10.0,
        metavar="SECONDS",
        help="after SIGINT/SIGTERM, wait this long for the batches in flight "
        f"({STOP_TIMEOUT.range}, default 10)",
    )


def cmd_relay(args: argparse.Namespace) -> int:
    defer_stop_signals()
    settings = args.settings  # flags, --app, OUTBOX_<FIELD>, defaults (relay.cli.settings_flags)
    engine = database(args)
    migrate.require_schema(engine)
    relay = Relay(engine, args.broker, settings, fast_path=False, concurrency=args.concurrency,
                  metrics_port=args.metrics_port, metrics_addr=args.metrics_addr,
                  name="outbox-worker")  # fmt: skip
    relay.start()  # the metrics server first: a port in use fails before the sweeps start
    started = time.monotonic()
    log.info("relay worker started: db=%s broker=%s", mask_url(args.db), mask_url(args.broker))
    signum = signal.sigwait(STOP_SIGNALS)
    second_signal_exits("relay", signum)
    log.info("%s: stopping (deadline %.0f s)", signal.Signals(signum).name, args.stop_timeout)
    finished = relay.stop(args.stop_timeout)
    totals = relay.sweeper.totals
    line = (
        f"relay worker stopped by {signal.Signals(signum).name}: sent={totals.sent} "
        f"retry_later={totals.failed} dead={totals.dead} in {time.monotonic() - started:.0f} s"
    )
    if not finished:  # a sweep's transaction is open: exiting rolls it back (rows pending)
        log.info("%s; stop timeout passed, the batch in flight stays pending", line)
        log_reasons(totals)
        exit_now(EXIT_OK)
    engine.dispose()
    log.info("%s", line)
    log_reasons(totals)
    return EXIT_OK


def log_reasons(result: SweepResult) -> None:
    for line in reason_lines(result):
        log.info("%s", line)


def defer_stop_signals() -> None:
    """SIGTERM and SIGINT wait for ``signal.sigwait``: called before any thread starts
    (threads inherit the mask). A Python handler that sets an Event can deadlock on the
    Event's own lock when it interrupts the main thread inside ``Event.wait``."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def second_signal_exits(command: str, first: int) -> None:
    """After the first stop signal (taken by sigwait), a second one exits at once."""
    stop = StopSignals(command).install()
    stop.received = first
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # the main thread's only


def exit_now(status: int) -> NoReturn:
    """Exit without waiting for threads still in a transaction (the database rolls it
    back when the connection closes): past the stop timeout, the batch stays pending."""
    sys.stdout.flush()
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(status)


def cmd_drain(args: argparse.Namespace) -> int:
    stop = StopSignals("drain").install()
    try:
        return drain(args, stop)
    finally:
        stop.restore()


def drain(args: argparse.Namespace, stop: StopSignals) -> int:
    engine, total = backlog(args)
    settings = args.settings
    # No duty of its own: this command sweeps on demand, with the relay's sweeper.
    relay = Relay(engine, args.broker, settings, fast_path=False, sweeper=False,
                  name="outbox-drain")  # fmt: skip
    # The adapter retries, and warns, every 0.2 s: from its first try till it stops.
    with repeats_dropped():
        with signals_blocked():
            relay.start()
        connected = wait_connected(relay, stop)
        if stop.received or not connected:
            relay.stop(2.0)
            engine.dispose()
            if stop.received:
                return report_drain(SweepResult(), total, 0.0, stop.received, as_json=args.json)
            raise OutboxError(f"broker {mask_url(args.broker)} unreachable; nothing was touched")
    sweeper = relay.sweeper
    sweeper.batch_log_level = logging.DEBUG  # the progress shows the batches
    started = time.monotonic()
    with progress("drain", total) as shown:
        work = Background(lambda: drain_passes(sweeper, args.concurrency, shown))
        with signals_blocked():  # the sweeps' threads leave the signals to this one
            work.start()
        stopped_by, finished = await_drain(work, stop, sweeper, args.stop_timeout)
    seconds = time.monotonic() - started
    if not finished:  # a batch's transaction is open: exiting rolls it back (rows pending)
        exit_now(report_drain(shown.result(), total, seconds, stopped_by, True, args.json))
    try:
        result = work.result()
        left = left_pending(engine)
    finally:
        relay.stop(2.0)
        engine.dispose()
    return report_drain(result, total, seconds, stopped_by, as_json=args.json, left=left)


HEADS_SHOWN = 5  # dead heads a drain's summary names; `outbox status` lists them all


class Left(NamedTuple):
    """What a drain leaves pending that no pass of it could send: scheduled rows not due
    yet (a relay's scheduler's, in time) and blocked ones (behind a dead message of their
    ordered key: an operator's, by `outbox requeue --id` or `outbox skip` of the head)."""

    scheduled: int = 0
    blocked: int = 0
    blocked_keys: int = 0
    heads: tuple[BlockedKey, ...] = ()  # the oldest HEADS_SHOWN dead heads
    now: datetime | None = None  # the database clock when counted


NOTHING_LEFT = Left()


def left_pending(engine: Engine) -> Left:
    """Counted by Operator.status, as `outbox status` counts them."""
    now, backlog, _, heads = Operator(engine).status(blocked_limit=HEADS_SHOWN, settled=False)
    blocked = sum(row.blocked for row in backlog)
    scheduled = sum(row.scheduled for row in backlog)
    keys = sum(row.blocked_keys for row in backlog)
    return Left(scheduled, blocked, keys, tuple(heads) if blocked else (), now)


def backlog(args: argparse.Namespace) -> tuple[Engine, int]:
    """The engine for --db, once the schema is checked, and the pending count (less the
    scheduled rows not due yet: a drain does not publish them)."""
    engine = database(args)
    try:
        migrate.require_schema(engine)
        return engine, Operator(engine).due_count()
    except BaseException:
        engine.dispose()
        raise


def wait_connected(relay: Relay, stop: StopSignals) -> bool:
    """Wait for the broker up to CONNECT_WAIT_S, or until a stop signal."""
    deadline = time.monotonic() + CONNECT_WAIT_S
    while not relay.wait_connected(SIGNAL_CHECK_S):
        if stop.received or time.monotonic() > deadline:
            return False
    return True


def drain_passes(sweeper: Sweeper, concurrency: int, shown: Progress) -> SweepResult:
    """Up to DRAIN_PASSES sweeps; the totals count each row once, however many passes
    tried it (a row that failed in the last pass to claim it is retry_later). Each pass
    publishes the scheduled rows due by then too, never one before its time (a failed
    one is backing off: a later pass does not retake it)."""
    publish_due(sweeper, on_batch=shown.add)
    swept = sweeper.sweep(concurrency, min_age_s=0, due_only=False, on_batch=shown.add)
    for _ in range(DRAIN_PASSES - 1):  # failed rows are pending again: give them more tries
        if shown.result().failed == 0 or sweeper.stopping or swept.aborted:
            break
        shown.next_pass()
        publish_due(sweeper, on_batch=shown.add)
        swept = sweeper.sweep(concurrency, min_age_s=0, due_only=False, on_batch=shown.add)
    result = shown.result()
    result.aborted = swept.aborted
    return result


def await_drain(
    work: Background, stop: StopSignals, sweeper: Sweeper, timeout: float
) -> tuple[int | None, bool]:
    """Wait for the drain; after a stop signal, ``timeout`` more seconds at most for the
    batches in flight. The signal that stopped it (None: it ended by itself), and
    whether the work ended (False: batches still in flight at the deadline).

    The main thread looks for a signal every SIGNAL_CHECK_S: its handler only notes it
    (see relay.cli.stopping), and a join cannot be interrupted without an exception.
    """
    while (signum := stop.received) is None:
        work.join(SIGNAL_CHECK_S)
        if not work.is_alive():
            return None, True
    log.info("%s: stopping (deadline %.0f s): finishing the batches in flight", stop.name, timeout)
    deadline = time.monotonic() + timeout
    sweeper.stop(timeout)  # the batches in hand finish; no new one is claimed
    work.join(max(0.0, deadline - time.monotonic()))
    return signum, not work.is_alive()


def report_drain(
    result: SweepResult,
    total: int,
    seconds: float,
    stopped_by: int | None,
    late: bool = False,
    as_json: bool = False,
    left: Left = NOTHING_LEFT,
) -> int:
    """Print the summary line; the exit status (128 + the signal when one stopped it)."""
    if stopped_by is not None:
        why = f" (stopped by {signal.Signals(stopped_by).name}"
        why += "; stop timeout passed: the batches in flight stay pending)" if late else ")"
    else:
        why = " (stopped: broker unreachable)" if result.aborted else ""
    if as_json:
        document = drain_document(result, total, seconds, stopped_by, late)
        print(json.dumps(document | left_document(left)))
    else:
        print(
            f"drained: sent={result.sent} retry_later={result.failed} dead={result.dead}",
            f"of {total} pending in {seconds:.2f} s ({result.sent / max(seconds, 1e-9):,.0f} msg/s)"
            + why
            + left_note(left),
        )
        for line in reason_lines(result) + blocked_lines(left):
            print(line)
    if stopped_by is not None:
        return exit_status(stopped_by)
    return drain_status(result, left)


def left_note(left: Left) -> str:
    """The summary line's end: what the drain left pending, and to whom."""
    note = f"; {left.blocked} blocked behind a dead message, left" if left.blocked else ""
    if left.scheduled:
        note += f"; {left.scheduled} scheduled for later, left to the relays"
    return note


def blocked_lines(left: Left) -> list[str]:
    """The blocked rows left, and the dead heads holding them: what releases them."""
    if not left.blocked:
        return []
    lines = [
        f"left {left.blocked} message(s) of {left.blocked_keys} key(s) behind a dead message "
        "of their key: `outbox requeue --id HEAD` retries the head (once its cause is "
        "fixed), `outbox skip HEAD` gives it up and lets the key go on:"
    ]
    lines += [
        f"  head {key.msg_id}: topic {safe(key.topic)}, key {safe(key.key)!r}, seq {key.seq}, "
        f"{key.behind} behind"
        for key in left.heads
    ]
    if left.blocked_keys > len(left.heads):
        lines.append(f"  ... and {left.blocked_keys - len(left.heads)} more: `outbox status`")
    return lines


def left_document(left: Left) -> dict[str, object]:
    """``drain --json``'s figures of what it left pending (as `outbox status --json`'s)."""
    heads = [blocked_json(key, left.now) for key in left.heads if left.now is not None]
    return {"scheduled_later": left.scheduled, "blocked": left.blocked,
            "blocked_keys": left.blocked_keys, "blocked_heads": heads}  # fmt: skip


def drain_status(result: SweepResult, left: Left = NOTHING_LEFT) -> int:
    """Dead rows need a person whatever else happened (EXIT_DATA), so do rows left behind
    a dead message (`outbox status` exits 3 for the same dead head); rows still failing or
    a broker gone are worth another run later (EXIT_FAILED)."""
    if result.dead or left.blocked:
        return EXIT_DATA
    return EXIT_FAILED if result.failed or result.aborted else EXIT_OK


def drain_document(
    result: SweepResult, total: int, seconds: float, stopped_by: int | None, late: bool
) -> dict[str, object]:
    """``drain --json``: the summary line's figures, and why it stopped early (or null)."""
    stopped = signal.Signals(stopped_by).name if stopped_by is not None else None
    return {
        "sent": result.sent,
        "retry_later": result.failed,
        "dead": result.dead,
        "pending_at_start": total,
        "seconds": round(seconds, 3),
        "stopped_by": stopped,
        "stop_timeout_passed": late,
        "broker_unreachable": result.aborted,
        "failures": [
            {"count": n, "reason": why, "fate": fate} for n, why, fate in counted_reasons(result)
        ],
    }


REASONS_SHOWN = 10


def counted_reasons(result: SweepResult) -> list[tuple[int, str, str]]:
    """(how many, reason, fate: dead or retry later), most frequent first."""
    counted = [(n, why, "dead") for why, n in result.dead_reasons.items()]
    counted += [(n, why, "retry later") for why, n in result.retry_reasons.items()]
    return sorted(counted, key=lambda c: (-c[0], c[1], c[2]))


def reason_lines(result: SweepResult) -> list[str]:
    """The failures grouped by reason, most frequent first: '  5 x permanent: ... (dead)'."""
    counted = counted_reasons(result)
    lines = [f"  {n} x {why} ({fate})" for n, why, fate in counted[:REASONS_SHOWN]]
    if len(counted) > REASONS_SHOWN:
        rest = len(counted) - REASONS_SHOWN
        lines.append(f"  ... and {rest} more reason(s): `outbox dead` lists the messages")
    return lines


class Background(threading.Thread):
    """Runs ``work`` in a thread of its own; ``result()`` returns or raises what it did."""

    def __init__(self, work: Callable[[], SweepResult]) -> None:
        super().__init__(name="outbox-drain-sweeps", daemon=True)  # the loop is outbox-drain
        self._work = work
        self._result: SweepResult | None = None
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            self._result = self._work()
        except BaseException as exc:  # handed to the main thread by result()
            self._error = exc

    def result(self) -> SweepResult:
        if self._error is not None:
            raise self._error
        assert self._result is not None, "result() before the work ended"
        return self._result


@contextmanager
def repeats_dropped() -> Iterator[None]:
    """Within the block, each distinct log line is shown once."""
    seen: set[str] = set()

    def first_time(record: logging.LogRecord) -> bool:
        line = f"{record.name}: {record.getMessage()}"
        new = line not in seen
        seen.add(line)
        return new

    handlers = logging.getLogger().handlers
    for handler in handlers:
        handler.addFilter(first_time)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(first_time)


PARSERS = (add_relay, add_drain)
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "relay": cmd_relay,
    "drain": cmd_drain,
}
