"""What the example services share on their command line."""

from __future__ import annotations

import argparse
import os


def add_db_and_broker(parser: argparse.ArgumentParser) -> None:
    """``--db`` and ``--broker``, defaulting to OUTBOX_DB and OUTBOX_BROKER (required if unset)."""
    for flag, variable in (("--db", "OUTBOX_DB"), ("--broker", "OUTBOX_BROKER")):
        parser.add_argument(
            flag, default=os.environ.get(variable), required=variable not in os.environ
        )
