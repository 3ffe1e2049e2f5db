"""Fail when modules import each other, directly or round a longer loop (`make imports`).

Every import counts: those under ``if TYPE_CHECKING:`` and those inside functions too
(the seam ``Outbox.start()`` -> ``relay.runtime`` included), so a type moved up into a
module that uses it shows here. import-linter's ``acyclic_siblings`` contract looks
inside one package at a time and would miss a loop through that seam, hence this
check over the whole graph of the packages ``[tool.importlinter]`` names.
"""

from __future__ import annotations

import sys
import tomllib
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent


def packages() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return list(config["tool"]["importlinter"]["root_packages"])


def imports_of(graph: grimp.ImportGraph) -> dict[str, set[str]]:
    modules = graph.modules
    return {m: graph.find_modules_directly_imported_by(m) & modules for m in modules}


def tangles(edges: dict[str, set[str]]) -> Iterator[list[str]]:
    """The groups of modules that reach each other (Tarjan's strongly connected
    components, iterative: no recursion limit), each of two or more modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, todo = work[-1]
            step = next(todo, None)
            if step is None:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[module])
                if low[module] == index[module]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == module:
                            break
                    if len(group) > 1:
                        yield sorted(group)
            elif step not in index:
                index[step] = low[step] = len(index)
                stack.append(step)
                on_stack.add(step)
                work.append((step, iter(sorted(edges[step]))))
            elif step in on_stack:
                low[module] = min(low[module], index[step])


def one_loop(group: list[str], edges: dict[str, set[str]]) -> list[str]:
    """A shortest way from the group's first module back to itself, inside the group."""
    start, members = group[0], set(group)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for step in sorted(edges[module] & members):
                if step == start:
                    path = [module]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if step not in came_from:
                    came_from[step] = module
                    following.append(step)
        frontier = following
    raise AssertionError(f"{group} is not a cycle")  # tangles() only yields cycles


def describe(graph: grimp.ImportGraph, loop: list[str]) -> list[str]:
    lines = []
    for importer, imported in pairwise(loop):
        details = graph.get_import_details(importer=importer, imported=imported)
        where = "; ".join(f"line {d['line_number']}: {d['line_contents']}" for d in details)
        lines.append(f"  {importer} -> {imported} ({where})")
    return lines


def main() -> int:
    sys.path.insert(0, str(ROOT))  # the checkout's packages, whatever the current folder
    graph = grimp.build_graph(*packages(), exclude_type_checking_imports=False, cache_dir=None)
    edges = imports_of(graph)
    found = list(tangles(edges))
    for group in found:
        print(f"import cycle among {', '.join(group)}:", file=sys.stderr)
        print("\n".join(describe(graph, one_loop(group, edges))), file=sys.stderr)
    if found:
        print(
            f"{len(found)} import cycle(s): move the shared names into a module below "
            "both (outbox/events.py, spark_jobs/window.py are such leaves)",
            file=sys.stderr,
        )
        return 1
    print(f"no import cycles among {len(edges)} modules (type-only and lazy imports counted)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
