"""Command-line value types and output hygiene shared by the Spark jobs and the ``outbox``
command (standard library only: the jobs ship alone with ``spark-submit --py-files``)."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import unquote, urlsplit

DAY_S = 86400
# Numbers as a command line writes them: ASCII digits only (int() and float() also take
# Unicode digits such as '١٢', 'inf', 'nan' and '1_000'), at most this many characters.
WHOLE = re.compile(r"[+-]?[0-9]+")
DECIMAL = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
LONGEST = 40


def iso_time(text: str) -> datetime:
    """An ISO 8601 time for a command-line flag; naive times are UTC."""
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not an ISO 8601 time: {text!r} (e.g. 2024-05-01T12:00:00Z)"
        ) from None
    return value if value.tzinfo else value.replace(tzinfo=UTC)


@dataclass(frozen=True)
class Bounded:
    """The ``type`` of every numeric flag: a number from ``lo`` to ``hi`` (both included),
    in ASCII digits; anything else is a usage error (exit status 2) that argparse prefixes
    with the flag, e.g. ``argument --limit: '0' is not a whole number from 1 to 10000``.
    A flag's help states ``range`` (tests/unit/test_flag_ranges.py checks every parser)."""

    lo: float
    hi: float
    what: str  # "a whole number", "a number", "a number of seconds"

    @property
    def range(self) -> str:
        """The accepted values as a flag's help and error say them: ``1 to 10000``."""
        return f"{plain(self.lo)} to {plain(self.hi)}"

    def __call__(self, text: str) -> int | float:
        word = text.strip()
        whole = self.what == WHOLE_NUMBER
        if len(word) <= LONGEST and (WHOLE if whole else DECIMAL).fullmatch(word):
            value = int(word) if whole else float(word)
            if self.lo <= value <= self.hi:
                return value
        raise argparse.ArgumentTypeError(f"{shown(text)} is not {self.what} from {self.range}")


WHOLE_NUMBER = "a whole number"


def bounded_int(lo: int, hi: int) -> Bounded:
    """A whole number from ``lo`` to ``hi``, for a count, a size or a port."""
    return Bounded(lo, hi, WHOLE_NUMBER)


def bounded_number(lo: float, hi: float) -> Bounded:
    """A number from ``lo`` to ``hi`` (finite: never inf or nan), for a rate or a share."""
    return Bounded(lo, hi, "a number")


def bounded_seconds(lo: float, hi: float) -> Bounded:
    """A number of seconds from ``lo`` to ``hi`` (finite: never inf or nan)."""
    return Bounded(lo, hi, "a number of seconds")


# --sla of `outbox status` and `outbox reconcile` (the same rows are stuck in both).
SLA_SECONDS = bounded_seconds(0, 30 * DAY_S)


def plain(number: float) -> str:
    """A bound as written: 2592000, not 2.592e+06; 0.5 as 0.5."""
    return str(int(number)) if float(number).is_integer() else str(number)


def shown(text: str) -> str:
    """A refused value, quoted and cut: a 5,000-digit argument is not echoed whole."""
    return repr(text if len(text) <= LONGEST else text[:LONGEST] + "...")


def out_file_problem(path: str) -> str | None:
    """Why a file cannot be written at ``path`` (None when it can): a folder there, or its
    folder missing, not a folder or not writable. Checked before any work starts."""
    out = Path(path)
    if out.is_dir():
        return "a folder, not a file"
    return folder_problem(out.parent)


def out_folder_problem(path: str) -> str | None:
    """Why a folder of results cannot be written at ``path`` (None when it can, remote
    paths such as s3a:// included): a file there, or the nearest existing folder on the
    way (the missing ones are created) not a folder or not writable."""
    if "://" in path and not path.startswith("file://"):
        return None  # Spark's to judge
    out = Path(path.removeprefix("file://"))
    if out.exists() and not out.is_dir():
        return "a file, not a folder"
    while not out.exists() and out != out.parent:
        out = out.parent
    return folder_problem(out)


def folder_problem(folder: Path) -> str | None:
    """Why files cannot be made in ``folder``: missing, not a folder, not writable."""
    if not folder.exists():
        return f"no folder {folder}"
    if not folder.is_dir():
        return f"{folder} is not a folder"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"folder {folder} is not writable"
    return None


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
