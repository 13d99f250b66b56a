"""Crashes: kill -9 of watchers, workers (mid-LLM-call, mid-append) and the API; Redis restarts
with and without AOF; a full file system while appending.

Builds on tests/producer/test_watcher_processes.py and tests/worker/test_crash.py
(one kill each, in isolation): here the kills repeat, land at random moments,
and hit the whole stack while agents keep publishing.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis

from compactor.embedded import EmbeddedRedis
from compactor.keys import Keys
from compactor.queue import enqueue_compaction
from compactor.store import SessionStore
from events.config import Settings
from events.log import SessionLog
from events.view import build_view
from tests.chaos.conftest import (
    CWD,
    FlakyStub,
    Publishing,
    Stack,
    agent_turn,
    assert_exactly_once_in_order,
    assert_never_stuck,
    backlog,
    read_lines,
    scaled,
    wait_quiet,
    worker_children,
)
from tests.support import free_port, wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(600)]

WINDOW = 800
JANITOR_RECOVERY_S = 90  # a killed worker's job is abandoned after ~20-30 s; generous on a busy machine


def _state_matches_log(client: redis.Redis, settings: Settings, sid: str) -> None:
    """The Redis state, brought up to date, says what a rebuild from the log says."""
    store = SessionStore(client, settings)
    log = store.log(sid, CWD)
    with log.lock():
        current = store.current(sid, CWD, log)
        rebuilt = store.rebuild(sid, CWD, log)
    from_view = build_view(log.read(), settings.context).prompt_estimate
    assert current.prompt_estimate == rebuilt.prompt_estimate == from_view
    assert current.log_size == rebuilt.log_size == log.size()


def test_kill_9_watchers_and_workers_at_random_moments_loses_nothing(
    r: redis.Redis, redis_url: str, make_stack: Callable[..., Stack],
) -> None:
    """Invariant: while agents publish, a watcher or a worker is SIGKILLed every 0.5-2.5 s (a worker
    usually mid-LLM-call: the LLM takes 0.2-0.8 s and the workers are kept busy); a killed watcher
    is restarted, a killed worker is replaced by its supervisor. Once quiet (no later turn_end
    needed: the janitor re-checks a killed job's session): every event is in its log exactly once
    and in order, no torn line, no dangling job claim, every session still over 0.9·W has a summary
    or a counted failure, and the Redis state of every session equals a rebuild from its log."""
    rng = random.Random(int(os.environ.get("COMPACTOR_CHAOS_SEED", "3")))
    with FlakyStub(error_rate=0.0, latency_s=(0.2, 0.8)) as stub:
        stack = make_stack(redis_url, stub)
        settings = stack.settings
        watchers = [stack.watcher(), stack.watcher()]
        supervisor = stack.workers(3)
        wait_for(lambda: len(worker_children(supervisor)) == 3 and r.exists(f"{settings.redis.prefix}:lease:0"),
                 90, "the stack to start")
        sessions = [f"storm-{i}" for i in range(scaled(40))]
        kills = {"watcher": 0, "worker": 0}
        started = time.monotonic()
        with Publishing(r, settings, sessions, 6, WINDOW, pace_s=0.01) as agents:
            for _ in range(scaled(6)):
                time.sleep(rng.uniform(0.5, 2.5))
                if rng.random() < 0.5:
                    victim = rng.randrange(2)
                    os.kill(watchers[victim].pid, signal.SIGKILL)
                    watchers[victim].wait()
                    watchers[victim] = stack.watcher()
                    kills["watcher"] += 1
                else:
                    children = worker_children(supervisor)
                    if children:
                        rng.choice(children).kill()
                        kills["worker"] += 1
            agents.join(300)
        wait_quiet(r, settings, JANITOR_RECOVERY_S + 120)
        recovered = time.monotonic() - started
        assert_exactly_once_in_order(settings, agents.published)
        assert_never_stuck(r, settings, sessions, history=False)
        for sid in sessions:
            _state_matches_log(r, settings, sid)
        print(f"storm: kills={kills} llm_calls={len(stub.requests)} quiet after {recovered:.0f}s, "
              f"done after {time.monotonic() - started:.0f}s")


def _lock_holders(lock_path: Path) -> set[int]:
    """Pids holding a flock on ``lock_path`` (from /proc/locks)."""
    try:
        inode = os.stat(lock_path).st_ino
    except FileNotFoundError:
        return set()
    holders = set()
    with open("/proc/locks") as f:
        for line in f:
            parts = line.split()
            if "->" in parts:  # a waiter, not a holder
                continue
            if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5].rsplit(":", 1)[-1] == str(inode):
                holders.add(int(parts[4]))
    return holders


def test_worker_killed_while_holding_the_log_lock_leaves_a_readable_log_and_a_consistent_state(
    r: redis.Redis, redis_url: str, make_stack: Callable[..., Stack],
) -> None:
    """Invariant: a worker SIGKILLed inside its locked read-fold-append section (caught holding the
    log's flock) leaves no torn line after the next append, the lock is free again (the kernel drops
    a dead process's flock), the state equals a rebuild from the log, and a forced compaction
    afterwards succeeds with exactly one more summary."""
    with FlakyStub(error_rate=0.0, latency_s=(0.0, 0.0)) as stub:
        stack = make_stack(redis_url, stub)
        settings = stack.settings
        sid = "locked-1"
        rng = random.Random(5)
        events = [e for t in range(1, 301) for e in agent_turn(rng, sid, t, 10_000_000)]
        SessionStore(r, settings).apply(sid, CWD, events)
        log = SessionLog(settings.data_dir, CWD, sid)
        supervisor = stack.workers(2)
        wait_for(lambda: len(r.keys("rq:worker:*")) >= 2, 90, "the workers to register")
        caught = _kill_inside_lock(r, settings, sid, log, supervisor)
        assert caught, "never caught the worker inside the lock"
        with log.lock():  # free: a SIGKILLed holder's flock is released by the kernel
            pass
        wait_for(lambda: len(worker_children(supervisor)) == 2, 30, "the supervisor to replace the worker")
        # new turns: the killed job may have appended its summary before it died (killed while
        # saving the state under the lock), which leaves the forced job below nothing new
        SessionStore(r, settings).apply(sid, CWD, [e for t in range(301, 304) for e in agent_turn(rng, sid, t, 10_000_000)])
        summaries_before = sum(e["type"] == "summary" for e in log.read())
        job = enqueue_compaction(r, settings, sid, CWD, "llm", forced=True)
        wait_for(lambda: (r.hget(f"rq:job:{job}", "status") or b"") in (b"finished", b"failed"),
                 JANITOR_RECOVERY_S, "the forced compaction after the kill")
        assert r.hget(f"rq:job:{job}", "status") == b"finished", stack.output()[-3000:]
        lines = read_lines(settings, sid)
        assert sum(e["type"] == "summary" for e in lines) == summaries_before + 1
        _state_matches_log(r, settings, sid)


def _kill_inside_lock(r: redis.Redis, settings: Settings, sid: str, log: SessionLog,
                      supervisor: subprocess.Popen[bytes], attempts: int = 40) -> bool:
    """Enqueue forced compactions and SIGKILL the worker the moment it holds the session's lock."""
    for _ in range(attempts):
        children = {c.pid for c in worker_children(supervisor)}
        if not children:
            time.sleep(0.2)
            continue
        enqueue_compaction(r, settings, sid, CWD, "llm", forced=True)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            holders = _lock_holders(log.path) & children
            if holders:
                os.kill(holders.pop(), signal.SIGKILL)
                return True
            time.sleep(0.0005)
    return False


def test_api_killed_mid_request_publishes_each_batch_all_or_nothing(
    r: redis.Redis, redis_url: str, make_stack: Callable[..., Stack],
) -> None:
    """Invariant: while a client posts event batches, the API process is SIGKILLed at random
    moments and restarted. Every batch answered 202 is in the log exactly once in order; a batch
    whose request died with the API is in the log entirely or not at all (one MULTI/EXEC), never
    twice; the watcher never dead-letters anything."""
    stack = make_stack(redis_url)
    settings = stack.settings
    stack.watcher()
    port = free_port()
    api = stack.api(port)
    base = f"http://127.0.0.1:{port}"
    wait_for(lambda: _answers(base), 90, "the API to start")
    batches: list[tuple[int, list[str], bool]] = []  # (turn, uuids, acknowledged)
    stop = threading.Event()

    def client() -> None:
        turn = 1
        with httpx.Client(base_url=base, timeout=5) as http:
            while not stop.is_set():
                events = agent_turn(random.Random(turn), "api-1", turn, 10_000_000)
                for event in events:
                    event["uuid"] = str(uuid.uuid4())
                try:
                    answer = http.post("/api/sessions/api-1/events", json={"cwd": CWD, "events": events})
                    ok = answer.status_code == 202
                except httpx.HTTPError:
                    ok = False
                batches.append((turn, [e["uuid"] for e in events], ok))
                if ok:
                    turn += 1
                else:
                    time.sleep(0.05)  # and retry the turn, as an agent would

    thread = threading.Thread(target=client)
    thread.start()
    try:
        for _ in range(scaled(4)):
            time.sleep(random.uniform(0.5, 1.5))
            os.kill(api.pid, signal.SIGKILL)
            api.wait()
            api = stack.api(port)
            wait_for(lambda: _answers(base), 90, "the API to restart")
        time.sleep(0.5)
    finally:
        stop.set()
        thread.join(30)
    wait_for(lambda: backlog(r, settings) == 0, 60, "the watcher to drain")
    logged = [e["uuid"] for e in read_lines(settings, "api-1")]
    assert len(logged) == len(set(logged)), "a batch was applied twice"
    position = {u: i for i, u in enumerate(logged)}
    dead = {json.loads(fields[b"event"])["uuid"]: fields[b"reason"].decode()
            for _, fields in r.xrange(Keys(settings.redis.prefix).dead)}
    for turn, uuids, acknowledged in batches:
        present = [u in position for u in uuids]
        assert all(present) or not any(present), f"turn {turn}: a batch was torn in half"
        if all(present):
            assert [position[u] for u in uuids] == sorted(position[u] for u in uuids)
        elif acknowledged:  # a retry of a turn whose first attempt landed although its request died
            assert all("goes backwards" in dead.get(u, "") for u in uuids), f"turn {turn}: acknowledged, then lost"
    for turn in {t for t, _, ok in batches if ok}:
        landed = [u for t, u, _ in batches if t == turn and u[0] in position]
        assert len(landed) == 1, f"turn {turn} is in the log {len(landed)} times"
    assert sum(ok for _, _, ok in batches) >= 3


def _answers(base: str) -> bool:
    try:
        return httpx.get(base + "/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[Callable[[bool], EmbeddedRedis]]:
    servers: list[EmbeddedRedis] = []

    def start(persist: bool) -> EmbeddedRedis:
        server = EmbeddedRedis(tmp_path / "own-redis", persist=persist).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.mark.parametrize("persist", [True, False], ids=["aof", "no-persistence"])
def test_redis_kill_9_and_restart_loses_no_logged_line_and_duplicates_nothing(
    persist: bool, own_redis: Callable[[bool], EmbeddedRedis], make_stack: Callable[..., Stack],
) -> None:
    """Invariant: Redis is SIGKILLed twice mid-stream and restarted (with AOF ``everysec`` at most
    the last second of writes is lost; without persistence all of Redis is). Each log is the
    published ids of its session in publication order, with no duplicate, minus only entries
    Redis lost before they were applied (with AOF: only ones published within ~1 s of a kill);
    every entry published after the last restart is applied; the watcher and workers reconnect
    on their own; no job claim dangles; each session's state (rebuilt when lost) equals a
    rebuild from its log."""
    server = own_redis(persist)
    with FlakyStub(error_rate=0.0, latency_s=(0.05, 0.2)) as stub:
        stack = make_stack(server.url, stub)
        settings = stack.settings
        client = redis.Redis.from_url(server.url)
        stack.watcher()
        stack.workers(2)
        wait_for(lambda: client.exists(f"{settings.redis.prefix}:lease:0") == 1, 90, "the watcher")
        sessions = [f"rr-{i}" for i in range(scaled(30))]
        with Publishing(client, settings, sessions, 8, WINDOW, pace_s=0.01) as agents:
            for _ in range(2):
                time.sleep(1.5)
                server.kill()
                time.sleep(0.5)
                server.start()
            after_restart = {sid: len(ids) for sid, ids in agents.published.items()}
            agents.join(300)
        wait_quiet(client, settings, 180)
        if not persist:  # a job Redis forgot with everything else is re-raised by the next turn_end
            agents.one_more_turn()
            wait_quiet(client, settings, 120)
        lost = 0
        for sid, ids in agents.published.items():
            logged = [e["streamId"] for e in read_lines(settings, sid) if "streamId" in e]
            assert len(logged) == len(set(logged)), f"{sid}: a line was applied twice"
            assert logged == [i for i in ids if i in set(logged)], f"{sid}: out of order or unknown ids"
            assert set(ids[after_restart[sid]:]) <= set(logged), f"{sid}: lost an entry published after the restart"
            lost += len(ids) - len(logged)
        assert_never_stuck(client, settings, sessions, history=False)
        for sid in sessions:
            _state_matches_log(client, settings, sid)
        client.close()
        print(f"redis restarts persist={persist}: {lost} entries lost with Redis before being applied")


FILLER = "filler.bin"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 512 KiB tmpfs. Mounting needs root (CI and these machines run as root); without it the
    test fails, saying so, rather than passing without having filled a disk."""
    mount_point = tmp_path / "small-disk"
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount_point)],
                          capture_output=True)
    if done.returncode != 0:
        pytest.fail(f"the disk-full test needs to mount a tmpfs (root): "
                    f"{done.stderr.decode(errors='replace').strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_disk_full_while_appending_is_a_clear_error_with_no_torn_line_and_recovers(
    r: redis.Redis, redis_url: str, small_disk: Path, make_stack: Callable[..., Stack],
) -> None:
    """Invariant: when the data dir's file system fills up mid-stream, the watcher logs a clear
    error naming the session and ENOSPC, keeps running, leaves every log ending in a complete line
    (a failed append is truncated back) and acks nothing it did not write; once space returns,
    every event lands exactly once and in order, without a restart."""
    data_dir = small_disk / "data"
    stack = make_stack(redis_url, data_dir=data_dir)
    settings = stack.settings
    watcher = stack.watcher()
    wait_for(lambda: r.exists(f"{settings.redis.prefix}:lease:0") == 1, 90, "the watcher")
    filler = small_disk / FILLER
    free = shutil.disk_usage(small_disk).free
    filler.write_bytes(b"\0" * max(0, free - 96 * 1024))  # leave ~96 KiB: a few dozen turns
    sessions = [f"full-{i}" for i in range(4)]
    with Publishing(r, settings, sessions, 30, 10_000_000, pace_s=0.005) as agents:
        agents.join(120)
    wait_for(lambda: "No space left on device" in stack.output(), 60, "the ENOSPC error in the watcher log")
    time.sleep(1.5)  # a few held-back retries against the full disk
    assert watcher.poll() is None, "the watcher died on a full disk"
    assert backlog(r, settings) > 0, "entries were acked although their append failed"
    for sid in sessions:
        read_lines(settings, sid)  # every log ends with a complete line and parses
    output = stack.output()
    error_lines = [line for line in output.splitlines() if "append failed" in line]
    assert error_lines and all("session=full-" in line for line in error_lines), output[-2000:]
    filler.unlink()
    wait_for(lambda: backlog(r, settings) == 0, 60, "the held-back sessions to resume")
    assert watcher.poll() is None
    assert_exactly_once_in_order(settings, agents.published)
    torn = list(data_dir.rglob("*.torn"))
    assert torn == [], f"torn fragments were left: {torn}"
