"""Watchers as real processes: kill -9 mid-stream, splitting and taking over shards, Redis data loss."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
import yaml

from compactor.embedded import EmbeddedRedis
from compactor.keys import Keys
from events.config import Settings
from events.log import SessionLog
from producer.publisher import Publisher
from producer.watcher import Watcher
from tests.producer.conftest import (
    CWD,
    backlog,
    fast_settings,
    log_lines,
    turn_end,
    user,
)
from tests.support import wait_for

pytestmark = pytest.mark.slow

WATCHER_SCRIPT = (
    "import logging, sys\n"
    "logging.basicConfig(level=logging.INFO)\n"
    "from events.config import load_settings\n"
    "from producer.watcher import main\n"
    "main(load_settings(sys.argv[1]), name=sys.argv[2])\n"
)


def write_config(path: Path, settings: Settings) -> Path:
    path.write_text(yaml.safe_dump({
        "dataDir": str(settings.data_dir),
        "redis": {"url": settings.redis.url, "shards": settings.redis.shards},
        "watcher": {"leaseMs": settings.watcher.lease_ms, "blockMs": settings.watcher.block_ms,
                    "claimIdleMs": settings.watcher.claim_idle_ms, "batchSize": settings.watcher.batch_size},
    }))
    return path


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[[Settings, str], subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []

    def start(settings: Settings, name: str) -> subprocess.Popen[bytes]:
        config = write_config(tmp_path / f"{name}-{len(started)}.yaml", settings)
        env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
        with open(tmp_path / f"{name}-{len(started)}.log", "wb") as log:
            process = subprocess.Popen([sys.executable, "-c", WATCHER_SCRIPT, str(config), name],
                                       stdout=log, stderr=subprocess.STDOUT, env=env)
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait()



def lines_on_disk(settings: Settings, sessions: list[str]) -> int:
    total = 0
    for sid in sessions:
        path = SessionLog(settings.data_dir, CWD, sid).path
        total += path.read_bytes().count(b"\n") if path.exists() else 0
    return total


def holders(r: redis.Redis, settings: Settings) -> list[str]:
    keys = Keys(settings.redis.prefix, settings.redis.shards)
    values = r.mget([keys.lease(n) for n in range(settings.redis.shards)])
    return [v.decode().split(":")[0] if v else "" for v in values]


def publish_turns(publisher: Publisher, sessions: list[str], first: int, last: int) -> dict[str, list[str]]:
    ids: dict[str, list[str]] = {sid: [] for sid in sessions}
    for turn in range(first, last + 1):
        for sid in sessions:
            ids[sid] += publisher.publish(sid, CWD, [user(turn, f"{sid} {turn}"), turn_end(turn)])
    return ids


def test_kill_9_mid_stream_then_restart_applies_every_event_once_in_order(
    r: redis.Redis, tmp_path: Path, redis_url: str, spawn: Callable[[Settings, str], subprocess.Popen[bytes]]
) -> None:
    settings = fast_settings(tmp_path / "data", redis_url, shards=2, batch_size=8)
    sessions = [f"k{i}" for i in range(6)]
    published = publish_turns(Publisher(r, settings), sessions, 1, 400)
    total = sum(len(ids) for ids in published.values())
    first = spawn(settings, "w1")
    wait_for(lambda: lines_on_disk(settings, sessions) >= 300, 60, "the first watcher to start applying")
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert lines_on_disk(settings, sessions) < total, "killed too late to be mid-stream"
    spawn(settings, "w1")
    wait_for(lambda: backlog(r, settings) == 0, 90, "the restarted watcher to drain")
    for sid, ids in published.items():
        assert [line["streamId"] for line in log_lines(settings, sid)] == ids


def test_two_watchers_split_the_shards_and_one_takes_over_when_the_other_is_killed(
    r: redis.Redis, tmp_path: Path, redis_url: str, spawn: Callable[[Settings, str], subprocess.Popen[bytes]]
) -> None:
    settings = fast_settings(tmp_path / "data", redis_url)
    a, _ = spawn(settings, "a"), spawn(settings, "b")
    wait_for(lambda: sorted(holders(r, settings)) == ["a"] * 4 + ["b"] * 4, 60, "an even split")
    a.send_signal(signal.SIGKILL)
    a.wait()
    wait_for(lambda: holders(r, settings) == ["b"] * 8, 15, "b to take over a's shards")
    sessions = [f"t{i}" for i in range(16)]
    published = publish_turns(Publisher(r, settings), sessions, 1, 3)
    wait_for(lambda: backlog(r, settings) == 0 and lines_on_disk(settings, sessions) == 96, 30, "b to apply all")
    for sid, ids in published.items():
        assert [line["streamId"] for line in log_lines(settings, sid)] == ids


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_releases_the_leases_for_an_immediate_takeover(
    r: redis.Redis, tmp_path: Path, redis_url: str, spawn: Callable[[Settings, str], subprocess.Popen[bytes]],
    signum: int,
) -> None:
    """SIGTERM, and SIGHUP (a closed terminal: it killed the watcher outright, its leases held
    until they ran out) stop the watcher cleanly."""
    settings = fast_settings(tmp_path / "data", redis_url)
    a = spawn(settings, "a")
    wait_for(lambda: holders(r, settings) == ["a"] * 8, 60, "a to own every shard")
    a.send_signal(signum)
    assert a.wait(10) == 0
    assert holders(r, settings) == [""] * 8
    assert r.zcard(Keys().watchers) == 0


def test_a_watcher_started_under_nohup_keeps_running_through_a_hangup(
    r: redis.Redis, tmp_path: Path, redis_url: str
) -> None:
    """``nohup compactor watch &`` leaves SIGHUP ignored: taking it as a stop (as a closed terminal
    stops a watcher not under nohup) overrode that, and the watcher ended with the terminal."""
    settings = fast_settings(tmp_path / "data", redis_url)
    config = write_config(tmp_path / "nohup.yaml", settings)
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    with open(tmp_path / "nohup.log", "wb") as log:
        process = subprocess.Popen([sys.executable, "-c", WATCHER_SCRIPT, str(config), "n"], stdout=log,
                                   stderr=subprocess.STDOUT, env=env,
                                   preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    try:
        wait_for(lambda: holders(r, settings) == ["n"] * 8, 60, "the watcher to own every shard")
        process.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert process.poll() is None and holders(r, settings) == ["n"] * 8
        process.send_signal(signal.SIGTERM)
        assert process.wait(10) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_redis_restart_with_data_loss_recreates_groups_and_keeps_going(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis", persist=False).start()
    try:
        settings = fast_settings(tmp_path / "data", server.url)
        client = redis.Redis.from_url(server.url)
        publisher = Publisher(client, settings)
        stop = threading.Event()
        thread = threading.Thread(target=Watcher(client, settings, name="w").run, args=(stop,))
        thread.start()
        before = publish_turns(publisher, ["a1", "b2", "c3"], 1, 5)
        wait_for(lambda: lines_on_disk(settings, list(before)) == 30, 60, "the first events")
        server.kill()
        time.sleep(0.5)  # the watcher meets a dead server for a while
        server.start()
        after = publish_turns(publisher, ["a1", "b2", "c3"], 6, 8)
        wait_for(lambda: lines_on_disk(settings, list(before)) == 48, 30, "the events after the restart")
        stop.set()
        thread.join(10)
        assert not thread.is_alive()
        for sid in before:
            assert [line["streamId"] for line in log_lines(settings, sid)] == before[sid] + after[sid]
        stream = Keys().stream_for("a1")
        assert client.xinfo_groups(stream)[0]["pending"] == 0
        client.close()
    finally:
        server.stop()


def test_the_heap_is_frozen_after_the_heavy_imports() -> None:
    """``prepare_heap`` imports litellm and loads the tokenizer *before* freezing: afterwards
    the loop's warm-up imports nothing, and a full collection scans only a small heap
    (litellm's ~250 000 objects left unfrozen made each one take ~100 ms)."""
    code = (
        "import gc, sys\n"
        "from producer.watcher.core import prepare_heap, warm_up\n"
        "prepare_heap()\n"
        "modules = len(sys.modules)\n"
        "warm_up()\n"
        "print(len(sys.modules) - modules, len(gc.get_objects()), 'litellm' in sys.modules)\n"
    )
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         timeout=120).stdout.split()
    assert out[2] == "True"
    assert int(out[0]) == 0
    assert int(out[1]) < 20_000
