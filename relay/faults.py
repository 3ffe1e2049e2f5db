"""Reusable faults for tests, benches and comparisons.

``TcpProxy(target_port)`` listens on a free loopback port and forwards to the
target. ``stop()`` closes the listener and every forwarded connection (to the client
the broker is gone); ``start()`` listens again on the same port (it came back).
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading

from relay.embedded import free_port


class TcpProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self._listener: socket.socket | None = None
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()

    def start(self) -> TcpProxy:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(
            target=self._accept, args=(listener,), name="tcp-proxy", daemon=True
        ).start()
        return self

    def stop(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, set()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # stopped
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._sockets |= {client, upstream}
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


# A model-B producer that dies by SIGKILL after its local transaction committed and
# before its end request left: check-back alone must settle the message.
_KILLED_PRODUCER = """
import os, sys
from outbox.halfop import SqlTransactionListener, TransactionProducer
from examples.warehouse_orders import place_order

class DiesAfterCommit(SqlTransactionListener):
    def execute_local_transaction(self, msg, arg):
        state = super().execute_local_transaction(msg, arg)
        print(msg.msg_id, state.value, flush=True)
        os.kill(os.getpid(), 9)

listener = DiesAfterCommit(sys.argv[1], place_order, group=sys.argv[4], rollback_after_s=2)
producer = TransactionProducer(group=sys.argv[4], broker=sys.argv[2], listener=listener)
producer.start()
producer.send_in_transaction(sys.argv[3], b"x", {"sku": "K1"})
"""


def kill_producer_after_commit(
    db: str, broker: str, topic: str, group: str = "orders", cwd: str | None = None
) -> tuple[str, str, int]:
    """Run such a producer in a subprocess; returns (msg_id, local state, exit code).

    ``cwd`` must be a checkout (the producer imports ``examples.warehouse_orders``).
    """
    done = subprocess.run(
        [sys.executable, "-c", _KILLED_PRODUCER, db, broker, topic, group],
        cwd=cwd, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    words = done.stdout.split()
    if len(words) != 2:
        raise RuntimeError(f"the producer did not report its transaction: {done.stderr[-2000:]}")
    return words[0], words[1], done.returncode
