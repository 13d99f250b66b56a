"""URLs and addresses as they may be shown: a Redis URL never with its password, an IPv6
host in brackets."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def redacted(url: str) -> str:
    """``url`` with its password (if any) replaced by ``***``, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def host_port(host: str, port: int) -> str:
    """``host:port``, or ``[host]:port`` for an IPv6 address."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


WILDCARD_HOSTS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}  # listening on all -> open locally


def listening_url(host: str, port: int) -> str:
    """The ``http://`` URL to open for a server listening on ``host:port``: a wildcard address
    (the image's ``0.0.0.0``) is no address to open; its loopback is, and the URL says it listens
    on all interfaces."""
    local = WILDCARD_HOSTS.get(host)
    if local is None:
        return "http://" + host_port(host, port)
    return f"http://{host_port(local, port)} (listening on all interfaces, {host_port(host or '0.0.0.0', port)})"
