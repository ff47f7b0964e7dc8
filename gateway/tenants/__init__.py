"""Tenants: who an API key belongs to (`directory.py`, the keys file; `registry.py`, keys and
limits kept in Redis), what a tenant may do per minute and at once (`limits.py`), and what it
may see (`access.py`)."""
