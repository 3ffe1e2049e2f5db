"""``python -m examples.fastapi_async --port 8000``, on OUTBOX_DB (async) and OUTBOX_BROKER."""

from examples.fastapi_async.app import main

main()
