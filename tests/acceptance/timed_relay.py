"""`outbox relay` whose Redis adapter notes when each publish started and was answered.

Run as ``python -m tests.acceptance.timed_relay relay ...`` (the arguments are the
``outbox`` command's). Each publish appends one line per ordered message to the file
``$OUTBOX_TEST_TIMES``: ``start end key seq msg_id ok``, on CLOCK_MONOTONIC in ns (one
clock for every process of the machine), so a test can see two rows of a key in
flight at once in two workers. Its first sweep appends the process id to
``$OUTBOX_TEST_TIMES.sweeping``: a test waits for every worker to sweep before it makes
rows due, so that they all compete for them, however slowly each one started.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence

from outbox.broker import PublishResult
from outbox.message import Message
from relay.brokers.redis import RedisBroker
from relay.cli import main
from relay.sweep.sweeper import Sweeper

untimed = RedisBroker.publish
unnoted = Sweeper.sweep


async def timed(self: RedisBroker, messages: Sequence[Message]) -> list[PublishResult]:
    start = time.monotonic_ns()
    results = await untimed(self, messages)
    end = time.monotonic_ns()
    lines = [
        f"{start} {end} {m.key} {m.seq} {m.msg_id} {int(r.ok)}\n"
        for m, r in zip(messages, results, strict=True)
        if m.seq is not None
    ]
    with open(os.environ["OUTBOX_TEST_TIMES"], "a") as out:
        out.writelines(lines)
    return results


def noted(self: Sweeper, *args: object, **kwargs: object) -> object:
    if not getattr(self, "noted", False):
        self.noted = True  # type: ignore[attr-defined]
        with open(os.environ["OUTBOX_TEST_TIMES"] + ".sweeping", "a") as out:
            out.write(f"{os.getpid()}\n")
    return unnoted(self, *args, **kwargs)  # type: ignore[arg-type]


RedisBroker.publish = timed  # type: ignore[method-assign]
Sweeper.sweep = noted  # type: ignore[assignment, method-assign]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
