"""The app factory: ``create_app(config)``, as ``flask --app examples.webapp.app`` finds it.

The extensions (``db``, ``migrate``, ``ob``) are made at import time; the factory binds
them to the app it makes: ``ob.bind(db.engine)`` inside the app context, so the outbox
writes through the app's own engine and pool. The relay starts here, once per app (and
in each worker a pre-fork server forks from it, on its first message), unless
``OUTBOX_START_RELAY=false`` (CLI commands: ``flask db upgrade``) or no ``OUTBOX_BROKER``.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping
from typing import Any

from flask import Flask, Response

from examples.webapp import views
from examples.webapp.extensions import db, migrate, ob


def create_app(config: Mapping[str, Any] | None = None) -> Flask:
    """The app on ``OUTBOX_DB`` (``config`` overrides: a test's own database)."""
    app = with_database(Flask(__name__), config)
    with app.app_context():
        ob.bind(db.engine)
    app.register_blueprint(views.bp)
    app.after_request(served_by)
    serve_metrics(app)
    ob.start()  # returns at once; the relay connects in the background
    return app


def with_database(app: Flask, config: Mapping[str, Any] | None) -> Flask:
    """``app`` with its database settings, ``db`` and ``migrate`` (no outbox, no views)."""
    app.config["SQLALCHEMY_DATABASE_URI"] = os.environ.get("OUTBOX_DB")
    app.config.update(config or {})
    if not app.config["SQLALCHEMY_DATABASE_URI"]:
        raise RuntimeError("OUTBOX_DB: set it to the app's database URL")
    db.init_app(app)
    migrate.init_app(app, db)
    return app


def prepare(config: Mapping[str, Any] | None = None) -> None:
    """The schema, as a deploy makes it before the app starts: ``outbox migrate``, then
    ``flask db upgrade``. On an app of its own, which serves nothing and starts no relay."""
    import flask_migrate

    import outbox.migrate

    app = with_database(Flask(__name__), config)
    with app.app_context():
        outbox.migrate.upgrade(db.engine)
        flask_migrate.upgrade()
        db.engine.dispose()


def serve_metrics(app: Flask) -> None:
    """``GET /metrics``: this process's relay in Prometheus' format (with the metrics
    extra): what the app's own fast path published, which no worker sees."""
    try:
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

        from relay.metrics import register
    except ImportError:  # installed without [metrics]: no /metrics
        return
    registry = CollectorRegistry()
    register(ob, registry)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(registry), mimetype=CONTENT_TYPE_LATEST)


def served_by(response: Response) -> Response:
    """Names the worker process in each reply (X-Worker): shows how a server spreads them."""
    response.headers["X-Worker"] = str(os.getpid())
    return response


def main() -> None:
    """``python -m examples.webapp``: the schema, then Flask's own server (threaded)."""
    parser = argparse.ArgumentParser(description="the warehouse inbound example service")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("outbox").setLevel(logging.INFO)  # the relay's start and stop lines
    prepare()
    app = create_app()
    app.run(host="127.0.0.1", port=args.port, threaded=True)  # in production: gunicorn
