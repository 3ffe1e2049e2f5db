"""Alembic's INFO lines from the relay's own schema check, kept out of an app's log.

The sweeper checks the schema's revision before its first sweep (relay.sweep.jobs).
Through Alembic that logs at INFO: "setup plugin ..." seven times when Alembic is first
imported (1.18 and later), then "Context impl ..." and "Will assume ... DDL." at each
check. The CLI quiets the whole ``alembic`` tree; an app's log is the app's, so here
only the records of a thread inside ``quiet_alembic()`` are dropped, by a filter on the
two loggers that write them. Alembic's warnings and errors pass, as does anything the
app's own Alembic runs log.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

# The loggers of Alembic's modules that log at INFO during an import and a revision read.
ALEMBIC_LOGGERS = ("alembic.runtime.plugins", "alembic.runtime.migration")


class ThreadsQuieted(logging.Filter):
    """Drops records below WARNING logged by the threads in ``threads``."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: set[int] = set()
        self.lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record.thread not in self.threads


_quieted = ThreadsQuieted()
for _name in ALEMBIC_LOGGERS:
    logging.getLogger(_name).addFilter(_quieted)


@contextmanager
def quiet_alembic() -> Iterator[None]:
    """Alembic's INFO and DEBUG lines from this thread are dropped inside the block."""
    me = threading.get_ident()
    with _quieted.lock:
        nested = me in _quieted.threads
        _quieted.threads.add(me)
    try:
        yield
    finally:
        if not nested:
            with _quieted.lock:
                _quieted.threads.discard(me)
