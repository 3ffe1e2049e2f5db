"""`outbox purge`: one retention pass now, on PostgreSQL, MariaDB and SQLite.

It deletes the sent rows sent, and the canceled rows written, longer ago than the
retention, and no other; it says how many, on stdout (``--json`` too), with progress on
stderr once a batch came back full; a retention of 0 days or less is bad usage (exit 2)
naming the flag and its rule. The workers' retention job runs the same pass
(relay.operator.Operator.purge), which tests/integration/test_sweeper.py tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, insert, select

from outbox.message import uuid7
from outbox.table import CANCELED, DEAD, PENDING, SENT, SKIPPED, outbox_message
from relay import cli as cli_module
from relay import store
from tests.helpers import migrated

t = outbox_message
OUTBOX = str(Path(sys.executable).with_name("outbox"))
DAY = timedelta(days=1)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OUTBOX_PROGRESS_EVERY_S": "0"}  # a progress line per batch
    env = {k: v for k, v in env.items() if k not in ("OUTBOX_RETENTION_S", "OUTBOX_PURGE_BATCH")}
    return subprocess.run(
        [OUTBOX, *args], capture_output=True, text=True, timeout=60, env=env, check=False
    )


def put(engine: Engine, created: datetime, status: str, sent: datetime | None = None) -> int:
    values: dict[str, Any] = {"msg_id": uuid7(), "topic": "purge.x", "payload": b"{}"}
    values |= {"status": status, "created_at": created, "sent_at": sent}
    with engine.begin() as conn:
        key = conn.execute(insert(t).values(**values)).inserted_primary_key
        assert key is not None
        return int(key[0])


def left(engine: Engine) -> set[int]:
    with engine.connect() as conn:
        return set(conn.execute(select(t.c.id)).scalars())


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> int:
    """The command in this process (its output in ``capsys``): its exit status."""
    capsys.readouterr()
    try:
        return cli_module.main(list(argv))
    except SystemExit as exc:  # argparse's own usage errors
        return exc.code if isinstance(exc.code, int) else 1


def test_purge_takes_old_sent_and_canceled_rows_only(
    any_db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with migrated(any_db) as engine:
        with engine.connect() as conn:
            now = store.db_clock(conn)
        old = [
            put(engine, now - 5 * DAY, SENT, now - 4 * DAY),
            put(engine, now - 9 * DAY, SENT, now - 2 * DAY),
            put(engine, now - 3 * DAY, CANCELED),
        ]
        # Sent a minute ago though written days ago (sent_at counts), canceled lately (10 s
        # ago: older than the second pass's 1 s however fast the first pass ran).
        lately = now - timedelta(seconds=10)
        recent = [put(engine, now - 5 * DAY, SENT, now - DAY / 1440), put(engine, lately, CANCELED)]
        kept = [put(engine, now - 9 * DAY, status) for status in (PENDING, DEAD, SKIPPED)]

        done = cli("purge", "--db", any_db, "--retention-days", "1", "--purge-batch", "2", "--json")
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert (report["purged"], report["retention_s"]) == (3, 86400.0)
        older_than = datetime.fromisoformat(report["older_than"])
        assert abs(older_than.replace(tzinfo=None) - (now - DAY).replace(tzinfo=None)) < DAY / 24
        # Two batches, the first full: progress on stderr, counted once each.
        assert "purge: 2 rows" in done.stderr and "purge: 3 rows" in done.stderr
        assert left(engine) == {*recent, *kept}

        # --retention-s 1: every settled row older than a second, the recent ones too
        # (in this process: a second start of the command costs seconds on a busy machine).
        assert run(capsys, "purge", "--db", any_db, "--retention-s", "1") == 0
        out, err = capsys.readouterr()
        assert out.startswith("purged 2 message(s) sent or canceled before ")
        assert out.rstrip().endswith("(retention 1.15741e-05 days)")
        assert "purge:" not in err  # within one batch: no progress
        assert left(engine) == set(kept) and old


def test_a_retention_of_no_days_is_bad_usage(
    sqlite_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """0 is refused as the retention_s setting refuses it: a pass that deletes every
    settled row at once is asked for with a small --retention-s instead. Found before
    the command touches the database (none exists here)."""
    monkeypatch.delenv("OUTBOX_RETENTION_S", raising=False)
    for days in ["0", "-1", "-0.5", "3651", "two"]:
        assert run(capsys, "purge", "--db", sqlite_url, "--retention-days", days) == 2, days
        out, err = capsys.readouterr()
        assert out == "" and err.strip() == (
            "outbox purge: retention_s (--retention-days): must be a number above 0, at "
            f"most 3650, got {days!r}"
        )
