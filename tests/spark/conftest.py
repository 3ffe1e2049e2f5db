"""One small local SparkSession for the whole test session (with the PostgreSQL JDBC
driver, for the ledger read over JDBC)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pyspark.sql import SparkSession

from spark_jobs.ledger import with_jdbc_jar


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    session = (
        with_jdbc_jar(SparkSession.builder)
        .master("local[2]")
        .appName("outbox-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
