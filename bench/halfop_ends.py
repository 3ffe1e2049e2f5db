"""What an end request costs model B's coordinator: `python -m bench.halfop_ends`.

``--requests`` halfs (3,000) are stored in an embedded nats-server, then their COMMIT
end requests are sent at once, as producers send them, to a coordinator in this process
(no database: the coordinator alone sets the pace). Shown: the time until every op is
written, and CPU time per request of this process (the coordinator's thread, plus the
sender's small share) and of nats-server over that phase. Each request reads and writes
the transaction's settlement record (the SETTLED bucket), publishes the real message
and writes the op. On 2 shared CPUs the figures move by 30 % from run to run: run it
a few times.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid

import nats

from bench.report import print_rows
from outbox.message import build_message
from relay.brokers.nats import create_stream
from relay.lab.halfop import Coordinator, CoordinatorSettings
from relay.lab.halfop.coordinator import SETTLED_BUCKET
from relay.lab.halfop.protocol import (
    COMMIT_OR_ROLLBACK,
    END_SUBJECT,
    HALF_OFFSET,
    HALF_TOPIC,
    PGROUP,
    TRANSACTION_ID,
    UNIQ_KEY,
    LocalTransactionState,
    TransactionMessage,
    half_headers,
)
from relay.testing.embedded import NatsServer

# No round during the run; every end request comes in time.
SETTINGS = CoordinatorSettings(check_interval_s=3600, transaction_timeout_s=600)


async def store_halfs(url: str, count: int) -> list[dict[str, str]]:
    """``count`` halfs stored; the COMMIT end request of each."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    requests = []
    for _ in range(count):
        msg = TransactionMessage.of(
            build_message("real.o", b"x" * 100, max_payload_bytes=2**20),
            transaction_id=str(uuid.uuid4()),
            born_timestamp_ms=int(time.time() * 1000),
        )
        ack = await js.publish(HALF_TOPIC, msg.payload, headers=half_headers(msg, "bench"))
        requests.append(
            {
                HALF_OFFSET: str(ack.seq),
                COMMIT_OR_ROLLBACK: LocalTransactionState.COMMIT_MESSAGE.value,
                TRANSACTION_ID: msg.transaction_id,
                UNIQ_KEY: msg.msg_id,
                PGROUP: "bench",
            }
        )
    await nc.close()
    return requests


async def send_ends(url: str, requests: list[dict[str, str]]) -> None:
    nc = await nats.connect(url)
    for headers in requests:
        await nc.publish(END_SUBJECT, b"", headers=headers)
    await nc.flush()
    await nc.close()


async def record_bytes(url: str) -> tuple[int, int]:
    """The SETTLED bucket's records and the bytes the server stores for them."""
    nc = await nats.connect(url)
    try:
        state = (await nc.jetstream().stream_info(f"KV_{SETTLED_BUCKET}")).state
    finally:
        await nc.close()
    return state.messages, state.bytes


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (/proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description="model B: the cost of an end request")
    parser.add_argument("--requests", type=int, default=3000)
    count = parser.parse_args().requests
    with NatsServer() as server:
        assert server.proc is not None
        create_stream(server.url, "REAL", "real.>")
        coordinator = Coordinator(server.url, SETTINGS)
        coordinator.start()
        requests = asyncio.run(store_halfs(server.url, count))
        began, cpu, server_cpu = (
            time.perf_counter(),
            time.process_time(),
            cpu_seconds(server.proc.pid),
        )
        asyncio.run(send_ends(server.url, requests))
        while coordinator.stats.ops_written < count:
            time.sleep(0.005)
        seconds = time.perf_counter() - began
        cpu = time.process_time() - cpu
        server_cpu = cpu_seconds(server.proc.pid) - server_cpu
        coordinator.stop()
        records, stored = asyncio.run(record_bytes(server.url))
    print_rows(
        f"model B end requests, {os.cpu_count()} CPUs",
        [
            ("end requests settled", f"{count:,} in {seconds:.2f} s ({count / seconds:,.0f}/s)"),
            ("CPU per request, coordinator", f"{cpu / count * 1e6:.0f} us"),
            ("CPU per request, nats-server", f"{server_cpu / count * 1e6:.0f} us"),
            ("settlement records kept", f"{records:,}, {stored / max(records, 1):.0f} bytes each"),
        ],
    )


if __name__ == "__main__":
    main()
