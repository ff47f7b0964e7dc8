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


def flag_table(parser: argparse.ArgumentParser, rows: tuple[tuple[str, type, object, str], ...]) -> None:
    """flag() for each (name, type, default, help) row: a command's settings read as a table."""
    for name, kind, default, text in rows:
        flag(parser, name, type=kind, default=default, help=text)


ROUTING_MODES = ("prefix", "none")  # the gateway's --routing (gateway/fleet/routing.py)
REDIS_URL_HELP = ("redis://[user:password@]host:port/db, or rediss:// for TLS (TLS options in the query: "
                  "?ssl_ca_certs=ca.pem), or redis+cluster://host:port,host:port for a Redis Cluster")


def redis_flags(parser: argparse.ArgumentParser, *, default: str | None = None,
                 help: str = REDIS_URL_HELP) -> None:
    """--redis-url and --redis-password-file: every command that talks to Redis takes both."""
    flag(parser, "redis-url", default=default, help=help)
    flag(parser, "redis-password-file",
          help="file whose first line is the Redis password (kept out of the URL, `ps` and shell history)")


def list_flag(parser: argparse.ArgumentParser, name: str, **kwargs) -> None:
    """A repeatable --name; TOKENFLEET_NAME (comma-separated) stands in when none is given."""
    parser.add_argument(f"--{name}", action="append", default=None, **kwargs)


def list_value(args: argparse.Namespace, name: str) -> list[str]:
    given = getattr(args, name.replace("-", "_"))
    if given:
        return given
    env = env_default(name)
    return [item.strip() for item in env.split(",") if item.strip()] if env else []
