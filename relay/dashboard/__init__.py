"""The operator dashboard (`outbox dashboard`, ``pip install 'outbox-relay[dashboard]'``).

- relay.dashboard.app: ``create_app()`` and the routes: overview (live), dead letters,
  one message, blocked keys, reports, /healthz, and the pages plugins register (model
  B's records, relay.lab.dashboard); actions behind a token;
- relay.dashboard.params: each route's parameters and their rules, checked in one place;
- relay.dashboard.database: the pages' reads and writes, a database down as a 503 and
  one log line per outage;
- relay.dashboard.overview: the overview's figures and charts, a relay's /metrics;
- relay.dashboard.guard: sessions, the token and CSRF checks;
- relay.dashboard.reports: reports under ``--reports DIR``, served read-only.
"""

from __future__ import annotations

from relay.dashboard.app import create_app

__all__ = ["create_app"]
