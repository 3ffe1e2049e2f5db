"""`--dist loadgroup` on pytest 9.2: the xdist_group marks take effect again.

pytest-xdist (3.8) puts a grouped test in its group by renaming it `<nodeid>@<group>`,
assigning ``item._nodeid``; pytest 9.2's node ids are structured and no longer read that
attribute, so every group was silently ignored (pytest-dev/pytest-xdist#1386): the Spark
tests started a SparkSession and a cluster on each worker, and each worker built the
wheel, its virtualenvs and the plan tests' large tables. This names the items as xdist
would have, after xdist's own hook, where its renaming did not take.
"""

from __future__ import annotations

import pytest


def group_suffix(item: pytest.Item) -> str:
    """xdist's suffix for ``item``: `@` and its groups' names, sorted, joined by `_`."""
    names = {
        str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
        for mark in item.iter_markers("xdist_group")
    }
    return "@" + "_".join(sorted(names)) if names else ""


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not getattr(config.option, "loadgroup", False):
        return  # not an xdist worker of a loadgroup run
    for item in items:
        suffix = group_suffix(item)
        if suffix and not item.nodeid.endswith(suffix):
            item._id = type(item._id).parse(item.nodeid + suffix)
