"""shared/logging.py: loggers made at import (every module's `log = get_logger(...)`) follow
the configuration the command sets afterwards, its level and its JSON lines."""

from __future__ import annotations

import json
import subprocess
import sys

import structlog
from structlog.testing import capture_logs

from shared.logging import configure_logging, get_logger

_MADE_BEFORE_CONFIGURATION = """
from shared.logging import configure_logging, get_logger
log = get_logger("tokenfleet.example", replica="s0")
configure_logging("WARNING", json=True)
log.info("filtered out at WARNING")
log.warning("kept", n=1)
"""


def test_a_logger_made_at_import_writes_json_at_the_configured_level() -> None:
    done = subprocess.run([sys.executable, "-c", _MADE_BEFORE_CONFIGURATION],
                          capture_output=True, text=True, timeout=60, check=True)
    [line] = done.stderr.splitlines()
    record = json.loads(line)
    assert (record["event"], record["level"], record["n"], record["replica"]) == (
        "kept", "warning", 1, "s0")


def test_capture_logs_sees_a_module_logger_after_the_logging_was_configured_again() -> None:
    """The suite configures logging in-process more than once (CLI entry points); a module
    logger made before must still be captured by a later test."""
    log = get_logger("tokenfleet.example")
    try:
        configure_logging("INFO", json=True)
        configure_logging("WARNING", json=False)
        with capture_logs() as logs:
            log.info("below the level")
            log.warning("seen")
    finally:
        structlog.reset_defaults()
    assert [entry["event"] for entry in logs] == ["seen"]
