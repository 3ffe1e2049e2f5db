"""Model B's protocol: stream and subject names, message properties, states, the listener.

The sequence of ``TransactionProducer.send_in_transaction``: the half message is sent
synchronously (if that fails the local transaction is NOT run); then the listener's
``execute_local_transaction`` runs (an exception or None counts as UNKNOW); then an
end-transaction request goes out one-way, without waiting for an answer. The
coordinator (``outbox coordinator``) makes the message visible on COMMIT, drops it on
ROLLBACK, and for anything unresolved asks one live producer of the group to run
``check_local_transaction``. Names and defaults follow Apache RocketMQ 4.x
(docs/models.md, model B, compares it with the outbox).

The burden is on the app: check-back is only as correct as ``check_local_transaction``.
``SqlTransactionListener`` (relay.lab.halfop.producer) records each transaction id inside
the local transaction, which is what makes the answer reliable.
"""

from __future__ import annotations

import abc
import enum
import time
from dataclasses import dataclass, fields
from typing import Any

from outbox.message import Message, carried_headers, uncarried

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
# A discard record without its payload (too large to copy): the payload's size in bytes;
# the payload itself stays in the half stream at HALF_OFFSET.
PAYLOAD_IN_HALF = "PAYLOAD_IN_HALF"
# Bytes a half must leave under the server's max_payload for the coordinator's own
# copies of it: the largest growth is a check request of a put-back copy, a
# HALF_OFFSET line (35 bytes with a 20-digit offset) plus TRANSACTION_CHECK_TIMES
# grown from "0" to at most 20 digits (19): 54 bytes. The rest is margin.
HEADER_HEADROOM = 256
SYSTEM_PROPERTIES = {REAL_TOPIC, PGROUP, TRAN_MSG, CHECK_TIMES, BORN_TIMESTAMP, TRANSACTION_ID}


class LocalTransactionState(enum.Enum):
    COMMIT_MESSAGE = "COMMIT_MESSAGE"
    ROLLBACK_MESSAGE = "ROLLBACK_MESSAGE"
    UNKNOW = "UNKNOW"  # RocketMQ's spelling
    UNKNOWN = "UNKNOW"  # an alias of UNKNOW


class SendStatus(enum.Enum):
    SEND_OK = "SEND_OK"
    SEND_FAILED = "SEND_FAILED"  # the half was not stored: nothing ran, nothing to undo


@dataclass(frozen=True, slots=True, kw_only=True)
class TransactionMessage(Message):
    """What a listener sees: a message (built and checked as ``send()`` builds one) and
    where its half is."""

    transaction_id: str
    half_offset: int | None = None
    born_timestamp_ms: int = 0  # wall clock, ms since the epoch: the half's BORN_TIMESTAMP
    check_times: int = 0

    @classmethod
    def of(cls, message: Message, **half: Any) -> TransactionMessage:
        """``message`` with the fields of its half (``transaction_id`` and the others)."""
        return cls(**{f.name: getattr(message, f.name) for f in fields(Message)}, **half)

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
    """The half's properties: the headers every broker carries (outbox.message), and the
    real topic and group kept aside, as the broker does."""
    headers = carried_headers(msg)
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
    """``half_headers`` undone: the message a check request is about."""
    from relay.brokers.nats import DEDUP_HEADER  # a half comes from NATS: the client is there

    carried = {
        k: v
        for k, v in headers.items()
        if k not in SYSTEM_PROPERTIES and k not in (UNIQ_KEY, DEDUP_HEADER)
    }
    app_headers, key, tags = uncarried(carried)
    return TransactionMessage(
        msg_id=headers.get(UNIQ_KEY, ""),
        topic=headers.get(REAL_TOPIC, ""),
        payload=payload,
        key=key,
        tags=tags,
        headers=app_headers,
        transaction_id=headers.get(TRANSACTION_ID, ""),
        half_offset=half_offset,
        born_timestamp_ms=int(headers.get(BORN_TIMESTAMP, "0") or 0),
        check_times=int(headers.get(CHECK_TIMES, "0") or 0),
    )
