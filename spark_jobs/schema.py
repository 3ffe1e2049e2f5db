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
        ("deliver_at", TS),  # a scheduled message's due time (database clock); null: none
        ("key", pa.string()),  # an ordered message's key (any message's, if it has one)
        ("seq", pa.int64()),  # an ordered message's place in its (topic, key); null: none
    ]
)
# Columns a ledger exported before them lacks: the job reads them as null.
LEDGER_OPTIONAL = ("deliver_at", "key", "seq")

# The broker log: one row per message the broker stores (copies included).
BROKER = pa.schema(
    [
        ("msg_id", pa.string()),
        ("topic", pa.string()),
        ("seq", pa.string()),  # its place in the log: stream sequence, entry id, offset
        ("broker_ts", TS),
        ("key", pa.string()),  # Outbox-Key
        ("outbox_seq", pa.int64()),  # Outbox-Seq: an ordered message's place in its key
        # An entry the relay cannot have written (a stranger's): why, else null; then
        # msg_id is what could be salvaged (or null), key and outbox_seq are null.
        ("malformed", pa.string()),
        ("raw", pa.string()),  # a malformed entry's fields, escaped, cut short
        ("stream", pa.string()),  # where it was read: JetStream stream, topic, queue
    ]
)
# Columns an export made before them lacks: the job reads them as null.
BROKER_OPTIONAL = ("key", "outbox_seq", "malformed", "raw", "stream")

# Model B's business truth: SqlTransactionListener's table (outbox_transaction_record).
RECORDS = pa.schema(
    [
        ("transaction_id", pa.string()),
        ("producer_group", pa.string()),
        ("msg_id", pa.string()),
        ("created_at", TS),
    ]
)

# Model B's system streams in one file: ``stream`` is half, op or discarded. A half
# row is one copy of a half (put-backs add copies); an op row names the half offset
# it settles; a discarded row is a half given up after too many checks.
HALFOP_LOG = pa.schema(
    [
        ("stream", pa.string()),
        ("msg_id", pa.string()),
        ("topic", pa.string()),  # REAL_TOPIC (empty for ops)
        ("seq", pa.int64()),
        ("broker_ts", TS),
        ("check_times", pa.int32()),
        ("half_offset", pa.int64()),  # ops and discarded: the half they refer to
    ]
)
