"""How the jobs start Spark: quiet unless asked, shuffles sized to the input.

Quiet: the driver's JVM reads ``log4j2.properties`` (shipped beside this module: Spark
logs nothing) and draws no stage bars; the job prints its own steps and errors. The log
configuration must reach the JVM before it starts: this builder's options do it when
Python starts Spark (`outbox reconcile`, `outbox compare`); under ``spark-submit`` the
JVM runs first, so pass ``--conf spark.driver.extraJavaOptions=...`` (`log_options`),
and the job turns Spark's logging off once its session exists.

Sized: a small night must not pay for 200 shuffle partitions. Adaptive execution
coalesces small partitions (also inside the cached classification), and the number to
start from follows the inputs' bytes (``shuffle_partitions``), unless the
configuration already sets ``spark.sql.shuffle.partitions``. A small input on a local
master (``small_input``: a few thousand rows, a small night) starts a JVM that compiles
less and plans plainer (``SMALL_INPUT``), and maps the classes an earlier small run
loaded (spark_jobs.class_data): most of its seconds are start-up and planning, not data,
and a large input never takes that path.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pyspark import SparkContext
from pyspark.sql import SparkSession

from spark_jobs import class_data

LOG_CONFIG = Path(__file__).with_name("log4j2.properties")
# Of Parquet input (several times that in a shuffle): small enough that a task's share of
# the join sorts in memory with a 512 MiB driver in local mode (at 32 MiB, 10M x 10M
# spilled and spent a third of its time collecting garbage).
BYTES_PER_PARTITION = 8 * 1024 * 1024
SHUFFLE_PARTITIONS = "spark.sql.shuffle.partitions"
JAVA_OPTIONS = "spark.driver.extraJavaOptions"
ADAPTIVE = {
    "spark.sql.adaptive.enabled": "true",
    "spark.sql.adaptive.coalescePartitions.enabled": "true",
    "spark.sql.adaptive.advisoryPartitionSizeInBytes": str(BYTES_PER_PARTITION),  # not 64 MiB
    # The classification is cached: let adaptive execution size its shuffle too.
    "spark.sql.optimizer.canChangeCachedPlanOutputPartitioning": "true",
}


# Local inputs up to this many bytes run as a small input: a ledger and broker log of about
# 60 bytes a message, so some 70,000 messages.
SMALL_INPUT_BYTES = 4 * 1024 * 1024
# The JVM of a small input: C1 only (the C2 compiler's work never pays back in seconds),
# the class data archive of the JDK, one GC thread for a small heap.
SMALL_JAVA_OPTIONS = "-XX:TieredStopAtLevel=1 -Xshare:auto -XX:+UseSerialGC"
SMALL_INPUT = {
    "spark.ui.enabled": "false",  # no web UI to start for a run of seconds
    # Rows are few: compiling each stage's code costs more than interpreting it, and
    # adaptive execution's extra jobs per shuffle more than it saves.
    "spark.sql.codegen.wholeStage": "false",
    "spark.sql.adaptive.enabled": "false",
    SHUFFLE_PARTITIONS: "1",  # one task per shuffle stage, not one per core
}


def small_input(master: str | None, paths: Sequence[str | None]) -> bool:
    """Whether a run is small: on a local master this process starts (not spark-submit's
    JVM, nor a cluster) and over local inputs of at most ``SMALL_INPUT_BYTES`` in all.
    Remote inputs (hdfs://, a postgresql:// ledger) count as large: their size is unknown."""
    if master is None:
        if "PYSPARK_GATEWAY_PORT" in os.environ:  # under spark-submit: its JVM, its master
            return False
    elif not master.startswith("local"):
        return False
    total = 0
    for path in paths:
        if path is None:
            continue
        if "://" in path.removeprefix("file://"):
            return False
        total += local_bytes(Path(path.removeprefix("file://")))
    return total <= SMALL_INPUT_BYTES


def local_bytes(path: Path) -> int:
    """The bytes of a file, or of every file under a folder (0 when missing: the job
    names a missing input itself)."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def log_options() -> str:
    """The driver's Java options that make Spark log nothing (our log4j2 configuration)."""
    return f"-Dlog4j2.configurationFile={LOG_CONFIG.as_uri()}"


def builder(
    app: str, master: str | None, verbose: bool = False, small: bool = False
) -> SparkSession.Builder:
    """A session builder for a job: UTC, adaptive shuffles, and quiet unless ``verbose``;
    ``small`` (see ``small_input``): a JVM and plans for a small input."""
    made = SparkSession.builder.appName(app).config("spark.sql.session.timeZone", "UTC")
    if master:  # spark-submit's --master otherwise, or local[*] when run alone
        made = made.master(master)
    for key, value in {**ADAPTIVE, **(SMALL_INPUT if small else {})}.items():
        made = made.config(key, value)
    java = [SMALL_JAVA_OPTIONS] if small else []
    if not verbose:
        made = made.config("spark.ui.showConsoleProgress", "false")
        if LOG_CONFIG.is_file():  # not when the package runs from a zip (--py-files)
            java.append(log_options())
    if java:
        made = made.config(JAVA_OPTIONS, " ".join(java))
    return made


def started(made: SparkSession.Builder, verbose: bool = False, small: bool = False) -> SparkSession:
    """The session; quiet from here on unless ``verbose``, even if the JVM was started by
    spark-submit without our log configuration. ``small`` (a small input's builder): the
    JVM this process starts maps the class data archive (spark_jobs.class_data)."""
    archive = with_class_data(made) if small else None
    spark = made.getOrCreate()
    if archive is not None:
        WRITING[id(spark)] = (archive, getattr(SparkContext._gateway, "proc", None))
    if not verbose:
        spark.sparkContext.setLogLevel("OFF")
        without_sketch_warning(spark)
    return spark


# Sessions whose JVM writes the class data archive as it exits: the archive and the JVM.
WRITING: dict[int, tuple[class_data.Archive, Any]] = {}


def with_class_data(made: SparkSession.Builder) -> class_data.Archive | None:
    """Adds the archive's options to the driver's when this process starts the JVM (not
    when one runs already: its options are set)."""
    if SparkContext._gateway is not None:
        return None
    java = made._options.get(JAVA_OPTIONS, "")
    archive = class_data.prepared(java)
    if archive is not None:
        made.config(JAVA_OPTIONS, f"{java} {archive.options}".strip())
    return archive


def stopped(spark: SparkSession) -> None:
    """Stops the session; a run writing the class data archive lets its JVM exit and
    write it (this process starts a new JVM for a next session)."""
    spark.stop()
    archive, jvm = WRITING.pop(id(spark), (None, None))
    if archive is None:
        return
    gateway = SparkContext._gateway
    try:
        if gateway is not None:
            gateway.shutdown()
    finally:
        SparkContext._gateway = SparkContext._jvm = None
        class_data.finished(archive, jvm)


# DataSketches (the KLL sketches of the latency percentiles) prints a warning to the JVM's
# stderr, not to a log, when this class first loads under Java > 11.
SKETCH_MEMORY = "org.apache.datasketches.memory.internal.ResourceImpl"


def without_sketch_warning(spark: SparkSession) -> None:
    """Loads DataSketches' memory class in the driver's JVM with its stderr muted, so the
    warning is never printed there (nor by local mode's tasks, which share that JVM; a
    cluster's executors print it to their own logs)."""
    from py4j.protocol import Py4JError  # type: ignore[import-untyped]

    jvm = spark.sparkContext._jvm
    assert jvm is not None
    system = jvm.java.lang.System
    stderr = system.err
    system.setErr(jvm.java.io.PrintStream(jvm.java.io.OutputStream.nullOutputStream()))
    try:
        loader = jvm.java.lang.Thread.currentThread().getContextClassLoader()
        jvm.java.lang.Class.forName(SKETCH_MEMORY, True, loader)
    except Py4JError:  # another Spark moved the class: a stray line, not a failed job
        pass
    finally:
        system.setErr(stderr)


def size_shuffles(spark: SparkSession, input_bytes: int | None) -> None:
    """Start shuffles from a partition count fitted to ``input_bytes`` (None: unknown,
    Spark's own), unless the configuration sets one."""
    if input_bytes is None or spark.sparkContext.getConf().contains(SHUFFLE_PARTITIONS):
        return
    cores = spark.sparkContext.defaultParallelism
    spark.conf.set(SHUFFLE_PARTITIONS, str(shuffle_partitions(input_bytes, cores)))


def shuffle_partitions(input_bytes: int, cores: int) -> int:
    """One partition per ``BYTES_PER_PARTITION`` of input, and at least one per core."""
    return max(cores, math.ceil(input_bytes / BYTES_PER_PARTITION), 1)


def input_bytes(spark: SparkSession, paths: list[str]) -> int:
    """The bytes under each path (local or remote: Hadoop's file system answers)."""
    jvm = spark.sparkContext._jvm  # Hadoop's FileSystem has no Python API
    conf = spark.sparkContext._jsc.hadoopConfiguration()
    total = 0
    for path in paths:
        hadoop_path = jvm.org.apache.hadoop.fs.Path(path)  # type: ignore[union-attr]
        total += hadoop_path.getFileSystem(conf).getContentSummary(hadoop_path).getLength()
    return int(total)
