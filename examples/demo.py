"""`make demo`: the outbox on an embedded SQLite file.

Creates the schema, commits one business row and its message in one transaction,
rolls back a second one, and shows what the table holds.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from sqlalchemy import Column, Integer, MetaData, String, Table, select
from sqlalchemy.orm import Session

from outbox import Outbox, migrate, outbox_message

business = MetaData()
inbound = Table(
    "inbound", business, Column("id", Integer, primary_key=True), Column("sku", String(40))
)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ob = Outbox(f"sqlite:///{Path(tmp) / 'demo.sqlite'}")
        migrate.upgrade(ob.engine)
        business.create_all(ob.engine)

        @ob.transactional
        def receive(session: Session, sku: str, fail: bool = False) -> str:
            session.execute(inbound.insert().values(sku=sku))
            msg_id = ob.send(session, "warehouse.inbound", {"sku": sku}, key=sku)
            if fail:
                raise ValueError(f"{sku}: rejected")
            return msg_id

        print("committed", receive("A-1"))
        try:
            receive("B-2", fail=True)
        except ValueError as exc:
            print("rolled back:", exc)
        with ob.engine.connect() as conn:
            for row in conn.execute(
                select(
                    outbox_message.c.msg_id,
                    outbox_message.c.topic,
                    outbox_message.c.status,
                    outbox_message.c.payload,
                )
            ):
                print("outbox row:", row.msg_id, row.topic, row.status, row.payload.decode())
        ob.engine.dispose()


if __name__ == "__main__":
    main()
