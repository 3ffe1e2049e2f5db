"""Model B, for comparison with the outbox: RocketMQ-style transactional messages.

An app runs a ``TransactionProducer`` with its ``TransactionListener`` (or the
``SqlTransactionListener``, which makes check-back reliable); ``outbox coordinator``
runs the ``Coordinator``. The modules:

- ``relay.lab.halfop.protocol``: stream and subject names, message properties, the
  ``LocalTransactionState`` answers, ``TransactionMessage`` and ``TransactionListener``.
- ``relay.lab.halfop.producer``: ``TransactionProducer`` (the app side; its
  ``drop_end_requests`` option is the "end requests lost" fault) and
  ``SqlTransactionListener`` (records each committed transaction for check-back).
- ``relay.lab.halfop.link``: the NATS connection a producer sends halfs and end requests on.
- ``relay.lab.halfop.coordinator``: the broker side (``outbox coordinator``), a relay part
  on the shared connection loop, made of ``halfs`` (its streams and buckets, the rules of
  a half), ``ends`` (end transactions), ``checks`` (check-back rounds) and ``oplog``
  (the op stream's reading); ``settings``: its settings and counters.

The producer, link and coordinator need the ``nats`` extra; the protocol does not, so
they are imported on first use of their names here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from relay.lab.halfop.protocol import (
    CHECK_MAX_TOPIC,
    HALF_TOPIC,
    OP_TOPIC,
    LocalTransactionState,
    SendResult,
    SendStatus,
    TransactionListener,
    TransactionMessage,
)

if TYPE_CHECKING:
    from relay.lab.halfop.coordinator import Coordinator, CoordinatorSettings
    from relay.lab.halfop.producer import SqlTransactionListener, TransactionProducer

__all__ = [
    "CHECK_MAX_TOPIC",
    "HALF_TOPIC",
    "OP_TOPIC",
    "Coordinator",
    "CoordinatorSettings",
    "LocalTransactionState",
    "SendResult",
    "SendStatus",
    "SqlTransactionListener",
    "TransactionListener",
    "TransactionMessage",
    "TransactionProducer",
]

_NEEDS_NATS = {
    "Coordinator": "relay.lab.halfop.coordinator",
    "CoordinatorSettings": "relay.lab.halfop.coordinator",
    "SqlTransactionListener": "relay.lab.halfop.producer",
    "TransactionProducer": "relay.lab.halfop.producer",
}


def __getattr__(name: str) -> Any:
    module = _NEEDS_NATS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
