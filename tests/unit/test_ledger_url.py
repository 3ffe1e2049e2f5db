"""The reconciliation's ledger source: a PostgreSQL URL in any spelling is read over JDBC,
anything else is a Parquet path (``outbox reconcile --ledger``)."""

from __future__ import annotations

import pytest

from spark_jobs.ledger import id_ranges, is_postgres, jdbc_url


@pytest.mark.parametrize(
    "url",
    [
        "postgres://u:p@h:5433/db",
        "postgresql://u:p@h:5433/db",
        "postgresql+psycopg://u:p@h:5433/db",
    ],
)
def test_every_postgres_spelling_is_read_over_jdbc(url: str) -> None:
    assert is_postgres(url)
    assert jdbc_url(url) == (
        "jdbc:postgresql://h:5433/db",
        {"user": "u", "driver": "org.postgresql.Driver", "fetchsize": "10000", "password": "p"},
    )


def test_a_read_task_per_million_ids_and_never_fewer_than_eight() -> None:
    assert [id_ranges(lo, hi) for lo, hi in [(0, 0), (5, 7_999_999), (0, 1_000_000_000)]] == [
        8,
        8,
        1001,
    ]


@pytest.mark.parametrize("source", ["/tmp/ledger.parquet", "ledger", "mysql://h/db"])
def test_anything_else_is_not(source: str) -> None:
    assert not is_postgres(source)
