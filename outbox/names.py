"""The one rule for the schema and table names the project puts into SQL or connection options.

A name is 1 to 63 characters (PostgreSQL's limit; MariaDB's is 64) of lower-case ASCII
letters, digits and ``_``, not starting with a digit. Lower case only: PostgreSQL folds
unquoted names to lower case (in ``search_path`` too) and MariaDB's database names may
or may not be case-sensitive, so a mixed-case name would be one table here and another
there. Nothing else gets through: no quote, space, ``-`` (libpq's ``-c`` options),
``;``, NUL or non-ASCII letter can reach a statement or an ``options`` string.
"""

from __future__ import annotations

import re

from outbox.errors import ConfigError

NAME_MAX = 63
NAME_PATTERN = r"[a-z_][a-z0-9_]*"
NAME_RULE = (
    "must be 1 to {longest} characters of lower-case ASCII letters, digits and _, "
    "not starting with a digit"
)
_NAME = re.compile(NAME_PATTERN)


def check_name(field: str, value: object, longest: int = NAME_MAX) -> str:
    """``value`` if it is an acceptable schema or table name, else ConfigError naming ``field``."""
    if not isinstance(value, str) or len(value) > longest or not _NAME.fullmatch(value):
        shown = value if not isinstance(value, str) or len(value) <= 80 else value[:80] + "..."
        raise ConfigError(f"{field}: {NAME_RULE.format(longest=longest)}, got {shown!r}")
    return value
