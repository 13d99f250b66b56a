"""The long-running processes: ``serve`` (all in one), ``watch``, ``work`` and ``api``.

Each of ``watch``/``work``/``api`` is what one docker-compose service runs; they
need a Redis URL (``REDIS_URL``) unless a ``compactor serve`` on the same data
dir provides its embedded one. ``serve`` starts the embedded Redis itself.

Redis: ``watch`` and ``work`` exit 1 (one line) when it does not answer at
start, and ride out an outage once running (they retry); ``api`` starts
anyway and answers 503 while Redis is down (``/healthz`` included), like
during an outage. ``serve --port 0`` takes the port the OS picks before it
starts anything, so its banner and the API agree.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Annotated

import redis
import typer

from compactor.cli.common import (
    ConfigOpt,
    DataDirOpt,
    LogFormatOpt,
    LogLevelOpt,
    RedisUrlOpt,
    api_socket,
    check_access_if_up,
    connect,
    fail,
    load,
    origin_named,
    readable_data_dir,
    redis_url_of,
    shards_or_exit,
    setup_logging,
    usable_data_dir,
    user_errors,
)
from compactor.urls import host_port
from events.config import Settings

logger = logging.getLogger(__name__)

# On SIGTERM the API answers the requests in flight for this long, then closes the rest: a forced
# compaction waiting for its job (up to api.jobWaitSeconds) had held a stop for 5 minutes. (The job
# runs on; the client can ask GET /api/jobs/{id}.) Within serve's STOP_TIMEOUT_S.
API_STOP_GRACE_S = 5

HostOpt = Annotated[str | None, typer.Option(
    "--host", envvar="COMPACTION_API_HOST", show_envvar=True,
    help="Interface the API binds (default api.host, 127.0.0.1).")]
# (as text: a wrong value, from the option or its variable, is then bad configuration like any other, named
# in one line by the settings, not in typer's usage box)
PortOpt = Annotated[str | None, typer.Option(
    "--port", envvar="COMPACTION_API_PORT", show_envvar=True,
    help="API port (default api.port, 8080; 0: a free one, logged, and named in serve's banner).")]


def serve(
    config: ConfigOpt = None,
    redis_url: RedisUrlOpt = None,
    data_dir: DataDirOpt = None,
    workers: Annotated[str | None, typer.Option(
        "--workers", "-w", envvar="COMPACTION_WORKERS", show_envvar=True,
        help="Worker processes, 1-64 (default worker.count, 2).")] = None,
    host: HostOpt = None,
    port: PortOpt = None,
    log_level: LogLevelOpt = "INFO",
    log_format: LogFormatOpt = None,
) -> None:
    """Run the watcher, the workers and the HTTP API together (the main job).

    With redis.url empty, an embedded Redis (AOF on) runs under {dataDir}/.redis.
    Ctrl-C or SIGTERM stops everything cleanly.
    """
    from compactor.serve import serve as run_serve

    setup_logging(log_level, log_format)
    os.environ["COMPACTION_LOG_LEVEL"] = log_level  # the children log at the same level
    settings = usable_data_dir(load(config, redis_url=redis_url, data_dir=data_dir, COMPACTION_API_HOST=host,
                                    COMPACTION_API_PORT=port, COMPACTION_WORKERS=workers), data_dir, config)
    # The API child binds it in a moment: a port in use is said now, before Redis and the banner;
    # port 0 becomes the port the OS picked here, so the banner names it (and restarts keep it).
    with api_socket(settings.api.host, settings.api.port, host_key=origin_named("api.host", host, "COMPACTION_API_HOST"),
                    port_key=origin_named("api.port", port, "COMPACTION_API_PORT")) as sock:
        bound = int(sock.getsockname()[1])
    check_access_if_up(settings, data_dir=True)  # each child would fail on it, and be restarted, over and over
    with user_errors():
        code = run_serve(settings, workers=settings.worker.count, host=host, port=bound)
    raise typer.Exit(code)


def watch(
    config: ConfigOpt = None,
    redis_url: RedisUrlOpt = None,
    data_dir: DataDirOpt = None,
    log_level: LogLevelOpt = "INFO",
    log_format: LogFormatOpt = None,
) -> None:
    """Consume the event streams into the session logs and trigger compactions."""
    from compactor.serve import exit_with_parent
    from producer.watcher import main as watcher_main

    setup_logging(log_level, log_format)
    loaded = load(config, redis_url=redis_url, data_dir=data_dir)
    settings = _with_redis_then_data_dir(loaded, data_dir, config)
    # unreachable now: exit 1, as `work`; an outage later is waited out
    on_its_data_dir(connect(settings, service=True), settings, embedded=_embedded(loaded))
    exit_with_parent()
    with user_errors():
        watcher_main(settings)


def work(
    config: ConfigOpt = None,
    redis_url: RedisUrlOpt = None,
    data_dir: DataDirOpt = None,
    count: Annotated[str | None, typer.Option(
        "--count", "-n", envvar="COMPACTION_WORKERS", show_envvar=True,
        help="Worker processes in this container/process, 1-64 (default worker.count, 2).")] = None,
    burst: Annotated[bool, typer.Option(
        "--burst", help="Run the queued jobs, then exit.")] = False,
    log_level: LogLevelOpt = "INFO",
    log_format: LogFormatOpt = None,
) -> None:
    """Run RQ workers for the compaction jobs."""
    from compactor.serve import exit_with_parent
    from worker.runner import WorkerLoopEnded, WorkersFailed
    from worker.runner import main as runner_main

    setup_logging(log_level, log_format)
    loaded = load(config, redis_url=redis_url, data_dir=data_dir, COMPACTION_WORKERS=count,
                  options={"COMPACTION_WORKERS": "--count"})
    settings = _with_redis_then_data_dir(loaded, data_dir, config)
    exit_with_parent()
    # one line naming the (redacted) URL when Redis does not answer, as watch says
    on_its_data_dir(connect(settings, service=True), settings, embedded=_embedded(loaded), shards=True)
    with user_errors():
        try:
            runner_main(settings, count=settings.worker.count, burst=burst)
        except (WorkersFailed, WorkerLoopEnded) as e:
            fail(str(e))


def api(
    config: ConfigOpt = None,
    redis_url: RedisUrlOpt = None,
    data_dir: DataDirOpt = None,
    host: HostOpt = None,
    port: PortOpt = None,
    log_level: LogLevelOpt = "INFO",
    log_format: LogFormatOpt = None,
) -> None:
    """Serve the HTTP API (binds 127.0.0.1:8080 unless told otherwise)."""
    import uvicorn

    from compactor import ignored_at_start
    from compactor.serve import exit_with_parent
    from producer.api import create_app

    setup_logging(log_level, log_format)
    settings = _with_redis(readable_data_dir(load(config, redis_url=redis_url, data_dir=data_dir,
                                                  COMPACTION_API_HOST=host, COMPACTION_API_PORT=port),
                                             data_dir, config))
    sock = api_socket(settings.api.host, settings.api.port,  # before uvicorn, which exits 3 on a bind error
                      host_key=origin_named("api.host", host, "COMPACTION_API_HOST"),
                      port_key=origin_named("api.port", port, "COMPACTION_API_PORT"))
    check_access_if_up(settings)  # (a Redis down now is answered 503 meanwhile)
    exit_with_parent()
    application = create_app(settings)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            application.state.stopping.set()  # a waiting forced compaction answers 202 now (not 500 after the grace)
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                if ignored_at_start(signal.SIGINT):  # (a script's background job: stays ignored)
                    signal.signal(signal.SIGINT, signal.SIG_IGN)
                yield

    server = Server(uvicorn.Config(application, host=settings.api.host, port=settings.api.port,
                                   log_level=log_level.lower(), log_config=None,
                                   timeout_graceful_shutdown=API_STOP_GRACE_S))
    sock.listen(2048)  # (uvicorn's backlog) before the line that says so: a script reading it connects at once
    logger.info("API listening on http://%s", host_port(settings.api.host, sock.getsockname()[1]))
    # uvicorn re-raises the signal it stopped on once it is done: exit 0 then, as watch, work and serve
    # do (a SIGTERM killed the process by the signal); a SIGHUP (the terminal closed) stops it the same way
    signal.signal(signal.SIGTERM, _stopped)
    if not ignored_at_start(signal.SIGHUP):  # (nohup: stays ignored)
        signal.signal(signal.SIGHUP, lambda _signum, frame: server.handle_exit(signal.SIGTERM, frame))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # (likewise for the Ctrl-C it stopped on; uvicorn.run swallows it too)
        pass


def on_its_data_dir(client: redis.Redis, settings: Settings, *, embedded: bool = False,
                    shards: bool = False) -> None:
    """Exit 2 unless ``dataDir`` is the one the sessions Redis knows were written to
    (``compactor.datadir``; ``embedded``: serve's own Redis, inside it), or, with ``shards``,
    when live watchers read with another ``redis.shards`` (a worker's wait for a forced job's
    ``after`` entry looks at the stream its session hashes to); the client closed."""
    from compactor.datadir import check_data_dir

    try:
        with user_errors():
            check_data_dir(client, settings, embedded=embedded)
            if shards:
                shards_or_exit(client, settings)
    finally:
        client.close()


def _embedded(settings: Settings) -> bool:
    """Whether the Redis is the one ``serve`` runs inside ``dataDir`` (named by no ``redis.url``,
    or, in serve's children, by the URL of its socket there)."""
    from compactor.embedded import EmbeddedRedis
    from compactor.serve import embedded_dir

    return not settings.redis.url or settings.redis.url == EmbeddedRedis(embedded_dir(settings)).url


def _stopped(_signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(0)


def _with_redis_then_data_dir(loaded: Settings, option: Path | None, config: Path | None) -> Settings:
    """``_with_redis``, with the data dir checked (``usable_data_dir``) before it when that creates
    nothing (it exists, or cannot be created: a file or an unwritable directory on its way), and
    after it when it would create the directory: a start refused for want of a Redis left
    ~/.codingcode/project behind; a data dir that can never be used is said first."""
    path = loaded.data_dir
    try:
        existing = next((p for p in (path, *path.parents) if p.exists()), path)
        first = path.exists() or not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK)
    except OSError:  # (a parent that cannot be searched: said as usable_dir says it)
        first = True
    if first:
        usable_data_dir(loaded, option, config)
        return _with_redis(loaded)
    settings = _with_redis(loaded)
    usable_data_dir(loaded, option, config)
    return settings


def _with_redis(settings: Settings) -> Settings:
    """The settings with ``redis.url`` resolved (the embedded server of a running serve)."""
    url = redis_url_of(settings)
    if url == settings.redis.url:
        return settings
    return settings.model_copy(update={"redis": settings.redis.model_copy(update={"url": url})})
