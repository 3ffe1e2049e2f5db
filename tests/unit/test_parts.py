"""relay.part's contract on every part and on the Relay: start() and stop(timeout) are
idempotent and safe from any thread, a second stop() does nothing, stop() before start()
is fine; and only relay/runtime.py assembles the parts."""

from __future__ import annotations

import ast
import asyncio
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine

from outbox import migrate
from outbox.events import Stats
from outbox.message import build_message
from outbox.settings import Settings
from relay.fastpath.acks import AckBatcher
from relay.fastpath.dispatcher import Dispatcher
from relay.loop import BrokerLoop
from relay.part import Part
from relay.runtime import Relay
from relay.sweep.jobs import SweeperJobs
from relay.sweep.sweeper import Sweeper
from relay.testing import MemoryBroker
from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parents[2]
FAST = Settings(sweep_interval_s=0.05, ack_flush_ms=2)


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    url = f"sqlite:///{tmp_path / 'parts.sqlite'}"
    migrate.upgrade(url)
    eng = create_engine(url)
    yield eng
    eng.dispose()


class Built:
    """One part under test, and what must run before and after it (its owner's share)."""

    def __init__(self, part: Part, before: Callable[[], None] = lambda: None) -> None:
        self.part = part
        self.before = before
        self.after: list[Callable[[], None]] = []


def broker_loop(engine: Engine) -> Built:
    return Built(BrokerLoop(MemoryBroker()))


def dispatcher(engine: Engine) -> Built:
    loop = BrokerLoop(MemoryBroker())
    built = Built(Dispatcher(loop, lambda acks: len(acks), FAST), before=loop.start)
    built.after.append(lambda: loop.stop(2))
    return built


def ack_batcher(engine: Engine) -> Built:
    loop = asyncio.new_event_loop()  # an AckBatcher is made on the broker loop
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def make() -> AckBatcher:
        return AckBatcher(lambda acks: len(acks), Stats())

    def close_loop() -> None:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)

    built = Built(asyncio.run_coroutine_threadsafe(make(), loop).result(5))
    built.after.append(close_loop)
    return built


def sweeper(engine: Engine) -> Built:
    loop = BrokerLoop(MemoryBroker())
    built = Built(Sweeper(engine, loop, FAST), before=loop.start)
    built.after.append(lambda: loop.stop(2))
    return built


def sweeper_jobs(engine: Engine) -> Built:
    loop = BrokerLoop(MemoryBroker())
    built = Built(SweeperJobs(Sweeper(engine, loop, FAST)), before=loop.start)
    built.after.append(lambda: loop.stop(2))
    return built


def relay(engine: Engine) -> Built:
    return Built(Relay(engine, MemoryBroker(), FAST))


PARTS = [broker_loop, dispatcher, ack_batcher, sweeper, sweeper_jobs, relay]


@pytest.fixture(params=PARTS, ids=[make.__name__ for make in PARTS])
def built(request: pytest.FixtureRequest, engine: Engine) -> Iterator[Built]:
    made: Built = request.param(engine)
    made.before()
    yield made
    made.part.stop(2)
    for undo in made.after:
        undo()


def test_start_twice_then_stop_twice(built: Built) -> None:
    built.part.start()
    built.part.start()  # nothing more is started
    assert built.part.stop(5) is True
    assert built.part.stop(5) is True  # a no-op: the first one's answer


def test_stop_before_start_is_fine_and_the_part_never_starts(built: Built) -> None:
    threads = set(threading.enumerate())
    assert built.part.stop(1) is True
    built.part.start()
    assert set(threading.enumerate()) <= threads, "a stopped part started threads"
    assert built.part.stop(1) is True


def test_stop_from_another_thread(built: Built) -> None:
    built.part.start()
    answers: list[bool] = []
    stoppers = [threading.Thread(target=lambda: answers.append(built.part.stop(5)))]
    stoppers.append(threading.Thread(target=lambda: answers.append(built.part.stop(5))))
    for stopper in stoppers:
        stopper.start()
    for stopper in stoppers:
        stopper.join(10)
    assert len(answers) == 2 and True in answers  # the other may have come mid-stop
    assert built.part.stop(5) is True


def test_a_relay_publishes_through_a_broker_object_and_stops_every_thread(
    engine: Engine,
) -> None:
    before = {th.ident for th in threading.enumerate()}
    broker = MemoryBroker()
    relay = Relay(engine, broker, FAST, sweeper=False)
    relay.start()
    try:
        assert relay.wait_connected(5)
        messages = [build_message("t.x", f"m{i}", max_payload_bytes=1000) for i in range(3)]
        assert relay.submit(messages, check=False) == 3
        wait_until(lambda: len(broker.published) == 3, what="published")
    finally:
        assert relay.stop(5) is True
    assert not relay.running
    assert relay.submit(messages, check=False) == 0
    assert {th.ident for th in threading.enumerate()} <= before


def test_a_relay_stops_the_parts_it_started_when_one_fails_to_start(engine: Engine) -> None:
    before = {th.ident for th in threading.enumerate()}
    relay = Relay(engine, MemoryBroker(), FAST)
    assert relay.jobs is not None

    def fail() -> None:
        raise RuntimeError("no scheduler")

    relay.jobs._start = fail  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="no scheduler"):
        relay.start()
    assert not relay.running and not relay.broker_loop.running
    wait_until(lambda: {th.ident for th in threading.enumerate()} <= before, 10, "threads gone")


def test_a_relay_stops_the_fast_path_first_and_the_broker_loop_last(engine: Engine) -> None:
    """The fast path gets the whole deadline for what it holds (acked rows not yet
    marked would be published again), and the loop outlives everything publishing."""
    relay = Relay(engine, MemoryBroker(), FAST)
    assert relay.dispatcher is not None and relay.jobs is not None
    parts = {"dispatcher": relay.dispatcher, "jobs": relay.jobs, "sweeper": relay.sweeper,
             "broker_loop": relay.broker_loop}  # fmt: skip
    stopped: list[tuple[str, float]] = []
    for name, part in parts.items():
        real = part.stop

        def record(timeout: float = 5.0, name: str = name, real: Any = real) -> bool:
            stopped.append((name, timeout))
            return bool(real(timeout))

        part.stop = record  # type: ignore[method-assign]
    relay.start()
    assert relay.stop(5) is True
    order = list(dict.fromkeys(name for name, _ in stopped))  # the jobs stop their sweeper too
    assert order == ["dispatcher", "jobs", "sweeper", "broker_loop"]
    assert stopped[0][1] > 4.9  # the whole deadline


ASSEMBLED = {"BrokerLoop", "Dispatcher", "AckBatcher", "SweeperJobs", "Sweeper"}
ALLOWED = {
    "relay/runtime.py",
    "relay/fastpath/dispatcher.py",
}  # the Dispatcher makes its AckBatcher


def constructions(path: Path) -> list[str]:
    """The relay parts ``path`` constructs, as 'Name (line N)'."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            if name in ASSEMBLED:
                found.append(f"{name} (line {node.lineno})")
    return found


def test_no_module_but_relay_runtime_assembles_relay_parts() -> None:
    """Any other place that builds them would start and stop them in its own order."""
    offenders = {}
    for package in ("outbox", "relay"):
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if relative in ALLOWED or relative.startswith("relay/testing/"):
                continue
            if made := constructions(path):
                offenders[relative] = made
    assert offenders == {}
