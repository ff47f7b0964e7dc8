"""Tokens per wall-clock second, for the status page's sparkline."""

from __future__ import annotations


class TokenHistory:
    """Tokens per wall-clock second over the last `window_s` seconds: what a scheduler puts in
    its heartbeat so that the status page can draw the last minutes as soon as it opens."""

    def __init__(self, window_s: int = 120) -> None:
        self.window_s = window_s
        self._counts: dict[int, int] = {}  # unix second -> tokens in it

    def add(self, now: float, num_tokens: int) -> None:
        second = int(now)
        if second not in self._counts:
            for old in [s for s in self._counts if s <= second - self.window_s]:
                del self._counts[old]
        self._counts[second] = self._counts.get(second, 0) + num_tokens

    def recent(self, now: float) -> list[list[int]]:
        """[[second, tokens], ...] of the seconds in the window that had tokens, oldest first."""
        first = int(now) - self.window_s
        return sorted([s, n] for s, n in self._counts.items() if s > first)
