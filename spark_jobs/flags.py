"""Command-line value types and output hygiene shared by the Spark jobs and the ``outbox``
command (standard library only: the jobs ship alone with ``spark-submit --py-files``)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterable
from datetime import UTC, datetime
from urllib.parse import unquote, urlsplit


def iso_time(text: str) -> datetime:
    """An ISO 8601 time for a command-line flag; naive times are UTC."""
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not an ISO 8601 time: {text!r} (e.g. 2024-05-01T12:00:00Z)"
        ) from None
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def seconds(text: str) -> float:
    """A number of seconds for a command-line flag (--sla): finite, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be 0 or more seconds, not {text!r}")
    return value


# The masters spark-submit takes; anything else makes its JVM exit with a Java stack.
SPARK_MASTER = re.compile(r"local(\[[^\]]+\])?|local-cluster\[[^\]]+\]|spark://.+|yarn|k8s://.+")


def spark_master(text: str) -> str:
    """A Spark master URL for --master, checked before a JVM starts."""
    if not SPARK_MASTER.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"not a Spark master: {text!r} (local[N], local[*], spark://HOST:PORT, yarn, k8s://URL)"
        )
    return text


def without_passwords(text: str, inputs: Iterable[str | None]) -> str:
    """``text`` with the password of every URL among ``inputs`` replaced by ``***``.

    A job's inputs are paths or a database URL; Spark's and the JDBC driver's errors
    may echo that URL, password and all.
    """
    for value in inputs:
        if not value or "://" not in value:
            continue
        try:
            password = urlsplit(value).password
        except ValueError:
            continue
        for secret in {password, unquote(password or "")} - {None, ""}:
            text = text.replace(str(secret), "***")
    return text
