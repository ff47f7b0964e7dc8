"""Redis URLs with credentials: a password file's password goes into the URL, intact."""

from __future__ import annotations

import pytest
from redis.connection import SSLConnection, parse_url

from shared.errors import InvalidRequestError
from shared.redis_url import redacted, resolve_redis_url, with_password


def test_a_password_file_fills_the_url_and_keeps_host_db_and_tls_options(tmp_path):
    secret = tmp_path / "pw"
    secret.write_text("p@ss:w/rd %1\n")
    url = resolve_redis_url("rediss://redis.example:6380/2?ssl_ca_certs=/etc/ca.pem", str(secret))
    options = parse_url(url)
    assert options["password"] == "p@ss:w/rd %1"
    assert (options["host"], options["port"], options["db"]) == ("redis.example", 6380, 2)
    assert options["ssl_ca_certs"] == "/etc/ca.pem" and options["connection_class"] is SSLConnection
    assert "p@ss" not in redacted(url) and "***" in redacted(url)


def test_a_username_is_kept_and_a_password_in_the_url_replaced():
    options = parse_url(with_password("redis://app:old@10.0.0.1:7000/0", "new"))
    assert (options["username"], options["password"]) == ("app", "new")


def test_bad_schemes_and_unreadable_or_empty_files_are_clear_errors(tmp_path):
    with pytest.raises(InvalidRequestError, match="redis://, rediss://"):
        resolve_redis_url("http://127.0.0.1:6379")
    with pytest.raises(InvalidRequestError, match="cannot read the Redis password file"):
        resolve_redis_url("redis://127.0.0.1", str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("")
    with pytest.raises(InvalidRequestError, match="is empty"):
        resolve_redis_url("redis://127.0.0.1", str(tmp_path / "empty"))
