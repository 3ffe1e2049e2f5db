"""Column layout of the two inputs of the reconciliation, as Parquet files hold them."""

from __future__ import annotations

import pyarrow as pa

TS = pa.timestamp("us", tz="UTC")

# The outbox ledger: one row per message the app committed (outbox_message).
LEDGER = pa.schema(
    [
        ("id", pa.int64()),
        ("msg_id", pa.string()),
        ("topic", pa.string()),
        ("status", pa.string()),
        ("created_at", TS),
        ("sent_at", TS),
        ("attempts", pa.int32()),
        ("receipt", pa.string()),
    ]
)

# The broker log: one row per message the broker stores (copies included).
BROKER = pa.schema(
    [
        ("msg_id", pa.string()),
        ("topic", pa.string()),
        ("seq", pa.string()),  # stream sequence or entry id
        ("broker_ts", TS),
    ]
)
