"""Warehouse inbound on FastAPI, async: an ``AsyncSession`` injected per request."""
