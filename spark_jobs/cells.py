"""Text cells a spreadsheet shows and never runs: the one guard for every CSV written.

A spreadsheet opening a CSV runs a cell starting with =, +, - or @ as a formula
(OWASP's "CSV injection"), and some first drop what leads it: spaces, tabs, line
breaks, other control characters, zero-width ones. A phantom's msg_id and topic come
from the broker, anyone's to write, so a text cell whose first character is one of
those, or a formula character (or its full-width form), gets a leading apostrophe:
the spreadsheet shows the rest as text. The rule looks at the first character only,
so no run of leading characters, whatever a given spreadsheet strips, can hide a
formula; a harmless value starting with a space gets the apostrophe too.

``safe_cell`` is the rule in Python; ``safe_columns`` applies the same rule to a
DataFrame's text columns on the executors (a JVM regex, UNSAFE_FIRST). Spark's CSV
writer must then keep each value as given (ignoreLeadingWhiteSpace=False and
ignoreTrailingWhiteSpace=False): by default it drops leading and trailing whitespace,
and so passed " =HYPERLINK(...)" on as a live formula.
"""

from __future__ import annotations

import unicodedata

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

# What starts a formula: = + - @, and their full-width forms (read as such by some).
FORMULA_FIRST = "=+-@\uff1d\uff0b\uff0d\uff20"
# Unicode categories a spreadsheet may skip or never show: control characters (tab, CR,
# LF, NUL, VT...), format ones (zero-width space, BOM...), space, line and paragraph
# separators.
BLANK = ("Cc", "Cf", "Zs", "Zl", "Zp")
# The same rule for Spark's rlike (java.util.regex: \p{..} are the same categories).
UNSAFE_FIRST = r"^[=+\-@\uFF1D\uFF0B\uFF0D\uFF20\p{Cc}\p{Cf}\p{Zs}\p{Zl}\p{Zp}]"
GUARD = "'"


def unsafe(text: str) -> bool:
    """Whether a spreadsheet could run ``text`` as a formula, or skip its way to one."""
    return bool(text) and (text[0] in FORMULA_FIRST or unicodedata.category(text[0]) in BLANK)


def safe_cell(text: str) -> str:
    """``text`` as a cell a spreadsheet shows and never runs."""
    return GUARD + text if unsafe(text) else text


def safe_columns(frame: DataFrame) -> DataFrame:
    """``frame`` with safe_cell's rule applied to each text column (nulls stay null)."""
    for name, kind in frame.dtypes:
        if kind == "string":
            text = F.col(name)
            guarded = F.concat(F.lit(GUARD), text)
            frame = frame.withColumn(
                name, F.when(text.rlike(UNSAFE_FIRST), guarded).otherwise(text)
            )
    return frame
