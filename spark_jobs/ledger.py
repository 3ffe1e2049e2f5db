"""The outbox ledger as a Spark DataFrame: from Parquet, or straight from PostgreSQL.

Only the rows a window needs are read (``Window.ledger_from`` to ``ledger_until``:
created then, or due then for a message scheduled earlier). Over JDBC the window is a
WHERE in the query PostgreSQL runs, and the read is split into ``partitions`` id
ranges between the window's own lowest and highest id, so neither the driver nor any
one executor holds the night, and no executor scans the year. From Parquet exported
by day (``outbox export ledger --by-day``: ``day=YYYY-MM-DD`` folders) Spark reads only
the window's days (partition pruning), plus the footers of the rest for scheduled rows;
a flat export is filtered row group by row group. The PostgreSQL JDBC driver comes
from Debian's libpostgresql-jdbc-java (`make test` installs it).
"""

from __future__ import annotations

from datetime import UTC, date, datetime
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from spark_jobs.window import Window

JDBC_JAR = "/usr/share/java/postgresql.jar"
LEDGER_COLUMNS = ("id", "msg_id", "topic", "status", "created_at", "sent_at", "attempts", "receipt",
                  "deliver_at")  # fmt: skip


def jdbc_url(sqlalchemy_url: str) -> tuple[str, dict[str, str]]:
    """A JDBC URL and connection properties for a PostgreSQL SQLAlchemy URL.

    A ``search_path`` given in ``options`` becomes the JDBC ``currentSchema``.
    """
    url = urlsplit(sqlalchemy_url)
    if not is_postgres(sqlalchemy_url):
        raise ValueError(f"a JDBC ledger read needs PostgreSQL, not {url.scheme}")
    props = {"user": unquote(url.username or "postgres"), "driver": "org.postgresql.Driver"}
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


def window_sql(window: Window | None) -> str:
    """The WHERE clause of the window's rows (empty without a window)."""
    if window is None:
        return ""
    lo, hi = sql_time(window.ledger_from), sql_time(window.ledger_until)
    created = f"created_at >= {lo} AND created_at < {hi}"
    return f" WHERE ({created}) OR (deliver_at >= {lo} AND deliver_at < {hi})"


def sql_time(moment: datetime) -> str:
    return f"TIMESTAMPTZ '{moment.astimezone(UTC).isoformat()}'"


def id_bounds(spark: SparkSession, sqlalchemy_url: str, window: Window | None) -> tuple[int, int]:
    """The lowest and highest id among the window's rows: the JDBC partitions' range."""
    url, props = jdbc_url(sqlalchemy_url)
    query = f"(SELECT min(id) AS lo, max(id) AS hi FROM outbox_message{window_sql(window)}) AS b"
    row = spark.read.jdbc(url, query, properties=props).first()
    return (int(row["lo"]), int(row["hi"])) if row and row["lo"] is not None else (0, 0)


def read_ledger_jdbc(
    spark: SparkSession, sqlalchemy_url: str, window: Window | None = None, partitions: int = 8
) -> DataFrame:
    url, props = jdbc_url(sqlalchemy_url)
    lo, hi = id_bounds(spark, sqlalchemy_url, window)
    columns = ", ".join(["id", "msg_id::text AS msg_id", *LEDGER_COLUMNS[2:]])
    query = f"(SELECT {columns} FROM outbox_message{window_sql(window)}) AS ledger"
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
    return in_window(spark.read.parquet(source), window)


def in_window(ledger: DataFrame, window: Window | None) -> DataFrame:
    """The Parquet ledger's rows the window needs; by day (the ``day`` partition column of
    an export by day) so that Spark lists and reads only the window's days' files."""
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
    scheduled_earlier = ledger.where(due & (F.col("created_at") < F.lit(lo)))
    return ledger.where(days & created).unionByName(scheduled_earlier)


def utc_day(moment: datetime) -> date:
    return moment.astimezone(UTC).date()
