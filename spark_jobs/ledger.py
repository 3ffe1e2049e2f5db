"""The outbox ledger as a Spark DataFrame: from Parquet, or straight from PostgreSQL.

The JDBC read is split by id range into ``partitions`` parallel reads, so neither the
driver nor any one executor holds the whole table. The PostgreSQL JDBC driver comes
from Debian's libpostgresql-jdbc-java (`make test` installs it).
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

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


def read_ledger_jdbc(spark: SparkSession, sqlalchemy_url: str, partitions: int = 8) -> DataFrame:
    url, props = jdbc_url(sqlalchemy_url)
    bounds = spark.read.jdbc(
        url, "(SELECT min(id) AS lo, max(id) AS hi FROM outbox_message) AS bounds", properties=props
    ).first()
    lo, hi = (bounds["lo"], bounds["hi"]) if bounds and bounds["lo"] is not None else (0, 0)
    rest = ", ".join(LEDGER_COLUMNS[2:])
    query = f"(SELECT id, msg_id::text AS msg_id, {rest} FROM outbox_message) AS ledger"
    frame = spark.read.jdbc(
        url, query, column="id", lowerBound=int(lo), upperBound=int(hi) + 1,
        numPartitions=partitions, properties=props,
    )  # fmt: skip
    return frame.select(*LEDGER_COLUMNS).withColumn("attempts", F.col("attempts").cast("int"))


def count_ledger(spark: SparkSession, source: str, ledger: DataFrame) -> int:
    """The ledger's rows: over JDBC one count(*), not a second read of the table."""
    if not is_postgres(source):
        return ledger.count()
    url, props = jdbc_url(source)
    query = "(SELECT count(*) AS n FROM outbox_message) AS counted"
    row = spark.read.jdbc(url, query, properties=props).first()
    return int(row["n"]) if row else 0


def read_ledger(spark: SparkSession, source: str) -> DataFrame:
    """``source`` is a Parquet path, or a postgresql:// URL read over JDBC."""
    if is_postgres(source):
        return read_ledger_jdbc(spark, source)
    return spark.read.parquet(source)
