"""``compactor serve``: the watcher, N workers and the API as supervised child processes.

Invariants:
- With ``redis.url`` empty, one embedded Redis (AOF on) runs under
  ``{dataDir}/.redis``; a second ``serve`` on the same data dir refuses to start
  instead of sharing its files, and a Redis orphaned by a killed ``serve``
  (the process ``serve.pid`` names is gone, or a zombie) is shut down cleanly and replaced, at once, under
  the old children still stopping (they reconnect to the new server on the same socket). CLI commands run
  next to a ``serve`` find that server through its unix socket (``client_redis_url``).
- Every child gets the same effective settings: they are written once to a
  private (0600) config file passed with ``--config``, and the environment
  overrides are removed from the children's environment so nothing differs.
- Children run in their own sessions, so Ctrl-C reaches only the supervisor,
  which stops them (SIGTERM to all at once; then Redis, last). Children exit
  by themselves when the supervisor dies (``COMPACTOR_PARENT_PID``; ``exit_with_parent``:
  SIGTERM within ``PARENT_POLL_INTERVAL_S``, SIGKILL ``STOP_TIMEOUT_S`` later, as on a stop).
- A child that dies is restarted after a short delay; one that dies
  ``MAX_RESTARTS`` times within ``RESTART_WINDOW_S`` stops the whole stack with
  a message naming it. One that dies while the data dir has no id (moved,
  unmounted) is restarted, uncounted, once the id is back.
- Redis is PINGed every ``REDIS_CHECK_INTERVAL_S``. The embedded one missing
  ``REDIS_MISSES_TO_FAIL`` checks in a row stops the stack (exit 1: our own
  server died; whatever runs ``serve`` restarts it on its AOF). An external
  one (``redis.url`` set) is waited for, a line per missed check, as the
  children wait for it (the watcher and workers retry, the API answers 503);
  so is one, embedded or not, that answers PING with an error (MISCONF, when
  its disk is full: it serves again by itself once there is room). Meanwhile
  a child that exits is restarted only once Redis answers (started before, it
  would fail its own Redis check at start and count as dying).
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import signal
import site
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import psutil
import redis
import yaml

from compactor import ignored_at_start, write_or_drop
from compactor.datadir import ID_FILE, data_dir_id
from compactor.embedded import OWNER_LOCK_FILE, EmbeddedRedis
from compactor.logging import json_configured
from compactor.urls import listening_url, redacted
from events.config import EMBEDDED_SOCKET, ENV_OVERRIDES, Settings
from events.errors import CompactorError, InvalidConfig

logger = logging.getLogger(__name__)

Output = IO[bytes] | int | None  # where children write: a file, subprocess.DEVNULL, or inherit

EMBEDDED_DIR_NAME = ".redis"
ORPHAN_STOP_TIMEOUT_S = 10.0  # how long an orphaned embedded Redis gets to stop after SHUTDOWN
SERVE_PID_FILE = "serve.pid"  # in the embedded dir: the serve that owns its Redis
PARENT_PID_ENV = "COMPACTOR_PARENT_PID"
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # compactor.metrics: the children share their metrics
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
RESTART_DELAY_S = 1.0
OUTPUT_TAIL_LINES = 20  # of the children's output, logged when one dies (when it goes to a file)
OUTPUT_TAIL_BYTES = 8192
STOP_TIMEOUT_S = 15.0
API_READY_TIMEOUT_S = 60.0  # the banner waits this long at most for the API to accept connections
PARENT_POLL_INTERVAL_S = 1.0  # how often a child checks that its parent is still there
POLL_INTERVAL_S = 0.2
REDIS_CHECK_INTERVAL_S = 2.0
REDIS_MISSES_TO_FAIL = 3


def embedded_dir(settings: Settings) -> Path:
    """Where the embedded Redis keeps its socket, AOF and log."""
    return settings.data_dir / EMBEDDED_DIR_NAME


def client_redis_url(settings: Settings) -> str:
    """The configured Redis URL, else the socket of a running ``compactor serve``."""
    if settings.redis.url:
        return settings.redis.url
    server = EmbeddedRedis(embedded_dir(settings))
    if server.socket.exists():
        if _listened_on(server.socket):
            return server.url
        raise InvalidConfig("redis.url", f"is empty and no `compactor serve` runs under {settings.data_dir} "
                                         f"({server.socket} is a killed one's, left behind): start it, or set "
                                         "REDIS_URL or redis.url")  # (it said "Redis unreachable", exit 1)
    raise InvalidConfig("redis.url", f"is empty and no `compactor serve` runs under "
                                     f"{settings.data_dir}: set REDIS_URL or redis.url")


def _listened_on(path: Path) -> bool:
    """Whether a server listens on the unix socket ``path`` (not one left by a killed process:
    connection refused). Any other failure (a full backlog, permissions) counts as listened on:
    the client's own connect says what it is."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
        return True
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        return True
    finally:
        probe.close()


def _owner_alive(directory: Path) -> bool:
    """Whether the ``serve`` recorded in ``{directory}/serve.pid`` (pid and start time,
    so a reused pid does not count) is still running: a zombie is not (a supervisor that killed
    it and started a new one before reaping it had the new one refused, "another serve runs")."""
    try:
        pid, started = (directory / SERVE_PID_FILE).read_text().split()
        process = psutil.Process(int(pid))
        created: float = process.create_time()
        return abs(created - float(started)) < 0.01 and process.status() != psutil.STATUS_ZOMBIE
    except (OSError, ValueError, psutil.Error):
        return False


def _record_owner(directory: Path) -> None:
    me = psutil.Process()
    (directory / SERVE_PID_FILE).write_text(f"{me.pid} {me.create_time()}\n")


def _shutdown_orphan(server: EmbeddedRedis) -> None:
    """Stop a Redis left behind by a killed ``serve`` (SHUTDOWN writes its AOF first).

    One still answering ``ORPHAN_STOP_TIMEOUT_S`` later is left alone and the serve
    refused (``CompactorError``): starting another server would take its socket and
    append to the same AOF files."""
    logger.warning("stopping the embedded Redis a killed serve left at %s", server.url)
    client = redis.Redis.from_url(server.url, socket_timeout=5.0)
    try:
        client.shutdown()
    except redis.RedisError as e:
        logger.warning("shutdown of the orphaned Redis: %s", e)
    finally:
        client.close()
    deadline = time.monotonic() + ORPHAN_STOP_TIMEOUT_S
    while server.ping():
        if time.monotonic() >= deadline:
            raise CompactorError(
                f"the embedded Redis a killed serve left at {server.url} still answers "
                f"{ORPHAN_STOP_TIMEOUT_S:g} s after SHUTDOWN (see {server.directory / 'redis.log'}): "
                "stop that redis/valkey-server, then start serve again")
        time.sleep(0.05)


def start_embedded(settings: Settings) -> EmbeddedRedis:
    """Start the embedded Redis under the data dir; refuse when another serve owns one there.

    A server that answers while the serve recorded in ``serve.pid`` is gone was
    left behind by a killed serve: it is shut down (AOF kept) and started afresh.
    """
    server = EmbeddedRedis(embedded_dir(settings), persist=True)
    already = f"is empty and another `compactor serve` already runs on {settings.data_dir}"
    try:
        claimed = server.claim()  # (two serves started at once both found no server and started one each)
    except OSError as e:
        raise InvalidConfig("dataDir", f"cannot lock {server.directory / OWNER_LOCK_FILE}: {e.strerror or e} "
                                       "(the embedded Redis needs a local file system)") from e
    if not claimed:
        raise InvalidConfig("redis.url", already)
    try:
        if server.ping():
            if _owner_alive(server.directory):
                raise InvalidConfig("redis.url", f"{already} (Redis at {server.url})")
            _shutdown_orphan(server)
        server.start()  # (in a session of its own: a terminal's Ctrl-C, or a signal to our process
        # group, reaches only us, and we stop Redis last, after the children)
        _record_owner(server.directory)
        server.keep_after(our_code_env(dict(os.environ)), STOP_TIMEOUT_S + 5)  # (a kill -9 of this serve:
        # its children stop within STOP_TIMEOUT_S, then the keeper shuts Redis down)
    except BaseException:
        server.stop()  # (releases the claim)
        raise
    return server


# + pid + "-" + start + "-": a stack's private dir (its effective config, token included)
PRIVATE_PREFIX = "compactor-serve-"
DEMO_PREFIX = "compactor-demo-"  # a demo's temporary data dir (its logs and its Redis's AOF)
DEMO_MARK = ".compactor-demo"  # in it, locked (flock) by the demo while it runs


def private_dir_prefix(pid: int | None = None) -> str:
    """The name a serve's private dir starts with: its pid and its process's start time (in
    1/100 s): in a container serve is always pid 1, and a restarted one took the dir a killed one
    left (its API token in it) for its own: never removed."""
    pid = os.getpid() if pid is None else pid
    return f"{PRIVATE_PREFIX}{pid}-{_started(pid)}-"


def temporary_demo_dir() -> tuple[Path, int]:
    """A new temporary data dir for a demo and the descriptor of its mark, locked for as long as
    it stays open: a demo killed with SIGKILL left it (megabytes of logs and AOF) for good, and
    ``remove_stale_private_dirs`` removes one whose mark nobody holds (no name tells it: a pid
    in it was another process's in another pid namespace, and a directory an operator named so
    looked like one)."""
    path = Path(tempfile.mkdtemp(prefix=DEMO_PREFIX))
    try:  # (locked, then named: a sweep between the two found a new demo's mark free, and removed it)
        fd = os.open(path / f"{DEMO_MARK}.new", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.rename(path / f"{DEMO_MARK}.new", path / DEMO_MARK)
        except BaseException:
            os.close(fd)
            raise
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    return path, fd


def _started(pid: int) -> int | None:
    try:
        return round(float(psutil.Process(pid).create_time()) * 100)
    except psutil.Error:
        return None


def remove_stale_private_dirs(root: Path | None = None) -> list[Path]:
    """Remove the private dirs of stacks whose serve is gone (``kill -9``: its effective config,
    API token included, stayed in the temp dir), and the data dirs of demos gone (their logs and
    AOF, megabytes each, stayed for good) once their Redis is down: no process has its pid, or
    the one that has started at another time; the dirs removed."""
    removed = []
    tmp = Path(root or tempfile.gettempdir())
    for path in tmp.glob(f"{DEMO_PREFIX}*"):
        if _demo_gone(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    for path in tmp.glob(f"{PRIVATE_PREFIX}*-*"):
        parts = path.name[len(PRIVATE_PREFIX):].split("-")  # pid, start, mkdtemp's part (no "-" in it)
        pid, started = parts[0], parts[1] if len(parts) == 3 else ""  # (two: an earlier version's name)
        try:
            mine = path.is_dir() and path.stat().st_uid == os.getuid()
        except OSError:
            continue
        if not mine or not pid.isdigit():
            continue
        gone = not psutil.pid_exists(int(pid))
        if not gone and started.isdigit():
            gone = _started(int(pid)) != int(started)
        if gone:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _demo_gone(path: Path) -> bool:
    """Whether ``path`` is a demo's temporary data dir (its mark in it, ours) whose demo is gone
    (the mark's lock free) and whose Redis is down (a killed demo's, until its keeper stops it)."""
    try:
        fd = os.open(path / DEMO_MARK, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False  # (no mark: not a demo's, or an earlier version's)
    try:
        if os.fstat(fd).st_uid != os.getuid():
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # (held: the demo runs)
    finally:
        os.close(fd)
    socket_path = path / EMBEDDED_SOCKET
    return not (socket_path.exists() and _listened_on(socket_path))


def metrics_dir(private: Path) -> Path:
    """The children's shared Prometheus directory: ``$PROMETHEUS_MULTIPROC_DIR`` when set,
    else one in the stack's private dir; emptied of old metric files either way."""
    from compactor.metrics import prepare_multiprocess_dir

    configured = os.environ.get(MULTIPROC_ENV)
    return prepare_multiprocess_dir(Path(configured) if configured else private / "metrics")


def write_effective_config(settings: Settings, redis_url: str, directory: Path) -> Path:
    """The settings as a private YAML file, with ``redis.url`` pinned to ``redis_url``."""
    data: dict[str, Any] = settings.model_dump(mode="json", by_alias=True)
    data["redis"]["url"] = redis_url
    path = directory / "codingcode.yaml"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        yaml.safe_dump(data, f, sort_keys=False)
    return path


def child_env(parent_pid: int) -> dict[str, str]:
    """The children's environment: ours without the config overrides, plus the parent pid."""
    env = {k: v for k, v in os.environ.items() if k not in ENV_OVERRIDES}
    env.pop("CODINGCODE_CONFIG", None)
    env[PARENT_PID_ENV] = str(parent_pid)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return our_code_env(env)


def our_python(*args: str) -> list[str]:
    """The command line of a child Python running this code: ``-P`` keeps the working directory
    off its import path. A folder named ``events``, ``worker``, ``producer`` or ``compactor`` there
    (an agent's own project, say) was imported instead of ours: serve's and demo's children died
    at start (``No module named 'events.errors'``). Give it the environment of ``our_code_env``."""
    return [sys.executable, "-P", *args]


def our_code_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the directory our packages were imported from first on ``PYTHONPATH``, unless
    it is a site-packages directory (there already, and never put before the standard library):
    a child run with ``-P`` from an uninstalled checkout found them by the working directory."""
    root = Path(__file__).resolve().parent.parent
    site_dirs = {Path(p).resolve() for p in [*site.getsitepackages(), site.getusersitepackages()]}
    if root in site_dirs:
        return env
    rest = env.get("PYTHONPATH", "")
    return {**env, "PYTHONPATH": f"{root}{os.pathsep}{rest}" if rest else str(root)}


def exit_with_parent(parent_pid: int | None = None) -> None:
    """Stop this process when its parent goes away: SIGTERM, then SIGKILL ``STOP_TIMEOUT_S`` later
    if still running, as ``Supervisor.stop`` would. The parent is ``parent_pid``, else the ``serve``
    named by ``COMPACTOR_PARENT_PID`` (not set: nothing to watch)."""
    if parent_pid is None:
        expected = os.environ.get(PARENT_PID_ENV, "")
        if not expected.isdigit():
            return
        parent_pid = int(expected)
    threading.Thread(target=_stop_when_orphaned, args=(parent_pid,), name="parent-watch", daemon=True).start()


def _stop_when_orphaned(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_INTERVAL_S)
    logger.warning("parent %d is gone; stopping", parent_pid)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(STOP_TIMEOUT_S)
    logger.warning("still running %.0fs after the parent went; killing", STOP_TIMEOUT_S)
    os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class ChildSpec:
    """One supervised process: a name for messages and the ``compactor`` subcommand args."""

    name: str
    args: list[str]


@dataclass
class Child:
    spec: ChildSpec
    process: subprocess.Popen[bytes] | None = None
    deaths: deque[float] = field(default_factory=deque)
    restart_at: float | None = None
    awaits_data_dir: bool = False  # exited while the data dir was gone: restarted once it is back


class ChildFailed(RuntimeError):
    """A child kept dying; the stack is shut down."""


class Supervisor:
    """Starts, watches, restarts and stops the child processes."""

    def __init__(self, specs: list[ChildSpec], config: Path, *,
                 output: Output = None, data_dir: Path | None = None) -> None:
        self.children = [Child(spec) for spec in specs]
        self.config = config
        self.output = output
        self.env = child_env(os.getpid())
        self.data_dir = data_dir  # whose id, once the children made it, is looked at when one exits
        self.data_dir_id: str | None = None

    def _spawn(self, child: Child) -> None:
        argv = our_python("-m", "compactor", *child.spec.args, "--config", str(self.config))
        child.process = subprocess.Popen(
            argv, env=self.env, stdin=subprocess.DEVNULL, start_new_session=True,
            stdout=self.output, stderr=subprocess.STDOUT if self.output else None)
        child.restart_at = None
        logger.info("started %s pid=%d", child.spec.name, child.process.pid)

    def start(self) -> None:
        for child in self.children:
            self._spawn(child)

    def check(self) -> None:
        """Restart children that died; ChildFailed when one dies too often. One that died while
        the data dir was gone (moved, unmounted: its id file with it) is not counted, and is
        restarted once it is back: the watcher stops on it (exit 2), and was restarted into a
        data dir it created again, empty, refused there 5 times, and the stack shut down, the
        data dir put back then moved inside the empty one."""
        now = time.monotonic()
        if self.data_dir is not None and self.data_dir_id is None:
            self.data_dir_id = self._data_dir_id_now()
        for child in self.children:
            if child.awaits_data_dir:
                if self._data_dir_id_now() is not None:
                    logger.warning("the data dir %s is back; restarting %s", self.data_dir, child.spec.name)
                    child.awaits_data_dir = False
                    self._spawn(child)
                continue
            if child.restart_at is not None:
                if now >= child.restart_at:
                    if self.data_dir_id is not None and self._data_dir_id_now() is None:  # (gone meanwhile)
                        logger.warning("%s not restarted while the data dir %s is gone; restarted once it is back",
                                       child.spec.name, self.data_dir)
                        child.restart_at, child.awaits_data_dir = None, True
                    else:
                        self._spawn(child)
                continue
            code = child.process.poll() if child.process else None
            if code is None:
                continue
            self._record_death(child, code, now)

    def _record_death(self, child: Child, code: int, now: float) -> None:
        tail = self._output_tail()
        if tail:  # (the demo's children write to a file of its own, gone when it ends: the reason with it)
            logger.warning("%s exited with code %s; the last lines the children wrote:\n%s", child.spec.name, code, tail)
        if self.data_dir_id is not None and self._data_dir_id_now() is None:
            logger.warning("%s exited with code %s while the data dir %s is gone (its %s with it: moved or "
                           "unmounted?); restarted once it is back", child.spec.name, code, self.data_dir, ID_FILE)
            child.process, child.awaits_data_dir = None, True
            return
        child.deaths.append(now)
        while child.deaths and now - child.deaths[0] > RESTART_WINDOW_S:
            child.deaths.popleft()
        if len(child.deaths) >= MAX_RESTARTS:
            raise ChildFailed(f"{child.spec.name} exited {len(child.deaths)} times within "
                              f"{RESTART_WINDOW_S:.0f}s (last exit code {code}); giving up")
        logger.warning("%s exited with code %s; restarting in %.0fs",
                       child.spec.name, code, RESTART_DELAY_S)
        child.restart_at = now + RESTART_DELAY_S

    def _data_dir_id_now(self) -> str | None:
        """The data dir's id as it is now: None when it has none (gone); one that cannot be read
        (an I/O error) is taken for there."""
        assert self.data_dir is not None
        try:
            return data_dir_id(self.data_dir)
        except InvalidConfig:
            return self.data_dir_id or ""

    def _output_tail(self) -> str:
        """The last ``OUTPUT_TAIL_LINES`` lines the children wrote to ``output``, when that is a file."""
        try:
            fd = self.output.fileno() if self.output is not None and hasattr(self.output, "fileno") else None
            if fd is None or not stat.S_ISREG(os.fstat(fd).st_mode):
                return ""
            size = os.fstat(fd).st_size
            text = os.pread(fd, OUTPUT_TAIL_BYTES, max(0, size - OUTPUT_TAIL_BYTES)).decode("utf-8", "replace")
        except (OSError, ValueError):
            return ""
        return "\n".join(text.splitlines()[-OUTPUT_TAIL_LINES:])

    def pids(self) -> dict[str, int]:
        return {c.spec.name: c.process.pid for c in self.children
                if c.process is not None and c.process.poll() is None}

    def stop(self) -> None:
        """SIGTERM every child, wait up to STOP_TIMEOUT_S, then SIGKILL the rest."""
        running = [c.process for c in self.children if c.process and c.process.poll() is None]
        for process in running:
            process.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in running:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("pid %d did not stop in %.0fs; killing", process.pid, STOP_TIMEOUT_S)
                process.kill()
                process.wait()


def stack_specs(*, workers: int, watcher: bool = True, api: bool = True,
                host: str | None = None, port: int | None = None) -> list[ChildSpec]:
    """The child processes of a stack: API first, then the watcher, then the workers."""
    specs: list[ChildSpec] = []
    if api:
        api_args = ["api"]
        if host:
            api_args += ["--host", host]
        if port is not None:
            api_args += ["--port", str(port)]
        specs.append(ChildSpec("api", api_args))
    if watcher:
        specs.append(ChildSpec("watcher", ["watch"]))
    specs += [ChildSpec(f"worker-{n}", ["work", "--count", "1"]) for n in range(1, workers + 1)]
    return specs


@dataclass
class Stack:
    """A running stack: its Redis URL, the supervisor, and the embedded server if any."""

    redis_url: str
    supervisor: Supervisor
    config: Path
    embedded: EmbeddedRedis | None = None

    def redis_problem(self) -> RedisProblem | None:
        """None when Redis answers PING; else whether it is down or answered with an error (it
        runs, but refuses: MISCONF when its disk is full, which it answers even to PING)."""
        try:
            client = redis.Redis.from_url(self.redis_url, socket_timeout=1.0,
                                          socket_connect_timeout=1.0)
            try:
                client.ping()
                return None
            finally:
                client.close()
        except redis.ResponseError as e:  # (before RedisError: an error reply is an answer)
            return RedisProblem(str(e), refusing=True)
        except (redis.RedisError, OSError) as e:
            return RedisProblem(str(e) or type(e).__name__, refusing=False)


@dataclass(frozen=True)
class RedisProblem:
    """Why the stack's Redis did not answer PING: ``refusing`` when it answered with an error."""

    error: str
    refusing: bool


@contextmanager
def running_stack(settings: Settings, specs: list[ChildSpec], *,
                  output: Output = None) -> Iterator[Stack]:
    """Start Redis (embedded when not configured) and the children; stop all on exit. The stop
    runs whole: a stop signal (a handler raising KeyboardInterrupt, as ``demo``'s) that comes
    meanwhile is held until it is done (it cut ``Supervisor.stop`` short: a child left running,
    the demo's keys deleted under it), and nothing lies between a start and its ``finally``."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)  # (here, once: a child never creates it, usable_data_dir)
    embedded = start_embedded(settings) if not settings.redis.url else None
    private: Path | None = None
    try:
        redis_url = embedded.url if embedded else settings.redis.url
        remove_stale_private_dirs()
        private = Path(tempfile.mkdtemp(prefix=private_dir_prefix()))
        config = write_effective_config(settings, redis_url, private)
        supervisor = Supervisor(specs, config, output=output, data_dir=settings.data_dir)
        supervisor.env[MULTIPROC_ENV] = str(metrics_dir(private))
        try:
            supervisor.start()
            yield Stack(redis_url, supervisor, config, embedded)
        finally:
            with stop_signals_held():
                supervisor.stop()
    finally:
        with stop_signals_held():
            if embedded is not None:
                embedded.stop()
            if private is not None:
                shutil.rmtree(private, ignore_errors=True)


class _StopRequested:
    """SIGINT/SIGTERM/SIGHUP handler: records the signal and lets the loop wind down (a closed
    terminal's SIGHUP killed serve at once, its embedded Redis and private dir left behind)."""

    def __init__(self) -> None:
        self.signal: int | None = None

    def __call__(self, signum: int, _frame: object) -> None:
        self.signal = signum

    @contextmanager
    def installed(self) -> Iterator[_StopRequested]:
        with stop_signals_handled(self):
            yield self


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # Ctrl-C, a stop, a closed terminal


@contextmanager
def stop_signals_held() -> Iterator[None]:
    """``STOP_SIGNALS`` held back in the block (main thread only) and handed to their handlers
    after it, in the order they came. (Not with a signal mask: a signal sent to the process goes
    to any thread that does not block it, and its Python handler then runs in the main thread
    all the same.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[signal.Signals] = []
    previous = {s: signal.signal(s, lambda signum, _frame: pending.append(signal.Signals(signum)))
                for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)
        for signum in pending:
            handler = previous[signum]
            if callable(handler):
                handler(signum, None)  # (what it raises, KeyboardInterrupt say, goes on from here)
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), signum)  # its default action, now


@contextmanager
def stop_signals_handled(handler: Callable[[int, Any], None]) -> Iterator[None]:
    """``handler`` for each of ``STOP_SIGNALS`` while in the block; the previous ones restored after.
    A signal ignored at the start (SIGHUP: ``nohup compactor serve &``; SIGINT: a script's background
    job) stays ignored (``compactor.ignored_at_start``)."""
    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS if not ignored_at_start(s)}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


def supervise(stack: Stack, stop: _StopRequested) -> int:
    """Watch the stack until a signal (exit 0) or a child or the embedded Redis fails for good (exit 1)."""
    misses, next_redis_check = _Misses(), time.monotonic()
    while stop.signal is None:
        try:
            if not misses.count:  # else a child that exited waits: started now, it would fail its Redis check
                stack.supervisor.check()
        except ChildFailed as e:
            if not json_configured():  # (under JSON logs the error below is the operator's line)
                print(f"compactor serve: {e}; shutting down", file=sys.stderr)
            logger.error("%s; shutting down", e)
            return 1
        if time.monotonic() >= next_redis_check:
            misses = _check_redis(stack, misses)
            next_redis_check = time.monotonic() + REDIS_CHECK_INTERVAL_S
            if misses.count >= REDIS_MISSES_TO_FAIL and stack.embedded is not None and not misses.refusing:
                announce(f"Redis at {redacted(stack.redis_url)} stopped answering; shutting down",
                         logging.ERROR)
                return 1
        time.sleep(POLL_INTERVAL_S)
    logger.info("signal %s received; stopping", stop.signal)
    return 0


@dataclass(frozen=True)
class _Misses:
    """The Redis checks missed in a row, and whether the last one was a refusal (an error reply)."""

    count: int = 0
    refusing: bool = False


def _check_redis(stack: Stack, misses: _Misses) -> _Misses:
    """PING the stack's Redis; the checks missed in a row since it last answered. An outage of an
    external Redis is one line per check, and one when it answers again (the children retry alone);
    so is a Redis, embedded or not, that answers with an error (MISCONF: its disk is full; it
    serves again by itself once there is room, and the stack waits for it)."""
    url = redacted(stack.redis_url)
    problem = stack.redis_problem()
    if problem is None:
        if misses.count and (stack.embedded is None or misses.refusing):
            logger.info("Redis at %s answers again after %d missed checks", url, misses.count)
        return _Misses()
    if problem.refusing:
        logger.warning("Redis at %s refuses to serve (%s; %d checks in a row); waiting for it, checking every "
                       "%.0fs (a child that exits meanwhile is restarted once it serves)",
                       url, problem.error, misses.count + 1, REDIS_CHECK_INTERVAL_S)
    elif stack.embedded is None:
        logger.warning("Redis at %s does not answer (%d missed in a row); waiting for it, checking every "
                       "%.0fs (a child that exits meanwhile is restarted once it answers)",
                       url, misses.count + 1, REDIS_CHECK_INTERVAL_S)
    return _Misses(misses.count + 1, problem.refusing)


def serve(settings: Settings, *, workers: int, host: str | None = None,
          port: int | None = None) -> int:
    """Run watcher + workers + API until Ctrl-C/SIGTERM; the process exit code."""
    specs = stack_specs(workers=workers, host=host, port=port)
    with _StopRequested().installed() as stop:
        with running_stack(settings, specs) as stack:
            api_host, api_port = host or settings.api.host, settings.api.port if port is None else port
            where = listening_url(api_host, api_port)
            # (a script reading the banner connects at once)
            waited = _wait_for_api(stack, stop, api_host, api_port)
            if waited == API_REFUSED_CODE:
                announce("the API could not start (its error above); stopping", logging.ERROR)
                return API_REFUSED_CODE
            if waited != "stopped":  # (stopped before the API listened: no banner of a stack never up)
                announce(f"API {where}, watcher, {workers} worker(s); "
                         f"Redis {redacted(stack.redis_url)}; Ctrl-C to stop")
            code = supervise(stack, stop)
        announce("stopped")
    return code


def _wait_for_api(stack: Stack, stop: _StopRequested, host: str, port: int) -> int | str | None:
    """Until the API child listens on ``port`` (the listener its own: the port was free when
    ``serve`` looked, but another process could take it before the child bound it, and a connect
    took that one's for the API: the banner named another service's, and the child, refused the
    port, was restarted until serve gave up, 40 s later, exit 1), at most ``API_READY_TIMEOUT_S``
    ("late"): "ready"; its exit code once it exited first (``supervise`` takes over); "stopped"
    when a stop is asked for before it listens (looked at once more: one that came right after
    the API was up, a script's that saw it answer, left the banner out)."""
    api = next((c for c in stack.supervisor.children if c.spec.name == "api"), None)
    if api is None:
        return "ready"
    connect_to = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    deadline = time.monotonic() + API_READY_TIMEOUT_S
    while True:
        if api.process is None or (code := api.process.poll()) is not None:
            return code
        if _listens(api.process.pid, port, connect_to):
            return "ready"
        if stop.signal is not None:
            return "stopped"
        if time.monotonic() >= deadline:
            return "late"
        time.sleep(0.05)


API_REFUSED_CODE = 2  # the API child's exit for what no restart mends (its port taken, a bad host): serve's too


def _listens(pid: int, port: int, connect_to: str) -> bool:
    """Whether process ``pid`` listens on TCP ``port`` (a connect to ``connect_to`` succeeds, when
    its sockets cannot be listed)."""
    try:
        process = psutil.Process(pid)
        listing = getattr(process, "net_connections", None) or process.connections  # (psutil < 6: the old name)
        return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in listing(kind="tcp"))
    except psutil.AccessDenied:
        try:
            socket.create_connection((connect_to, port), timeout=1.0).close()
            return True
        except OSError:
            return False
    except psutil.Error:  # (gone meanwhile: its exit is seen next)
        return False


def announce(message: str, level: int = logging.INFO) -> None:
    """A line for the operator on stderr: ``compactor serve: message`` as plain text, or a log
    record under ``--log-format json`` (stderr then stays one JSON object per line)."""
    if json_configured():
        logger.log(level, "%s", message)
    else:
        write_or_drop(sys.stderr, f"compactor serve: {message}\n")  # (its reader gone: serve stops all the same)
