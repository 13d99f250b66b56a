"""URLs and addresses as they may be shown: a Redis URL never with its password, an IPv6
host in brackets."""

from __future__ import annotations

from urllib.parse import unquote, urlsplit, urlunsplit


def redacted(url: str) -> str:
    """``url`` with its password (if any) replaced by ``***``, for messages and logs: the one in
    its user info, and a ``?password=`` query parameter's (redis-py authenticates with either; the
    query's was printed whole)."""
    parts = urlsplit(url)
    query = parts.query
    if query:  # (the name as redis-py reads it: ``pass%77ord`` is ``password``)
        query = "&".join(f"{name}=***" if unquote(name).lower() == "password" else field
                         for field in query.split("&") for name in [field.partition("=")[0]])
    if parts.password is not None:
        url = urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{parts.netloc.rpartition('@')[2]}"))
    if query != parts.query:  # (not through urlunsplit: it drops the empty host of ``unix:///path``)
        url = url.replace(f"?{parts.query}", f"?{query}", 1)
    return url


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
