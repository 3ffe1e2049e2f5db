"""Small shared test helpers."""

from __future__ import annotations

import time
from collections.abc import Callable

from relay.halfop.protocol import LocalTransactionState, TransactionListener, TransactionMessage


def wait_until(condition: Callable[[], object], timeout: float = 10.0, what: str = "") -> None:
    """Poll ``condition`` until it is true; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or condition}")
        time.sleep(0.002)


class AlwaysCommits(TransactionListener):
    """A model-B listener whose local transaction always commits (no database)."""

    def execute_local_transaction(
        self, msg: TransactionMessage, arg: object
    ) -> LocalTransactionState:
        return LocalTransactionState.COMMIT_MESSAGE

    def check_local_transaction(self, msg: TransactionMessage) -> LocalTransactionState:
        return LocalTransactionState.COMMIT_MESSAGE
