"""The outbox ledger as a Spark DataFrame: from Parquet, or straight from PostgreSQL.

Only the rows a window needs are read (``Window.ledger_from`` to ``ledger_until``:
created then, or due then for a message scheduled earlier). Over JDBC the window is a
WHERE in the query PostgreSQL runs, and the read is split into id ranges (one per
million ids, at least 8; rows fetched 10,000 at a time) between the window's own
lowest and highest id, so neither the driver nor any one executor holds the night,
and no executor scans the year. From Parquet exported by day (``outbox export ledger
--by-day``: ``day=YYYY-MM-DD`` folders) Spark reads only the window's days (partition
pruning), plus the footers of the rest for scheduled rows; a flat export is filtered
row group by row group. The PostgreSQL JDBC driver comes from Debian's
libpostgresql-jdbc-java (`make test` installs it).
"""

from __future__ import annotations

import re
from datetime import UTC, date, datetime
from functools import reduce
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from spark_jobs.window import Window

JDBC_JAR = "/usr/share/java/postgresql.jar"
# An id range per million rows (at least 8): a billion-row night is a thousand tasks.
ROWS_PER_PARTITION = 1_000_000
# Rows per round trip: without it PostgreSQL's driver holds a query's whole result in
# the executor's memory (Spark's dialect turns autocommit off, so a cursor is used).
FETCH_SIZE = "10000"
LEDGER_COLUMNS = ("id", "msg_id", "topic", "status", "created_at", "sent_at", "attempts", "receipt",
                  "deliver_at", "key", "seq")  # fmt: skip


def jdbc_url(sqlalchemy_url: str) -> tuple[str, dict[str, str]]:
    """A JDBC URL and connection properties for a PostgreSQL SQLAlchemy URL.

    A ``search_path`` given in ``options`` becomes the JDBC ``currentSchema``.
    """
    url = urlsplit(sqlalchemy_url)
    if not is_postgres(sqlalchemy_url):
        raise ValueError(f"a JDBC ledger read needs PostgreSQL, not {url.scheme}")
    props = {"user": unquote(url.username or "postgres"), "driver": "org.postgresql.Driver",
             "fetchsize": FETCH_SIZE}  # fmt: skip
    if url.password:
        props["password"] = unquote(url.password)
    options = parse_qs(url.query).get("options", [""])[-1]
    if "search_path=" in options:
        props["currentSchema"] = options.split("search_path=", 1)[1].split()[0]
    host, port, database = url.hostname or "127.0.0.1", url.port or 5432, url.path.lstrip("/")
    return f"jdbc:postgresql://{host}:{port}/{database}", props


def is_postgres(source: str) -> bool:
    """A PostgreSQL URL, with or without a driver: postgresql+psycopg://, postgres://."""
    scheme, sep, _ = source.partition("://")
    return bool(sep) and scheme.split("+")[0] in ("postgresql", "postgres")


def with_jdbc_jar(builder: SparkSession.Builder) -> SparkSession.Builder:
    """The PostgreSQL driver for the driver and the executors (spark.jars ships it)."""
    if not Path(JDBC_JAR).exists():
        raise FileNotFoundError(f"{JDBC_JAR} missing: apt-get install libpostgresql-jdbc-java")
    return builder.config("spark.jars", JDBC_JAR)


def window_sql(window: Window | None, lowest_id: int | None = None) -> str:
    """The WHERE clause of the window's rows (empty without a window): created in its span
    (from ``lowest_id`` on, when known), or due in it."""
    if window is None:
        return ""
    lo, hi = sql_time(window.ledger_from), sql_time(window.ledger_until)
    created = f"created_at >= {lo} AND created_at < {hi}"
    if lowest_id is not None:
        created += f" AND id >= {lowest_id}"
    return f" WHERE ({created}) OR (deliver_at >= {lo} AND deliver_at < {hi})"


def created_sql(window: Window | None) -> str:
    """The WHERE clause of the rows created in the window's span (the id bounds' rows)."""
    if window is None:
        return ""
    lo, hi = sql_time(window.ledger_from), sql_time(window.ledger_until)
    return f" WHERE created_at >= {lo} AND created_at < {hi}"


def sql_time(moment: datetime) -> str:
    return f"TIMESTAMPTZ '{moment.astimezone(UTC).isoformat()}'"


def id_bounds(spark: SparkSession, sqlalchemy_url: str, window: Window | None) -> tuple[int, int]:
    """The lowest and highest id among the rows created in the window's span: the JDBC
    partitions' range. Not of the rows due in it: one scheduled months ago would stretch
    the range over the months between, and the night would land in one partition (rows
    below the range go to the first partition, which Spark reads as ``id < b1``)."""
    url, props = jdbc_url(sqlalchemy_url)
    query = f"(SELECT min(id) AS lo, max(id) AS hi FROM outbox_message{created_sql(window)}) AS b"
    row = spark.read.jdbc(url, query, properties=props).first()
    return (int(row["lo"]), int(row["hi"])) if row and row["lo"] is not None else (0, 0)


def id_ranges(lo: int, hi: int) -> int:
    """How many id ranges (read tasks) for ids ``lo``..``hi``: about a million rows each."""
    return max(8, (hi - lo) // ROWS_PER_PARTITION + 1)


def read_ledger_jdbc(
    spark: SparkSession, sqlalchemy_url: str, window: Window | None = None
) -> DataFrame:
    url, props = jdbc_url(sqlalchemy_url)
    lo, hi = id_bounds(spark, sqlalchemy_url, window)
    partitions = id_ranges(lo, hi)
    columns = ", ".join(["id", "msg_id::text AS msg_id", *LEDGER_COLUMNS[2:]])
    query = f"(SELECT {columns} FROM outbox_message{window_sql(window, lo)}) AS ledger"
    frame = spark.read.jdbc(
        url, query, column="id", lowerBound=lo, upperBound=hi + 1,
        numPartitions=partitions, properties=props,
    )  # fmt: skip
    return frame.select(*LEDGER_COLUMNS).withColumn("attempts", F.col("attempts").cast("int"))


def count_ledger(
    spark: SparkSession, source: str, ledger: DataFrame, window: Window | None = None
) -> int:
    """The ledger rows read: over JDBC one count(*) of the window, not a second read."""
    if not is_postgres(source):
        return ledger.count()
    url, props = jdbc_url(source)
    query = f"(SELECT count(*) AS n FROM outbox_message{window_sql(window)}) AS counted"
    row = spark.read.jdbc(url, query, properties=props).first()
    return int(row["n"]) if row else 0


def read_ledger(spark: SparkSession, source: str, window: Window | None = None) -> DataFrame:
    """``source`` is a Parquet path, or a postgresql:// URL read over JDBC; with a
    ``window``, only the rows it needs."""
    if is_postgres(source):
        return read_ledger_jdbc(spark, source, window)
    return in_span(read_parquet(spark, source), window)


def read_parquet(spark: SparkSession, source: str) -> DataFrame:
    """A ledger export; an export by day of an empty range (a folder without a Parquet
    file) is an empty ledger of the export's columns, not an error."""
    reader = spark.read
    if is_empty_folder(source):
        from pyspark.sql.pandas.types import from_arrow_schema

        from spark_jobs.schema import LEDGER

        reader = reader.schema(from_arrow_schema(LEDGER))
    return reader.parquet(source)


def is_empty_folder(source: str) -> bool:
    """A local folder holding no Parquet file (an export by day of an empty range)."""
    path = Path(source.removeprefix("file://"))
    return (
        "://" not in source.removeprefix("file://")
        and path.is_dir()
        and not any(path.rglob("*.parquet"))
    )


def in_span(ledger: DataFrame, window: Window | None) -> DataFrame:
    """The Parquet ledger's rows the window needs: created in its span, or due in it; by
    day (the ``day`` partition column of an export by day) so that Spark lists and reads
    only the span's days' files for the rows created in it."""
    if window is None:
        return ledger
    lo, hi = window.ledger_from, window.ledger_until
    created = (F.col("created_at") >= F.lit(lo)) & (F.col("created_at") < F.lit(hi))
    if "deliver_at" not in ledger.columns:  # an older export: nothing scheduled
        return ledger.where(created)
    due = (F.col("deliver_at") >= F.lit(lo)) & (F.col("deliver_at") < F.lit(hi))
    if "day" not in ledger.columns:
        return ledger.where(created | due)
    days = F.col("day").between(F.lit(utc_day(lo)), F.lit(utc_day(hi)))  # dates, inferred
    # two disjoint parts: an OR with a data column would keep Spark from pruning days
    due_outside = ledger.where(due & ~created)  # scheduled earlier, or a past deliver_at
    return ledger.where(days & created).unionByName(due_outside)


def utc_day(moment: datetime) -> date:
    return moment.astimezone(UTC).date()


# Phantom candidates (at the broker in the window, no ledger row in the span) looked up by
# msg_id from the driver up to this many; past it, by a join with the rows outside the span.
LOOKUP_CAP = 100_000
LOOKUP_BATCH = 5_000  # msg_ids per query
UUID_TEXT = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def committed_outside(
    spark: SparkSession, source: str, candidates: DataFrame, window: Window
) -> DataFrame | None:
    """The msg_ids among ``candidates`` (a ``msg_id`` column) that have a ledger row outside
    the window's span: deliveries of commits before it (or long after), which the whole
    ledger would have matched. None when there is no candidate (nothing read then)."""
    if not is_postgres(source):  # the export's rows outside the span, joined on the executors
        count = candidates.count()
        if not count:
            return None
        ledger = outside_span(read_parquet(spark, source), window).select("msg_id")
        # few candidates (the usual night) are broadcast: the ledger's msg_ids stay put
        wanted = F.broadcast(candidates) if count <= LOOKUP_CAP else candidates
        return ledger.join(wanted, "msg_id", "left_semi")  # the caller's anti join: no distinct
    ids = [row["msg_id"] for row in candidates.limit(LOOKUP_CAP + 1).collect()]
    if not ids:
        return None
    if len(ids) > LOOKUP_CAP:
        return outside_span_jdbc(spark, source, window).join(candidates, "msg_id", "left_semi")
    return by_msg_id_jdbc(spark, source, ids)


def outside_span(ledger: DataFrame, window: Window) -> DataFrame:
    """The Parquet ledger's rows not created in the window's span (a row created in it was
    read with the window). Parquet's row-group statistics skip the span's row groups."""
    lo, hi = window.ledger_from, window.ledger_until
    created = F.col("created_at")
    return ledger.where(created.isNull() | (created < F.lit(lo)) | (created >= F.lit(hi)))


def by_msg_id_jdbc(spark: SparkSession, sqlalchemy_url: str, ids: list[str]) -> DataFrame | None:
    """The ledger's msg_ids among ``ids``, by its unique index, a query per batch. Only
    a UUID's text as PostgreSQL writes it can match (the job joins on ``msg_id::text``)."""
    url, props = jdbc_url(sqlalchemy_url)
    valid = sorted({i for i in ids if i and UUID_TEXT.fullmatch(i)})  # also keeps the SQL safe
    if not valid:
        return None
    found = []
    for n in range(0, len(valid), LOOKUP_BATCH):
        listed = ",".join(valid[n : n + LOOKUP_BATCH])
        where = f"msg_id = ANY(CAST('{{{listed}}}' AS uuid[]))"  # not msg_id::text: the index
        query = f"(SELECT msg_id::text AS msg_id FROM outbox_message WHERE {where}) AS known"
        found.append(spark.read.jdbc(url, query, properties=props))
    return reduce(DataFrame.unionByName, found)


def outside_span_jdbc(spark: SparkSession, sqlalchemy_url: str, window: Window) -> DataFrame:
    """The msg_ids of the rows created outside the window's span, in id ranges."""
    url, props = jdbc_url(sqlalchemy_url)
    lo, hi = sql_time(window.ledger_from), sql_time(window.ledger_until)
    where = f"created_at < {lo} OR created_at >= {hi}"
    query = f"(SELECT id, msg_id::text AS msg_id FROM outbox_message WHERE {where}) AS outside"
    lowest, highest = id_bounds(spark, sqlalchemy_url, None)
    frame = spark.read.jdbc(
        url, query, column="id", lowerBound=lowest, upperBound=highest + 1,
        numPartitions=id_ranges(lowest, highest), properties=props,
    )  # fmt: skip
    return frame.select("msg_id")
