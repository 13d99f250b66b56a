"""docker-compose.yml: each service runs a real ``compactor`` command, and those commands,
run here as local processes against the test Redis, compact a session end to end."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer.main
import yaml

from compactor.cli import app
from events.config import ENV_OVERRIDES
from events.log import SessionLog
from tests.support import free_port, wait_for

ROOT = Path(__file__).resolve().parents[2]
CWD = "/home/dev/project"
COMPACTOR_SERVICES = ("watcher", "worker", "api")
PATH_VARIABLES = ("COMPACTION_DATA_DIR", "PROMETHEUS_MULTIPROC_DIR")  # container paths on volumes
MULTIPROC = "PROMETHEUS_MULTIPROC_DIR"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data


def parse_cli(argv: list[str]) -> Any:
    """Parse ``compactor ...`` argv with the real (click) command; raises on a bad option."""
    assert argv[0] == "compactor", argv
    group: Any = typer.main.get_command(app)
    command = group.commands[argv[1]]
    return command.make_context(argv[1], list(argv[2:]))


def test_parse_cli_rejects_a_bad_option() -> None:
    with pytest.raises(Exception, match="No such option"):
        parse_cli(["compactor", "api", "--bogus"])


def test_services_and_redis_with_aof_on_a_volume(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {"redis", *COMPACTOR_SERVICES, "dashboard"}
    redis_service = services["redis"]
    assert redis_service["image"].startswith("redis:")
    assert "--appendonly" in redis_service["command"]
    assert redis_service["command"][redis_service["command"].index("--appendonly") + 1] == "yes"
    assert any(v.endswith(":/data") for v in redis_service["volumes"])
    assert redis_service["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    assert set(compose["volumes"]) == {"sessions", "redis-data", "metrics"}


@pytest.mark.parametrize("name", COMPACTOR_SERVICES)
def test_service_command_and_healthcheck_are_valid_cli_invocations(compose: dict[str, Any],
                                                                   name: str) -> None:
    service = compose["services"][name]
    context = parse_cli(service["command"])
    assert context.command.name == {"watcher": "watch", "worker": "work", "api": "api"}[name]
    health = service["healthcheck"]["test"]
    assert health[0] == "CMD" and health[1:3] == ["compactor", "health"] and "--check" in health
    parse_cli(health[1:])
    assert "sessions:/data" in service["volumes"]
    env = service["environment"]
    assert env["REDIS_URL"] == "redis://redis:6379/0" and env["COMPACTION_DATA_DIR"] == "/data"
    for variable in ("COMPACTION_LOG_LEVEL", "COMPACTION_LOG_FORMAT"):  # (README: `COMPACTION_LOG_FORMAT=json
        assert env[variable].startswith(f"${{{variable}:-")             # docker compose up` had no effect)
    assert service["depends_on"]["redis"]["condition"] == "service_healthy"


def test_api_binds_all_interfaces_in_the_container_but_publishes_on_localhost(
        compose: dict[str, Any]) -> None:
    api = compose["services"]["api"]
    context = parse_cli(api["command"])
    assert context.params["host"] == "0.0.0.0" and context.params["port"] == "8080"
    assert api["ports"] == ["127.0.0.1:${COMPACTION_API_PORT:-8080}:8080"]


def test_worker_scales_and_dashboard_is_optional(compose: dict[str, Any]) -> None:
    worker = compose["services"]["worker"]
    assert "container_name" not in worker and "ports" not in worker  # --scale worker=N works
    assert int(parse_cli(worker["command"]).params["count"]) == 1
    dashboard = compose["services"]["dashboard"]
    assert dashboard["profiles"] == ["dashboard"]
    assert dashboard["environment"]["RQ_DASHBOARD_REDIS_URL"] == "redis://redis:6379/0"


def test_a_stopped_worker_is_given_time_to_end_its_llm_call(compose: dict[str, Any]) -> None:
    """60 s against the default 120 s LLM timeout: a stop during a long call SIGKILLed the worker,
    and its job ran again as abandoned."""
    from events.config import ContextSettings

    grace = compose["services"]["worker"]["stop_grace_period"]
    assert grace.endswith("s") and int(grace[:-1]) > ContextSettings().llm_timeout_seconds


def volume_at(service: dict[str, Any], container_path: str) -> tuple[str, str]:
    """The named volume of ``service`` that holds ``container_path``, and the path inside it."""
    for mount in service["volumes"]:
        volume, target = mount.split(":")[:2]
        if container_path == target or container_path.startswith(target.rstrip("/") + "/"):
            return volume, container_path[len(target):].lstrip("/")
    raise AssertionError(f"{container_path} is on no volume of {service['command']}")


def test_the_three_processes_write_their_metrics_to_one_shared_directory(
        compose: dict[str, Any]) -> None:
    """The API's /metrics and status page count the watcher's and the workers' counters only
    when all of them write to the same PROMETHEUS_MULTIPROC_DIR: one volume, mounted in each."""
    services = compose["services"]
    directories = {services[name]["environment"].get(MULTIPROC) for name in COMPACTOR_SERVICES}
    assert len(directories) == 1 and None not in directories, directories
    (directory,) = directories
    (volume,) = {volume_at(services[name], directory) for name in COMPACTOR_SERVICES}
    assert volume[0] in compose["volumes"]  # a named volume, shared by the containers
    options = compose["volumes"][volume[0]]["driver_opts"]
    assert options["type"] == "tmpfs"  # emptied when the stack stops, not by a process starting
    uid = re.search(r"useradd .*--uid (\d+)", (ROOT / "Dockerfile").read_text())
    assert uid and f"uid={uid[1]}" in options["o"].split(",")  # writable by the image's user


def test_the_generated_config_is_readable_by_the_images_user(compose: dict[str, Any]) -> None:
    """Compose >= 2.34 writes an inline config's file root:root 0440 unless told a mode (compose
    issues 12656, 12794): every compactor process, the image's uid 1000, exited 2 reading it, for
    good under ``restart: unless-stopped``."""
    [entry] = compose["x-compactor"]["configs"]
    assert entry["target"] == compose["x-compactor"]["environment"]["CODINGCODE_CONFIG"]
    assert entry.get("mode") is not None and entry["mode"] & 0o004, entry  # readable by others, uid 1000 too


def test_the_generated_config_is_valid(compose: dict[str, Any], tmp_path: Path) -> None:
    from events.config import load_settings

    content = compose["configs"]["codingcode"]["content"]
    rendered = content.replace("${COMPACTION_MODEL:-}", "extractive").replace(
        "${COMPACTION_FALLBACK_MODEL-extractive}", "extractive")
    path = tmp_path / "codingcode.yaml"
    path.write_text(rendered)
    settings = load_settings(path, environ={})
    assert settings.context.compaction_model == "extractive" and settings.context.fallback_model == "extractive"


def test_dockerfile_installs_the_console_script_and_runs_serve() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "pip install ." in text and '\nCMD ["compactor", "serve"]\n' in text
    for package in ("events", "producer", "worker", "compactor"):
        assert f"COPY {package} ./{package}" in text


def test_the_images_address_and_health_check_follow_the_api_settings(redis_url: str, tmp_path: Path) -> None:
    """``CMD serve --host 0.0.0.0`` overrode ``-e COMPACTION_API_HOST``, and the health check
    asked port 8080 whatever ``COMPACTION_API_PORT`` said; then it followed that variable but not
    a mounted config's ``api.port``: unhealthy for good."""
    import http.server
    import threading

    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^\s+COMPACTION_API_HOST=0\.0\.0\.0$", text, re.MULTILINE)
    check = re.search(r"^HEALTHCHECK [^\n]*\\\n\s+CMD (\[.+\])$", text, re.MULTILINE)
    assert check is not None
    argv = yaml.safe_load(check[1])
    assert argv == ["compactor", "health", "--check", "--api", "config"]

    class Healthz(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200 if self.path == "/healthz" else 404)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Healthz)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    config = tmp_path / "mounted.yaml"
    config.write_text(f"api: {{port: {port}}}\n")
    base = {k: v for k, v in os.environ.items() if k not in ENV_OVERRIDES}
    base.update(REDIS_URL=redis_url, LITELLM_LOCAL_MODEL_COST_MAP="True")
    try:
        for env, healthy in (({"CODINGCODE_CONFIG": str(config)}, True),  # a mounted config's port
                             ({"COMPACTION_API_PORT": str(port), "COMPACTION_API_HOST": "0.0.0.0"}, True),
                             ({"COMPACTION_API_PORT": str(free_port())}, False)):
            done = subprocess.run([sys.executable, "-m", "compactor", *argv[1:], "--json"], env={**base, **env},
                                  capture_output=True, text=True, timeout=60, check=False)
            assert (done.returncode == 0) == healthy, (env, done.stdout, done.stderr)
    finally:
        server.shutdown()


# -- the smoke test ----------------------------------------------------------------------


def local_argv(command: list[str], port: int) -> list[str]:
    """A compose command as a local process: this Python, localhost, a free port."""
    argv = [sys.executable, "-m", "compactor", *command[1:]]
    if "--host" in argv:
        argv[argv.index("--host") + 1] = "127.0.0.1"
    if "--port" in argv:
        argv[argv.index("--port") + 1] = str(port)
    return argv


def local_env(service: dict[str, Any], base: dict[str, str], volumes: Path) -> dict[str, str]:
    """A service's environment for a local process: its container paths under ``volumes``, one
    directory per named volume, so services that share a volume in compose share it here."""
    env = dict(base)
    for name in PATH_VARIABLES:
        if name in service["environment"]:
            volume, inside = volume_at(service, service["environment"][name])
            (volumes / volume).mkdir(parents=True, exist_ok=True)
            env[name] = str(volumes / volume / inside)
    return env


@pytest.fixture
def stack(compose: dict[str, Any], redis_url: str, tmp_path: Path) -> Iterator[dict[str, Any]]:
    config = tmp_path / "codingcode.yaml"
    config.write_text("context:\n  compactionModel: extractive\n")
    base = {k: v for k, v in os.environ.items() if k not in ENV_OVERRIDES and k != MULTIPROC}
    base.update(REDIS_URL=redis_url, CODINGCODE_CONFIG=str(config),
                LITELLM_LOCAL_MODEL_COST_MAP="True", COMPACTION_LOG_LEVEL="WARNING")
    volumes = tmp_path / "volumes"
    envs = {name: local_env(compose["services"][name], base, volumes) for name in COMPACTOR_SERVICES}
    port = free_port()
    processes = {name: subprocess.Popen(local_argv(compose["services"][name]["command"], port),
                                        env=envs[name], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True)
                 for name in COMPACTOR_SERVICES}
    try:
        yield {"envs": envs, "port": port, "processes": processes,
               "data": Path(envs["watcher"]["COMPACTION_DATA_DIR"])}
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in processes.values():
            try:
                process.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate()



def api_up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def turn(n: int, window: int) -> list[dict[str, Any]]:
    output = " ".join(f"line{i}" for i in range(300))
    return [
        {"type": "user", "turnId": n, "content": f"step {n}"},
        {"type": "assistant", "turnId": n, "content": "checking",
         "toolCalls": [{"id": f"c{n}", "name": "run_tests", "arguments": {"k": n}}]},
        {"type": "tool_result", "turnId": n, "toolCallId": f"c{n}", "toolName": "run_tests",
         "output": output},
        {"type": "turn_end", "turnId": n, "model": "gpt-4", "contextWindow": window},
    ]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_compose_commands_compact_a_session_end_to_end(compose: dict[str, Any],
                                                       stack: dict[str, Any]) -> None:
    url = f"http://127.0.0.1:{stack['port']}"
    wait_for(lambda: api_up(url) or any(p.poll() is not None for p in stack["processes"].values()),
             90, "the API")
    for name, process in stack["processes"].items():
        assert process.poll() is None, (name, process.communicate()[1])

    window = 2000
    for n in (1, 2, 3):
        response = httpx.post(f"{url}/api/sessions/e2e/events",
                              json={"cwd": CWD, "events": turn(n, window)}, timeout=10)
        assert response.status_code == 202, response.text
    log = SessionLog(stack["data"], CWD, "e2e")
    wait_for(lambda: log.exists() and any(e["type"] == "summary" for e in log.read()), 60,
             "a summary line in the log")
    summary = next(e for e in log.read() if e["type"] == "summary")
    assert summary["lastSummarizedTurnId"] >= 1 and summary["replaces"]

    session = httpx.get(f"{url}/api/sessions/e2e", params={"cwd": CWD}, timeout=10).json()
    assert session["lastCompaction"]["kind"] == "llm"
    assert session["promptEstimate"] < 0.9 * window

    def counters() -> dict[str, float]:  # the API's, with the watcher's and the worker's
        got: dict[str, float] = httpx.get(f"{url}/api/overview", timeout=10).json()["counters"]
        return got

    wait_for(lambda: counters()["jobsSucceeded"] >= 1, 30, "the worker's jobs in the API's counters")
    totals = counters()
    assert totals["eventsIngested"] >= 12 and totals["tokensReleased"] > 0, totals

    for name in COMPACTOR_SERVICES:  # the compose health checks, against the local stack
        health = compose["services"][name]["healthcheck"]["test"][1:]
        argv = [sys.executable, "-m", "compactor", *health[1:]]
        argv = [a.replace("http://127.0.0.1:8080", url) for a in argv]
        wait_for(lambda argv=argv, env=stack["envs"][name]:
                 subprocess.run(argv, check=False, env=env, timeout=60).returncode == 0,
                 60, f"{name} healthcheck")
    # the health checks run with the service's environment; they must not leave metric files
    # of their own, which the API would read on every scrape and which would pile up
    files = list(Path(stack["envs"]["api"][MULTIPROC]).glob("*.db"))
    writers = {f.stem.split("_")[-1].rsplit("-", 1)[-1] for f in files}  # {type}_[{host}-]{pid}
    assert writers <= {str(p.pid) for p in stack["processes"].values()}, sorted(files)
