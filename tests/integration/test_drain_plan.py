"""The drain's claims read about what they return, whatever the backlog behind them.

A backlog of 20,000 pending rows (and a few ordered keys), freshly analyzed: the plan of
the drain's unordered claim from an id in the middle, and of its ordered heads' claim,
executed (PostgreSQL's EXPLAIN ANALYZE, MariaDB's ANALYZE FORMAT=JSON), reads a few
hundred rows, not the backlog (issue 40: one statement with both read every remaining
pending row per batch, so a drain was quadratic).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, Engine, Select, text

from outbox.dialects import dialect_for
from relay import store

BACKLOG = 20_000
KEYS, PER_KEY = 10, 10  # ordered rows: 10 keys of 10, so 10 heads
LIMIT = 500

FILL = {
    "postgresql": """
        INSERT INTO outbox_message (msg_id, topic, key, seq, payload, created_at)
        SELECT gen_random_uuid(), 'plan',
               CASE WHEN g > :n THEN 'k' || (g % :keys) END,
               CASE WHEN g > :n THEN (g - :n - 1) / :keys + 1 END,
               '\\x7b7d'::bytea, now() - interval '1 hour'
        FROM generate_series(1, :n + :ordered) AS g""",
    "mariadb": """
        INSERT INTO outbox_message (msg_id, topic, `key`, seq, payload, created_at)
        SELECT REPLACE(UUID(), '-', ''), 'plan',
               CASE WHEN seq > :n THEN CONCAT('k', seq % :keys) END,
               CASE WHEN seq > :n THEN (seq - :n - 1) DIV :keys + 1 END,
               '{}', UTC_TIMESTAMP(6) - INTERVAL 1 HOUR
        FROM seq_1_to_30000 WHERE seq <= :n + :ordered""",
}
ANALYZE = {"postgresql": "ANALYZE outbox_message", "mariadb": "ANALYZE TABLE outbox_message"}


def backlog(conn: Connection) -> None:
    name = kind(conn)
    params = {"n": BACKLOG, "keys": KEYS, "ordered": KEYS * PER_KEY}
    conn.execute(text(FILL[name]), params)
    conn.commit()
    conn.execute(text(ANALYZE[name]))
    conn.commit()


def kind(conn: Connection) -> str:
    return "postgresql" if conn.dialect.name == "postgresql" else "mariadb"


def executed_plan(conn: Connection, stmt: Select[Any]) -> tuple[int, int]:
    """(rows the plan read at its table accesses, rows it returned), the statement run
    for real in a transaction rolled back afterwards."""
    compiled = stmt.compile(conn, compile_kwargs={"render_postcompile": True})
    sql, params = str(compiled), compiled.params
    with conn.begin():
        if kind(conn) == "postgresql":
            found = conn.exec_driver_sql(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}", params)
            plan = found.scalar_one()
            plan = plan if isinstance(plan, list) else json.loads(plan)
            top = plan[0]["Plan"]
            read = sum(pg_rows_read(top))
            returned = top["Actual Rows"]
        else:
            found = conn.exec_driver_sql(f"ANALYZE FORMAT=JSON {sql}", params)
            plan = json.loads(found.scalar_one())
            read = sum(maria_rows_read(plan))
            returned = len(conn.execute(stmt).all())
        conn.rollback()
    return int(read), int(returned)


def pg_rows_read(node: dict[str, Any]) -> list[float]:
    """Rows each scan node read (kept or filtered out), over its loops, in the tree."""
    own = []
    if "Scan" in node["Node Type"]:
        kept = node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)
        own.append(kept * node.get("Actual Loops", 1))
    for child in node.get("Plans", []):
        own += pg_rows_read(child)
    return own


def maria_rows_read(node: Any) -> list[float]:
    """Rows each table access of a MariaDB ANALYZE read (r_rows over r_loops)."""
    if isinstance(node, list):
        return [r for item in node for r in maria_rows_read(item)]
    if not isinstance(node, dict):
        return []
    own = []
    if "table_name" in node and "r_rows" in node:
        own.append(float(node["r_rows"] or 0) * float(node.get("r_loops", 1)))
    for value in node.values():
        own += maria_rows_read(value)
    return own


def middle_id(conn: Connection) -> int:
    low, high = conn.execute(text("SELECT min(id), max(id) FROM outbox_message")).one()
    conn.commit()
    return int(low + (high - low) // 2)


def test_the_drain_claims_read_about_what_they_return(server_db: Engine) -> None:
    dialect = dialect_for(server_db)
    now = dialect.bind_time(datetime.now(UTC))
    with server_db.connect() as conn:
        backlog(conn)
        after_id = middle_id(conn)
        unordered = store.claim_due_stmt(now, now, LIMIT, False, after_id=after_id)
        read, returned = executed_plan(conn, unordered)
        assert returned == LIMIT
        assert read < 2 * LIMIT, f"the unordered claim read {read} rows for {returned}"

        heads = store.claim_heads_stmt(now, LIMIT)
        read, returned = executed_plan(conn, heads)
        assert returned == KEYS, "each ordered key's head, whatever its id"
        # the ordered rows, and for each a look at its key's earlier rows
        assert read < 5 * KEYS * PER_KEY, f"the heads' claim read {read} rows"
