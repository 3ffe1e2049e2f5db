"""Model B's producer side: ``TransactionProducer`` and ``SqlTransactionListener``.

The sequence of ``TransactionProducer.send_in_transaction``: the half message is sent
synchronously, retried as RocketMQ retries a failed send (if every attempt fails the
local transaction is NOT run); then the listener's
``execute_local_transaction`` runs (an exception or None counts as UNKNOW); then an
end-transaction request goes out one-way, without waiting for an answer
(relay.lab.halfop.protocol has the whole protocol).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.orm import sessionmaker

from outbox import migrate
from outbox.engines import engine_from
from outbox.errors import ConfigError
from outbox.message import build_message
from outbox.table import transaction_record
from relay.lab.halfop.link import ProducerLink, worth_retrying
from relay.lab.halfop.protocol import (
    LocalTransactionState,
    SendResult,
    SendStatus,
    TransactionListener,
    TransactionMessage,
)

log = logging.getLogger("relay.lab.halfop")


class TransactionProducer:
    """RocketMQ's TransactionMQProducer over NATS JetStream.

    ``retry_times_when_send_failed`` (RocketMQ's retryTimesWhenSendFailed, default 2):
    a half send that failed for a reason another attempt may fix (a timeout, no
    connection, JetStream unavailable) is tried again, up to that many more times;
    bad input (e.g. PayloadTooLarge) is not. Each attempt has ``send_timeout_s``,
    waiting in it for the connection while the link reconnects (and, for a retry, for
    JetStream to answer), so a send that fails every time takes up to (1 + retries) x
    ``send_timeout_s``. The halfs of all
    attempts carry the transaction id as ``Nats-Msg-Id``: when a lost ack made the
    producer send again, the server keeps the first copy only and acks with its offset.
    ``half_retries`` counts the attempts after a first one; ``halfs_deduplicated`` those
    the server already had; ``reconnects`` the times the link connected anew after the
    server closed its connection (the link always comes back, check subscription too).

    ``check_threads`` / ``check_queue`` size the pool that answers check requests
    (RocketMQ: 1 thread, a queue of 2,000); a full queue drops the request, and the
    coordinator asks again at its next round.

    ``drop_end_requests`` is a fault for tests and comparisons: while True, phase-2
    end-transaction requests never leave (check answers still do), so only
    check-back settles the transactions. It can be switched at any time.
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
        drop_end_requests: bool = False,
        retry_times_when_send_failed: int = 2,
    ) -> None:
        self.group = group
        self.listener = listener
        self.send_timeout_s = send_timeout_s
        self.retry_times_when_send_failed = retry_count(retry_times_when_send_failed)
        self.max_payload_bytes = max_payload_bytes
        self._link = ProducerLink(broker, group, self._on_check)
        self.drop_end_requests = drop_end_requests
        self._checks: ThreadPoolExecutor | None = None
        self._check_capacity = check_queue + check_threads
        self._check_slots = threading.BoundedSemaphore(self._check_capacity)
        self._check_threads = check_threads
        self.checks_answered = 0
        self.checks_dropped = 0
        self.half_retries = 0
        self.halfs_deduplicated = 0
        self._counting = threading.Lock()  # sends may come from many threads

    @property
    def drop_end_requests(self) -> bool:
        return self._link.drop_end_requests

    @drop_end_requests.setter
    def drop_end_requests(self, value: bool) -> None:
        self._link.drop_end_requests = value

    @property
    def ends_sent(self) -> int:
        """End-transaction requests (and check answers) sent so far."""
        return self._link.ends_sent

    @property
    def reconnects(self) -> int:
        """New connections after the server closed the link's connection for good."""
        return self._link.reconnects

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
        msg = TransactionMessage.of(
            built, transaction_id=str(uuid.uuid4()), born_timestamp_ms=int(time.time() * 1000)
        )
        try:
            offset = self._store_half(msg)
        except Exception as exc:
            log.warning("half send of %s failed: %r", msg.msg_id, exc)
            return SendResult(
                SendStatus.SEND_FAILED, msg.msg_id, msg.transaction_id, None,
                LocalTransactionState.ROLLBACK_MESSAGE, repr(exc),
            )  # fmt: skip
        msg = replace(msg, half_offset=offset)
        state = self._run_local(msg, arg)
        self._link.end_transaction(msg, state)  # one-way: no answer awaited
        return SendResult(SendStatus.SEND_OK, msg.msg_id, msg.transaction_id, offset, state)

    def _store_half(self, msg: TransactionMessage) -> int:
        """The half's offset, after at most 1 + retry_times_when_send_failed attempts."""
        attempt = 0
        while True:
            attempt += 1
            try:
                ack = self._link.send_half(msg, self.send_timeout_s, retry=attempt > 1)
            except Exception as exc:
                if attempt > self.retry_times_when_send_failed or not worth_retrying(exc):
                    raise
                log.info("half send of %s failed (%r); sending again", msg.msg_id, exc)
                with self._counting:
                    self.half_retries += 1
                continue
            if ack.duplicate:  # an earlier attempt was stored, its ack lost
                with self._counting:
                    self.halfs_deduplicated += 1
            return int(ack.seq)

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


def retry_count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(
            f"retry_times_when_send_failed: must be a whole number >= 0, got {value!r}"
        )
    return value


class SqlTransactionListener(TransactionListener):
    """A listener for SQLAlchemy apps that makes check-back answer correctly.

    ``work(session, msg, arg)`` is the app's local transaction. The listener writes
    one row (the transaction id) in the same transaction, so afterwards the row
    exists if and only if the local transaction committed (its table,
    ``outbox_transaction_record``, is created here if missing: ``outbox migrate
    --model-b``, on the database's own migration lock). Check-back then answers:
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
        self.engine = engine_from(db)
        migrate.upgrade(self.engine, model_b=True)  # model B's first use makes its table
        self.sessions = sessionmaker(self.engine)
        self.work = work
        self.group = group
        self.rollback_after_s = rollback_after_s

    def execute_local_transaction(self, msg: TransactionMessage, arg: Any) -> LocalTransactionState:
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
