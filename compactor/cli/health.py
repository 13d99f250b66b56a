"""``compactor health``: is Redis (and optionally the API, a worker, a watcher) alive?

A worker counts as alive while RQ's record of it (``last_heartbeat``) is under
``WORKER_ALIVE_S`` old: every worker heartbeats each ``HEARTBEAT_INTERVAL_S``
(5 s), idle or busy, so a killed one stops counting within 20 s, not when its
key expires (``worker_ttl + 60`` s).

Meant for container health checks: ``compactor health --check`` prints nothing
and exits 0 when every requested check passes, 1 otherwise, also when the
configuration does not load (a bad ``redis.url`` included) or names no Redis
(say, before ``compactor serve`` has started its embedded one): a health check
reports, it never exits 2 (Docker reserves 2). Without ``--check``, a
configuration that does not load is what it is for every command: one line,
exit 2.
"""

from __future__ import annotations

import contextlib
import io
import logging
import socket
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, NoReturn
from urllib.parse import urlsplit, urlunsplit

import redis
import typer
from typer.core import TyperCommand

from compactor.cli.common import (
    ConfigOpt,
    DataDirOpt,
    JsonOpt,
    RedisUrlOpt,
    UsageError,
    load,
    print_json,
)
from compactor.keys import Keys
from compactor.shards import server_ms
from compactor.redis_errors import probe_writes
from compactor.urls import WILDCARD_HOSTS, host_port, redacted
from events.config import Settings
from events.errors import InvalidConfig

logger = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 3.0
# A worker is live while its last heartbeat is younger than this. Ours beat every 5 s, busy or idle
# (worker.runner.HEARTBEAT_INTERVAL_S; not imported here: worker.runner loads litellm).
WORKER_ALIVE_S = 20.0


def check_redis(client: redis.Redis, keys: Keys) -> str:
    probe_writes(client, keys.health)  # (PING answered while Redis refused every write: OOM)
    return "ok"


def check_api(url: str, token: str) -> str:
    import httpx

    # (its UTF-8 bytes: httpx encodes a str header as ASCII, and a non-ASCII token failed every check)
    headers = {b"Authorization": b"Bearer " + token.encode()} if token else {}
    probe = healthz_url(url)
    try:
        response = httpx.get(probe, headers=headers, timeout=CHECK_TIMEOUT_S)
    except httpx.HTTPError as e:  # (the address said: "[Errno 111] Connection refused" named none)
        raise RuntimeError(f"{redacted(probe)}: {e}") from None
    if response.status_code != 200:
        raise RuntimeError(f"HTTP {response.status_code} from {redacted(probe)}")
    return "ok"


def healthz_url(url: str) -> str:
    """The API's ``/healthz`` under ``url`` (its base, or ``/healthz`` itself), its query kept
    apart: ``…/healthz`` was asked for ``…/healthz/healthz`` (a 404), and ``http://h:8461?x=1``
    for ``/?x=1/healthz``, the status page, which answered ok whatever the API's health."""
    parts = urlsplit(url)
    path = parts.path.rstrip("/")
    if not path.endswith("/healthz"):
        path += "/healthz"
    return urlunsplit(parts._replace(path=path, fragment=""))


def check_workers(client: redis.Redis, settings: Settings, host: str | None = None) -> str:
    """``ok (N)``: N workers on the queue whose last heartbeat is under ``WORKER_ALIVE_S`` old
    (a SIGKILLed worker stays registered until its key expires, up to 2 minutes); with ``host``,
    only the workers running on that host (RQ records each worker's hostname: a container's own)."""
    from rq import Queue, Worker

    queue = Queue(Keys(settings.redis.prefix, settings.redis.shards).queue, connection=client)
    registered = Worker.all(connection=client, queue=queue)
    if host is not None:
        registered = [w for w in registered if w.hostname == host]
    now = datetime.fromtimestamp(server_ms(client) / 1000, UTC)  # (the workers beat in Redis's time: worker.runner)
    live = [w for w in registered
            if w.last_heartbeat is not None and (now - w.last_heartbeat).total_seconds() < WORKER_ALIVE_S]
    if not registered:
        raise RuntimeError("no RQ worker registered on the queue" + (f" from host {host}" if host else ""))
    if not live:
        raise RuntimeError(f"no live RQ worker on the queue: {len(registered)} registered, "
                           f"none with a heartbeat in the last {WORKER_ALIVE_S:.0f}s")
    return f"ok ({len(live)})"


def check_watcher(client: redis.Redis, settings: Settings) -> str:
    keys = Keys(settings.redis.prefix, settings.redis.shards)
    value = client.get(keys.shard_count)  # (the live watchers' count: another one is refused)
    recorded = value.decode() if isinstance(value, bytes) else value
    if recorded is not None and recorded != str(keys.shards):
        raise RuntimeError(f"the watchers read {recorded} shards ({keys.shard_count}); this "
                           f"configuration's redis.shards is {keys.shards}")
    held = sum(1 for n in range(keys.shards) if client.exists(keys.lease(n)))
    if held == 0:
        raise RuntimeError("no watcher holds a shard lease")
    return f"ok ({held}/{keys.shards} shards leased)"


API_FROM_CONFIG = "config"  # ``--api config``


def _api_url(value: str) -> str:
    """``--api``: an http(s) URL with a host and, if given, a port from 1 to 65535 (a bad one was
    reported as a refused connection: unhealthy, exit 1, where the command line is wrong)."""
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError as e:
        raise typer.BadParameter(f"{value!r} is not a URL: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or port == 0:
        raise typer.BadParameter(f"{value!r} is not an http(s) URL of the API (e.g. http://127.0.0.1:8080)")
    return value


def health(
    check: Annotated[bool, typer.Option(
        "--check", help="Print nothing; exit 0 when healthy, 1 otherwise.")] = False,
    api_url: Annotated[str | None, typer.Option(
        "--api", help="Also GET this API's /healthz (e.g. http://127.0.0.1:8080; 'config': at the configured "
                      "api.host and api.port, a wildcard host as its loopback).")] = None,
    workers: Annotated[bool, typer.Option(
        "--workers",
        help=f"Also require a live RQ worker on the queue (a heartbeat in the last {WORKER_ALIVE_S:.0f} s).")] = False,
    watcher: Annotated[bool, typer.Option(
        "--watcher", help="Also require a watcher holding a shard lease.")] = False,
    this_host: Annotated[bool, typer.Option(
        "--this-host", help="With --workers: count only the workers on this host (a container's own, "
                            "for its healthcheck), not any of the deployment's.")] = False,
    json_out: JsonOpt = False,
    config: ConfigOpt = None,
    redis_url: RedisUrlOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Check Redis (and --api / --workers / --watcher); exit 0 healthy, 1 not."""
    wrong: typer.BadParameter | None = None
    if this_host and not workers:  # (it was ignored: a healthcheck believed it counted its own workers)
        wrong = typer.BadParameter("only with --workers (it narrows the workers counted)", param_hint="--this-host")
    elif api_url is not None and api_url != API_FROM_CONFIG:
        try:
            _api_url(api_url)
        except typer.BadParameter as e:
            wrong = typer.BadParameter(str(e), param_hint="--api")
    if wrong is not None:  # (a health check reports, it never exits 2, which Docker reserves: unhealthy, silently)
        if not check:
            raise wrong
        _unhealthy_at_once(json_out, "options", f"{wrong.param_hint}: {wrong}")
    if check:
        loaded = _quiet_load(config, redis_url, data_dir)
        if isinstance(loaded, str):
            _unhealthy_at_once(json_out, "config", loaded)
        settings = loaded
    else:
        settings = load(config, redis_url=redis_url, data_dir=data_dir)
    unknown_port = api_url == API_FROM_CONFIG and settings.api.port == 0
    if unknown_port:  # (port 0 was checked, "Connection refused": the API's port is one chosen at its start)
        api_url = None
    elif api_url == API_FROM_CONFIG:  # (the image's healthcheck: whatever port and address a mounted config gives)
        host = settings.api.host
        api_url = "http://" + host_port(WILDCARD_HOSTS.get(host, host), settings.api.port)
    report = run_checks(settings, api_url=api_url, workers=workers, watcher=watcher,
                        host=socket.gethostname() if this_host else None)
    if unknown_port:
        report["api"] = "error: api.port is 0 (a free port the API chose at its start): give --api URL"
    healthy = all(value.startswith("ok") for value in report.values())
    if json_out:
        print_json({"healthy": healthy, "checks": report})
    elif not check:
        for name, value in report.items():
            typer.echo(f"{name:8} {value}")
    raise typer.Exit(0 if healthy else 1)


def _quiet_load(config: Path | None, redis_url: str | None, data_dir: Path | None) -> Settings | str:
    """``load`` for ``--check``: the settings, or why the configuration does not load (unhealthy)."""
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            return load(config, redis_url=redis_url, data_dir=data_dir)
    except typer.Exit:
        return _what(said, "the configuration does not load")


class HealthCommand(TyperCommand):
    """``health``'s command: with ``--check``, its command line refused (an unknown option, an empty
    ``--config`` or ``--data-dir``) is unhealthy too, exit 1, silently (``--json``: the report says
    why): it exited 2, which Docker reserves, with a message."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        own = args[:args.index("--")] if "--" in args else list(args)  # (click's parser takes args up)
        if "--check" not in own:
            return super().parse_args(ctx, args)
        said = io.StringIO()
        try:
            with contextlib.redirect_stderr(said):  # (an option's own check says why there: ``fail``)
                return super().parse_args(ctx, args)
        except typer.Exit as e:
            if not e.exit_code:  # (--help)
                raise
            error = _what(said, "the command line is refused")
        except UsageError as e:
            error = str(e)
        _unhealthy_at_once("--json" in own, "options", error)


def _what(said: io.StringIO, otherwise: str) -> str:
    """The one line a refusal wrote on the stderr ``said`` caught (``fail``'s), else ``otherwise``."""
    return said.getvalue().strip().removeprefix("compactor: ") or otherwise


def _unhealthy_at_once(json_out: bool, name: str, error: str) -> NoReturn:
    """``--check`` before any check could run: exit 1, silently (``--json``: the report says why)."""
    if json_out:
        print_json({"healthy": False, "checks": {name: f"error: {error}"}})
    raise typer.Exit(1)


def run_checks(settings: Settings, *, api_url: str | None, workers: bool,
               watcher: bool, host: str | None = None) -> dict[str, str]:
    """Each requested check's outcome: ``ok...`` or ``error: ...`` (no Redis URL to use is
    an error of the checks that need Redis, not of the command)."""
    from compactor.serve import client_redis_url

    report: dict[str, str] = {}
    client: redis.Redis | None = None
    no_redis = ""
    try:
        client = redis.Redis.from_url(client_redis_url(settings), socket_timeout=CHECK_TIMEOUT_S,
                                      socket_connect_timeout=CHECK_TIMEOUT_S)
    except InvalidConfig as e:
        no_redis = f"invalid configuration: {e}"

    def redis_client() -> redis.Redis:
        if client is None:
            raise RuntimeError(no_redis)
        return client

    keys = Keys(settings.redis.prefix, settings.redis.shards)
    checks: dict[str, Callable[[], str]] = {"redis": lambda: check_redis(redis_client(), keys)}
    if api_url:
        checks["api"] = lambda: check_api(api_url, settings.api.token)
    if workers:
        checks["workers"] = lambda: check_workers(redis_client(), settings, host)
    if watcher:
        checks["watcher"] = lambda: check_watcher(redis_client(), settings)
    for name, run in checks.items():
        try:
            report[name] = run()
        except Exception as e:  # noqa: BLE001 - a health check reports every failure
            report[name] = f"error: {e}"
    if client is not None:
        client.close()
    return report
