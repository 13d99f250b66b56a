"""The long-running processes as an operator meets them: orphans, outages, health, the banner, status.

Real processes against a real Redis (the session's, or one of the test's own where
the test stops it).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import redis
from rq import Queue, Worker
from rq.job import Job
from rq.utils import utcformat
from typer.testing import CliRunner

from compactor import serve
from compactor.cli import app
from compactor.cli.health import WORKER_ALIVE_S, check_workers
from compactor.embedded import EmbeddedRedis
from compactor.keys import Keys
from events.config import ENV_OVERRIDES, Settings
from tests.producer.test_api import write_session
from worker import context as worker_context
from tests.support import free_port, wait_for

PASSWORD = "s3cret-pw"


def process_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ENV_OVERRIDES}
    env.update(LITELLM_LOCAL_MODEL_COST_MAP="True", PYTHONUNBUFFERED="1", **extra)
    return env


def compactor(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """``python -m compactor ARGS`` in its own process group, its output kept."""
    return subprocess.Popen([sys.executable, "-m", "compactor", *args], env=env or process_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill_all(process: subprocess.Popen[str], others: list[int]) -> str:
    """SIGKILL the process, its group and ``others``; what it wrote on stderr."""
    for pid in [process.pid, *others]:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return process.communicate(timeout=30)[1]


def ended_with_one_line(process: subprocess.Popen[str]) -> tuple[int, str]:
    """The exit code of a command that is to end by itself (killed past 30 s), and the one line it
    wrote on stderr."""
    try:
        _, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            kill_all(process, [])
    [line] = err.strip().splitlines()
    return process.returncode, line


def registered_workers(r: redis.Redis, settings: Settings) -> list[Worker]:
    return Worker.all(connection=r, queue=Queue(Keys(settings.redis.prefix).queue, connection=r))


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


# -- orphans -----------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(120)
def test_work_children_stop_when_their_parent_is_killed(r: redis.Redis, settings: Settings,
                                                        tmp_path: Path) -> None:
    """kill -9 of ``work --count 2`` left both worker children running (PPID 1) for good."""
    process = compactor("work", "--count", "2", "--redis-url", settings.redis.url,
                        "--data-dir", str(tmp_path / "data"))
    children: list[int] = []
    try:
        wait_for(lambda: len(registered_workers(r, settings)) == 2 or process.poll() is not None, 60,
                 "two RQ workers")
        assert process.poll() is None, process.communicate()[1]
        children = [c.pid for c in psutil.Process(process.pid).children()]
        assert len(children) == 2
        process.kill()
        process.wait()
        wait_for(lambda: not any(alive(pid) for pid in children), 15, "the orphaned workers to stop")
        assert registered_workers(r, settings) == []  # a warm stop: each left RQ's registry
    finally:
        kill_all(process, children)


def test_the_startup_check_waits_for_a_redis_busy_running_a_script(tmp_path: Path) -> None:
    """``BUSY`` (another client's script past the busy threshold) passes by itself, as a Redis
    that is down or loading does: the API and serve start and ride it out. Only a refusal for good
    (a database Redis does not have, a wrong password, an ACL) ends them at start."""
    from compactor.cli.common import check_access_if_up

    server = EmbeddedRedis(tmp_path / "redis", persist=False).start()
    try:
        client = redis.Redis.from_url(server.url)
        client.config_set("busy-reply-threshold", 200)
        script = threading.Thread(target=lambda: redis.Redis.from_url(server.url).eval(
            "local t = redis.call('TIME')[1]; while redis.call('TIME')[1] - t < 3 do end return 1", 0))
        script.start()
        time.sleep(0.6)
        with pytest.raises(redis.ResponseError, match="BUSY"):
            redis.Redis.from_url(server.url).ping()
        check_access_if_up(Settings.model_validate({"dataDir": str(tmp_path / "data"), "redis": {"url": server.url}}))
        script.join(10)
    finally:
        server.stop()


READY = {"watch": "watcher started", "work": "*** Listening on", "api": "Application startup complete",
         "serve": "compactor serve: API"}


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("command", ["watch", "work", "api", "serve"])
def test_a_ctrl_c_ignored_at_the_start_stays_ignored(settings: Settings, tmp_path: Path, command: str) -> None:
    """A shell without job control starts a background job with SIGINT ignored (``compactor serve &``
    in a script: the terminal's Ctrl-C, meant for the script's foreground command, reaches the whole
    process group). Each process took SIGINT over once its handlers were set, a moment after its
    start: a Ctrl-C then stopped it, one in its first fraction of a second did not. Now ignored
    throughout, by the process and its children (``work``'s forked workers, in its group), as
    ``nohup``'s SIGHUP is; SIGTERM still stops it, exit 0."""
    args = {"serve": ["--workers", "1", "--port", "0"], "work": ["--count", "2"],
            "api": ["--port", str(free_port())]}.get(command, [])
    env = process_env(COMPACTION_DATA_DIR=str(tmp_path / "data"),
                      **({} if command == "serve" else {"REDIS_URL": settings.redis.url}))
    with open(tmp_path / "err.log", "w") as err:
        process = subprocess.Popen([sys.executable, "-m", "compactor", command, *args], env=env, text=True,
                                   stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
                                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        ready = 2 if command == "work" else 1
        wait_for(lambda: (tmp_path / "err.log").read_text().count(READY[command]) >= ready
                 or process.poll() is not None, 90, f"{command} to be ready")
        time.sleep(0.5)
        os.killpg(process.pid, signal.SIGINT)  # (a Ctrl-C: the whole group)
        time.sleep(2.0)
        assert process.poll() is None, (tmp_path / "err.log").read_text()[-3000:]
        assert "stopping" not in (tmp_path / "err.log").read_text().split(READY[command])[-1].lower()
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0, (tmp_path / "err.log").read_text()[-3000:]
    finally:
        if process.poll() is None:
            kill_all(process, [])


ORPHAN = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    if sys.argv[1:] == ["child"]:
        from compactor import serve
        serve.STOP_TIMEOUT_S = 1.0
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # busy: a job it will not drop for SIGTERM
        serve.exit_with_parent(os.getppid())
        print("ready", flush=True)
        time.sleep(120)
    else:
        child = subprocess.Popen([sys.executable, __file__, "child"], stdout=subprocess.PIPE, text=True)
        child.stdout.readline()
        print(child.pid, flush=True)
        time.sleep(120)
""")


@pytest.mark.timeout(60)
def test_an_orphan_that_does_not_stop_on_sigterm_is_killed(tmp_path: Path) -> None:
    """A child that outlives its parent gets SIGTERM, then SIGKILL ``STOP_TIMEOUT_S`` later."""
    script = tmp_path / "orphan.py"
    script.write_text(ORPHAN)
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env=process_env(PYTHONPATH=str(Path(__file__).parents[2])), start_new_session=True)
    child = 0
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        parent.kill()
        parent.wait()
        killed_at = time.monotonic()
        wait_for(lambda: not alive(child), 15, "the orphan to be killed")
        assert time.monotonic() - killed_at >= 1.0  # SIGTERM was ignored; SIGKILL came after the timeout
    finally:
        parent.kill()
        parent.communicate()
        if child and alive(child):
            os.kill(child, signal.SIGKILL)


# -- health --workers --------------------------------------------------------------------

def test_health_counts_only_workers_with_a_recent_heartbeat(r: redis.Redis, settings: Settings) -> None:
    from worker.runner import CompactionWorker

    worker = CompactionWorker.for_settings(r, settings)
    worker.register_birth()
    try:
        assert check_workers(r, settings) == "ok (1)"
        stale = datetime.now(UTC) - timedelta(seconds=WORKER_ALIVE_S + 1)
        r.hset(worker.key, "last_heartbeat", utcformat(stale))
        with pytest.raises(RuntimeError, match=r"no live RQ worker on the queue: 1 registered, "
                                               r"none with a heartbeat in the last 20s"):
            check_workers(r, settings)
        worker._keeper._beat()  # idle: RQ itself beats only every 45 s while it waits for a job
        assert check_workers(r, settings) == "ok (1)"
        # a container's healthcheck counts its own worker: any of the deployment's made a dead one healthy
        assert check_workers(r, settings, host=socket.gethostname()) == "ok (1)"
        with pytest.raises(RuntimeError, match="no RQ worker registered on the queue from host elsewhere"):
            check_workers(r, settings, host="elsewhere")
    finally:
        worker.register_death()
        worker_context.clear()


@pytest.mark.parametrize("skew_s", [-30.0, 3600.0])
def test_health_ages_heartbeats_by_redis_s_clock_not_its_hosts_or_the_workers(
        r: redis.Redis, settings: Settings, monkeypatch: pytest.MonkeyPatch, skew_s: float) -> None:
    """RQ wrote ``last_heartbeat`` by the worker host's clock and health aged it by its own: checked
    from a host 30 s ahead a live worker was dead; from one an hour behind a dead one lived on.
    Both now use Redis's TIME (the worker's through ``sync_clock``)."""
    import compactor.cli.health as health_module
    from compactor import queue as queue_module
    from worker.runner import CompactionWorker

    real = time.time_ns
    monkeypatch.setattr(time, "time_ns", lambda: real() - int(skew_s * 1e9))  # the worker host's clock, off
    monkeypatch.setattr(queue_module, "_clock_synced_at", None)
    monkeypatch.setattr(queue_module, "_clock_offset_ns", queue_module._clock_offset_ns)
    queue_module.sync_clock(r)

    class HealthHostClock(datetime):  # the health check's host, off the other way
        @classmethod
        def now(cls, tz: Any = None) -> Any:
            return datetime.now(tz) + timedelta(seconds=skew_s)

    monkeypatch.setattr(health_module, "datetime", HealthHostClock)
    worker = CompactionWorker.for_settings(r, settings)
    worker.register_birth()
    try:
        worker._keeper._beat()
        beat = Worker.find_by_key(worker.key, connection=r).last_heartbeat
        seconds, _ = r.time()
        assert beat is not None and abs(beat.timestamp() - int(seconds)) < 5  # in Redis's time
        assert check_workers(r, settings) == "ok (1)"
        r.hset(worker.key, "last_heartbeat", utcformat(datetime.fromtimestamp(int(seconds) - WORKER_ALIVE_S - 1, UTC)))
        with pytest.raises(RuntimeError, match="no live RQ worker"):
            check_workers(r, settings)
    finally:
        worker.register_death()
        worker_context.clear()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_health_workers_fails_soon_after_the_workers_are_killed(r: redis.Redis, settings: Settings,
                                                                tmp_path: Path) -> None:
    """``health --workers`` said ``workers ok (1)`` for ~2 minutes after kill -9 (until RQ's key expired)."""
    runner = CliRunner()
    args = ["health", "--workers", "--redis-url", settings.redis.url, "--data-dir", str(tmp_path / "data")]
    process = compactor("work", "--count", "1", *args[2:])
    try:
        wait_for(lambda: runner.invoke(app, args).exit_code == 0 or process.poll() is not None, 60, "a live worker")
        assert process.poll() is None, process.communicate()[1]
        time.sleep(8)  # past a keeper heartbeat or so: the worker is idle, waiting for a job
        assert runner.invoke(app, args).exit_code == 0
        process.kill()
        process.wait()
        report = wait_for(lambda: (lambda result: result.exit_code == 1 and result.stdout)(runner.invoke(app, args)),
                          WORKER_ALIVE_S + 10, "health to see the worker gone")
        assert "none with a heartbeat" in report
    finally:
        kill_all(process, [])


# -- Redis at start and during an outage -------------------------------------------------

@pytest.mark.timeout(60)
def test_watch_with_an_unreachable_redis_exits_1_at_once(tmp_path: Path) -> None:
    """It logged a retry every few seconds, forever, where `work` says so and exits 1."""
    url = f"redis://:{PASSWORD}@127.0.0.1:{free_port()}/0"
    code, line = ended_with_one_line(compactor("watch", "--redis-url", url, "--data-dir", str(tmp_path / "data")))
    assert code == 1
    assert line.startswith("compactor: Redis unreachable at redis://:***@127.0.0.1:") and PASSWORD not in line


@pytest.mark.timeout(60)
def test_api_with_an_unreachable_redis_answers_503(tmp_path: Path) -> None:
    """Documented: the API starts anyway and answers 503 until Redis answers, as during an outage."""
    port = free_port()
    process = compactor("api", "--port", str(port), "--redis-url", f"redis://127.0.0.1:{free_port()}/0",
                        "--data-dir", str(tmp_path / "data"))
    try:
        def status() -> int:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code
            except httpx.HTTPError:
                return 0 if process.poll() is None else -1

        assert wait_for(status, 30, "the API") == 503
    finally:
        kill_all(process, [])


class PasswordRedis(EmbeddedRedis):
    """A Redis of the test's own on a TCP port, with a password (never to be printed)."""

    def __init__(self, directory: Path, port: int) -> None:
        super().__init__(directory, persist=False, port=port)

    @property
    def url(self) -> str:
        return f"redis://:{PASSWORD}@127.0.0.1:{self.port}/0"

    def _args(self) -> list[str]:
        return [*super()._args(), "--requirepass", PASSWORD]


@pytest.fixture
def external_redis(tmp_path: Path) -> Iterator[PasswordRedis]:
    server = PasswordRedis(tmp_path / "redis", free_port()).start()
    yield server
    server.stop()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("refusal", ["database", "password"])
def test_api_on_a_redis_that_refuses_it_exits_1_naming_why(external_redis: PasswordRedis, tmp_path: Path,
                                                          refusal: str) -> None:
    """A Redis that answers and refuses (a database it does not have, a wrong password) is a
    configuration error, as watch and work say at start: the API started, then answered every
    request, /healthz included, a 500 (``DB index is out of range``)."""
    url = (external_redis.url.rsplit("/", 1)[0] + "/99999" if refusal == "database"
           else external_redis.url.replace(PASSWORD, "wrong-pw"))
    code, line = ended_with_one_line(compactor("api", "--port", str(free_port()), "--redis-url", url,
                                               "--data-dir", str(tmp_path / "data")))
    assert code == 1
    assert line.startswith("compactor: Redis refused at redis://:***@127.0.0.1:"), line
    assert ("DB index is out of range" if refusal == "database" else "invalid username-password") in line
    assert PASSWORD not in line and "wrong-pw" not in line


def serve_children(process: subprocess.Popen[str]) -> dict[str, int]:
    """The pid of serve's running ``api``, ``watch`` and ``work`` children, by command."""
    found = {}
    for child in psutil.Process(process.pid).children():
        try:
            argv = child.cmdline()  # python -P -m compactor {api,watch,work} ...
        except psutil.Error:  # exited: a zombie until serve reaps it
            continue
        if argv[1:4] == ["-P", "-m", "compactor"]:
            found[argv[4]] = child.pid
    return found


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_serve_rides_out_an_outage_of_an_external_redis(external_redis: PasswordRedis, tmp_path: Path) -> None:
    """It shut the whole stack down ("stopped answering", exit 1) after ~6 s of outage, where its
    children wait. A worker that dies meanwhile is restarted once Redis answers, not into a
    Redis check that fails until it has "died" 5 times."""
    port = free_port()
    process = compactor("serve", "--workers", "1", "--port", str(port), "--data-dir", str(tmp_path / "data"),
                        env=process_env(REDIS_URL=external_redis.url))
    url, children = f"http://127.0.0.1:{port}", list[int]()
    client = redis.Redis.from_url(external_redis.url)
    try:
        wait_for(lambda: healthy(url) or process.poll() is not None, 90, "the API")
        wait_for(lambda: client.keys("rq:worker:*") or process.poll() is not None, 60, "the worker")
        before = serve_children(process)
        children = list(before.values())
        external_redis.kill()
        os.kill(before["work"], signal.SIGKILL)
        time.sleep(20)  # > REDIS_MISSES_TO_FAIL checks, and time for 5 restarts of the worker
        assert process.poll() is None, process.communicate()[1]
        external_redis.start()  # the same port: the outage is over
        wait_for(lambda: healthy(url), 60, "the API to answer again")
        after = wait_for(lambda: (lambda c: c.get("work") not in (None, before["work"]) and c)(serve_children(process)),
                         60, "the worker restarted")
        children += list(after.values())
        assert after["api"] == before["api"] and after["watch"] == before["watch"]
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=60)
        assert process.returncode == 0, err
    finally:
        client.close()
        if process.poll() is None:
            kill_all(process, children)
    said = [line for line in err.splitlines() if "compactor.serve" in line]
    assert any(re.search(r"Redis at redis://:\*\*\*@127\.0\.0\.1:\d+/0 does not answer \(3 missed in a row\)", line)
               for line in said), err
    assert any("answers again" in line for line in said), err
    assert "stopped answering" not in err and PASSWORD not in out + err


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_serve_stops_when_its_embedded_redis_dies(tmp_path: Path) -> None:
    """Kept as it was: its own server gone, the stack stops (exit 1) for whatever runs serve to restart."""
    process = compactor("serve", "--workers", "1", "--port", str(free_port()), "--log-level", "WARNING",
                        env=process_env(COMPACTION_DATA_DIR=str(tmp_path / "data")))
    children: list[int] = []
    try:
        def server() -> psutil.Process | None:
            found = [c for c in psutil.Process(process.pid).children()
                     if "valkey-server" in " ".join(c.cmdline()) or "redis-server" in " ".join(c.cmdline())]
            return found[0] if found else None

        redis_server = wait_for(server, 60, "the embedded Redis")
        wait_for(lambda: len(serve_children(process)) == 3 or process.poll() is not None, 60, "the children")
        children = [c.pid for c in psutil.Process(process.pid).children()]
        redis_server.kill()
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            kill_all(process, children)
    assert process.returncode == 1
    assert re.search(r"compactor serve: Redis at unix://\S+ stopped answering; shutting down", err), err
    assert not any(alive(pid) for pid in children)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_serve_on_port_0_names_the_port_its_api_listens_on(tmp_path: Path) -> None:
    """The banner said ``API http://127.0.0.1:0`` while the API listened on a port the OS picked."""
    process = compactor("serve", "--workers", "1", "--port", "0", "--log-level", "WARNING",
                        env=process_env(COMPACTION_DATA_DIR=str(tmp_path / "data")))
    children: list[int] = []
    try:
        assert process.stderr is not None
        banner = next(line for line in process.stderr if "compactor serve: API" in line)
        match = re.match(r"compactor serve: API http://127\.0\.0\.1:(\d+), watcher, 1 worker\(s\)", banner)
        assert match and match.group(1) != "0", banner
        wait_for(lambda: healthy(f"http://127.0.0.1:{match.group(1)}") or process.poll() is not None, 90,
                 "the API on the port the banner names")
        assert process.poll() is None
        children = [c.pid for c in psutil.Process(process.pid).children()]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            kill_all(process, children)
        process.communicate(timeout=30)


# -- status on a narrow terminal ---------------------------------------------------------

@pytest.mark.parametrize("columns", [40, 50, 60, 70, 80, 100, 120])
def test_status_keeps_the_session_column_on_a_narrow_terminal(r: redis.Redis, settings: Settings,
                                                              columns: int) -> None:
    """``COLUMNS=60 compactor status`` dropped the session column: rows could not be identified.
    Other columns are left out instead (the caption says which), the whole id shown (folded)."""
    sid = "my-session-123"
    write_session(r, settings, 2, sid=sid)
    result = CliRunner().invoke(app, ["status", "--limit", "1", "--redis-url", settings.redis.url,
                                      "--data-dir", str(settings.data_dir)], env={"COLUMNS": str(columns)})
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= columns
    [header] = [line for line in lines if "tokens" in line.split() or "failures" in line.split()]
    assert header.split()[0] == "session"
    first = next(i for i, line in enumerate(lines) if line.strip().startswith(sid[:6]))
    folded = "".join(line.split()[0] for line in lines[first:first + 3] if line.strip())
    assert folded.startswith(sid)
    if columns < 80:
        assert "hidden to fit: last compaction" in " ".join(result.stdout.split())


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigterm_stops_the_api_while_a_forced_compaction_waits(r: redis.Redis, settings: Settings,
                                                                redis_url: str) -> None:
    """A ``POST /compact`` waiting for its job (no worker runs) held a SIGTERM'd ``api`` for up to
    ``api.jobWaitSeconds`` (5 minutes): uvicorn waited for the request to end. Then it was cut
    after the 5 s grace with a bare 500 (no job id: the caller could not follow its job, which
    runs on); it is now answered at once as a wait that timed out is: 202 with the job id."""
    from compactor.cli.processes import API_STOP_GRACE_S
    from tests.producer.test_api import CWD, SID

    write_session(r, settings, 1)
    port = free_port()
    process = compactor("api", "--port", str(port), "--redis-url", redis_url,
                        "--data-dir", str(settings.data_dir))
    try:
        wait_for(lambda: healthy(f"http://127.0.0.1:{port}") or process.poll() is not None, 60, "the API")
        waiting = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
            import httpx
            try:
                answer = httpx.post("http://127.0.0.1:{port}/api/sessions/{SID}/compact", json={{"cwd": "{CWD}"}},
                                    timeout=600)
                print(answer.status_code, answer.text)
            except httpx.HTTPError as e:
                print("error", e)
            """)], stdout=subprocess.PIPE, text=True)
        wait_for(lambda: r.llen(f"rq:queue:{Keys().queue}") > 0 or bool(
            r.keys("rq:job:*")), 30, "the forced compaction's job")
        time.sleep(0.5)  # the request is waiting for its job
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        out, _ = waiting.communicate(timeout=30)
        assert time.monotonic() - started < API_STOP_GRACE_S - 1  # answered at once, not cut at the grace's end
        process.wait(timeout=60)
        assert time.monotonic() - started < API_STOP_GRACE_S + 5
        status, _, body = out.strip().partition(" ")
        assert status == "202", out
        assert Job.fetch(json.loads(body)["jobId"], connection=r).get_status() == "queued"
    finally:
        kill_all(process, [])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_serve_waits_for_its_embedded_redis_while_it_refuses_to_serve(tmp_path: Path) -> None:
    """A full disk under the embedded Redis: its AOF fails and it answers MISCONF, even to PING.
    serve took that for a dead server and stopped the stack, which then needed a restart by hand
    once there was room again. (Here PING is refused by an ACL rule: an error reply all the same.)"""
    process = compactor("serve", "--workers", "1", "--port", str(free_port()),
                        env=process_env(COMPACTION_DATA_DIR=str(tmp_path / "data")))
    children: list[int] = []
    try:
        wait_for(lambda: len(serve_children(process)) == 3 or process.poll() is not None, 90, "the children")
        children = [c.pid for c in psutil.Process(process.pid).children()]
        client = redis.Redis(unix_socket_path=str(tmp_path / "data" / ".redis" / "redis.sock"))
        client.execute_command("ACL", "SETUSER", "default", "-ping")
        time.sleep((serve.REDIS_MISSES_TO_FAIL + 1) * serve.REDIS_CHECK_INTERVAL_S + 1)
        assert process.poll() is None  # still serving
        client.execute_command("ACL", "SETUSER", "default", "+ping")
        time.sleep(serve.REDIS_CHECK_INTERVAL_S * 2)
        assert process.poll() is None
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            kill_all(process, children)
    said = [line for line in err.splitlines() if "compactor.serve" in line]
    assert any("refuses to serve (" in line and "ping" in line for line in said), err
    assert any("answers again" in line for line in said), err
    assert "stopped answering" not in err and process.returncode == 0
