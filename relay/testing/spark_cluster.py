"""A throwaway Spark standalone cluster (a master and its workers) from the installed pyspark.

Each daemon is the pyspark wheel's own ``bin/spark-class`` (no ``sbin`` scripts, nothing
downloaded) on free loopback ports, with its work and log folders under ``root``, in a
process group of its own so ``stop()`` ends it with every executor it launched::

    with SparkCluster(workers=2, cores=1, memory="1g", root=tmp_path) as cluster:
        subprocess.run(["outbox", "reconcile", "--master", cluster.master_url, ...])

``start()`` returns once the master's JSON (``web_url + "/json"``) lists every worker
ALIVE, or raises with the tail of the daemons' logs.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from relay.testing.embedded import free_port

MASTER = "org.apache.spark.deploy.master.Master"
BIND_FAILED = "BindException"  # in a daemon's log when its port was taken
WORKER = "org.apache.spark.deploy.worker.Worker"


class PortTaken(RuntimeError):
    """A daemon could not bind the free port picked for it: another process took it first."""


def spark_home() -> Path:
    """The pyspark package's folder: the wheel ships Spark's bin/ and jars/ there."""
    import pyspark

    return Path(pyspark.__file__).parent


class SparkCluster:
    def __init__(
        self,
        workers: int = 2,
        cores: int = 1,
        memory: str = "1g",
        root: str | Path | None = None,
        daemon_memory: str = "256m",
    ) -> None:
        self.workers, self.cores, self.memory = workers, cores, memory
        self.daemon_memory = daemon_memory  # the master's and workers' own heaps, not executors'
        self._own_root = root is None
        self.root = Path(root or tempfile.mkdtemp(prefix="outbox-spark-"))
        self.port, self.web_port = free_port(), free_port()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}  # by daemon: master, worker-N

    @property
    def master_url(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    @property
    def web_url(self) -> str:
        return f"http://127.0.0.1:{self.web_port}"

    @property
    def log_dir(self) -> Path:
        return self.root / "logs"

    def start(self, timeout: float = 90.0) -> SparkCluster:
        """Start the master and the workers; wait until all workers are ALIVE. A port
        taken between picking and binding it (the daemons do not move to another one)
        gets one more try on new ports. On any failure nothing is left running."""
        try:
            try:
                self._start(timeout)
            except PortTaken:
                self.stop(keep_root=True)
                self.port, self.web_port = free_port(), free_port()
                self._start(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, timeout: float) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        (self.root / "conf").mkdir(exist_ok=True)  # empty: no site spark-defaults leak in
        ports = ["--host", "127.0.0.1", "--port", str(self.port)]
        self._launch("master", [MASTER, *ports, "--webui-port", str(self.web_port)])
        # a worker that finds no master retries only after seconds: start them once it is up
        self._wait(self.master_alive, "the master ALIVE", timeout)
        for n in range(self.workers):
            work = self.root / f"work-{n}"
            work.mkdir(exist_ok=True)
            self._launch(
                f"worker-{n}",
                [WORKER, self.master_url, "--host", "127.0.0.1", "--port", str(free_port()),
                 "--webui-port", str(free_port()), "--cores", str(self.cores),
                 "--memory", self.memory, "--work-dir", str(work)],
            )  # fmt: skip
        wanted = f"{self.workers} ALIVE workers"
        self._wait(lambda: self.alive_workers() >= self.workers, wanted, timeout)

    def master_alive(self) -> bool:
        """Our master is up: its JSON names our port (not another's web UI on that port)."""
        state = self.state()
        return state.get("url") == self.master_url and state.get("status") == "ALIVE"

    def state(self) -> dict[str, Any]:
        """The master's JSON (its status, workers, apps); empty while its web UI is not up."""
        try:
            with urllib.request.urlopen(f"{self.web_url}/json", timeout=2) as answer:
                return dict(json.load(answer))
        except (OSError, ValueError):  # URLError is an OSError
            return {}

    def alive_workers(self) -> int:
        """How many workers the master lists ALIVE."""
        return sum(1 for w in self.state().get("workers", []) if w.get("state") == "ALIVE")

    def stop(self, timeout: float = 20.0, keep_root: bool = False) -> None:
        """End each daemon's process group (SIGTERM, then SIGKILL) and wait for it;
        the workers first, so they do not try to reconnect to a master that left."""
        procs, self.procs = self.procs, {}
        for proc in reversed(procs.values()):
            stop_group(proc, timeout)
        if self._own_root and not keep_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> SparkCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, lines: int = 15) -> str:
        """The last lines of every daemon's log, for an error message."""
        tails = []
        for path in sorted(self.log_dir.glob("*.out")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            tails.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(tails)

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            SPARK_HOME=str(spark_home()),
            SPARK_CONF_DIR=str(self.root / "conf"),
            SPARK_LOG_DIR=str(self.log_dir),
            SPARK_LOCAL_IP="127.0.0.1",
            SPARK_DAEMON_MEMORY=self.daemon_memory,
            # the REST submission server listens on a fixed port (6066): two clusters clash
            # a taken port fails the start (then retried on new ones) instead of the daemon
            # moving silently to the next port, where no one looks for it
            SPARK_MASTER_OPTS="-Dspark.master.rest.enabled=false -Dspark.port.maxRetries=0",
            SPARK_WORKER_OPTS="-Dspark.port.maxRetries=0",
            PYSPARK_PYTHON=sys.executable,  # executors' Python: the one that has pyspark
        )
        return env

    def _launch(self, name: str, args: list[str]) -> None:
        command = [str(spark_home() / "bin" / "spark-class"), *args]
        log: IO[bytes] = open(self.log_dir / f"{name}.out", "ab")  # noqa: SIM115 - the child keeps it
        try:
            proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=self._env(),
                start_new_session=True,  # its own process group: stop() ends its executors too
            )  # fmt: skip
        finally:
            log.close()
        self.procs[name] = proc

    def _wait(self, ready: Callable[[], bool], what: str, timeout: float) -> None:
        """Poll ``ready`` until true; past ``timeout`` or a daemon's exit, raise with the
        logs' tails (PortTaken when a daemon could not bind its port)."""
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [name for name, p in self.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{dead[0]} exited" if dead else f"not within {timeout:.0f} s"
                tail = self.log_tail()
                error = PortTaken if dead and BIND_FAILED in tail else RuntimeError
                raise error(f"Spark cluster at {self.master_url}: no {what} ({why}):\n{tail}")
            time.sleep(0.2)


def stop_group(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM the process's group, SIGKILL it if still there after ``timeout``; the group
    too when its leader has exited (an executor it launched may live on)."""
    signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while group_alive(proc) and time.monotonic() < deadline:
        time.sleep(0.1)
    if group_alive(proc):
        signal_group(proc, signal.SIGKILL)
        proc.wait()


def signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # the whole group is gone already
        os.killpg(proc.pid, sig)


def group_alive(proc: subprocess.Popen[bytes]) -> bool:
    """Any process of the group left (the leader reaped first: a zombie counts as one)."""
    proc.poll()
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return False
    return True
