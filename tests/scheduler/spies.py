"""Recording the order in which an engine calls its parts (the grammar overlap tests)."""

from __future__ import annotations

from collections.abc import Callable


def spy(events: list[str], name: str, fn: Callable) -> Callable:
    """fn, appending `name` to `events` at each call."""
    def wrapper(*args, **kwargs):
        events.append(name)
        return fn(*args, **kwargs)
    return wrapper
