"""How every benchmark prints its figures: a title and aligned name/value rows."""

from __future__ import annotations

from collections.abc import Sequence


def print_rows(title: str, rows: Sequence[Sequence[str]]) -> None:
    """First column left-aligned, the others right-aligned, two spaces apart."""
    print(f"\n{title}")
    widths = [max(len(row[i]) for row in rows) for i in range(max(len(r) for r in rows))]
    for row in rows:
        cells = [
            row[0].ljust(widths[0]),
            *(v.rjust(w) for v, w in zip(row[1:], widths[1:], strict=False)),
        ]
        print("  " + "  ".join(cells).rstrip())
