"""``compactor demo`` finishes in under a minute with micro and LLM (extractive) compactions."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from compactor.demo import Agent, DemoOptions, _agents, demo_settings
from compactor.llm_stub import STUB_MODEL, LLMStub
from events.config import ENV_OVERRIDES, Settings
from events.models import parse_event


def test_agent_turns_are_valid_events_that_end_with_turn_end() -> None:
    import random

    agent = Agent("demo-x-01", "/home/demo/projects/app-1", random.Random(1))
    batches = agent.turn(3, 8000)
    events = [e for batch in batches for e in batch]
    for event in [agent.meta(), *events]:
        parse_event(event)
    assert events[-1] == {"type": "turn_end", "turnId": 3, "model": "demo-agent",
                          "contextWindow": 8000}
    calls = {c["id"] for c in events[1]["toolCalls"]}
    assert calls == {e["toolCallId"] for e in events if e["type"] == "tool_result"}
    assert any(e.get("toolName") == "list_dir" for e in events)  # a non-compactable tool too


def test_each_demo_run_has_new_sessions_with_the_same_talk() -> None:
    """A second run on the same --data-dir must not find the first run's sessions (it
    reported their results and simulated nothing)."""
    first, second = _agents(DemoOptions(sessions=3)), _agents(DemoOptions(sessions=3))
    assert not {a.session_id for a in first} & {a.session_id for a in second}
    assert [a.turn(1, 8000) for a in first] == [a.turn(1, 8000) for a in second]


def test_demo_settings_use_extractive_and_a_private_prefix_on_shared_redis(
        settings: Settings, tmp_path: Path) -> None:
    demo = demo_settings(settings, tmp_path)
    assert demo.context.compaction_model == "extractive" and demo.data_dir == tmp_path
    assert demo.redis.prefix.startswith("compaction-demo")
    configured = settings.model_copy(update={"context": settings.context.model_copy(
        update={"compaction_model": "openai/gpt-4o-mini"})})
    assert demo_settings(configured, tmp_path).context.compaction_model == "openai/gpt-4o-mini"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_demo_with_defaults_finishes_under_a_minute_with_both_kinds(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ENV_OVERRIDES}
    env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "compactor", "demo", "--json"], check=False, cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=110)
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert elapsed < 60
    assert summary["sessions"] == DemoOptions().sessions
    assert summary["compactions"]["micro"] >= 1 and summary["compactions"]["llm"] >= 1
    assert summary["jobs"]["micro"] >= 1 and summary["jobs"]["llm"] >= 1
    assert summary["failedJobs"] == 0 and summary["tokensReleased"] > 0
    for row in summary["perSession"]:
        assert row["turns"] == DemoOptions().turns
        assert row["estimateAfter"] < row["estimateBefore"]
    assert not list(tmp_path.iterdir())  # nothing left in the working directory


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_demo_whose_jobs_failed_exits_1_naming_the_first_error(tmp_path: Path) -> None:
    """With every LLM job failing (a key the provider refuses) it printed 'failed jobs 2' among
    its numbers and exited 0, saying nothing of why."""
    config = tmp_path / "c.yaml"
    config.write_text(f"context:\n  compactionModel: {STUB_MODEL}\n  llmTimeoutSeconds: 5\n")
    env = {k: v for k, v in os.environ.items() if k not in ENV_OVERRIDES}
    with LLMStub(status=401) as stub:
        env.update(LITELLM_LOCAL_MODEL_COST_MAP="True", OPENAI_API_BASE=stub.base_url, OPENAI_API_KEY="sk-refused")
        done = subprocess.run([sys.executable, "-m", "compactor", "demo", "-s", "2", "-t", "30", "--json",
                               "--config", str(config)], check=False, cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=110)
    assert done.returncode == 1, done.stderr[-3000:]
    summary = json.loads(done.stdout)  # (still the numbers on stdout)
    assert summary["failedJobs"] >= 1 and summary["jobs"]["llm"] == 0
    last = done.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"compactor: {summary['failedJobs']} compaction job\(s\) failed; the first, "
                        r"\d{20}-llm-demo-\w+-\d\d: .*permanent LLM failure.*", last), last


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_demo_into_one_file_ends_the_live_numbers_before_the_table(redis_url: str,
                                                                   tmp_path: Path) -> None:
    """``compactor demo > f 2>&1`` (CI): the live view's last line ended without a newline, so
    the table's title was glued to it ("tokens released  146817830 sessions, ...")."""
    env = {k: v for k, v in os.environ.items() if k not in ENV_OVERRIDES}
    env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    with (tmp_path / "out").open("w") as out:
        done = subprocess.run([sys.executable, "-m", "compactor", "demo", "-s", "2", "-t", "3",
                               "--redis-url", redis_url], check=False, cwd=tmp_path, env=env,
                              stdout=out, stderr=subprocess.STDOUT, timeout=110)
    text = (tmp_path / "out").read_text()
    assert done.returncode == 0, text[-3000:]
    # said at its start (nothing was until the end, up to two minutes on a first run)
    assert text.startswith("compactor demo: 2 simulated sessions of 3 turns, "), text[:300]
    released = re.search(r"^failed jobs +\d+ +tokens released +(\d+) *$", text, re.M)
    assert released, text  # the live numbers' last line, ended
    assert re.search(rf"^ *2 sessions, \d+ events in .*; {released[1]} tokens released *$",
                     text, re.M | re.S), text  # the table's title, on a line of its own


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_demo_keeps_out_of_the_stacks_metrics_and_of_the_services_data_dir(redis_url: str,
                                                                         tmp_path: Path) -> None:
    """``docker compose exec api compactor demo`` (PROMETHEUS_MULTIPROC_DIR set, as in every
    container) added the demo's events, jobs and tokens to the stack's /metrics; and a
    COMPACTION_DATA_DIR the demo never uses, but the service could not (no such user's ~), refused it."""
    shared = tmp_path / "metrics"
    shared.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ENV_OVERRIDES}
    env.update(LITELLM_LOCAL_MODEL_COST_MAP="True", PROMETHEUS_MULTIPROC_DIR=str(shared),
               COMPACTION_DATA_DIR="~nosuchuser-compactor/data")
    done = subprocess.run([sys.executable, "-m", "compactor", "demo", "-s", "1", "-t", "4", "--json",
                           "--redis-url", redis_url], check=False, cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["sessions"] == 1
    assert list(shared.iterdir()) == []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_demo_under_another_rq_key_prefix_cleans_up_rqs_keys_too(redis_url: str, r: Any, tmp_path: Path) -> None:
    """With ``RQ_KEY_PREFIX`` set (keys.py's override), the clean-up's patterns still said ``rq:``:
    the demo's jobs, results, registries and queue index stayed on the shared Redis."""
    env = {k: v for k, v in os.environ.items() if k not in ENV_OVERRIDES}
    env.update(LITELLM_LOCAL_MODEL_COST_MAP="True", RQ_KEY_PREFIX="rqdemo")
    done = subprocess.run([sys.executable, "-m", "compactor", "demo", "-s", "1", "-t", "6", "--json",
                           "--redis-url", redis_url], check=False, cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr[-3000:]
    left = sorted(k.decode() for k in r.scan_iter(count=1000))
    assert any(k.startswith("rqdemo:") for k in left)  # (its workers' keys: RQ's to expire)
    assert not [k for k in left if "demo" in k and not k.startswith(("rqdemo:worker", "rqdemo:clean_groups"))], left
    assert not [m for m in r.smembers("rqdemo:queues") if b"compaction-demo" in m]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_demo_on_a_shared_redis_cleans_up_after_itself(settings: Settings, r: Any,
                                                       tmp_path: Path) -> None:
    from compactor.demo import run_demo

    r.set("unrelated", "kept")
    result = run_demo(settings, DemoOptions(sessions=2, turns=10, data_dir=tmp_path / "d"),
                      output=subprocess.DEVNULL)
    assert result["compactions"]["micro"] >= 1 and result["compactions"]["llm"] >= 1
    left = sorted(k.decode() for k in r.scan_iter(count=1000))
    assert "unrelated" in left
    assert not [k for k in left if "demo" in k and not k.startswith("rq:worker")], left
    assert not [m for m in r.smembers("rq:rl-keys") if b"demo" in m]  # (RQ's index of rate limits)
    assert (tmp_path / "d").is_dir()  # --data-dir given: the logs are kept


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("shared", "signum", "code"), [(False, signal.SIGTERM, 143), (True, signal.SIGHUP, 129)])
def test_a_stopped_demo_leaves_no_process_no_temp_dir_and_no_key(redis_url: str, r: Any, shared: bool,
                                                                 signum: int, code: int) -> None:
    """SIGTERM or SIGHUP killed the demo at once: its embedded Redis ran on, its temp dirs and its
    keys on a shared Redis stayed. Ctrl-C cleaned the keys up while a worker still ran a job,
    which wrote its keys after that."""
    tmp = Path(tempfile.mkdtemp(prefix="cd-", dir="/tmp"))  # short: the embedded Redis's socket is under it
    env = {k: v for k, v in os.environ.items() if k not in ENV_OVERRIDES}
    env.update(LITELLM_LOCAL_MODEL_COST_MAP="True", TMPDIR=str(tmp))
    command = [sys.executable, "-m", "compactor", "demo", "-s", "5", "-t", "200", "--json"]
    demo = subprocess.Popen(command + (["--redis-url", redis_url] if shared else []), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not any(r.scan_iter(match="rq:finished:compaction-demo*")) if shared else not _children_under(tmp):
            assert demo.poll() is None and time.monotonic() < deadline, demo.stderr.read() if demo.stderr else ""
            time.sleep(0.1)
        time.sleep(1.5)  # jobs running
    except BaseException:
        demo.kill()
        raise
    stderr = _stopped_leaving_nothing(demo, signum, code, tmp)
    assert "Traceback" not in stderr, stderr[-3000:]
    left = [k.decode() for k in r.scan_iter(count=1000)]
    assert not [k for k in left if "demo" in k and not k.startswith("rq:worker")], left
    tmp.rmdir()


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_a_stopped_bench_leaves_no_process_and_no_temp_dir(signum: int, code: int) -> None:
    """SIGTERM or SIGHUP killed ``bench`` at once: its embedded Redis ran on, its watcher process
    too (busy, for good), and its temp dirs stayed. It stops as Ctrl-C stops it."""
    tmp = Path(tempfile.mkdtemp(prefix="cb-", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if k not in ENV_OVERRIDES}
    env.update(LITELLM_LOCAL_MODEL_COST_MAP="True", TMPDIR=str(tmp))
    bench = subprocess.Popen([sys.executable, "-m", "compactor", "bench", "ingest", "--quick", "--json"], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not any("producer.watcher" in " ".join(p.info["cmdline"] or []) for p in _children_under(tmp)):
            assert bench.poll() is None and time.monotonic() < deadline, bench.stderr.read() if bench.stderr else ""
            time.sleep(0.1)
    except BaseException:
        bench.kill()
        raise
    _stopped_leaving_nothing(bench, signum, code, tmp)
    tmp.rmdir()


def _stopped_leaving_nothing(process: subprocess.Popen[str], signum: int, code: int, tmp: Path) -> str:
    """Send ``signum`` to ``process`` (a demo or bench with TMPDIR ``tmp``); check it exits ``code``
    and leaves no process and nothing under ``tmp``; its stderr."""
    try:
        process.send_signal(signum)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == code, stderr[-3000:]
    deadline = time.monotonic() + 10
    while _children_under(tmp) and time.monotonic() < deadline:  # (children exit on their own)
        time.sleep(0.1)
    assert not _children_under(tmp), [p.cmdline() for p in _children_under(tmp)]
    assert not list(tmp.iterdir()), list(tmp.iterdir())
    return stderr


def test_a_tmpdir_too_long_for_the_embedded_redis_socket_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """A TMPDIR of ~60 characters or more: the demo's embedded Redis failed at start, and the demo
    ended on a traceback holding the server's whole log."""
    long_dir = tmp_path / ("x" * 90)
    long_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ENV_OVERRIDES}
    env.update(LITELLM_LOCAL_MODEL_COST_MAP="True", TMPDIR=str(long_dir))
    done = subprocess.run([sys.executable, "-m", "compactor", "demo", "-s", "1", "-t", "1"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "TMPDIR: too long for the embedded Redis" in lines[0], done.stderr[-3000:]
    for scenario in ("ingest", "jobs"):  # the benchmarks likewise (they ended on the server's traceback)
        done = subprocess.run([sys.executable, "-m", "compactor", "bench", scenario, "--quick"], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr[-3000:]
        said = [line for line in done.stderr.splitlines() if line.startswith("compactor: ")]
        assert said and "TMPDIR: too long for the embedded Redis" in said[0], done.stderr[-3000:]
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert not list(long_dir.iterdir())


def _children_under(tmp: Path) -> list[Any]:
    """The live processes whose command line names ``tmp`` (the demo's Redis, watcher and workers)."""
    import psutil

    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        cmdline = process.info["cmdline"] or []
        if process.info["status"] != psutil.STATUS_ZOMBIE and any(str(tmp) in part for part in cmdline):
            found.append(process)
    return found


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_second_demo_on_the_same_data_dir_reports_its_own_jobs(settings: Settings, tmp_path: Path) -> None:
    """The embedded Redis kept under --data-dir keeps RQ's registries (a day; failed jobs a week):
    the second run counted the first run's jobs and released tokens with its own (about twice)."""
    from compactor.demo import run_demo

    embedded = settings.model_copy(update={"redis": settings.redis.model_copy(update={"url": ""})})
    options = DemoOptions(sessions=3, turns=8, data_dir=tmp_path / "d")
    first = run_demo(embedded, options, output=subprocess.DEVNULL)
    second = run_demo(embedded, options, output=subprocess.DEVNULL)
    jobs = [sum(run["jobs"].values()) for run in (first, second)]
    assert jobs[0] > 0 and jobs[1] < 1.6 * jobs[0], (first["jobs"], second["jobs"])
    assert second["tokensReleased"] < 1.6 * first["tokensReleased"], (first, second)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_demo_child_killed_mid_run_is_restarted_and_the_demo_finishes(settings: Settings, tmp_path: Path) -> None:
    """The demo never looked at its processes: a watcher killed mid-run left it waiting 30 s, then
    reporting all zeros and exiting 0. It restarts a child that died, as serve does."""
    import psutil

    from compactor.demo import run_demo

    embedded = settings.model_copy(update={"redis": settings.redis.model_copy(update={"url": ""})})
    killed: list[int] = []

    def kill_the_watcher() -> None:
        deadline = time.monotonic() + 60
        while not killed and time.monotonic() < deadline:
            for child in psutil.Process().children(recursive=True):
                if "watch" in child.cmdline():
                    time.sleep(2)  # mid-run
                    child.kill()
                    killed.append(child.pid)
                    return
            time.sleep(0.1)

    killer = threading.Thread(target=kill_the_watcher, daemon=True)
    killer.start()
    result = run_demo(embedded, DemoOptions(sessions=2, turns=12, data_dir=tmp_path / "d"), output=subprocess.DEVNULL)
    killer.join()
    assert killed
    assert all(row["turns"] == 12 for row in result["perSession"]), result["perSession"]
    assert result["compactions"]["micro"] + result["compactions"]["llm"] >= 1, result


def test_the_demo_waits_for_its_last_jobs_while_they_progress_and_no_longer_than_its_cap(
        r: Any, settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fixed 30 s settle ended a demo whose killed watcher a loaded machine took longer to bring
    back: every turn published, none compacted yet, zeros reported (the CI run of 2026-12-03)."""
    from compactor import demo
    from compactor.demo import JobStats, _wait

    def wait(moving_for: float, timeout: float) -> float:
        started = time.monotonic()
        progress = lambda: int(min(time.monotonic() - started, moving_for) * 10)  # noqa: E731
        _wait(lambda: False, r, settings, [], JobStats("none-"), started, None, timeout_s=timeout,
              keep_up=lambda: None, progress=progress)
        return time.monotonic() - started

    assert 1.5 + 0.5 <= wait(moving_for=1.5, timeout=0.5) < 1.5 + 0.5 + 1.0  # idle 0.5 s after the last move
    monkeypatch.setattr(demo, "SETTLE_CAP_S", 1.0)
    assert 1.0 <= wait(moving_for=60, timeout=0.5) < 2.0  # moving for good: the cap ends it


def test_the_demos_settle_wait_starts_once_a_watcher_and_a_worker_are_up(
        r: Any, settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a loaded machine a watcher took 58 s from its start to its first lease: the settle wait,
    30 s without a move, ran out first, and the demo reported zeros for every session, exit 0."""
    from compactor import demo
    from compactor.demo import JobStats, _not_ready, _ready, _wait
    from compactor.keys import Keys

    keys = Keys(settings.redis.prefix, settings.redis.shards)
    assert _not_ready(r, settings) == "no watcher holds a shard lease yet"
    started = time.monotonic()
    up = threading.Timer(1.5, lambda: r.set(keys.lease(0), "w", px=60_000))  # the watcher's first lease
    up.start()
    _wait(lambda: False, r, settings, [], JobStats("none-"), started, None, timeout_s=0.5, keep_up=lambda: None,
          progress=lambda: 0, ready=lambda: _ready(r, settings) or _not_ready(r, settings).startswith("no worker"))
    assert 1.5 + 0.25 <= time.monotonic() - started < 1.5 + 0.5 + 1.0  # idle 0.5 s once it was up (0.25 s polls)
    assert _not_ready(r, settings) == "no worker has started yet"
    monkeypatch.setattr(demo, "SETTLE_CAP_S", 1.0)
    r.delete(keys.lease(0))
    started = time.monotonic()
    _wait(lambda: False, r, settings, [], JobStats("none-"), started, None, timeout_s=0.5, keep_up=lambda: None,
          progress=lambda: 0, ready=lambda: _ready(r, settings))
    assert 1.0 <= time.monotonic() - started < 2.0  # never up: the cap ends it


def test_a_demo_that_applied_no_event_fails_saying_why(
        r: Any, settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """It reported zeros for every session and exited 0."""
    from compactor import demo
    from compactor.demo import DemoFailed, DemoOptions, _agents, _drive

    monkeypatch.setattr(demo, "SETTLE_TIMEOUT_S", 0.3)
    monkeypatch.setattr(demo, "SETTLE_CAP_S", 0.5)
    agents = _agents(DemoOptions(sessions=1, turns=1))
    with pytest.raises(DemoFailed, match=r"no event was applied within 0s \(no watcher holds a shard lease yet\)"):
        _drive(r, settings, agents, DemoOptions(sessions=1, turns=1), None, lambda: None)
