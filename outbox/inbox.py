"""The consumer's side: an inbox that makes at-least-once delivery effectively once.

A broker delivers a message at least once: again after a consumer died before its ack,
again when an operator requeues it at the outbox. ``Inbox`` runs each message's handler
in a transaction of the consumer's own database that also records ``(consumer,
msg_id)`` in ``outbox_inbox``; the runner (``outbox consume``, relay.consume)
acknowledges the broker's message only after that commit. A copy of a message the
consumer recorded is acknowledged without running the handler::

    inbox = Inbox("postgresql://app@db/shop", consumer="billing")

    @inbox.handler("orders.*")
    def bill(session: Session, message: InboxMessage) -> None:
        session.add(Invoice(order=message.json()["order"]))

A handler that raises rolls its transaction back (nothing recorded) and the message is
tried again later, after ``backoff_s``; past ``max_attempts`` it becomes the consumer's
dead letter (a row with its error, topic, headers and payload) and is acknowledged:
``outbox dead --consumer NAME`` lists it, ``outbox requeue --consumer NAME`` gives it
back and the runner runs it again from the table. One message's failure never stops or
repeats another's. Several consumers (names) are independent; processes of one consumer
share the work (the broker's durable consumer, queue or group), and the inbox row's key
lets only one of two concurrent copies run its handler to the commit.
"""

from __future__ import annotations

import asyncio
import inspect
import re
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

from sqlalchemy import CursorResult, Engine, and_, delete, func, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from outbox.api import relay_runtime
from outbox.binding import Binding
from outbox.consumer import (
    AsyncHandler,
    Handler,
    InboxMessage,
    Outcome,
    Result,
    SyncHandler,
)
from outbox.errors import ConfigError, OutboxError
from outbox.names import check_name
from outbox.settings import Settings
from outbox.table import DEAD, HANDLED, REQUEUED, db_now, inbox_message

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

__all__ = ["Inbox", "InboxMessage", "Outcome", "Result"]

t = inbox_message
RECORD = insert(t)
MAX_ATTEMPTS = 5
KEEP_DAYS = 7.0  # how long a handled msg_id is remembered: longer than any copy can come
PURGE_BATCH = 1000
BACKOFF_S = (1.0, 5.0, 30.0, 120.0, 600.0)  # before the 2nd, 3rd ... attempt; the last repeats
GAP_WAIT_S = 30.0  # an ordered message waits this long for its key's previous one
GAP_RETRY_S = 1.0  # and is tried again this often meanwhile
HELD_MOST = 10_000  # held messages remembered (when each was first held), at most
ERROR_MAX = 2000  # characters of a dead letter's error kept


class Duplicate(Exception):
    """The inbox row was there already: leave the transaction, run nothing."""


class Held(Exception):
    """An ordered message came before its key's previous one: leave, try again later."""


def pattern_regex(pattern: str) -> re.Pattern[str]:
    """A topic pattern in the broker's wildcard syntax (NATS subjects): ``*`` one token,
    ``>`` (last) one or more. The same rule as spark_jobs.topics, which imports nothing
    of the outbox's."""
    tokens = pattern.split(".") if isinstance(pattern, str) else [""]
    last = len(tokens) - 1
    misplaced = any((">" in k and (k != ">" or i < last)) or ("*" in k and k != "*")
                    for i, k in enumerate(tokens))  # fmt: skip
    if "" in tokens or misplaced:
        raise ConfigError(
            f"pattern: tokens separated by dots, '*' for one token, '>' for the rest at "
            f"the end, got {pattern!r}"
        )
    parts = [r"[^.]+" if k == "*" else r".+" if k == ">" else re.escape(k) for k in tokens]
    return re.compile(r"\.".join(parts))


class Inbox(Binding):
    """A consumer's inbox on ``db`` (a URL, an Engine or an AsyncEngine).

    ``consumer`` names it (letters, digits, ``_``; the broker's durable consumer, queue or
    group takes the name too). ``max_attempts`` tries per message before it is dead,
    ``backoff_s`` the waits between them. ``session_factory``: the app's own
    (``sessionmaker`` or ``async_sessionmaker``) for its handlers' sessions.
    """

    def __init__(
        self,
        db: str | Engine | AsyncEngine | None = None,
        consumer: str = "",
        *,
        session_factory: Any = None,
        max_attempts: int = MAX_ATTEMPTS,
        backoff_s: tuple[float, ...] = BACKOFF_S,
        keep_days: float = KEEP_DAYS,
        gap_wait_s: float = GAP_WAIT_S,
    ) -> None:
        self.consumer = check_name("consumer", consumer)
        self.keep_days = check_keep_days(keep_days)
        self.gap_wait_s = check_gap_wait(gap_wait_s)
        self._held: dict[uuid.UUID, tuple[float, int]] = {}  # msg_id: (first held, times)
        self.max_attempts = check_attempts(max_attempts)
        self.backoff_s = check_backoff(backoff_s)
        self.handlers: list[tuple[re.Pattern[str], str, Handler]] = []
        self.settings = Settings()
        self._unbound(session_factory)
        if db is not None:
            self.bind(db)

    def __repr__(self) -> str:
        return f"Inbox(consumer={self.consumer!r}, handlers={[p for _, p, _ in self.handlers]})"

    def handler(self, pattern: str) -> Callable[[Handler], Handler]:
        """Register ``fn(session, message)`` for the topics ``pattern`` matches (the first
        registered pattern that matches a topic wins). ``async def`` handlers get an
        ``AsyncSession``."""
        regex = pattern_regex(pattern)

        def register(fn: Handler) -> Handler:
            if not callable(fn):
                raise ConfigError(f"handler: must be callable, got {fn!r}")
            self.handlers.append((regex, pattern, fn))
            return fn

        return register

    @property
    def has_handlers(self) -> bool:
        return bool(self.handlers)

    @property
    def patterns(self) -> list[str]:
        """The topic patterns of the handlers: what the runner subscribes to."""
        return [pattern for _, pattern, _ in self.handlers]

    def handler_for(self, topic: str) -> Handler | None:
        return next((fn for regex, _, fn in self.handlers if regex.fullmatch(topic)), None)

    def delay_before(self, attempt: int) -> float:
        """Seconds to wait before attempt ``attempt + 1``."""
        return self.backoff_s[min(attempt, len(self.backoff_s)) - 1]

    # One delivery

    def handle(self, message: InboxMessage, attempt: int = 1) -> Result:
        """Run the handler of ``message`` in a transaction that records it, unless it was
        recorded before. ``attempt``: the broker's delivery count (1: the first)."""
        fn = self.handler_for(message.topic)
        if fn is None or is_async(fn):
            return self._no_sync_handler(message, fn, attempt)
        run = cast(SyncHandler, fn)
        try:
            with self.session_factory() as session, session.begin():
                late = self._record(session, message)
                run(session, message)
        except Duplicate:
            return Result(Outcome.DUPLICATE)
        except Held as held:
            return self._hold(message, str(held))
        except Exception as exc:  # the handler's fault: this message's alone
            return self._failed(message, attempt, exc)
        return self._handled(message, late)

    async def handle_async(self, message: InboxMessage, attempt: int = 1) -> Result:
        """``handle`` for ``async def`` handlers, in an ``AsyncSession``; a sync handler
        runs in a worker thread."""
        fn = self.handler_for(message.topic)
        if fn is None or not is_async(fn):
            return await asyncio.to_thread(self.handle, message, attempt)
        run = cast(AsyncHandler, fn)
        try:
            async with self.async_session_factory() as session, session.begin():
                late = await session.run_sync(self._record, message)
                await run(session, message)
        except Duplicate:
            return Result(Outcome.DUPLICATE)
        except Held as held:
            return self._hold(message, str(held))
        except Exception as exc:
            return self._failed(message, attempt, exc)
        return self._handled(message, late)

    def _no_sync_handler(self, message: InboxMessage, fn: Handler | None, attempt: int) -> Result:
        if fn is None:
            error = f"no handler of consumer {self.consumer!r} matches topic {message.topic!r}"
            return self._bury(message, attempt, error)
        raise ConfigError(
            f"handler: {fn!r} for {message.topic!r} is async: run the inbox with "
            "run_async() (or handle_async())"
        )

    def _record(self, session: Session, message: InboxMessage) -> str | None:
        """The inbox row, first in the transaction: a second copy waits here for the
        first one's commit and then finds the row (Duplicate), or its rollback and then
        runs. An ordered message then checks its key's order (``in_order``)."""
        row = {"consumer": self.consumer, "msg_id": message.msg_id, "topic": message.topic,
               "key": message.key, "seq": message.seq}  # fmt: skip
        try:
            session.execute(RECORD, row)  # one statement, built once: its compiled form cached
        except IntegrityError as exc:
            raise Duplicate from exc
        if message.seq is None or message.key is None:
            return None
        return self.in_order(session, message)

    def in_order(self, session: Session, message: InboxMessage) -> str | None:
        """Whether ``message`` is its key's next (the one after the last handled, or
        dead, before it): Held while one is missing, for ``gap_wait_s``; past that, or
        when a later one was handled already, it runs and the reason is returned (the
        runner reports it). The first message of a key the consumer sees starts it."""
        assert message.seq is not None
        key = and_(t.c.consumer == self.consumer, t.c.topic == message.topic,
                   t.c.key == message.key, t.c.msg_id != message.msg_id)  # fmt: skip
        before = select(func.max(t.c.seq)).where(key, t.c.seq < message.seq).scalar_subquery()
        after = select(func.min(t.c.seq)).where(key, t.c.seq > message.seq).scalar_subquery()
        prev, later = session.execute(select(before, after)).one()  # one round trip
        where = f"seq {message.seq} of key {message.key!r} of {message.topic}"
        if later is not None:
            return f"{where} came after seq {later}"
        if prev is None or prev == message.seq - 1:
            return None
        first, _ = self._held.get(message.msg_id, (time.monotonic(), 0))
        if time.monotonic() - first < self.gap_wait_s:
            raise Held(f"{where} waits for seq {prev + 1}")
        return f"{where} handled without seq {prev + 1}, after {self.gap_wait_s:g} s"

    def _hold(self, message: InboxMessage, why: str) -> Result:
        first, times = self._held.pop(message.msg_id, (time.monotonic(), 0))
        self._held[message.msg_id] = (first, times + 1)
        if len(self._held) > HELD_MOST:  # bounded: the oldest forgotten (it waits anew)
            self._held.pop(next(iter(self._held)))
        return Result(Outcome.HELD, min(GAP_RETRY_S, self.gap_wait_s), why)

    def _handled(self, message: InboxMessage, late: str | None) -> Result:
        self._held.pop(message.msg_id, None)
        return Result(Outcome.HANDLED, out_of_order=late)

    def _failed(self, message: InboxMessage, attempt: int, exc: BaseException) -> Result:
        error = f"{type(exc).__name__}: {exc}"[:ERROR_MAX]
        _, held = self._held.get(message.msg_id, (0.0, 0))
        attempt -= held  # deliveries it was held for are no failures
        if attempt >= self.max_attempts:
            return self._bury(message, attempt, error)
        return Result(Outcome.RETRY, self.delay_before(attempt), error)

    def _bury(self, message: InboxMessage, attempt: int, error: str) -> Result:
        """Record ``message`` as this consumer's dead letter (ack it then; its key goes on
        past it); a copy recorded meanwhile (handled by another process) is left as it is."""
        self._held.pop(message.msg_id, None)
        row = {"consumer": self.consumer, "msg_id": message.msg_id, "topic": message.topic,
               "key": message.key, "seq": message.seq,
               "status": DEAD, "attempts": attempt, "last_error": error,
               "headers": message.header_map(), "payload": message.payload}  # fmt: skip
        try:
            with self.engine.begin() as conn:
                conn.execute(insert(t).values(**row))
        except IntegrityError:
            return Result(Outcome.DUPLICATE)
        return Result(Outcome.DEAD, error=error)

    # Running it

    def run(self, broker: str) -> dict[str, int]:
        """Consume from ``broker`` (a nats:// URL) until SIGINT or SIGTERM, in this thread
        (the main one): what ``outbox consume --app`` runs. The counts by outcome."""
        return dict(relay_runtime().consume_until_signalled(self, broker))

    async def run_async(self, broker: str, stopping: Any = None) -> dict[str, int]:
        """Consume from ``broker`` on the running loop until ``stopping`` (an
        ``asyncio.Event``) is set; the counts by outcome."""
        return dict(await relay_runtime().consume(self, broker, stopping))

    # The dedup window

    def purge(self, batch: int = PURGE_BATCH) -> int:
        """Forget the msg_ids handled more than ``keep_days`` ago (dead letters stay), in
        batches; the rows removed. A copy of such a message would run its handler again:
        keep_days must outlast every way a copy comes (the broker's redelivery, the
        outbox's retention, within which an operator can requeue a sent message)."""
        with self.engine.connect() as conn:  # the database's clock, as every age here
            older = conn.execute(select(db_now())).scalar_one() - timedelta(days=self.keep_days)
        old = and_(t.c.consumer == self.consumer, t.c.status == HANDLED, t.c.created_at < older)
        removed = 0
        while True:
            with self.engine.begin() as conn:
                ids = list(conn.execute(select(t.c.msg_id).where(old).limit(batch)).scalars())
                if ids:
                    conn.execute(delete(t).where(old, t.c.msg_id.in_(ids)))
            removed += len(ids)
            if len(ids) < batch:
                return removed

    # Dead letters given back

    def requeued(self, limit: int = 100) -> list[InboxMessage]:
        """Dead letters an operator gave back (``outbox requeue --consumer``), oldest first."""
        query = (
            select(t.c.msg_id, t.c.topic, t.c.payload, t.c.headers)
            .where(t.c.consumer == self.consumer, t.c.status == REQUEUED)
            .order_by(t.c.created_at)
            .limit(limit)
        )
        with self.engine.connect() as conn:
            rows = conn.execute(query).all()
        return [stored(row.msg_id, row.topic, row.payload, row.headers) for row in rows]

    def handle_requeued(self, message: InboxMessage) -> Result:
        """Run a requeued dead letter's handler in a transaction that marks it handled;
        failing, it is dead again at once (the operator asked for one more try)."""
        fn = self.handler_for(message.topic)
        mine = and_(t.c.consumer == self.consumer, t.c.msg_id == message.msg_id,
                    t.c.status == REQUEUED)  # fmt: skip
        taken = {"status": HANDLED, "attempts": t.c.attempts + 1, "created_at": db_now()}
        try:
            with self.session_factory() as session, session.begin():
                took = session.execute(update(t).where(mine).values(**taken))
                if cast(CursorResult[Any], took).rowcount != 1:
                    raise Duplicate  # another process took it
                if fn is None or is_async(fn):
                    raise OutboxError(f"no sync handler matches topic {message.topic!r}")
                cast(SyncHandler, fn)(session, message)
        except Duplicate:
            return Result(Outcome.DUPLICATE)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"[:ERROR_MAX]
            with self.engine.begin() as conn:
                again = {"status": DEAD, "attempts": t.c.attempts + 1, "last_error": error}
                conn.execute(update(t).where(mine).values(**again))
            return Result(Outcome.DEAD, error=error)
        return Result(Outcome.HANDLED)


def is_async(fn: Handler) -> bool:
    return inspect.iscoroutinefunction(fn)


def stored(msg_id: uuid.UUID, topic: str, payload: bytes | None, headers: Any) -> InboxMessage:
    """A dead letter's message as the table keeps it."""
    carried = {str(k): str(v) for k, v in (headers or {}).items()}
    return InboxMessage.from_broker(str(msg_id), topic, payload or b"", carried)


def check_attempts(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1000:
        raise ConfigError(f"max_attempts: must be a whole number from 1 to 1000, got {value!r}")
    return value


def check_gap_wait(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 3600:
        raise ConfigError(f"gap_wait_s: must be seconds from 0 to 3600, got {value!r}")
    return float(value)


def check_keep_days(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 3650:
        raise ConfigError(
            f"keep_days: must be a number of days above 0, at most 3650, got {value!r}"
        )
    return float(value)


def check_backoff(value: object) -> tuple[float, ...]:
    waits = list(value) if isinstance(value, tuple | list) else []
    if not waits or not all(
        isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v <= 86400 for v in waits
    ):
        raise ConfigError(
            f"backoff_s: must be a non-empty sequence of seconds from 0 to 86400, got {value!r}"
        )
    return tuple(float(v) for v in waits)
