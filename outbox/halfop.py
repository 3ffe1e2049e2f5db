"""Model B, for comparison: RocketMQ-style transactional messages (half, op, check-back).

The sequence of ``TransactionProducer.send_in_transaction``: the half message is sent
synchronously (if that fails the local transaction is NOT run); then the listener's
``execute_local_transaction`` runs (an exception or None counts as UNKNOW); then an
end-transaction request goes out one-way, without waiting for an answer. The
coordinator (``outbox coordinator``) makes the message visible on COMMIT, drops it on
ROLLBACK, and for anything unresolved asks one live producer of the group to run
``check_local_transaction``. Names and defaults follow Apache RocketMQ 4.x; see
shared/design/models.md, model B.

The burden is on the app: check-back is only as correct as ``check_local_transaction``.
``SqlTransactionListener`` records each transaction id inside the local transaction,
which is what makes the answer reliable.
"""

from __future__ import annotations

import abc
import enum
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from outbox.message import build_message

log = logging.getLogger("outbox.halfop")

# Streams (JetStream stands in for the commit log) and subjects of the protocol.
HALF_TOPIC = "RMQ_SYS_TRANS_HALF_TOPIC"
OP_TOPIC = "RMQ_SYS_TRANS_OP_HALF_TOPIC"
CHECK_MAX_TOPIC = "TRANS_CHECK_MAX_TIME_TOPIC"
END_SUBJECT = "RMQ_SYS_TRANS_END"
CHECK_SUBJECT = "RMQ_SYS_TRANS_CHECK"  # + "." + producer group
# Message properties, as RocketMQ names them.
REAL_TOPIC = "REAL_TOPIC"
PGROUP = "PGROUP"
TRAN_MSG = "TRAN_MSG"
UNIQ_KEY = "UNIQ_KEY"
TRANSACTION_ID = "__transactionId__"
CHECK_TIMES = "TRANSACTION_CHECK_TIMES"
CHECK_IMMUNITY_TIME = "CHECK_IMMUNITY_TIME_IN_SECONDS"
BORN_TIMESTAMP = "BORN_TIMESTAMP"  # ms since the epoch, when the half was sent
HALF_OFFSET = "HALF_OFFSET"
COMMIT_OR_ROLLBACK = "COMMIT_OR_ROLLBACK"
OP_TAG = "d"  # an op message's tag: the half at this offset is done
SYSTEM_PROPERTIES = {REAL_TOPIC, PGROUP, TRAN_MSG, CHECK_TIMES, BORN_TIMESTAMP, TRANSACTION_ID}


class LocalTransactionState(enum.Enum):
    COMMIT_MESSAGE = "COMMIT_MESSAGE"
    ROLLBACK_MESSAGE = "ROLLBACK_MESSAGE"
    UNKNOW = "UNKNOW"  # RocketMQ's spelling
    UNKNOWN = "UNKNOW"  # an alias of UNKNOW


class SendStatus(enum.Enum):
    SEND_OK = "SEND_OK"
    SEND_FAILED = "SEND_FAILED"  # the half was not stored: nothing ran, nothing to undo


@dataclass(frozen=True)
class TransactionMessage:
    """What a listener sees: the message and where its half is."""

    msg_id: str
    topic: str
    payload: bytes
    transaction_id: str
    key: str | None = None
    tags: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    half_offset: int | None = None
    born_timestamp_ms: int = 0
    check_times: int = 0

    @property
    def age_s(self) -> float:
        return time.time() - self.born_timestamp_ms / 1000


@dataclass(frozen=True)
class SendResult:
    send_status: SendStatus
    msg_id: str
    transaction_id: str
    half_offset: int | None
    local_state: LocalTransactionState
    error: str | None = None


class TransactionListener(abc.ABC):
    @abc.abstractmethod
    def execute_local_transaction(self, msg: TransactionMessage, arg: Any) -> LocalTransactionState:
        """Run the local transaction; say how it ended."""

    @abc.abstractmethod
    def check_local_transaction(self, msg: TransactionMessage) -> LocalTransactionState:
        """Asked later by the coordinator: did the transaction of ``msg`` commit?"""


def half_headers(msg: TransactionMessage, group: str) -> dict[str, str]:
    """The half's properties: the real topic and group kept aside, as the broker does."""
    headers = dict(msg.headers)
    if msg.key is not None:
        headers["Outbox-Key"] = msg.key
    if msg.tags is not None:
        headers["Outbox-Tags"] = msg.tags
    headers.update(
        {
            REAL_TOPIC: msg.topic,
            PGROUP: group,
            TRAN_MSG: "true",
            UNIQ_KEY: msg.msg_id,
            TRANSACTION_ID: msg.transaction_id,
            BORN_TIMESTAMP: str(msg.born_timestamp_ms),
            CHECK_TIMES: str(msg.check_times),
        }
    )
    return headers


def message_from_half(
    headers: dict[str, str], payload: bytes, half_offset: int
) -> TransactionMessage:
    app_headers = {
        k: v
        for k, v in headers.items()
        if k not in SYSTEM_PROPERTIES and k not in (UNIQ_KEY, "Nats-Msg-Id")
    }
    return TransactionMessage(
        msg_id=headers.get(UNIQ_KEY, ""),
        topic=headers.get(REAL_TOPIC, ""),
        payload=payload,
        transaction_id=headers.get(TRANSACTION_ID, ""),
        key=app_headers.pop("Outbox-Key", None),
        tags=app_headers.pop("Outbox-Tags", None),
        headers=app_headers,
        half_offset=half_offset,
        born_timestamp_ms=int(headers.get(BORN_TIMESTAMP, "0") or 0),
        check_times=int(headers.get(CHECK_TIMES, "0") or 0),
    )


class TransactionProducer:
    """RocketMQ's TransactionMQProducer over NATS JetStream.

    ``check_threads`` / ``check_queue`` size the pool that answers check requests
    (RocketMQ: 1 thread, a queue of 2,000); a full queue drops the request, and the
    coordinator asks again at its next round.
    """

    def __init__(
        self,
        group: str,
        broker: str,
        listener: TransactionListener,
        *,
        check_threads: int = 1,
        check_queue: int = 2000,
        send_timeout_s: float = 3.0,
        max_payload_bytes: int = 1024 * 1024,
    ) -> None:
        from relay.halfop_link import ProducerLink

        self.group = group
        self.listener = listener
        self.send_timeout_s = send_timeout_s
        self.max_payload_bytes = max_payload_bytes
        self._link = ProducerLink(broker, group, self._on_check)
        self._checks: ThreadPoolExecutor | None = None
        self._check_capacity = check_queue + check_threads
        self._check_slots = threading.BoundedSemaphore(self._check_capacity)
        self._check_threads = check_threads
        self.checks_answered = 0
        self.checks_dropped = 0

    def start(self, timeout: float = 10.0) -> None:
        # Fresh slots each start: answers cancelled by a stop never gave theirs back.
        self._check_slots = threading.BoundedSemaphore(self._check_capacity)
        self._checks = ThreadPoolExecutor(
            self._check_threads, thread_name_prefix=f"check-{self.group}"
        )
        self._link.start(timeout)

    def stop(self, timeout: float = 5.0) -> None:
        self._link.stop(timeout)
        if self._checks is not None:
            self._checks.shutdown(wait=True, cancel_futures=True)
            self._checks = None

    def send_in_transaction(
        self,
        topic: str,
        payload: object,
        arg: Any = None,
        *,
        key: str | None = None,
        tags: str | list[str] | None = None,
        headers: dict[str, str] | None = None,
    ) -> SendResult:
        built = build_message(
            topic,
            payload,
            key=key,
            tags=tags,
            headers=headers,
            max_payload_bytes=self.max_payload_bytes,
        )
        msg = TransactionMessage(
            msg_id=built.msg_id,
            topic=built.topic,
            payload=built.payload,
            transaction_id=str(uuid.uuid4()),
            key=built.key,
            tags=built.tags,
            headers=built.headers,
            born_timestamp_ms=int(time.time() * 1000),
        )
        try:
            offset = self._link.send_half(msg, self.send_timeout_s)
        except Exception as exc:
            log.warning("half send of %s failed: %r", msg.msg_id, exc)
            return SendResult(
                SendStatus.SEND_FAILED, msg.msg_id, msg.transaction_id, None,
                LocalTransactionState.ROLLBACK_MESSAGE, repr(exc),
            )  # fmt: skip
        msg = TransactionMessage(**{**msg.__dict__, "half_offset": offset})
        state = self._run_local(msg, arg)
        self._link.end_transaction(msg, state)  # one-way: no answer awaited
        return SendResult(SendStatus.SEND_OK, msg.msg_id, msg.transaction_id, offset, state)

    def _run_local(self, msg: TransactionMessage, arg: Any) -> LocalTransactionState:
        try:
            state = self.listener.execute_local_transaction(msg, arg)
        except Exception:
            log.exception("execute_local_transaction raised for %s: UNKNOW", msg.msg_id)
            return LocalTransactionState.UNKNOW
        return state if isinstance(state, LocalTransactionState) else LocalTransactionState.UNKNOW

    def _on_check(self, msg: TransactionMessage) -> None:
        """Called on the link's loop for each check request; answered from the pool."""
        pool = self._checks
        if pool is None or not self._check_slots.acquire(blocking=False):
            self.checks_dropped += 1  # queue full: the coordinator asks again later
            return
        try:
            pool.submit(self._answer_check, msg)
        except RuntimeError:  # pool shut down
            self._check_slots.release()

    def _answer_check(self, msg: TransactionMessage) -> None:
        try:
            try:
                state = self.listener.check_local_transaction(msg)
            except Exception:
                log.exception("check_local_transaction raised for %s: UNKNOW", msg.msg_id)
                state = LocalTransactionState.UNKNOW
            if not isinstance(state, LocalTransactionState):
                state = LocalTransactionState.UNKNOW
            self._link.end_transaction(msg, state, check_answer=True)
            self.checks_answered += 1
        finally:
            self._check_slots.release()


__all__ = [
    "LocalTransactionState",
    "SendResult",
    "SendStatus",
    "SqlTransactionListener",
    "TransactionListener",
    "TransactionMessage",
    "TransactionProducer",
]


class SqlTransactionListener(TransactionListener):
    """A listener for SQLAlchemy apps that makes check-back answer correctly.

    ``work(session, msg, arg)`` is the app's local transaction. The listener writes
    one row (the transaction id) in the same transaction, so afterwards the row
    exists if and only if the local transaction committed. Check-back then answers:
    COMMIT when the row exists; ROLLBACK when it does not and the half is older than
    ``rollback_after_s`` (the local transaction cannot still be running: keep this
    above your longest transaction); UNKNOW otherwise (ask again later).
    """

    def __init__(
        self,
        db: Any,
        work: Any,
        *,
        group: str = "default",
        rollback_after_s: float = 60.0,
    ) -> None:
        from sqlalchemy.orm import sessionmaker

        from outbox.config import engine_from

        self.engine = engine_from(db)
        self.sessions = sessionmaker(self.engine)
        self.work = work
        self.group = group
        self.rollback_after_s = rollback_after_s

    def execute_local_transaction(self, msg: TransactionMessage, arg: Any) -> LocalTransactionState:
        from sqlalchemy import insert

        from outbox.table import transaction_record

        session = self.sessions()
        try:
            session.begin()
            self.work(session, msg, arg)
            session.execute(
                insert(transaction_record).values(
                    transaction_id=msg.transaction_id,
                    producer_group=self.group,
                    msg_id=uuid.UUID(msg.msg_id),
                )
            )
        except Exception:
            session.rollback()
            session.close()
            log.info("local transaction %s rolled back", msg.transaction_id, exc_info=True)
            return LocalTransactionState.ROLLBACK_MESSAGE
        try:
            session.commit()
        except Exception:  # the COMMIT's fate is unknown (e.g. the connection died)
            log.warning("commit of %s failed: UNKNOW", msg.transaction_id, exc_info=True)
            return LocalTransactionState.UNKNOW
        finally:
            session.close()
        return LocalTransactionState.COMMIT_MESSAGE

    def check_local_transaction(self, msg: TransactionMessage) -> LocalTransactionState:
        from sqlalchemy import select

        from outbox.table import transaction_record

        with self.engine.connect() as conn:
            found = conn.execute(
                select(transaction_record.c.transaction_id).where(
                    transaction_record.c.transaction_id == msg.transaction_id
                )
            ).first()
        if found is not None:
            return LocalTransactionState.COMMIT_MESSAGE
        if msg.age_s > self.rollback_after_s:
            return LocalTransactionState.ROLLBACK_MESSAGE
        return LocalTransactionState.UNKNOW
