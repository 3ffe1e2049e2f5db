"""send(delay=...) and cancel() through an app's own running relay: a scheduled message
goes out by the scheduler (never the fast path), once; a canceled one never goes out.

"Never" without waiting a while: the canceled message was due before the relay started,
and the scheduler claims due rows earliest first: once a message due after it is
published, it was passed over.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from sqlalchemy.orm import Session

from outbox import Outbox
from outbox.events import Path, RelayListener, Sent
from relay.testing import MemoryBroker
from tests.helpers import migrated, wait_until
from tests.scheduling import statuses


class Paths(RelayListener):
    """The path each message was published by."""

    def __init__(self) -> None:
        self.by_id: dict[str, Path] = {}
        self._lock = threading.Lock()

    def published(self, sent: Sequence[Sent], path: Path) -> None:
        with self._lock:
            self.by_id.update({s.msg_id: path for s in sent})

    def of(self, msg_id: str) -> Path | None:
        with self._lock:
            return self.by_id.get(msg_id)


def test_scheduled_messages_go_by_the_scheduler_and_canceled_ones_never(any_db: str) -> None:
    with migrated(any_db) as engine:
        broker, paths = MemoryBroker(), Paths()
        ob = Outbox(engine, broker=broker, listener=paths)
        with Session(engine) as session, session.begin():  # due at once, canceled unseen
            canceled = ob.send(session, "r", b"canceled", delay=0)
        with Session(engine) as session, session.begin():
            assert ob.cancel(session, canceled)
        ob.start()
        try:
            with Session(engine) as session, session.begin():
                now = ob.send(session, "r", b"now")
                deduped = ob.send(session, "r", b"once", delay=0.2, dedup_key="k")
                assert ob.send(session, "r", b"twice", delay=0.2, dedup_key="k") == deduped
                later = ob.send(session, "r", b"later", delay=0.4)
            wait_until(lambda: paths.of(later) is not None, what="the later message published")
        finally:
            ob.stop()
        assert paths.of(now) == "fast"
        assert (paths.of(deduped), paths.of(later)) == ("scheduler", "scheduler")
        assert sorted(m.payload for m in broker.published) == [b"later", b"now", b"once"]
        assert statuses(engine) == {
            now: "sent",
            canceled: "canceled",
            deduped: "sent",
            later: "sent",
        }
