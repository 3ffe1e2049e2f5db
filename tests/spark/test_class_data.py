"""The class data archive of a small night's JVM (spark_jobs.class_data): in the user's
cache, written under a temporary name and renamed once complete, never shown to the
user, and left alone when it cannot help. bench/small_night.py measures its seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pyspark import SparkContext
from pyspark.sql import SparkSession

from spark_jobs import class_data, session
from spark_jobs.generate import Plan, generate


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("OUTBOX_SPARK_CDS", raising=False)
    return tmp_path / "outbox-relay" / "spark-cds"


def test_the_first_run_writes_the_archive_under_a_temporary_name(cache: Path) -> None:
    archive = class_data.prepared("-Xmx1g")
    assert archive is not None and archive.writing is not None
    assert archive.writing.parent == cache and archive.writing.name.endswith(".tmp")
    assert archive.writing.exists()  # made here: the JVM refuses to start if it cannot
    assert f"-XX:ArchiveClassesAtExit={archive.writing}" in archive.options
    assert "-Xlog:cds=off" in archive.options and "-Xshare:auto" in archive.options
    assert not archive.path.exists()


def test_a_later_run_reads_it(cache: Path) -> None:
    first = class_data.prepared("-Xmx1g")
    assert first is not None
    first.path.write_bytes(class_data.MAGIC)
    later = class_data.prepared("-Xmx1g")
    assert later is not None and later.writing is None
    assert later.options.startswith(f"-XX:SharedArchiveFile={first.path} ")


def test_other_java_options_or_jars_make_another_archive(
    cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    key = class_data.archive_key("-Xmx1g")
    assert key == class_data.archive_key("-Xmx1g")
    assert key != class_data.archive_key("-Xmx2g")
    jars = tmp_path / "spark" / "jars"
    jars.mkdir(parents=True)
    (jars / "spark-core.jar").write_bytes(b"x")
    monkeypatch.setenv("SPARK_HOME", str(jars.parent))
    assert class_data.archive_key("-Xmx1g") not in (None, key)


def test_while_another_run_writes_one_this_run_neither_writes_nor_waits(cache: Path) -> None:
    first = class_data.prepared("-Xmx1g")
    assert first is not None and first.writing is not None
    assert class_data.prepared("-Xmx1g") is None
    old = time.time() - class_data.STALE_S - 1  # left by a killed run: removed
    os.utime(first.writing, (old, old))
    again = class_data.prepared("-Xmx1g")
    assert again is not None and again.writing is not None
    assert not first.writing.exists()


def test_an_unwritable_cache_or_off_means_no_archive(
    cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # a file: no folder under it
    assert class_data.prepared("-Xmx1g") is None
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("OUTBOX_SPARK_CDS", "off")
    assert class_data.prepared("-Xmx1g") is None


def exiting(status: int) -> subprocess.Popen[bytes]:
    code = f"import sys; sys.stdin.read(); sys.exit({status})"
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)


def test_the_archive_is_renamed_into_place_only_when_complete(cache: Path) -> None:
    archive = class_data.prepared("-Xmx1g")
    assert archive is not None and archive.writing is not None
    (cache / "spark-0000000000000000.jsa").write_bytes(b"of an older JDK")
    archive.writing.write_bytes(class_data.MAGIC + b"...")
    class_data.finished(archive, exiting(0))  # the JVM exits when its stdin closes
    assert archive.path.read_bytes() == class_data.MAGIC + b"..."
    assert sorted(p.name for p in cache.iterdir()) == [archive.path.name]


def test_an_archive_finished_after_its_run_stopped_waiting_is_put_in_place(cache: Path) -> None:
    archive = class_data.prepared("-Xmx1g")
    assert archive is not None and archive.writing is not None
    archive.writing.write_bytes(class_data.MAGIC + b"...")  # its header: written last
    assert class_data.prepared("-Xmx1g") is None  # just written: maybe not yet done
    old = time.time() - class_data.SETTLED_S - 1
    os.utime(archive.writing, (old, old))
    later = class_data.prepared("-Xmx1g")
    assert later is not None and later.writing is None and later.path == archive.path
    assert archive.path.read_bytes() == class_data.MAGIC + b"..."


@pytest.mark.parametrize(("status", "content"), [(1, class_data.MAGIC), (0, b""), (0, b"junk")])
def test_a_failed_or_partial_archive_is_dropped(cache: Path, status: int, content: bytes) -> None:
    archive = class_data.prepared("-Xmx1g")
    assert archive is not None and archive.writing is not None
    archive.writing.write_bytes(content)
    class_data.finished(archive, exiting(status))
    assert not archive.path.exists() and not archive.writing.exists()


def test_a_running_jvm_is_left_as_it_is(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its options are set: a session in a process whose JVM runs adds nothing."""
    monkeypatch.setattr(SparkContext, "_gateway", object())
    made = session.builder("job", None, small=True)
    before = dict(made._options)
    assert session.with_class_data(made) is None
    assert made._options == before and not cache.exists()


def test_a_small_night_writes_the_archive_once_then_starts_from_it(
    cache: Path, tmp_path: Path, spark: SparkSession
) -> None:
    """Two small nights in fresh processes: the first leaves the archive, the second maps
    it; neither says a word about it, and both give the same figures."""
    night = tmp_path / "night"
    generate(spark, Plan(rows=200, lost=1, phantom=1), night)
    window = json.loads((night / "expected.json").read_text())["window"]
    flags = ["--ledger", str(night / "ledger"), "--broker-log", str(night / "broker")]
    flags += ["--start", window["start"], "--end", window["end"]]
    outputs = []
    for n in range(2):
        out = tmp_path / f"out-{n}"
        code = "import sys; from relay.cli import main; sys.exit(main())"
        cmd = [sys.executable, "-c", code, "reconcile", *flags, "--out", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
        assert done.returncode == 3, done.stderr
        assert "cds" not in (done.stdout + done.stderr).lower()
        assert "shared archive" not in (done.stdout + done.stderr).lower()
        archives = list(cache.glob("spark-*.jsa"))
        assert len(archives) == 1 and class_data.is_archive(archives[0])
        assert not list(cache.glob("*.tmp"))
        outputs.append(done.stdout)
    assert outputs[0] == outputs[1]
