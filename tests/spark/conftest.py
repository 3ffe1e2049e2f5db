"""One small local SparkSession for the whole test session (with the PostgreSQL JDBC
driver, for the ledger read over JDBC), and one standalone cluster, started only for the
tests that ask for it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pyspark.sql import SparkSession

from relay.testing.spark_cluster import SparkCluster
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


@pytest.fixture(scope="session")
def spark_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkCluster]:
    """A master and two workers (one core, 1 GiB each), for the whole test session."""
    with SparkCluster(workers=2, cores=1, memory="1g", root=tmp_path_factory.mktemp("spark")) as c:
        yield c
