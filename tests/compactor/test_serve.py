"""``compactor serve``: supervision, the embedded Redis, effective settings, clean shutdown."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from compactor import serve
from compactor.embedded import EmbeddedRedis
from compactor.serve import ChildFailed, ChildSpec, Supervisor
from events.config import ENV_OVERRIDES, Settings, load_settings
from events.errors import InvalidConfig
from events.log import SessionLog
from tests.support import free_port, wait_for

CWD = "/home/dev/project"




def test_effective_config_round_trips_with_the_redis_url_pinned(settings: Settings,
                                                                tmp_path: Path) -> None:
    tuned = settings.model_copy(update={"context": settings.context.model_copy(
        update={"compaction_model": "extractive", "compactable_tools": ("read_file",)})})
    path = serve.write_effective_config(tuned, "unix:///x.sock?db=0", tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    loaded = load_settings(path, environ={})
    assert loaded.redis.url == "unix:///x.sock?db=0"
    assert loaded.context == tuned.context and loaded.data_dir == tuned.data_dir
    assert loaded.api == tuned.api and loaded.limits == tuned.limits


def test_child_env_drops_overrides_and_names_the_parent(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ENV_OVERRIDES:
        monkeypatch.setenv(var, "x")
    monkeypatch.setenv("CODINGCODE_CONFIG", "/elsewhere.yaml")
    env = serve.child_env(1234)
    assert not set(ENV_OVERRIDES) & set(env) and "CODINGCODE_CONFIG" not in env
    assert env[serve.PARENT_PID_ENV] == "1234"


def test_client_redis_url_prefers_config_then_a_running_serve(settings: Settings,
                                                              tmp_path: Path) -> None:
    assert serve.client_redis_url(settings) == settings.redis.url
    local = settings.model_copy(update={"redis": settings.redis.model_copy(update={"url": ""}),
                                        "data_dir": tmp_path / "d"})
    with pytest.raises(InvalidConfig, match="no `compactor serve` runs"):
        serve.client_redis_url(local)
    with EmbeddedRedis(serve.embedded_dir(local), persist=False) as server:
        assert serve.client_redis_url(local) == server.url
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a socket file no server listens on: a killed
    stale.bind(str(server.socket))  # serve's, left behind (it said "Redis unreachable", exit 1)
    stale.close()
    with pytest.raises(InvalidConfig, match=r"no `compactor serve` runs under .* is a killed one's, left behind"):
        serve.client_redis_url(local)


def test_a_second_embedded_redis_on_the_same_data_dir_is_refused(settings: Settings,
                                                                 tmp_path: Path) -> None:
    local = settings.model_copy(update={"redis": settings.redis.model_copy(update={"url": ""}),
                                        "data_dir": tmp_path / "d"})
    first = serve.start_embedded(local)
    try:
        with pytest.raises(InvalidConfig, match="already runs"):
            serve.start_embedded(local)
    finally:
        first.stop()
    assert (serve.embedded_dir(local) / "appendonlydir").is_dir()


def test_two_serves_starting_at_once_on_one_data_dir_do_not_both_start_a_redis(settings: Settings,
                                                                               tmp_path: Path) -> None:
    """Each checked for a server, found none, and started its own on the same socket and AOF files
    (the first to stop deleted the other's socket): one now holds the directory while it checks."""
    import threading

    local = settings.model_copy(update={"redis": settings.redis.model_copy(update={"url": ""}),
                                        "data_dir": tmp_path / "d"})
    together = threading.Barrier(2)
    started: list[EmbeddedRedis] = []
    refused: list[str] = []

    def start() -> None:
        together.wait()
        try:
            started.append(serve.start_embedded(local))
        except InvalidConfig as e:
            refused.append(str(e))

    threads = [threading.Thread(target=start) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    try:
        assert len(started) == 1 and len(refused) == 1, (started, refused)
        assert "already runs" in refused[0]
    finally:
        for server in started:
            server.stop()
    again = serve.start_embedded(local)  # stopped: the directory is free again
    again.stop()


def test_a_redis_left_by_a_killed_serve_is_replaced_keeping_its_data(settings: Settings,
                                                                     tmp_path: Path) -> None:
    import redis

    local = settings.model_copy(update={"redis": settings.redis.model_copy(update={"url": ""}),
                                        "data_dir": tmp_path / "d"})
    orphan = EmbeddedRedis(serve.embedded_dir(local)).start()  # no serve.pid: nobody owns it
    redis.Redis.from_url(orphan.url).set("kept", "1")
    server = serve.start_embedded(local)
    try:
        assert redis.Redis.from_url(server.url).get("kept") == b"1"
        assert server.pid != orphan.pid
        pid_file = serve.embedded_dir(local) / serve.SERVE_PID_FILE
        assert pid_file.read_text().split()[0] == str(os.getpid())
    finally:
        server.stop()
        orphan.stop()


def test_a_serve_killed_and_not_reaped_yet_owns_its_redis_no_more(settings: Settings, tmp_path: Path) -> None:
    """A supervisor that SIGKILLs serve and starts it again before reaping the old one (a zombie,
    whose start time psutil still reads) had the new one refused: "another `compactor serve`
    already runs", exit 2, for as long as the old one stayed unreaped."""
    directory = tmp_path / "redis"
    directory.mkdir()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)"])
    try:
        process = psutil.Process(child.pid)
        (directory / serve.SERVE_PID_FILE).write_text(f"{child.pid} {process.create_time()}\n")
        assert serve._owner_alive(directory)  # (alive: running, or about to exit)
        wait_for(lambda: process.status() == psutil.STATUS_ZOMBIE, 10, "the child to exit, unreaped")
        assert not serve._owner_alive(directory)
    finally:
        child.wait()
    assert not serve._owner_alive(directory)  # (reaped)


def test_an_orphaned_redis_that_does_not_stop_is_left_alone_and_serve_refused(
        settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After 10 s of an orphan still answering, serve started a second server anyway: it took the
    orphan's socket and appended to the same AOF files."""
    import redis

    from compactor.embedded import server_binary
    from events.errors import CompactorError

    monkeypatch.setattr(serve, "ORPHAN_STOP_TIMEOUT_S", 1.0)
    local = settings.model_copy(update={"redis": settings.redis.model_copy(update={"url": ""}),
                                        "data_dir": tmp_path / "d"})
    orphan = EmbeddedRedis(serve.embedded_dir(local))
    monkeypatch.setattr(orphan, "_args", lambda: [*EmbeddedRedis._args(orphan), "--rename-command", "SHUTDOWN", ""])
    orphan.start()  # ignores SHUTDOWN
    try:
        redis.Redis.from_url(orphan.url).set("kept", "1")
        with pytest.raises(CompactorError, match="still answers 1 s after SHUTDOWN"):
            serve.start_embedded(local)
        assert redis.Redis.from_url(orphan.url).get("kept") == b"1"  # its socket is still its own
        assert [p for p in psutil.process_iter(["exe"]) if p.info["exe"] == server_binary()
                and str(serve.embedded_dir(local)) in " ".join(p.cmdline())] == [psutil.Process(orphan.pid)]
        again = EmbeddedRedis(serve.embedded_dir(local))
        assert again.claim()  # the refused serve let go of the directory
        again.release()
    finally:
        orphan.stop()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_serve_winds_down_on_a_terminal_hang_up_as_on_sigterm(signum: int) -> None:
    """A closed terminal's SIGHUP killed serve at once: its embedded Redis and its private dir
    (the effective config, API token included) were left behind."""
    script = ("import os, signal\nfrom compactor.serve import _StopRequested\n"
              "with _StopRequested().installed() as stop:\n"
              f"    os.kill(os.getpid(), {int(signum)})\n"
              "    print(stop.signal)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert (done.returncode, done.stdout.strip()) == (0, str(int(signum))), done.stderr


def test_supervisor_restarts_a_dying_child_then_gives_up(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serve, "RESTART_DELAY_S", 0.0)
    monkeypatch.setattr(serve, "MAX_RESTARTS", 3)
    supervisor = Supervisor([ChildSpec("flaky", ["no-such-command"])], tmp_path / "c.yaml",
                            output=subprocess.DEVNULL)
    supervisor.start()
    pids: set[int] = set()
    try:
        with pytest.raises(ChildFailed, match="flaky exited 3 times"):
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                pids |= set(supervisor.pids().values())
                supervisor.check()
                time.sleep(0.02)
    finally:
        supervisor.stop()
    assert len(pids) >= 2  # it was restarted before giving up


def _supervised_on_a_data_dir(tmp_path: Path) -> tuple[Path, Path, Supervisor]:
    """A data dir with its id, where it goes when moved away, and a supervisor of a child that
    always exits, on it (not started)."""
    data, away = tmp_path / "data", tmp_path / "away"
    data.mkdir()
    (data / ".compactor-id").write_text("0123abcd\n")
    return data, away, Supervisor([ChildSpec("flaky", ["no-such-command"])], tmp_path / "c.yaml",
                                  output=subprocess.DEVNULL, data_dir=data)


def test_a_child_that_exits_while_the_data_dir_is_gone_is_restarted_once_it_is_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The watcher stops on a data dir gone (exit 2): restarted at once, it created the data dir
    again, empty, was refused there 5 times and the stack shut down, and the data dir put back
    with ``mv`` went inside the empty one."""
    monkeypatch.setattr(serve, "RESTART_DELAY_S", 0.0)
    monkeypatch.setattr(serve, "MAX_RESTARTS", 2)
    data, away, supervisor = _supervised_on_a_data_dir(tmp_path)
    supervisor.check()  # (the id, as the children made it)
    data.rename(away)
    supervisor.start()
    try:
        deadline = time.monotonic() + 60
        while not supervisor.children[0].awaits_data_dir:
            assert time.monotonic() < deadline
            supervisor.check()
            time.sleep(0.02)
        for _ in range(20):  # not counted, not restarted, nothing created
            supervisor.check()
            time.sleep(0.02)
        assert supervisor.pids() == {} and not data.exists()
        away.rename(data)
        with pytest.raises(ChildFailed, match="flaky exited 2 times"):  # back: restarted, and counted again
            while time.monotonic() < deadline:
                supervisor.check()
                time.sleep(0.02)
    finally:
        supervisor.stop()


def test_a_restart_due_while_the_data_dir_is_gone_waits_for_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A child that died just before the data dir went (its restart queued, a second later) was
    started into the missing data dir, which it created again, empty."""
    monkeypatch.setattr(serve, "RESTART_DELAY_S", 0.5)
    data, away, supervisor = _supervised_on_a_data_dir(tmp_path)
    supervisor.start()
    try:
        deadline = time.monotonic() + 60
        while supervisor.children[0].restart_at is None:  # died, the data dir there: a restart queued
            assert time.monotonic() < deadline
            supervisor.check()
            time.sleep(0.02)
        data.rename(away)
        spawned: list[str] = []
        monkeypatch.setattr(supervisor, "_spawn", lambda child: spawned.append(child.spec.name))
        while not supervisor.children[0].awaits_data_dir:
            assert time.monotonic() < deadline
            supervisor.check()
            time.sleep(0.02)
        assert spawned == [] and not data.exists()
    finally:
        supervisor.stop()


@pytest.mark.parametrize("listens, psutil_5", [(False, False), (True, False), (True, True)],
                         ids=["another-process-took-the-port", "its-own", "its-own-psutil-5"])
def test_the_api_is_ready_only_once_its_own_process_listens(tmp_path: Path, listens: bool, psutil_5: bool,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """serve's port check closes its socket before the API child binds it: another process that took
    the port meanwhile answered the readiness connect, the banner named that one's address, and the
    child, refused the port, was restarted until serve gave up 40 s later, exit 1 (not 2)."""
    other = socket.create_server(("127.0.0.1", 0))
    port = other.getsockname()[1]
    if listens:
        other.close()
        code = (f"import socket, time\ns = socket.create_server(('127.0.0.1', {port}))\ntime.sleep(30)\n")
    else:
        code = "import sys, time\ntime.sleep(1.0)\nsys.exit(2)\n"  # (what the API child does on a port in use)
    if psutil_5:  # (``net_connections`` came in psutil 6: serve died on 5.9, which pyproject allows)
        real = psutil.Process

        class Psutil5Process(real):  # type: ignore[misc,valid-type]
            net_connections = None

            def connections(self, kind: str = "inet") -> Any:
                return real.net_connections(self, kind)

        monkeypatch.setattr(psutil, "Process", Psutil5Process)
    child = serve.Child(ChildSpec("api", ["api"]), process=subprocess.Popen([sys.executable, "-c", code]))
    supervisor = Supervisor([], tmp_path / "c.yaml")
    supervisor.children = [child]
    stack = serve.Stack("redis://unused", supervisor, tmp_path / "c.yaml")
    started = time.monotonic()
    try:
        assert serve._wait_for_api(stack, serve._StopRequested(), "127.0.0.1", port) == ("ready" if listens else 2)
        assert (time.monotonic() - started < 0.9) if listens else (time.monotonic() - started >= 0.9)
    finally:
        other.close()
        supervisor.stop()


@pytest.mark.parametrize("listens", [True, False], ids=["up-then-stopped", "stopped-first"])
def test_a_stop_during_the_wait_for_the_api_leaves_the_banner_out_only_if_it_never_listened(
        tmp_path: Path, listens: bool) -> None:
    """A stop that came right after the API was up (a script's, that saw it answer) left the banner
    out; one before it listens leaves it out (no banner of a stack that never was up)."""
    port = free_port()
    code = (f"import socket, time\ns = socket.create_server(('127.0.0.1', {port}))\nprint('up', flush=True)\n"
            "time.sleep(30)\n" if listens else "import time\nprint('up', flush=True)\ntime.sleep(30)\n")
    child = serve.Child(ChildSpec("api", ["api"]), process=subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True))
    supervisor = Supervisor([], tmp_path / "c.yaml")
    supervisor.children = [child]
    stop = serve._StopRequested()
    try:
        assert child.process is not None and child.process.stdout is not None
        assert child.process.stdout.readline() == "up\n"
        stop.signal = signal.SIGTERM
        waited = serve._wait_for_api(serve.Stack("redis://unused", supervisor, tmp_path / "c.yaml"), stop,
                                     "127.0.0.1", port)
        assert waited == ("ready" if listens else "stopped")
    finally:
        supervisor.stop()


def test_a_dying_childs_last_output_lines_are_logged_when_they_go_to_a_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The demo's children write to a temporary file of its own: "watcher exited with code 1;
    restarting" was all a user saw, the reason gone with the file."""
    monkeypatch.setattr(serve, "RESTART_DELAY_S", 60.0)
    with tempfile.TemporaryFile() as output:
        supervisor = Supervisor([ChildSpec("flaky", ["no-such-command"])], tmp_path / "c.yaml", output=output)
        supervisor.start()
        try:
            deadline = time.monotonic() + 60
            while not any("exited with code" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline
                supervisor.check()
                time.sleep(0.02)
        finally:
            supervisor.stop()
    [said] = [r.getMessage() for r in caplog.records if "the last lines the children wrote" in r.getMessage()]
    assert "no-such-command" in said  # (typer's usage error, as the child wrote it)


@pytest.mark.timeout(90)
def test_serve_on_a_port_in_use_says_so_before_starting_anything(tmp_path: Path) -> None:
    """It printed its banner as if up, restarted the API 5 times over ~17 s, then exited 1."""
    env = {k: v for k, v in os.environ.items() if k not in ENV_OVERRIDES}
    env.update(LITELLM_LOCAL_MODEL_COST_MAP="True", COMPACTION_DATA_DIR=str(tmp_path / "data"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-P", "-m", "compactor", "serve", "--workers", "1", "--port", str(port)],
                              env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"compactor: invalid configuration: api.port (from --port): cannot listen on 127.0.0.1:{port}: "
        "Address already in use; choose another with --port or COMPACTION_API_PORT"]
    assert not (tmp_path / "data" / serve.EMBEDDED_DIR_NAME).exists()  # no Redis was started


# -- the real thing ----------------------------------------------------------------------

@pytest.fixture
def served(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """``compactor serve`` on a fresh data dir, the embedded Redis, one worker. The data dir is
    given relative to the working directory the commands run in (``cwd``): a relative one had
    made the embedded Redis fail to start, and ``status`` miss its socket. That directory holds
    packages named as ours (an agent's own project): serve's children imported them and died."""
    for name in ("events", "worker", "producer", "compactor"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('the working directory\\'s {name}/')\n")
    config = tmp_path / "codingcode.yaml"
    config.write_text("context:\n  compactionModel: extractive\n")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ENV_OVERRIDES}
    env.update(LITELLM_LOCAL_MODEL_COST_MAP="True", COMPACTION_DATA_DIR="data")
    process = subprocess.Popen(  # (-P: as the console script, which does not put the directory on the path)
        [sys.executable, "-P", "-m", "compactor", "serve", "--config", str(config), "--workers", "1",
         "--port", str(port), "--log-level", "WARNING"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    info = {"process": process, "port": port, "env": env, "config": config, "cwd": tmp_path,
            "data": tmp_path / "data", "url": f"http://127.0.0.1:{port}"}
    try:
        yield info
    finally:
        if process.poll() is None:
            process.kill()
            for child in psutil.Process(process.pid).children(recursive=True):
                child.kill()
        process.communicate(timeout=30)


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def turn_events(n: int) -> list[dict[str, Any]]:
    words = " ".join(f"w{i}" for i in range(400))
    return [
        {"type": "user", "turnId": n, "content": f"step {n}"},
        {"type": "assistant", "turnId": n, "content": "running",
         "toolCalls": [{"id": f"c{n}", "name": "run_tests", "arguments": {}}]},
        {"type": "tool_result", "turnId": n, "toolCallId": f"c{n}", "toolName": "run_tests",
         "output": words},
        {"type": "turn_end", "turnId": n, "model": "gpt-4", "contextWindow": 1500},
    ]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_serve_runs_the_stack_on_embedded_redis_and_stops_cleanly(served: dict[str, Any]) -> None:
    process, url = served["process"], served["url"]
    wait_for(lambda: healthy(url) or process.poll() is not None, 90, "the API")
    assert process.poll() is None, process.communicate()[1]
    children = psutil.Process(process.pid).children(recursive=True)
    names = [" ".join(c.cmdline()) for c in children]
    assert any(" watch " in n for n in names) and any(" work " in n for n in names)
    assert any(" api " in n for n in names) and any("valkey-server" in n or "redis-server" in n
                                                     for n in names)

    for n in (1, 2, 3):
        response = httpx.post(f"{url}/api/sessions/s1/events",
                              json={"cwd": CWD, "events": turn_events(n)}, timeout=10)
        assert response.status_code == 202
    log = SessionLog(served["data"], CWD, "s1")
    wait_for(lambda: log.exists() and any(e["type"] == "summary" for e in log.read()), 60,
             "an LLM (extractive) summary in the log")

    status = subprocess.run(  # finds the embedded Redis through its socket: no REDIS_URL
        [sys.executable, "-P", "-m", "compactor", "status", "--json"], check=False, env=served["env"],
        capture_output=True, text=True, timeout=60, cwd=served["cwd"])
    assert status.returncode == 0, status.stderr
    assert [row["sessionId"] for row in json.loads(status.stdout)] == ["s1"]

    second = subprocess.run(
        [sys.executable, "-P", "-m", "compactor", "serve", "--port", str(free_port())],
        check=False, env=served["env"], capture_output=True, text=True, timeout=60, cwd=served["cwd"])
    assert second.returncode == 2 and "already runs" in second.stderr

    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0
    assert "stopped" in process.communicate()[1]
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert (served["data"] / ".redis" / "appendonlydir").is_dir()

    # its data dir's id lost (the embedded Redis recorded it): its own Redis, inside it, takes it
    # (the children were refused over and over, serve gave up; the record could not be reached)
    (served["data"] / ".compactor-id").unlink()
    port = free_port()
    again = subprocess.Popen(
        [sys.executable, "-P", "-m", "compactor", "serve", "--config", str(served["config"]), "--workers", "1",
         "--port", str(port), "--log-level", "WARNING"],
        env=served["env"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=served["cwd"])
    try:
        wait_for(lambda: healthy(f"http://127.0.0.1:{port}") or again.poll() is not None, 90, "the API again")
        response = httpx.post(f"http://127.0.0.1:{port}/api/sessions/s1/events",
                              json={"cwd": CWD, "events": turn_events(4)}, timeout=10)
        assert response.status_code == 202
        wait_for(lambda: any(e.get("turnId") == 4 for e in log.read()), 60, "turn 4 in the log")
        assert (served["data"] / ".compactor-id").read_text().strip()
    finally:
        again.send_signal(signal.SIGTERM)
        assert again.wait(timeout=60) == 0, again.communicate()[1]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_serve_restarts_a_killed_worker(served: dict[str, Any]) -> None:
    process, url = served["process"], served["url"]
    wait_for(lambda: healthy(url) or process.poll() is not None, 90, "the API")

    def worker_pids() -> list[int]:
        pids = []
        for child in psutil.Process(process.pid).children():
            try:
                if " work " in " ".join(child.cmdline()):
                    pids.append(child.pid)
            except psutil.Error:  # exited (a zombie until the supervisor reaps it)
                continue
        return pids

    (first,) = wait_for(worker_pids, 30, "the worker")
    os.kill(first, signal.SIGKILL)
    replacement = wait_for(lambda: [p for p in worker_pids() if p != first], 30, "a new worker")
    assert replacement and process.poll() is None
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=60) == 0


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_serve_with_json_logs_writes_only_json_lines(tmp_path: Path) -> None:
    """Under ``--log-format json`` the start and stop lines are records too: a log pipeline
    (``2>&1 | jq``, as OPERATIONS.md shows) stopped at the plain-text banner before."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ENV_OVERRIDES}
    env.update(LITELLM_LOCAL_MODEL_COST_MAP="True", COMPACTION_DATA_DIR=str(tmp_path / "data"))
    process = subprocess.Popen(
        [sys.executable, "-P", "-m", "compactor", "serve", "--workers", "1", "--port", str(port),
         "--log-format", "json"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: healthy(url) or process.poll() is not None, 90, "the API")
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=30)
    assert process.returncode == 0, err
    assert out == ""
    records = [json.loads(line) for line in err.splitlines()]  # every line is one JSON object
    said = [r["msg"] for r in records if r["logger"] == "compactor.serve"]
    assert any(m.startswith(f"API http://127.0.0.1:{port}, watcher, 1 worker(s)") for m in said)
    assert said[-1] == "stopped"


def test_a_killed_serves_private_dir_is_removed_by_the_next_one(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``kill -9`` of a serve left its private dir in the temp dir: the effective config, API token
    included. The next serve removes those of serves that are gone, and only those."""
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = tmp_path / f"{serve.private_dir_prefix(os.getpid()).replace(str(os.getpid()), str(dead.pid), 1)}abc"
    # in a container serve is pid 1 each time: a dir of this pid, of a process started at another time
    reused = tmp_path / f"{serve.PRIVATE_PREFIX}{os.getpid()}-12345-ghi"
    alive = tmp_path / f"{serve.private_dir_prefix()}def"
    earlier = tmp_path / f"{serve.PRIVATE_PREFIX}{os.getpid()}-jkl"  # an earlier version's name: by its pid
    other = tmp_path / "compactor-unrelated"
    for path in (gone, reused, alive, earlier, other):
        path.mkdir()
        (path / "codingcode.yaml").write_text("api: {token: secret}\n")
    assert sorted(serve.remove_stale_private_dirs(tmp_path)) == sorted([gone, reused])
    assert not gone.exists() and not reused.exists() and alive.exists() and earlier.exists() and other.exists()
    # a demo's data dir: a killed demo's stayed in the temp dir for good (its logs and AOF, megabytes)
    root = Path(tempfile.mkdtemp(prefix="sw-", dir="/tmp"))  # (a unix socket's path: 107 bytes at most)
    marks: list[int] = []
    try:
        monkeypatch.setattr(tempfile, "tempdir", str(root))
        (demo_gone, gone_mark), (demo_alive, alive_mark), (demo_served, served_mark) = (
            serve.temporary_demo_dir() for _ in range(3))
        marks += [alive_mark, served_mark]
        os.close(gone_mark)  # (its demo killed: the lock goes with it)
        (demo_served / ".redis").mkdir()
        listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listening.bind(str(demo_served / ".redis" / "redis.sock"))  # (its Redis not yet stopped by its keeper)
        listening.listen()
        os.close(served_mark)
        marks.remove(served_mark)
        named = root / "compactor-demo-2026-12-06"  # an operator's --data-dir, named so: no mark, kept
        named.mkdir()
        try:
            assert serve.remove_stale_private_dirs(root) == [demo_gone]
        finally:
            listening.close()
        assert not demo_gone.exists() and demo_alive.exists() and demo_served.exists() and named.exists()
    finally:
        for mark in marks:
            os.close(mark)
        shutil.rmtree(root)


def test_a_demo_starting_while_a_sweep_runs_keeps_its_data_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its mark was created, then locked: a sweep between the two found it free and removed the
    data dir of a demo just starting."""
    root = Path(tempfile.mkdtemp(prefix="sw-", dir="/tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    real_flock = serve.fcntl.flock

    def swept_first(fd: int, operation: int) -> None:
        monkeypatch.setattr(serve.fcntl, "flock", real_flock)
        serve.remove_stale_private_dirs(root)  # (another serve or demo starting at that instant)
        real_flock(fd, operation)

    monkeypatch.setattr(serve.fcntl, "flock", swept_first)
    try:
        path, mark = serve.temporary_demo_dir()
        try:
            assert path.is_dir() and (path / serve.DEMO_MARK).is_file()
            assert serve.remove_stale_private_dirs(root) == [] and path.is_dir()  # (held: the demo runs)
        finally:
            os.close(mark)
        assert serve.remove_stale_private_dirs(root) == [path] and not path.exists()
    finally:
        shutil.rmtree(root)


def _line_with(process: subprocess.Popen[str], text: str) -> str:
    """The first line of ``process``'s stderr holding ``text`` (what was read before it, on failure)."""
    assert process.stderr is not None
    seen = []
    for line in process.stderr:
        if text in line:
            return line
        seen.append(line)
    raise AssertionError(f"no line with {text!r}: {''.join(seen)[-3000:]}")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_serve_names_the_api_once_it_answers(tmp_path: Path) -> None:
    """The banner came ~2 s before the API accepted a connection: a script that waited for it
    and then connected was refused."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ENV_OVERRIDES}
    env.update(LITELLM_LOCAL_MODEL_COST_MAP="True", COMPACTION_DATA_DIR=str(tmp_path / "data"))
    process = subprocess.Popen([sys.executable, "-P", "-m", "compactor", "serve", "--workers", "1", "--port", str(port)],
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _line_with(process, f"API http://127.0.0.1:{port}")
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).status_code == 200  # at once, no retry
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=30)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_api_names_its_port_once_it_listens_and_exits_0_when_stopped(redis_url: str, tmp_path: Path,
                                                                     signum: int) -> None:
    """``API listening on`` came before uvicorn listened (a connection refused right after it);
    a SIGTERM ended the API by the signal (uvicorn re-raises it), where watch, work and serve
    exit 0; a SIGHUP killed it without its graceful stop."""
    env = {k: v for k, v in os.environ.items() if k not in ENV_OVERRIDES}
    env.update(LITELLM_LOCAL_MODEL_COST_MAP="True", COMPACTION_DATA_DIR=str(tmp_path / "data"))
    process = subprocess.Popen([sys.executable, "-P", "-m", "compactor", "api", "--port", "0", "--redis-url", redis_url],
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        line = _line_with(process, "API listening on http://127.0.0.1:")
        port = int(line.rsplit(":", 1)[1].split()[0])
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).status_code == 200  # at once, no retry
        process.send_signal(signum)
        assert process.wait(timeout=60) == 0
        _, stderr = process.communicate(timeout=30)
        assert "Traceback" not in stderr, stderr
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=30)


def test_a_stop_signal_during_a_held_teardown_comes_after_it() -> None:
    """A first Ctrl-C / SIGTERM to ``demo`` while its stack stopped raised in the middle of
    ``Supervisor.stop``: a child left running and the demo's keys deleted under it. The teardown
    holds the signals back and they come once it is done."""
    import os
    import signal as signals

    from compactor.serve import stop_signals_handled, stop_signals_held

    steps: list[str] = []

    def interrupt(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    other = threading.Event()  # (a process-directed signal may go to any thread: demo has several)
    threading.Thread(target=other.wait, daemon=True).start()
    with stop_signals_handled(interrupt):
        try:
            with stop_signals_held():
                os.kill(os.getpid(), signals.SIGTERM)
                time.sleep(0.05)
                steps.append("teardown done")
            steps.append("not reached")
        except KeyboardInterrupt:
            steps.append("interrupted after")
    other.set()
    assert steps == ["teardown done", "interrupted after"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_killed_serves_embedded_redis_is_shut_down_once_its_children_are_gone(tmp_path: Path) -> None:
    """``kill -9`` of serve: the API, watcher and workers exit on their own, but the embedded Redis
    (a session of its own) ran on for good, answering ``compactor health`` for a serve that was
    gone. Its keeper shuts it down once the children let go of it, the AOF written."""
    import redis

    port = free_port()
    data = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if k not in ENV_OVERRIDES}
    env.update(LITELLM_LOCAL_MODEL_COST_MAP="True", COMPACTION_DATA_DIR=str(data))
    process = subprocess.Popen([sys.executable, "-P", "-m", "compactor", "serve", "--workers", "1", "--port", str(port)],
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _line_with(process, f"API http://127.0.0.1:{port}")
        server = EmbeddedRedis(data / serve.EMBEDDED_DIR_NAME)
        client = redis.Redis.from_url(server.url)
        redis_pid = int(client.info("server")["process_id"])
        client.set("kept", "1")
        client.close()
        stack = psutil.Process(process.pid).children(recursive=True)
        process.kill()
        process.wait(timeout=30)
        gone, alive = psutil.wait_procs([psutil.Process(redis_pid), *stack], timeout=60)
        assert alive == [], [p.cmdline() for p in alive]
        assert not server.ping()
    finally:
        if process.poll() is None:
            process.kill()
        if process.stderr:
            process.stderr.close()
    with EmbeddedRedis(data / serve.EMBEDDED_DIR_NAME) as again:  # (shut down, not killed: the AOF kept it)
        assert redis.Redis.from_url(again.url).get("kept") == b"1"
