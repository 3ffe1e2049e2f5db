"""Warehouse inbound on FastAPI + SQLModel: a sync ``Session`` injected per request."""
