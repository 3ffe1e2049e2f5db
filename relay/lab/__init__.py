"""Model B, the comparison lab: RocketMQ's half/op model and the comparison of both models.

Opt-in: the product reaches it only through registration. ``register`` is named in the
entry-point group ``outbox.plugins`` (pyproject.toml); it adds the ``coordinator`` and
``compare`` commands, the dashboard's /halfop page and the ``records`` and ``halfop``
kinds of ``outbox export``. Its table has its own migration branch (``modelb``), applied
on model B's first use or by ``outbox migrate --model-b``.

- relay.lab.halfop: the producer, the coordinator and their protocol over NATS;
- relay.lab.compare: ``outbox compare``, both models on one workload;
- relay.lab.cli, relay.lab.dashboard, relay.lab.export: what ``register`` plugs in.
"""

from __future__ import annotations

from collections.abc import Sequence

from relay import ExportKind, Page, Plugins

RECORDS_HELP = "records: model B's transaction records (the listener's table)"
HALFOP_HELP = "halfop: model B's half, op and discarded streams (nats:// only)"


def register(plugins: Plugins) -> None:
    """Plug model B into the product (the entry point ``outbox.plugins: modelb``)."""
    from relay.lab import cli

    plugins.command_groups.append(cli)
    plugins.page_loaders.append(dashboard_pages)
    for kind in (
        ExportKind("records", RECORDS_HELP, cli.export_records),
        ExportKind("halfop", HALFOP_HELP, cli.export_halfop),
    ):
        plugins.export_kinds[kind.name] = kind


def dashboard_pages() -> Sequence[Page]:
    from relay.lab import dashboard  # needs the dashboard extra: only when one is made

    return dashboard.PAGES
