"""The driver JVM's class data archive (AppCDS): a small night's JVM starts from it.

A small night spends most of its seconds starting the JVM and loading Spark's classes
(some 20,000 of them, read, parsed and verified on every start). Java 17 can keep the
classes a run loaded in an archive (``-XX:ArchiveClassesAtExit``) and map it into the
next JVM (``-XX:SharedArchiveFile``): loading then costs a fraction.

The first small night on a machine writes the archive as its JVM exits (a few seconds
more, once); later ones start from it. It lives in the user's cache
(``$XDG_CACHE_HOME/outbox-relay/spark-cds``, else ``~/.cache/...``), named by a key of
what it depends on (the java binary, Spark's jars, the JVM's options), so a new JDK or
Spark makes a new one. The JVM writes to a temporary name and the file is renamed only
once the JVM has exited cleanly: two runs racing each write their own, the last rename
wins, and a reader never sees a partial file (Java 17 crashes on a truncated archive).
The JVM says nothing about it (``-Xlog:cds=off``), and one that cannot use the archive
(stale, from another JDK) starts without it (``-Xshare:auto``). ``OUTBOX_SPARK_CDS=off``
turns it off.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

# The JVM's own messages about its archive (missing classes, a stale file) go nowhere:
# they would land on the job's stdout, where its totals are.
QUIET = "-Xshare:auto -Xlog:cds=off -Xlog:cds+dynamic=off"
# A temporary archive younger than this is another run writing one: this run does not.
BUSY_S = 600
# One older than this was left by a run that was killed: removed.
STALE_S = 3600
# One complete and untouched for this long is done: a later run puts it in place.
SETTLED_S = 10
# How long a run waits for its JVM to write the archive at exit.
WRITE_TIMEOUT_S = 300
# The first bytes of a Java 17 dynamic archive (CDS_DYNAMIC_ARCHIVE_MAGIC, little-endian).
MAGIC = (0xF00BABA8).to_bytes(4, "little")


@dataclass(frozen=True)
class Archive:
    """This run's use of the archive: ``options`` for the driver JVM; ``writing``, the
    temporary file its JVM writes at exit (None: it reads ``path``)."""

    path: Path
    options: str
    writing: Path | None = None


def cache_dir() -> Path:
    """Where the archives live: the user's cache, as XDG says."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "outbox-relay" / "spark-cds"


def prepared(java_options: str) -> Archive | None:
    """The archive for a driver JVM started with ``java_options``: read it when it
    exists, else write it at exit; None when neither can be done (no Spark jars or java
    found, the cache not writable, another run writing it, or turned off)."""
    if os.environ.get("OUTBOX_SPARK_CDS", "").lower() in ("0", "off", "false", "no"):
        return None
    key = archive_key(java_options)
    if key is None:
        return None
    folder = cache_dir()
    path = folder / f"spark-{key}.jsa"
    if not path.is_file():
        adopted(path)
    if path.is_file():
        return Archive(path, f"-XX:SharedArchiveFile={path} {QUIET}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if being_written(folder):
            return None
        # The JVM refuses to start when it cannot create the file: make it here first.
        fd, name = _temporary(folder, path.name)
    except OSError:
        return None
    os.close(fd)
    writing = Path(name)
    return Archive(path, f"-XX:ArchiveClassesAtExit={writing} {QUIET}", writing)


def _temporary(folder: Path, name: str) -> tuple[int, str]:
    import tempfile

    return tempfile.mkstemp(prefix=f"{name}.", suffix=".tmp", dir=folder)


def adopted(path: Path) -> None:
    """Puts in place an archive a JVM finished after its run stopped waiting for it (a
    very slow machine): the JVM writes an archive's header last, so a temporary file that
    starts as an archive is complete."""
    now = time.time()
    for temporary in path.parent.glob(f"{path.name}.*.tmp"):
        try:
            if now - temporary.stat().st_mtime > SETTLED_S and is_archive(temporary):
                temporary.replace(path)
                return
        except OSError:  # another run took it first
            continue


def being_written(folder: Path) -> bool:
    """Whether another run is writing an archive now; removes ones left by killed runs."""
    busy = False
    now = time.time()
    for temporary in folder.glob("*.tmp"):
        try:
            age = now - temporary.stat().st_mtime
            if age > STALE_S:
                temporary.unlink()
            busy = busy or age < BUSY_S
        except OSError:  # another run renamed or removed it meanwhile
            continue
    return busy


def archive_key(java_options: str) -> str | None:
    """A digest of what an archive depends on: the java binary Spark will run (as
    spark-class finds it), Spark's jars (names, sizes, times) and the JVM's options."""
    java = java_binary()
    jars = spark_jars()
    if java is None or jars is None:
        return None
    digest = hashlib.sha256(java_options.encode())
    for path in (java, *jars):
        stat = path.stat()
        digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def java_binary() -> Path | None:
    """The JVM spark-class runs: ``$JAVA_HOME/bin/java``, else java on the PATH (its
    real file, so a JDK update changes the key: libjvm.so sits beside it)."""
    home = os.environ.get("JAVA_HOME")
    found = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    if not found or not Path(found).is_file():
        return None
    real = Path(found).resolve()
    server = real.parent.parent / "lib" / "server" / "libjvm.so"
    return server if server.is_file() else real


def spark_jars() -> list[Path] | None:
    """Spark's jars (the driver's classpath), sorted; None without them."""
    home = os.environ.get("SPARK_HOME")
    if not home:
        import pyspark

        home = str(Path(pyspark.__file__).parent)
    jars = sorted((Path(home) / "jars").glob("*.jar"))
    return jars or None


def finished(archive: Archive, jvm: subprocess.Popen[bytes] | None) -> None:
    """After the session stopped, for a run that writes the archive: let its JVM exit
    (it does when its stdin closes), wait for it, and put the archive in place if the
    JVM wrote one cleanly; else drop the temporary file."""
    writing = archive.writing
    if writing is None:
        return
    status = None
    if jvm is not None:
        try:
            if jvm.stdin is not None:
                jvm.stdin.close()
            status = jvm.wait(WRITE_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            return  # still writing: a later run removes the file if it is never done
    if status == 0 and is_archive(writing):
        writing.replace(archive.path)
        for other in archive.path.parent.glob("spark-*.jsa"):  # of an older JDK or Spark
            if other != archive.path:
                other.unlink(missing_ok=True)
    else:
        writing.unlink(missing_ok=True)


def is_archive(path: Path) -> bool:
    """Whether ``path`` starts as a dynamic archive does (not empty, not another file)."""
    try:
        with path.open("rb") as file:
            return file.read(len(MAGIC)) == MAGIC
    except OSError:
        return False
