"""The sweeper's two jobs on a schedule (APScheduler): the sweep and the retention purge.

Run by a ``Relay`` with the sweeper duty: inside an app (``Outbox(..., sweeper=True)``,
the default) and in the ``outbox relay`` worker process; any number of either can run
against one database.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime

from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.schedulers.background import BackgroundScheduler
from sqlalchemy.exc import SQLAlchemyError

from relay.display import one_line
from relay.outage import Outage
from relay.part import Lifecycle
from relay.sweep.quiet import quiet_alembic
from relay.sweep.sweeper import Sweeper

with quiet_alembic():  # the first import of Alembic logs seven INFO lines
    from outbox import migrate

log = logging.getLogger("relay.sweep.jobs")

RETENTION_INTERVAL_S = 60.0


class SkippedRuns(logging.Filter):
    """Drops APScheduler's "skipped: maximum number of running instances" warnings: a sweep
    outlasting its interval (a slow database, a broker outage) is the next run's to follow."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "maximum number of running instances" not in record.getMessage()


# APScheduler logs at INFO each job it runs ("Running job ...", "... executed
# successfully": two lines a second per process), each job added and each start and
# shutdown: an app's log, at INFO, is no place for them. Our scheduler and our executor
# log through loggers only we use, set to WARNING (where a job's failure would show);
# an app that wants their lines sets these two to INFO. The executor's logger is
# APScheduler's "apscheduler.executors.<alias>": the alias is ours.
scheduler_log = logging.getLogger("apscheduler.scheduler.sweeper")
scheduler_log.addFilter(SkippedRuns())
scheduler_log.setLevel(logging.WARNING)
EXECUTOR = "outbox-sweeper"
logging.getLogger(f"apscheduler.executors.{EXECUTOR}").setLevel(logging.WARNING)


class SweeperJobs(Lifecycle):
    """Calls ``sweeper.sweep`` every ``sweep_interval_s`` and, with ``retention``,
    ``sweeper.purge`` every minute, on the scheduler's threads."""

    def __init__(self, sweeper: Sweeper, concurrency: int = 1, retention: bool = True) -> None:
        super().__init__()
        self.sweeper = sweeper
        self.engine = sweeper.engine
        self.settings = sweeper.settings
        self.concurrency = concurrency
        self.retention = retention
        self._scheduler: BackgroundScheduler | None = None
        self._schema_ok = False
        self._schema_told: str | None = None  # the problem last logged, not to repeat it
        self.database = Outage("database", log)  # a sweep a second would log each failure

    def _start(self) -> None:
        # A late sweep still runs (once: coalesce); one still running at the next interval
        # makes APScheduler skip that run, which is expected, not a warning per interval.
        defaults = {"coalesce": True, "max_instances": 1, "misfire_grace_time": None}
        scheduler = BackgroundScheduler(job_defaults=defaults, logger=scheduler_log,
                                        executors={EXECUTOR: ThreadPoolExecutor()})  # fmt: skip
        scheduler.add_job(
            self._sweep, "interval", seconds=self.settings.sweep_interval_s,
            next_run_time=datetime.now(), id="sweep", executor=EXECUTOR,
        )  # fmt: skip
        if self.retention:
            scheduler.add_job(
                self._purge, "interval", seconds=RETENTION_INTERVAL_S,
                next_run_time=datetime.now(), id="retention", executor=EXECUTOR,
            )  # fmt: skip
        scheduler.start()
        self._scheduler = scheduler

    def _stop(self, timeout: float) -> bool:
        """Let a running sweep finish (within ``timeout``); start no new one.

        False when a sweep was still running at the deadline: its batch is marked when
        its publish is answered, or stays pending if the process ends first.
        """
        scheduler, self._scheduler = self._scheduler, None
        assert scheduler is not None, "started"
        deadline = time.monotonic() + timeout
        self.sweeper.stop(timeout)  # a running sweep finishes its batch and claims no more
        done = threading.Thread(target=shut_down, args=(scheduler,), daemon=True)
        done.start()
        done.join(max(0.0, deadline - time.monotonic()))
        if done.is_alive():
            log.warning("a sweep was still running at the stop deadline; its rows stay pending")
            return False
        return True

    def _sweep(self) -> None:
        try:
            if self._schema_at_head():
                self.sweeper.sweep(self.concurrency)
        except SQLAlchemyError as exc:  # the next interval tries again
            self.database.failed(f"sweep failed: {describe(exc)}")
            return
        except Exception:  # a bug, not an outage: its traceback; the job goes on
            log.exception("sweep failed")
            return
        self.database.ok()

    def _purge(self) -> None:
        try:
            if self._schema_at_head():
                self.sweeper.purge()
        except SQLAlchemyError as exc:  # the database is down: the sweep's outage says so
            self.database.failed(f"retention purge failed: {describe(exc)}")
        except Exception:
            log.exception("retention purge failed")

    def _schema_at_head(self) -> bool:
        """Sweep and purge only a schema at this package's head revision (checked until it is).

        A sweeper compares row times with the database's clock: on a schema one migration
        behind (MariaDB before 0003 wrote local times) it would take fresh rows at once or
        recover crashed ones hours late. The fast path does not compare times and goes on.
        """
        if self._schema_ok:
            return True
        try:
            with quiet_alembic():  # Alembic's "Context impl ..." lines, each check
                migrate.require_schema(self.engine)
        except migrate.SchemaProblem as problem:
            if str(problem) != self._schema_told:
                log.error("sweeper paused until the schema is fixed: %s", problem)
                self._schema_told = str(problem)
            return False
        self._schema_ok = True
        return True


def shut_down(scheduler: BackgroundScheduler) -> None:
    """Wait for the running job; submit no other. The jobs go first: APScheduler's own
    shutdown races its scheduler thread, which may submit a due job to the executor it
    just shut down (and log a traceback)."""
    scheduler.remove_all_jobs()  # under the job stores' lock: no submit can follow it
    scheduler.shutdown(wait=True)


def describe(exc: SQLAlchemyError) -> str:
    """The error's class and first line, without SQLAlchemy's SQL echo and links."""
    cause = getattr(exc, "orig", None) or exc
    return f"{type(cause).__name__}: {one_line(str(cause))}"
