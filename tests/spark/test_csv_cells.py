"""No cell of discrepancies.csv starts a spreadsheet formula, whatever precedes it:
spark_jobs.cells' guard on random values, then through Spark's real CSV writer, read
back with Python's csv module.

Before the guard looked past leading whitespace, " =HYPERLINK(...)", "\\x0b+SUM(1,2)" and
"\\n-2+3" (a phantom's msg_id, from the broker) went through it untouched and Spark's
writer then dropped the whitespace: a live formula in the file.
"""

from __future__ import annotations

import csv
import random
import unicodedata
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from pyspark.sql import SparkSession

from spark_jobs.cells import safe_cell
from spark_jobs.reconciliation import write_csv

FORMULAS = tuple("=+-@\uff1d\uff0b\uff0d\uff20")  # and the full-width forms
# What a spreadsheet may drop or never show before a cell's text: whitespace, control
# characters (NUL, VT, ESC...), zero-width and other format characters, separators.
SKIPPED = ("Cc", "Cf", "Zs", "Zl", "Zp")
SOME_SKIPPED = [" ", "\t", "\n", "\r", "\x0b", "\x0c", "\x00", "\x1b", "\x7f", "\x85",
                "\xa0", "\u2003", "\u200b", "\u2028", "\u3000", "\ufeff"]  # fmt: skip
FROM_THE_ISSUE = [' =HYPERLINK("http://evil.example","x")', "\x0b+SUM(1,2)", "\n-2+3"]
skipped_chars = st.sampled_from(SOME_SKIPPED) | st.characters(categories=SKIPPED)


def skipped(char: str) -> bool:
    return char.isspace() or unicodedata.category(char) in SKIPPED


def as_read(cell: str) -> str:
    """The cell as a spreadsheet may read it: what leads it and is skipped, dropped."""
    start = 0
    while start < len(cell) and skipped(cell[start]):
        start += 1
    return cell[start:]


def starts_a_formula(cell: str) -> bool:
    return as_read(cell)[:1] in FORMULAS


@settings(max_examples=300, deadline=None)
@given(
    prefix=st.text(skipped_chars, max_size=6),
    formula=st.sampled_from(FORMULAS),
    rest=st.text(max_size=20),
)
def test_no_leading_run_hides_a_formula(prefix: str, formula: str, rest: str) -> None:
    value = prefix + formula + rest
    cell = safe_cell(value)
    assert cell == "'" + value  # guarded, and otherwise the value as it was
    assert not starts_a_formula(cell)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=30))
def test_any_text_is_kept_or_guarded_and_never_a_formula(value: str) -> None:
    cell = safe_cell(value)
    assert cell in (value, "'" + value)
    assert not starts_a_formula(cell)
    if value[:1].isalnum():
        assert cell == value  # an ordinary id or topic is written as it is


def hostile_values() -> list[str]:
    """The issue's values, each formula character behind each skipped one, and random
    mixes of skipped, formula, quote and ordinary characters."""
    values = [*FROM_THE_ISSUE, "ok-1", "a=b", "trailing space  ", "'=already quoted"]
    values += [f"{blank}{formula}1+1" for blank in SOME_SKIPPED for formula in FORMULAS]
    alphabet = [*SOME_SKIPPED, *FORMULAS, "a", "7", '"', ",", ";", "'", "é", "\U0001f600"]
    draw = random.Random(37)
    values += ["".join(draw.choices(alphabet, k=draw.randint(1, 12))) for _ in range(300)]
    return values


def test_no_cell_written_by_spark_starts_a_formula(spark: SparkSession, tmp_path: Path) -> None:
    values = hostile_values()
    rows = [
        {"kind": "phantom", "msg_id": v, "topic": v, "details": "no ledger row"} for v in values
    ]
    spark.createDataFrame(rows).write.parquet(str(tmp_path / "found"))
    write_csv(spark, tmp_path / "found", tmp_path / "found.csv")
    with (tmp_path / "found.csv").open(newline="", encoding="utf-8") as f:
        read = list(csv.DictReader(f))
    for row in read:
        for cell in row.values():
            assert not starts_a_formula(cell), repr(cell)
    # Each value as the rule in Python says: nothing else added, dropped or trimmed.
    assert sorted(r["msg_id"] for r in read) == sorted(safe_cell(v) for v in values)
    assert all(r["topic"] == r["msg_id"] for r in read)
