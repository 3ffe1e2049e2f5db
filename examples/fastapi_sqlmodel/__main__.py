"""``python -m examples.fastapi_sqlmodel --port 8000``, on OUTBOX_DB and OUTBOX_BROKER."""

from examples.fastapi_sqlmodel.app import main

main()
