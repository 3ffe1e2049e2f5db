"""The app's extensions, made at import time and bound to an app in ``create_app``.

``ob`` is built here like ``db``: with its settings (the environment's ``OUTBOX_*``)
and no engine; the factory binds it to ``db.engine``, so the app and the outbox share
one engine. Without ``OUTBOX_BROKER`` (or with ``OUTBOX_START_RELAY=false``) this
process starts no relay: an ``outbox relay`` worker publishes instead.
"""

from __future__ import annotations

import atexit
import os
from pathlib import Path

from flask_migrate import Migrate
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy.orm import DeclarativeBase

import outbox.migrate
from outbox import Outbox


class Base(DeclarativeBase):
    pass


db = SQLAlchemy(model_class=Base)
# The app's own Alembic history; the filter keeps the outbox's tables out of it.
migrate = Migrate(
    directory=str(Path(__file__).with_name("migrations")),
    include_object=outbox.migrate.include_object,
)
ob = Outbox(broker=os.environ.get("OUTBOX_BROKER", ""))
atexit.register(ob.stop)  # the relay's last acks are marked before the process ends
