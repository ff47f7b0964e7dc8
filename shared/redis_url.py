"""Redis URLs with their credentials: `redis://` or `rediss://` (TLS), a password in the URL
or in a file (`--redis-password-file`, so that it shows neither in `ps` nor in shell history).

Everything that connects (redis-py, the gateway's pub/sub reader, the rate limiter's storage)
takes the one URL this module returns; TLS options ride in its query string as redis-py reads
them (`?ssl_ca_certs=/path/ca.pem`, `ssl_cert_reqs=none`, `ssl_certfile=`, `ssl_keyfile=`).
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from shared.errors import InvalidRequestError
from shared.redis_client import cluster_nodes

SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")  # (shared/redis_client.py)


def read_password_file(path: str | Path) -> str:
    """The password a file holds (its first line, without the line break)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise InvalidRequestError(f"cannot read the Redis password file {str(path)!r}: {exc.strerror}",
                                  param="redis-password-file") from None
    password = text.splitlines()[0] if text else ""
    if not password:
        raise InvalidRequestError(f"the Redis password file {str(path)!r} is empty",
                                  param="redis-password-file")
    return password


def with_password(url: str, password: str, username: str | None = None) -> str:
    """The URL with this password (and username, if given) in it; a password the URL had
    already is replaced."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        # redis-py reads a unix socket's password from the query string.
        query = "&".join(p for p in parts.query.split("&") if p and not p.startswith("password="))
        query = "&".join(filter(None, [query, f"password={quote(password, safe='')}"]))
        return urlunsplit(parts._replace(query=query))
    user = username if username is not None else (parts.username or "")
    if parts.scheme.endswith("+cluster"):  # host:port,host:port: urlsplit reads no host from it
        nodes = parts.netloc.rpartition("@")[2]
        return urlunsplit(parts._replace(netloc=f"{quote(user, safe='')}:{quote(password, safe='')}@{nodes}"))
    host = parts.hostname or "localhost"
    if ":" in host:
        host = f"[{host}]"  # an IPv6 address
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))


def resolve_redis_url(url: str, password_file: str | None = None) -> str:
    """The URL to connect with: checked, with the password file's password when one is given.
    A clear error names what is wrong (never the password)."""
    scheme = urlsplit(url).scheme
    if scheme not in SCHEMES:
        raise InvalidRequestError(f"--redis-url must start with redis://, rediss:// (TLS), unix:// or "
                                  f"redis+cluster:// (a Redis Cluster), got {scheme or 'no scheme'!r}",
                                  param="redis-url")
    if scheme.endswith("+cluster"):
        cluster_nodes(url)  # (a clear error for a node that is not host:port)
    if password_file:
        url = with_password(url, read_password_file(password_file))
    return url


def redacted(url: str) -> str:
    """The URL with its password hidden, for logs and status lines."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))
