"""`outbox purge`: one retention pass now, the one every `outbox relay` worker runs each minute.

The pass is relay.operator.Operator.purge, the code the workers' retention job calls
(relay.sweep.sweeper.Sweeper.purge): this command only reads its settings and shows
what it removed. The retention is the ``retention_s`` setting, given as a flag
(``--retention-days`` or ``--retention-s``), by ``--app``, ``OUTBOX_RETENTION_S`` or
its default, and checked as every setting is (outbox.settings.check).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

from outbox import migrate
from relay.cli.app import add_app_flag
from relay.cli.common import EXIT_OK, Commands, add_db_flag, database
from relay.cli.progress import Counting, counting
from relay.cli.settings_flags import add_settings_flags
from relay.operator import Operator, Purged
from spark_jobs.flags import DAY_S

APP_HELP = ("take --db and the retention from the app's own Outbox (an Outbox, or a "
            "callable returning one), e.g. myshop.outbox:ob; flags still win")  # fmt: skip


def add_purge(commands: Commands) -> None:
    pur = commands.add_parser(
        "purge",
        help="delete sent and canceled messages older than the retention, now",
        description="One retention pass now, as every `outbox relay` worker runs it each "
        "minute: delete the sent messages sent more than the retention ago and the "
        "canceled ones written that long ago (by the database clock), --purge-batch rows "
        "per transaction. Pending, dead and skipped messages are never deleted. Stopped "
        "halfway, whole batches are gone and running it again takes the rest. The "
        "retention is a number of days above 0 (0 is refused, as for the setting: "
        "--retention-s 1 purges every settled message older than a second). On a "
        "partitioned table (outbox migrate --partitioned) a day older than the retention "
        "is dropped whole, the messages it held that must stay moved aside first.",
    )
    add_db_flag(pur)
    add_app_flag(pur, APP_HELP)
    add_settings_flags(pur, ["retention_s", "purge_batch"])  # --retention-days too
    pur.add_argument(
        "--json",
        action="store_true",
        help='print {"purged": N, "older_than": TIME, "retention_s": S} on stdout instead',
    )


def cmd_purge(args: argparse.Namespace) -> int:
    settings = args.settings  # flags, --app, OUTBOX_<FIELD>, defaults
    engine = database(args)
    try:
        migrate.require_schema(engine)
        with progress_past_a_batch(settings.purge_batch) as on_batch:
            done = Operator(engine).purge(settings.retention_s, settings.purge_batch, on_batch)
    finally:
        engine.dispose()
    retention = settings.retention_s
    print(json.dumps(purged_json(done, retention)) if args.json else said(done, retention))
    return EXIT_OK


def purged_json(done: Purged, retention_s: float) -> dict[str, object]:
    return {"purged": done.rows, "older_than": done.older_than.isoformat(),
            "retention_s": retention_s, "partitions_dropped": list(done.partitions),
            "kept": done.kept}  # fmt: skip


def said(done: Purged, retention_s: float) -> str:
    """``purged 1200 message(s) sent or canceled before 2026-11-25T09:40:00+00:00
    (retention 3 days)``."""
    before = done.older_than.isoformat()
    said = f"purged {done.rows} message(s) sent or canceled before {before} ({days(retention_s)})"
    if done.partitions:  # a partitioned table
        said += f"; dropped {len(done.partitions)} partition(s): {', '.join(done.partitions)}"
        said += f", {done.kept} message(s) they held kept (pending, dead, skipped or sent late)"
    return said


@contextmanager
def progress_past_a_batch(batch: int) -> Iterator[Callable[[int], None]]:
    """Progress on stderr (relay.cli.progress) once a batch came back full, so there is
    more to delete; a pass that fits in one batch shows none, as requeue's."""
    with ExitStack() as stack:
        shown: list[Counting] = []

        def on_batch(deleted: int) -> None:
            if not shown and deleted >= batch:
                shown.append(stack.enter_context(counting("purge")))
            for display in shown:
                display.add(deleted)

        yield on_batch


def days(retention_s: float) -> str:
    """The retention as a person reads it: ``retention 3 days``, ``retention 0.5 days``."""
    return f"retention {retention_s / DAY_S:g} days"


PARSERS = (add_purge,)
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {"purge": cmd_purge}
