"""structlog set-up: console output in a terminal, JSON otherwise."""

from __future__ import annotations

import logging
import sys

import structlog


class _CurrentStderr:
    """Writes to whatever sys.stderr is at the time of the write, not at configuration: a
    replaced stderr (a test's capture, since closed) must not keep receiving log lines."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(level: str = "INFO", *, json: bool | None = None) -> None:
    if json is None:
        json = not sys.stderr.isatty()
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    logging.basicConfig(level=level, stream=sys.stderr, format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),
        # Not cached: a logger reads the configuration at each call (a few µs; no hot loop
        # logs), so one configured again (a test's capture, a second CLI run in a process)
        # follows it.
        cache_logger_on_first_use=False,
    )


def get_logger(name: str, **context: object) -> structlog.typing.FilteringBoundLogger:
    """A logger that follows the configuration in force when it logs, not the one when it was
    made: modules make theirs at import, before the command's `configure_logging` runs (a
    bound logger made then kept structlog's defaults: console lines, no level filter)."""
    return structlog.get_logger(name, **context)
