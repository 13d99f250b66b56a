"""What every ``compactor`` command shares: the options, loading settings, output helpers.

Invariants:
- Every command takes ``--config PATH`` (env ``CODINGCODE_CONFIG``); command-line
  overrides go through the same environment variables ``events.config`` reads,
  so a flag, an env var and the file are validated by one code path.
- Bad configuration is one line on stderr and exit code 2 (so is an API address
  that cannot be listened on: checked before anything is announced or started);
  an unreachable Redis is one line and exit code 1. No traceback for either.
- Data goes to stdout (JSON with ``--json``); progress and messages to stderr.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import socket
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn

import redis
import typer
from rich.console import Console

from compactor import to_devnull
from compactor.logging import json_configured
from compactor.redis_errors import AccessDenied, check_access, is_permission_error, is_refusal, is_transient
from compactor.urls import host_port, redacted
from events.config import ENV_OVERRIDES, Settings, load_settings
from events.errors import CompactorError, InvalidConfig, InvalidInput

logger = logging.getLogger(__name__)

# click's UsageError (of the click typer vendors since 0.22, or of click itself before)
UsageError: type[Exception] = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")

EXIT_FAILURE = 1
EXIT_CONFIG = 2
LOG_FORMAT_ENV = "COMPACTION_LOG_FORMAT"

def config_path_option(value: str | Path) -> Path:
    """``--config``'s value: an empty one is refused (``Path("")`` is the current directory: the
    error named ``.``, "cannot be read: Is a directory")."""
    if isinstance(value, Path):
        return value
    if not value:
        fail("invalid configuration: --config: must not be empty (name a codingcode.yaml, or leave the option "
             "out for ./codingcode.yaml)", EXIT_CONFIG)
    return Path(value)


ConfigOpt = Annotated[Path | None, typer.Option(
    "--config", "-c", envvar="CODINGCODE_CONFIG", show_envvar=True, parser=config_path_option,
    help="codingcode.yaml to read (default ./codingcode.yaml).")]
RedisUrlOpt = Annotated[str | None, typer.Option(
    "--redis-url", envvar="REDIS_URL", show_envvar=True,
    help="Redis URL; empty: the embedded server of `compactor serve`.")]
def data_dir_path(value: str | Path) -> Path:
    """``--data-dir``'s value: an empty one is refused (``Path("")`` is the current directory,
    which an empty ``dataDir`` in the config file is refused for meaning)."""
    if isinstance(value, Path):
        return value
    if not value:  # (a blank one reaches the config's own check, which names it alike)
        fail("invalid configuration: dataDir (from --data-dir): must not be empty (it would mean the current "
             "directory: pass . for that)", EXIT_CONFIG)
    return Path(value)


DataDirOpt = Annotated[Path | None, typer.Option(
    "--data-dir", envvar="COMPACTION_DATA_DIR", show_envvar=True, parser=data_dir_path,
    help="Root of the session logs (dataDir).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the data as JSON on stdout.")]
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LogLevelOpt = Annotated[str, typer.Option(
    "--log-level", envvar="COMPACTION_LOG_LEVEL", show_envvar=True,
    help=f"Logging level: {', '.join(LOG_LEVELS)}.")]
LogFormatOpt = Annotated[str | None, typer.Option(
    "--log-format", envvar=LOG_FORMAT_ENV, show_envvar=True,
    help="Log lines as 'text' (default) or 'json' (one object per line, with session/job fields).")]


class _StderrConsole(Console):
    """rich's console on stderr, silenced when stderr's reader is gone: rich's own handling
    exits 1 (and puts /dev/null on stdout's fd), and ``compact`` then printed no JSON line."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        to_devnull(self.file.fileno())


err_console = _StderrConsole(stderr=True)


def fail(message: str, code: int = EXIT_FAILURE) -> NoReturn:
    """Print ``compactor: message`` on stderr and exit with ``code``: under ``--log-format json``
    as an ERROR record (stderr stays one JSON object per line: a child of ``serve`` refused at its
    start broke the ``jq`` pipeline OPERATIONS shows)."""
    if json_configured():
        logging.getLogger("compactor").error("%s", message)
    else:
        typer.echo(f"compactor: {message}", err=True)
    raise typer.Exit(code)


OPTION_OF_ENV = {"REDIS_URL": "--redis-url", "COMPACTION_DATA_DIR": "--data-dir",
                 "COMPACTION_API_HOST": "--host", "COMPACTION_API_PORT": "--port", "COMPACTION_WORKERS": "--workers"}


def load(config: Path | None, *, redis_url: str | None = None, data_dir: Path | None = None,
         redis: bool = True, options: dict[str, str] | None = None, **env: Any) -> Settings:
    """Settings from ``--config`` and the environment, with these command-line overrides
    (``redis=False``: a command that never uses Redis, see ``load_settings``; ``options``: the
    command's own option names of variables, where they differ from ``OPTION_OF_ENV``'s).

    typer fills an option from its environment variable too: a wrong value equal to the
    variable's is named by the variable, any other by its option (``--redis-url``)."""
    environ = dict(os.environ)
    overrides = {k: str(v) for k, v in {"REDIS_URL": redis_url, "COMPACTION_DATA_DIR": data_dir, **env}.items()
                 if v is not None}
    environ.update(overrides)
    names = {**OPTION_OF_ENV, **(options or {})}
    origins = {var: names.get(var, var) for var, value in overrides.items() if not _from_env(var, value)}
    # An empty variable is unset (the file's value stands: compose's ``${VAR:-}``), but an option given
    # empty is empty: ``--redis-url ''`` (its help: "empty: the embedded server") had used the file's URL,
    # and ``--host ''`` the default address. Empty means embedded for the URL, and is refused elsewhere.
    for var, value in overrides.items():
        if value == "" and var in origins and var != "REDIS_URL":
            key = ".".join(ENV_OVERRIDES.get(var, (var,)))
            fail(f"invalid configuration: {key} (from {origins[var]}): must not be empty", EXIT_CONFIG)
    try:
        return load_settings(config, environ, origins, redis=redis)
    except InvalidConfig as e:
        fail(f"invalid configuration: {e}", EXIT_CONFIG)


def _from_env(var: str, value: str | Path) -> bool:
    """Whether an option's ``value`` is environment variable ``var``'s (typer fills the option from
    it): a path option holds it as a ``Path``, which drops a trailing slash and ``./`` (the variable
    was named as the option, ``--data-dir``)."""
    raw = os.environ.get(var)
    if raw is None:
        return False
    if var == "COMPACTION_DATA_DIR":
        return bool(raw) and Path(raw) == Path(value)
    return raw == str(value)


def outside_the_stack() -> None:
    """For a command that is no process of the stack (``compact``, ``status``): its metrics are
    its own, not written into the stack's shared directory (``docker compose exec api compactor
    compact`` counted its enqueue there, and each run left a file of its own behind). Call
    before ``compactor.metrics`` is imported."""
    os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)


def usable_data_dir(settings: Settings, option: Path | None = None, config: Path | None = None) -> Settings:
    """``settings`` once their ``dataDir`` exists and takes a file (created when missing); else
    exit 2 naming it, and where it came from (``option``: the command's ``--data-dir``; ``config``:
    its ``--config``, the file named in front when the value is the file's), before a process
    starts (logs, the embedded Redis and its socket live there)."""
    from compactor.serve import PARENT_PID_ENV
    from events.log import keep_data_dir

    name = _data_dir_named(option, config)
    try:
        there = settings.data_dir.exists()
    except OSError as e:  # (a directory on its way that cannot be searched: a traceback)
        fail(f"invalid configuration: {name}: {settings.data_dir} cannot be looked at: {e.strerror or e}",
             EXIT_CONFIG)
    if os.environ.get(PARENT_PID_ENV) and not there:  # (serve made it: gone since)
        fail(f"invalid configuration: {name}: {settings.data_dir} is gone (removed, moved or unmounted while the "
             "service ran): not created again", EXIT_CONFIG)  # (created, empty: the one put back went inside it)
    if not (os.environ.get(PARENT_PID_ENV) and settings.data_dir.is_dir()):
        usable_dir(settings.data_dir, name)
    # else a child of serve (or demo), which checked it at its start: one restarted while the disk
    # is full or read-only exited 2 each time, and serve gave up and stopped the whole stack (the
    # processes running meanwhile hold their sessions through it)
    keep_data_dir(settings.data_dir)
    return settings


def _data_dir_named(option: Path | None, config: Path | None) -> str:
    """``dataDir`` as an error names it: with the option, variable or file its value came from."""
    from events.config import file_with_key

    if option is not None and not _from_env("COMPACTION_DATA_DIR", option):
        return f"dataDir (from {OPTION_OF_ENV['COMPACTION_DATA_DIR']})"
    if os.environ.get("COMPACTION_DATA_DIR"):
        return "dataDir (from COMPACTION_DATA_DIR)"
    file = file_with_key(config, "dataDir")
    return f"{file}: dataDir" if file is not None else "dataDir"


def readable_data_dir(settings: Settings, option: Path | None = None, config: Path | None = None) -> Settings:
    """``settings`` unless their ``dataDir`` is there and no directory (exit 2 naming it): for a
    command that only reads logs (``api``, ``context``), which creates nothing. (One on a file
    answered every session as unknown, a mistake said as "no session".) A data dir not there yet
    is none of its concern: the watcher creates it."""
    path = settings.data_dir
    existing = next((p for p in (path, *path.parents) if p.exists()), path)
    if existing.exists() and not existing.is_dir():  # (it, or a file on its way: /srv/a-file/data)
        what = f"{path} is not a directory" if existing == path else f"{path}: {existing}, on its way, is not a directory"
        fail(f"invalid configuration: {_data_dir_named(option, config)}: {what}", EXIT_CONFIG)
    return settings


def usable_dir(path: Path, name: str) -> None:
    """Create ``path`` when missing and check that it takes a file; else exit 2 naming ``name``."""
    try:
        if path.exists() and not path.is_dir():
            fail(f"invalid configuration: {name}: {path} is not a directory", EXIT_CONFIG)
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        fail(f"invalid configuration: {name}: {path} cannot be created: {e.strerror or e}", EXIT_CONFIG)
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        fail(f"invalid configuration: {name}: {path} cannot be used: no file can be created in it "
             f"({e.strerror or e})", EXIT_CONFIG)


PORT_WAIT_S = 5.0  # how long a port in use is waited for before the API's start is refused


def origin_named(key: str, option: Any, var: str) -> str:
    """``key`` as an error names it: with the option or the environment variable its value came
    from (``api.port (from --port)``), as ``load`` names them; as is when the file or the default
    gave it (``option`` None)."""
    if option is None:
        return key
    return f"{key} (from {var if _from_env(var, option) else OPTION_OF_ENV.get(var, var)})"


def api_socket(host: str, port: int, *, host_key: str = "api.host", port_key: str = "api.port") -> socket.socket:
    """A socket bound to ``host:port`` for the API, not yet listening; else exit 2 naming the
    address and why (the port in use or privileged, not an address of this machine, not a host),
    the key by ``host_key``/``port_key`` (``origin_named``).
    A port in use is waited for ``PORT_WAIT_S``: the API of a ``serve`` killed with SIGKILL holds
    it for a second or so, until it sees its parent gone (a restart right after was refused)."""
    deadline = time.monotonic() + PORT_WAIT_S
    while True:
        # IPPROTO_TCP named: asyncio sets TCP_NODELAY on the connections it accepts only when the
        # listening socket says so; with protocol 0 every response on a kept-alive connection waited
        # ~40 ms (its headers and body two sends, the second held by Nagle until the client's delayed ACK)
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM,
                             socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT is free
        try:
            sock.bind((host, port))
            return sock
        except OSError as e:  # socket.gaierror for a name that does not resolve
            sock.close()
            if e.errno == errno.EADDRINUSE and time.monotonic() < deadline:
                time.sleep(0.1)
                continue
            key = port_key if e.errno in (errno.EADDRINUSE, errno.EACCES) else host_key
            hint = ("; choose another with --port or COMPACTION_API_PORT" if e.errno == errno.EADDRINUSE else "")
            fail(f"invalid configuration: {key}: cannot listen on {host_port(host, port)}: {e.strerror or e}{hint}",
                 EXIT_CONFIG)


def setup_logging(level: str, fmt: str | None = None) -> None:
    """One line per log record on stderr: text, or JSON with ``fmt``/``COMPACTION_LOG_FORMAT`` json.

    The chosen format is put back in the environment so child processes log alike.
    """
    from compactor.logging import configure

    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        origin = ("COMPACTION_LOG_LEVEL" if os.environ.get("COMPACTION_LOG_LEVEL") == level else "--log-level")
        fail(f"invalid {origin} {level!r}: must be one of {', '.join(LOG_LEVELS)}", EXIT_CONFIG)
    origin = LOG_FORMAT_ENV if fmt is None or fmt == os.environ.get(LOG_FORMAT_ENV) else "--log-format"
    fmt = (fmt or os.environ.get(LOG_FORMAT_ENV) or "text").strip().lower()
    try:
        configure(numeric, fmt)
    except ValueError as e:
        fail(f"invalid {origin}: {e}", EXIT_CONFIG)
    os.environ[LOG_FORMAT_ENV] = fmt


def redis_url_of(settings: Settings) -> str:
    """The Redis URL a client command should use (exit 2 when there is none)."""
    from compactor.serve import client_redis_url

    try:
        return client_redis_url(settings)
    except InvalidConfig as e:
        fail(f"invalid configuration: {e}", EXIT_CONFIG)


def connect(settings: Settings, *, service: bool = False) -> redis.Redis:
    """A Redis client that has answered PING (exit 1 when it does not); for a ``service``
    process (watch, work, api), one whose ACL lets it do what the service does (else exit 1
    naming what is refused)."""
    url = redis_url_of(settings)
    client = redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5)
    try:
        client.ping()
        if service:
            _access_or_exit(client, settings, url)
    except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
        # (redis-py's AuthenticationError is a ConnectionError: Redis answered, and refused)
        fail(f"Redis {'refused' if isinstance(e, redis.AuthenticationError) else 'unreachable'} at {redacted(url)}: {e}")
    except redis.RedisError as e:  # (an ACL's "no permissions to run the 'ping' command", ...)
        fail(f"Redis refused at {redacted(url)}: {e}")
    return client


def _access_or_exit(client: redis.Redis, settings: Settings, url: str) -> None:
    """``check_access``; exit 1 with its one line when Redis's ACL refuses the service something."""
    try:
        check_access(client, settings.redis.prefix)
    except AccessDenied as e:
        fail(f"Redis at {redacted(url)}: {e}")


def check_access_if_up(settings: Settings, *, data_dir: bool = False) -> None:
    """Exit 1 naming what Redis's ACL refuses the service, exit 2 for another shard count than the
    live watchers' (``shards_or_exit``) and, with ``data_dir``, for a data dir other than the one
    Redis records (``compactor.datadir``), when ``redis.url``'s Redis answers (one that does not
    is waited for later, by the caller's processes, which check then)."""
    if not settings.redis.url:
        return  # the embedded Redis, no ACL (and inside the data dir: that data dir's)
    client = redis.Redis.from_url(settings.redis.url, socket_timeout=5, socket_connect_timeout=2)
    try:
        try:
            client.ping()
        except redis.RedisError as e:
            if is_transient(e):
                raise  # (down, loading its data, busy running a script...: waited for, as during an outage)
            # answered, and refused for good: a database it does not have ("DB index is out of range"), a
            # wrong password, an ACL's no permission to ping; the API started, then answered every request a 500
            fail(f"Redis refused at {redacted(settings.redis.url)}: {e}")
        _access_or_exit(client, settings, settings.redis.url)
        shards_or_exit(client, settings)
        if data_dir:
            from compactor.datadir import check_data_dir

            with user_errors():
                check_data_dir(client, settings)
    except (redis.RedisError, OSError):
        pass
    finally:
        client.close()


def shards_or_exit(client: redis.Redis, settings: Settings) -> None:
    """Exit 2 when live watchers read with another ``redis.shards`` than ``settings``: this
    process's events would go to streams their sessions do not hash to, every one of them
    dead-lettered (``wrong_shard``). With no watcher live, any count goes (it is being changed)."""
    from compactor.keys import Keys
    from compactor.shards import ShardCountMismatch, gone_quiet, live_shard_count

    keys = Keys(settings.redis.prefix, settings.redis.shards)
    live = live_shard_count(client, keys, settings.watcher.lease_ms)
    if live is not None and live != keys.shards and not gone_quiet(client, keys, settings.watcher.lease_ms):
        fail(str(ShardCountMismatch(keys, live)), EXIT_CONFIG)


@contextmanager
def interrupted_by_signals() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP each interrupt the command as Ctrl-C does, so its clean-up runs
    (SIGTERM or a closed terminal killed ``demo`` and ``bench`` at once: their Redis, temp dirs,
    child processes and keys left behind); a second signal does not interrupt that clean-up.
    Stopped by SIGTERM or SIGHUP, the command exits with that signal's code (128 + its number);
    by Ctrl-C, as Ctrl-C does (130)."""
    from compactor.serve import stop_signals_handled

    received: list[int] = []

    def interrupt(signum: int, _frame: object) -> None:
        received.append(signum)
        if len(received) == 1:
            raise KeyboardInterrupt

    with stop_signals_handled(interrupt):
        try:
            yield
        except KeyboardInterrupt:
            if received and received[0] != signal.SIGINT:  # stopped, and cleaned up: the signal's exit code
                raise typer.Exit(128 + received[0]) from None
            raise


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn expected errors into one line on stderr (exit 2 for bad input or config, else 1)."""
    try:
        yield
    except InvalidInput as e:
        fail(str(e), EXIT_CONFIG)
    except CompactorError as e:
        fail(str(e) or type(e).__name__)
    except redis.AuthenticationError as e:  # (a ConnectionError to redis-py: Redis answered, and refused)
        fail(f"Redis refused: {e}")
    except (redis.ConnectionError, redis.TimeoutError) as e:
        fail(f"Redis unreachable: {e}")
    except redis.ResponseError as e:  # (MISCONF: its disk full; a permission: its ACL) - any other: a bug, traced
        if not (is_refusal(e) or is_permission_error(e)):
            raise
        fail(f"Redis refused: {e}")


def print_json(data: Any) -> None:
    """One line of JSON on stdout, in ASCII: every other character escaped (``\\u009b``), so no
    control character of a session's text (C1's CSI, a right-to-left override) reaches a terminal
    raw, and any stdout encoding writes it (latin-1 failed on the first CJK character)."""
    typer.echo(json.dumps(data, ensure_ascii=True, separators=(",", ":")))
