"""One background thread running an asyncio loop that owns a broker connection.

The fast path (Dispatcher) and the sweeper both publish through it. It connects in
the background, retrying with backoff, so a process starts even while its broker is
down; the adapter answers "retry" until the connection is up.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Coroutine
from typing import Any, Protocol, TypeVar

from relay.brokers import Broker
from relay.brokers.base import BrokerRefused
from relay.outage import Outage
from relay.part import START_TIMEOUT_S, Lifecycle

log = logging.getLogger("relay.loop")

T = TypeVar("T")


class Connection(Protocol):
    """What a loop owns: something that connects and closes on it (a Broker, say)."""

    async def connect(self) -> None: ...

    async def close(self) -> None: ...


class ConnectionLoop(Lifecycle):
    """The thread, the loop and the background (re)connect for any ``Connection``.

    ``start()`` returns once the loop runs (the connection comes up in the background);
    ``stop(timeout)`` closes the connection and ends the thread (relay.part's contract).
    """

    def __init__(self, connection: Connection, name: str) -> None:
        super().__init__()
        self.connection = connection
        self.name = name
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._connected = threading.Event()
        self._done: asyncio.Event | None = None
        self._connecting: asyncio.Task[None] | None = None
        # One per broker, shared by all that publish through this loop (the sweeper too)
        # and by the adapter's own reconnects when it tracks them (NATS does).
        self.outage: Outage = getattr(connection, "outage", None) or Outage("broker", log)

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S):
            raise TimeoutError(f"{self.name}: loop did not start within {START_TIMEOUT_S} s")

    def wait_connected(self, timeout: float) -> bool:
        """True once the first connection is up (the adapter reconnects by itself after)."""
        return self._connected.wait(timeout)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the loop from any thread (a RuntimeError once it has closed)."""
        assert self.loop is not None, "start() first"
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def reconnect(self) -> None:
        """Connect again in the background, as at start: for a connection its client gave
        up on for good. Call it on the loop; nothing happens while a connect runs, or once
        stopping."""
        if self._done is None or self._done.is_set():
            return
        if self._connecting is not None and not self._connecting.done():
            return
        self._connecting = asyncio.get_running_loop().create_task(self._connect())

    def _stop(self, timeout: float) -> bool:
        """Close the broker connection and end the thread (within ``timeout``, plus a
        second for the close: a stop with no time left still says goodbye)."""
        thread, loop, done = self._thread, self.loop, self._done
        assert thread is not None and loop is not None and done is not None, "started"
        deadline = time.monotonic() + timeout
        loop.call_soon_threadsafe(done.set)
        thread.join(max(0.0, deadline - time.monotonic()) + 1.0)
        if thread.is_alive():
            log.warning("%s: thread still running after stop", self.name)
            return False
        return True

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._main())
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _main(self) -> None:
        self._done = asyncio.Event()
        self.loop = asyncio.get_running_loop()
        self._ready.set()
        self._connecting = asyncio.create_task(self._connect())
        await self._done.wait()
        self._connecting.cancel()
        await asyncio.gather(self._connecting, return_exceptions=True)
        await self._cancel_others()
        try:
            await self.connection.close()
        except Exception:
            log.exception("%s: closing the broker failed", self.name)

    async def _connect(self) -> None:
        wait = 0.2
        while True:
            try:
                await self.connection.connect()
                self._connected.set()
                self.outage.ok()
                return
            except BrokerRefused as exc:  # it answered: its words and the setting to fix
                self.outage.refused(str(exc))
            except Exception as exc:
                self.outage.failed(f"connect failed ({exc.__class__.__name__})")
            await asyncio.sleep(wait)
            wait = min(wait * 2, 5.0)

    async def _cancel_others(self) -> None:
        current = asyncio.current_task()
        others = [t for t in asyncio.all_tasks() if t is not current]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)


class BrokerLoop(ConnectionLoop):
    """A loop that owns a broker adapter: the fast path and the sweeper publish through it."""

    def __init__(self, broker: Broker, name: str = "outbox-relay") -> None:
        super().__init__(broker, name)
        self.broker = broker
