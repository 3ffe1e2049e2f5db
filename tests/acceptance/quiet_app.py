"""An app that logs at INFO through the root logger, as most do, and runs a relay:
run by test_app_logs.py as ``python quiet_app.py DB_URL [BROKER_URL]``.

It starts the Outbox (MemoryBroker without BROKER_URL), sends three messages in one
transaction, waits until they and the row an earlier process left pending are
published and three more sweeps have run, and stops. Its output marks where start()
and stop() begin and end, so the test can tell the relay's lines from the app's.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy.orm import Session

from outbox import Outbox
from relay.testing import MemoryBroker

logging.basicConfig(
    level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stdout
)
SWEEPS_AFTER = 3  # the sweeps that must run once every message is published


def wait_until(condition: Callable[[], object], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.01)


def main(db: str, broker_url: str | None) -> None:
    memory = MemoryBroker()
    ob = Outbox(db, broker=broker_url or memory, sweep_interval_s=0.1,
                sweeper_age_s=1.0, handoff_limit_s=0.5)  # fmt: skip
    print("MARK start", flush=True)
    ob.start()
    relay = ob.relay
    assert relay is not None and relay.jobs is not None, "a relay with the sweeper duty"
    sweeps = count_calls(relay.sweeper, "sweep")
    with Session(ob.engine) as session, session.begin():
        for i in range(3):
            ob.send(session, "app.orders.created", {"i": i})
    wait_until(lambda: relay.sweeper.totals.sent == 1, "the row left pending, swept")
    wait_until(lambda: ob.stats is not None and ob.stats.marked == 3, "the 3 sent, marked")
    after = sweeps[0]
    wait_until(lambda: sweeps[0] >= after + SWEEPS_AFTER, f"{SWEEPS_AFTER} more sweeps")
    print("MARK stop", flush=True)
    ob.stop()
    print("MARK end", flush=True)


def count_calls(obj: Any, name: str) -> list[int]:
    """Counts calls of ``obj.name`` from now on (in the returned list's one item)."""
    calls, real = [0], getattr(obj, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    setattr(obj, name, counted)
    return calls


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
