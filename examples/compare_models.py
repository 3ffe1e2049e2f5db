"""Model A (outbox) and model B (half/op) on the same workload, side by side.

The same code as `outbox compare`; for example, a quick run with every fault:

    python -m examples.compare_models --transactions 1000 --faults all --out /tmp/cmp

It needs PostgreSQL (``--db``, default the local server's ``postgres`` database, in a
scratch schema) and starts the wheel's nats-server unless ``--broker`` names one.
"""

from __future__ import annotations

import sys

from relay.cli import main

if __name__ == "__main__":
    sys.exit(main(["compare", *sys.argv[1:]]))
