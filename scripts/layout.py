"""The shape of the code, as issue 39's figures read it: modules and lines per package,
the longest classes, and the places that compare a database dialect's name.

Run: ``python scripts/layout.py [ROOT]`` (ROOT defaults to the checkout). Lines are
physical lines of the .py files; a class's length runs from its ``class`` line to its
last statement.
"""

from __future__ import annotations

import ast
import re
import sys
from collections import defaultdict
from pathlib import Path

PACKAGES = ("outbox", "relay", "spark_jobs")
# A comparison with a dialect's name: ``backend == "sqlite"``, ``name in ("mysql", ...)``.
DIALECT_BRANCH = re.compile(r"""(==|!=|\bin)\s*\(?\s*["'](postgresql|mysql|mariadb|sqlite)["']""")


def package_of(path: Path, root: Path) -> str:
    return ".".join(path.relative_to(root).parent.parts)


def class_lengths(tree: ast.AST) -> list[tuple[str, int]]:
    return [
        (node.name, (node.end_lineno or node.lineno) - node.lineno + 1)
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
    ]


def main(root: Path) -> None:
    modules: dict[str, list[int]] = defaultdict(list)
    classes: list[tuple[int, str]] = []
    branches: dict[str, int] = {}
    for name in PACKAGES:
        for path in sorted((root / name).rglob("*.py")):
            text = path.read_text()
            rel = str(path.relative_to(root))
            modules[package_of(path, root)].append(len(text.splitlines()))
            classes += [(n, f"{rel}:{c}") for c, n in class_lengths(ast.parse(text))]
            if count := len(DIALECT_BRANCH.findall(text)):
                branches[rel] = count
    print("| package | modules | lines |\n| --- | --- | --- |")
    for package in sorted(modules):
        print(f"| {package} | {len(modules[package])} | {sum(modules[package]):,} |")
    print("\n| longest classes | lines |\n| --- | --- |")
    for lines, where in sorted(classes, reverse=True)[:8]:
        print(f"| {where} | {lines} |")
    print(f"\ndialect-name comparisons: {sum(branches.values())} in {len(branches)} modules")
    for rel, count in sorted(branches.items()):
        print(f"  {rel}: {count}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent)
