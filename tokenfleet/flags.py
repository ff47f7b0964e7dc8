"""Command-line flags backed by environment variables: every flag of every command can also
come from TOKENFLEET_<FLAG> (e.g. --max-tokens from TOKENFLEET_MAX_TOKENS)."""

from __future__ import annotations

import argparse

from shared.config import env_default

TRUE_WORDS = ("1", "true", "yes", "on")


def flag(parser: argparse.ArgumentParser, name: str, *, type=str, default=None, **kwargs) -> None:
    """Add --name whose default comes from TOKENFLEET_NAME when that variable is set."""
    env = env_default(name)
    if env is not None:
        if kwargs.get("action") == "store_true":
            default = env.lower() in TRUE_WORDS
        else:
            default = type(env)
    if kwargs.get("action") == "store_true":
        parser.add_argument(f"--{name}", default=bool(default), **kwargs)
    else:
        parser.add_argument(f"--{name}", type=type, default=default, **kwargs)
