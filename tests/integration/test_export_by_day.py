"""`outbox export ledger --by-day` into a folder: it refuses anything but an earlier export
by day, and replaces only the days it writes (nightly ``--since`` exports build up the
year), one Parquet file per day."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from sqlalchemy import insert

from outbox import migrate
from outbox.engines import engine_from
from outbox.table import outbox_message
from relay import export
from relay.cli import main

DAY = datetime(2025, 3, 1, tzinfo=UTC)


def add_rows(db: str, day: int, n: int) -> None:
    """``n`` sent rows committed on ``DAY + day`` days, an hour apart."""
    start = DAY + timedelta(days=day)
    rows = [{"msg_id": uuid.uuid4(), "topic": "t", "payload": b"{}", "status": "sent",
             "created_at": start + timedelta(hours=h)} for h in range(n)]  # fmt: skip
    engine = engine_from(db)
    with engine.begin() as conn:
        conn.execute(insert(outbox_message), rows)
    engine.dispose()


def days_in(folder: Path) -> dict[str, int]:
    """Rows per day folder; every entry of ``folder`` must be a day folder."""
    return {p.name: pq.read_table(p).num_rows for p in sorted(folder.iterdir())}


def export_days(db: str, out: Path, *flags: str) -> int:
    return main(["export", "ledger", "--db", db, "--out", str(out), "--by-day", *flags])


@pytest.fixture
def db(pg_url: str) -> str:
    migrate.upgrade(pg_url)
    return pg_url


def test_refuses_a_folder_that_is_not_an_export_by_day(
    db: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    add_rows(db, 0, 2)
    out = tmp_path / "home"
    (out / "day=2025-03-01").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    assert export_days(db, out) == 2  # a usage error, found before reading a row
    err = capsys.readouterr().err
    assert f"--out {out}: holds 'notes.txt'" in err and "day=YYYY-MM-DD" in err, err
    assert len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in out.iterdir()) == ["day=2025-03-01", "notes.txt"]
    assert (out / "notes.txt").read_text() == "mine"
    assert not any((out / "day=2025-03-01").iterdir())  # untouched: still empty


def test_a_later_export_replaces_its_days_and_keeps_the_others(
    db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(export, "CHUNK", 2)  # chunks cross days: still one file per day
    out = tmp_path / "ledger"
    add_rows(db, 0, 3)
    add_rows(db, 1, 4)
    assert export_days(db, out) == 0
    assert days_in(out) == {"day=2025-03-01": 3, "day=2025-03-02": 4}
    assert [p.name for p in (out / "day=2025-03-02").iterdir()] == ["part-00000.parquet"]

    add_rows(db, 1, 2)  # day 2 grows, day 3 is new
    add_rows(db, 2, 5)
    assert export_days(db, out, "--since", (DAY + timedelta(days=1)).isoformat()) == 0
    assert days_in(out) == {"day=2025-03-01": 3, "day=2025-03-02": 6, "day=2025-03-03": 5}
    assert [p.name for p in (out / "day=2025-03-02").iterdir()] == ["part-00000.parquet"]


def test_a_failed_export_leaves_the_days_as_they_were(
    db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "ledger"
    add_rows(db, 0, 3)
    assert export_days(db, out) == 0
    add_rows(db, 0, 1)

    def broken(*_: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(export, "swap_day", broken)
    with pytest.raises(OSError, match="disk full"):
        export.export_ledger(db, out, by_day=True)
    assert days_in(out) == {"day=2025-03-01": 3}  # no .part left beside it


def test_an_interrupted_swap_is_undone_by_the_next_export(db: str, tmp_path: Path) -> None:
    """A day set aside (``.day=...old``) and never replaced comes back; a half-written
    day (``.day=...part``) goes."""
    out = tmp_path / "ledger"
    add_rows(db, 0, 3)
    assert export_days(db, out) == 0
    (out / "day=2025-03-01").replace(out / ".day=2025-03-01.old")
    (out / ".day=2025-03-09.part").mkdir()
    until = DAY.isoformat()  # an export of nothing: it tidies up only
    assert export_days(db, out, "--until", until) == 0
    assert days_in(out) == {"day=2025-03-01": 3}


def test_a_flat_since_export_holds_the_rows_scheduled_into_it_and_by_day_does_not(
    db: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A message committed days before the night and due in it: the night's flat export
    has its ledger row (else its delivery would read as a phantom); an export by day keeps
    it in its own day's folder only. The progress total counts the same rows."""
    add_rows(db, 0, 1)
    add_rows(db, 5, 2)
    early = {"msg_id": uuid.uuid4(), "topic": "t", "payload": b"{}", "status": "pending",
             "created_at": DAY, "deliver_at": DAY + timedelta(days=5, hours=3)}  # fmt: skip
    engine = engine_from(db)
    with engine.begin() as conn:
        conn.execute(insert(outbox_message), [early])
    engine.dispose()
    night = (DAY + timedelta(days=5)).isoformat()
    flat = tmp_path / "night.parquet"
    assert main(["export", "ledger", "--db", db, "--out", str(flat), "--since", night]) == 0
    ids = set(pq.read_table(flat).column("msg_id").to_pylist())
    assert len(ids) == 3 and str(early["msg_id"]) in ids
    assert export.ledger_count(db, DAY + timedelta(days=5)) == 3
    capsys.readouterr()
    assert export_days(db, tmp_path / "days", "--since", night) == 0
    assert days_in(tmp_path / "days") == {"day=2025-03-06": 2}
    assert export.ledger_count(db, DAY + timedelta(days=5), by_day=True) == 2
