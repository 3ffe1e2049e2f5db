"""The relay's entry point for an app: ``Outbox.start()`` calls ``start_relay`` (the one
place where the app layer imports the relay)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from relay.acks import sql_finisher, sql_verifier
from relay.brokers import Broker, broker_for
from relay.dispatcher import Dispatcher
from relay.listener import Listeners
from relay.loop import BrokerLoop
from relay.worker import RelayJobs

if TYPE_CHECKING:
    from outbox.api import Outbox


def start_relay(
    outbox: Outbox, broker: Broker | None = None
) -> tuple[BrokerLoop, Dispatcher, RelayJobs | None]:
    """Start ``outbox``'s in-process relay: the broker loop, the fast path and (when the
    outbox asks for it) the sweeper jobs. ``broker`` defaults to the outbox's own: its
    Broker object, or a new adapter for its URL."""
    if broker is None:
        given = outbox.broker
        assert given is not None, "Outbox.start() checks the broker first"
        broker = broker_for(given) if isinstance(given, str) else given
    settings = outbox.settings
    hooks = Listeners(*outbox.listeners)  # one set, shared by the fast path and the sweeper
    relay = BrokerLoop(broker)
    relay.start()
    dispatcher = Dispatcher(
        relay,
        sql_finisher(outbox.engine, settings.mark_mode),
        settings,
        verify=sql_verifier(outbox.engine) if settings.verify_commit else None,
        listener=hooks,
    )
    dispatcher.start()
    jobs = RelayJobs(outbox.engine, relay, settings, listener=hooks) if outbox.sweeper else None
    if jobs is not None:
        jobs.start()
    return relay, dispatcher, jobs
