"""The NATS adapter's own publish path: one reply subscription, one deadline per batch.

Real nats-server each; a paused server (SIGSTOP) makes an ack late on purpose, a cut
TCP proxy makes a reconnect with publishes in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from outbox.broker import Outcome
from outbox.message import Message, build_message
from relay.brokers.base import NOT_CONNECTED
from relay.brokers.nats import TIMED_OUT, NatsBroker, read_stream
from relay.testing.embedded import NatsServer
from relay.testing.faults import TcpProxy


async def until(condition: Callable[[], object], what: str, timeout: float = 10.0) -> None:
    """Poll ``condition`` without blocking the loop; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.005)


@contextlib.contextmanager
def paused(server: NatsServer) -> Iterator[None]:
    """The server stopped (SIGSTOP: every thread of it), then resumed."""
    assert server.proc is not None
    proc = server.proc
    proc.send_signal(signal.SIGSTOP)
    try:
        threads = Path(f"/proc/{proc.pid}/task")
        deadline = time.monotonic() + 10
        while not all(_stopped(t / "stat") for t in threads.iterdir()):
            assert time.monotonic() < deadline, "nats-server did not stop"
            time.sleep(0.001)
        yield
    finally:
        proc.send_signal(signal.SIGCONT)


def _stopped(stat: Path) -> bool:
    try:  # "pid (comm) state ...": the state follows the last ')'
        return stat.read_text().rpartition(")")[2].split()[0] in "tT"
    except FileNotFoundError:
        return True  # a thread that ended


def messages(prefix: str, n: int) -> list[Message]:
    return [build_message(f"{prefix}.orders", {"n": i}, max_payload_bytes=1000) for i in range(n)]


def url(server_url: str, stream: tuple[str, str], timeout: float = 5.0) -> str:
    name, prefix = stream
    return f"{server_url}?stream={name}&subjects={prefix}.>&timeout={timeout}"


def test_a_second_copy_is_reported_duplicate_with_the_first_receipt(
    nats_server: NatsServer, stream: tuple[str, str]
) -> None:
    async def main() -> None:
        async with NatsBroker(url(nats_server.url, stream)) as broker:
            [message] = messages(stream[1], 1)
            [first] = await broker.publish([message])
            [second] = await broker.publish([message])
            assert (first.ok, first.duplicate) == (True, False)
            assert (second.ok, second.duplicate) == (True, True)
            assert second.receipt == first.receipt == f"{stream[0]}:1"

    asyncio.run(main())


def test_a_subject_no_stream_captures_is_permanent(
    nats_server: NatsServer, stream: tuple[str, str]
) -> None:
    async def main() -> None:
        async with NatsBroker(url(nats_server.url, stream)) as broker:
            stray = build_message(f"{stream[1]}x.orders", b"x", max_payload_bytes=1000)
            [good] = messages(stream[1], 1)
            results = await broker.publish([stray, good])
            assert results[0].outcome is Outcome.PERMANENT
            assert results[0].error == f"no JetStream stream captures subject {stray.topic!r}"
            assert results[1].ok

    asyncio.run(main())


def test_a_publish_while_the_stream_is_being_made_is_retried_not_refused(
    nats_server: NatsServer, stream: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connection is up before the adapter's stream exists: a publish in between
    (the fast path's first, on a loaded machine) must come back "retry", not "no stream
    captures subject" (permanent: left to a sweeper, out of order)."""

    async def main() -> None:
        broker = NatsBroker(url(nats_server.url, stream))
        making, release = asyncio.Event(), asyncio.Event()
        real = broker.ensure_stream

        async def slow_ensure(name: str, subjects: list[str]) -> None:
            making.set()
            await release.wait()
            await real(name, subjects)

        monkeypatch.setattr(broker, "ensure_stream", slow_ensure)
        connecting = asyncio.create_task(broker.connect())
        await asyncio.wait_for(making.wait(), 10)
        [early] = await broker.publish(messages(stream[1], 1))
        assert (early.outcome, early.error) == (Outcome.RETRY, NOT_CONNECTED)
        release.set()
        await connecting
        try:
            [later] = await broker.publish(messages(stream[1], 1))
            assert later.ok
        finally:
            await broker.close()

    asyncio.run(main())


def test_an_ack_after_the_batch_timeout_is_ignored(
    nats_server: NatsServer, stream: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        async with NatsBroker(url(nats_server.url, stream)):
            pass  # creates the stream
        broker = NatsBroker(url(nats_server.url, stream, timeout=0.3))
        async with broker:
            nc = broker._nc
            assert nc is not None
            batch = messages(stream[1], 3)
            with paused(nats_server):  # the acks wait until it resumes
                results = await broker.publish(batch)
            assert [(r.outcome, r.error) for r in results] == [(Outcome.RETRY, TIMED_OUT)] * 3
            assert broker._awaited == {}
            acks = nc.stats["in_msgs"]
            await until(lambda: nc.stats["in_msgs"] >= acks + 3, "the late acks")
            assert broker._awaited == {}
            # They were stored: publishing again is a duplicate, and the client still works.
            again = await broker.publish(batch)
            assert [(r.ok, r.duplicate) for r in again] == [(True, True)] * 3

    with caplog.at_level(logging.WARNING, logger="relay.brokers.nats"):
        asyncio.run(main())
    assert not caplog.records  # no error from the subscription callback


def test_publishes_in_flight_across_a_reconnect_are_each_ok_or_retry(
    nats_server: NatsServer, stream: tuple[str, str]
) -> None:
    """The server is paused so that all are in flight when the connection is cut; it
    may store some of them still: their acks are lost, so they are retried, and the
    stream drops the second copy."""
    proxy = TcpProxy(nats_server.port).start()

    async def main() -> None:
        broker = NatsBroker(url(f"nats://127.0.0.1:{proxy.port}", stream))
        async with broker:
            nc = broker._nc
            assert nc is not None
            [first] = await broker.publish(messages(stream[1], 1))
            batches = [messages(stream[1], 500) for _ in range(8)]
            with paused(nats_server):
                calls = [asyncio.ensure_future(broker.publish(b)) for b in batches]
                await until(lambda: len(broker._awaited) == 4000, "all handed to the client")
                proxy.stop()  # cut the connection with every publish in flight
                proxy.start()
            answers = await asyncio.wait_for(asyncio.gather(*calls), timeout=30)
            results = [r for answer in answers for r in answer]
            assert {r.outcome for r in results} <= {Outcome.OK, Outcome.RETRY}
            assert {r.error for r in results if not r.ok} <= {NOT_CONNECTED, TIMED_OUT}
            assert broker._awaited == {}
            await until(lambda: nc.is_connected, "the reconnect")
            retried = [m for b, a in zip(batches, answers, strict=True)
                       for m, r in zip(b, a, strict=True) if not r.ok]  # fmt: skip
            assert all(r.ok for r in await broker.publish(retried))  # the relay's next pass
        stored = await read_stream(nats_server.url, stream[0])
        sent = {m.msg_id for b in batches for m in b}
        assert first.ok and len(stored) == len(sent) + 1  # none lost, none twice
        assert {m.msg_id for m in stored} >= sent

    try:
        asyncio.run(main())
    finally:
        proxy.stop()
