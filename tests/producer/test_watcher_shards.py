"""All live watchers read with one ``redis.shards``: one started with another count is refused,
and the sweep of streams past the count never takes a stream a live watcher leases."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis

from compactor.keys import Keys
from events.config import Settings
from producer.publisher import Publisher
from producer.watcher import Watcher
from compactor.shards import ShardCountMismatch, server_ms
from events.log import SessionLog
from producer.watcher.orphans import letter_orphans
from tests.producer.conftest import CWD, drain, fast_settings, log_lines, turn_end, user


def _on_high_shard(count: int = 1) -> list[str]:
    """Sessions hashing to a shard >= 4 under 8 shards."""
    return [f"s{i}" for i in range(1000) if Keys(shards=8).shard_of(f"s{i}") >= 4][:count]


@pytest.fixture
def eight(tmp_path: Path, redis_url: str) -> Settings:
    return fast_settings(tmp_path / "data", redis_url, shards=8)


@pytest.fixture
def four(tmp_path: Path, redis_url: str) -> Settings:
    return fast_settings(tmp_path / "data", redis_url, shards=4)


def test_a_watcher_with_fewer_shards_beside_a_live_one_is_refused_and_takes_nothing(
        r: redis.Redis, eight: Settings, four: Settings) -> None:
    """A watcher started with ``redis.shards: 4`` beside a live one with 8 swept streams 4..7 as
    left behind by a lowered count: it dead-lettered the entries the live watcher was reading and
    moved its group past the rest (tens of thousands of events in 20 s, never applied)."""
    live = Watcher(r, eight, name="w8")
    drain(live, r, eight)
    sid = _on_high_shard()[0]
    sent = Publisher(r, eight).publish(sid, CWD, [user(1), turn_end(1)])
    newcomer = Watcher(r, four, name="w4")
    with pytest.raises(ShardCountMismatch) as refused:
        newcomer.run_once()
    message = str(refused.value)
    assert message.startswith("redis.shards: is 4, but the watchers live on this Redis")
    assert "read 8 shards (recorded in compaction:shards)" in message
    assert not newcomer.leases.owned and not r.exists(Keys().dead)
    assert r.zcard(Keys().watchers) == 1  # (the refused one was not registered)
    drain(live, r, eight)
    assert [line["streamId"] for line in log_lines(eight, sid)] == sent
    assert r.get(Keys().shard_count) == b"8"


def test_a_changed_count_is_taken_once_no_watcher_with_the_old_one_lives(
        r: redis.Redis, eight: Settings, four: Settings, caplog: pytest.LogCaptureFixture) -> None:
    old = Watcher(r, eight, name="w8")
    drain(old, r, eight)
    old.close()  # (a graceful stop leaves the registry)
    with caplog.at_level(logging.WARNING, logger="producer.watcher.leases"):
        new = Watcher(r, four, name="w4")
        drain(new, r, four)
    assert r.get(Keys().shard_count) == b"4"
    assert "redis.shards changed from 8 to 4" in caplog.text
    caplog.clear()
    new.run_once()
    new._next_tick = 0.0
    new.run_once()
    assert "changed" not in caplog.text  # (said once, not at every heartbeat)


def test_a_paused_watcher_with_the_old_count_keeps_its_streams_and_stops_at_its_next_heartbeat(
        r: redis.Redis, eight: Settings, four: Settings) -> None:
    """A watcher silent past its heartbeat (paused) drops out of the registry, so a newcomer
    with another count is let in; the streams the paused one still leases are not swept under
    it, and when it wakes, it stops (its count is no longer the recorded one)."""
    eight = fast_settings(eight.data_dir, eight.redis.url, shards=8,  # (its leases outlast the test's steps)
                          watcher={"leaseMs": 30_000, "blockMs": 50, "claimIdleMs": 1000})
    old = Watcher(r, eight, name="w8")
    drain(old, r, eight)
    sid = _on_high_shard()[0]
    shard = Keys(shards=8).shard_of(sid)
    Publisher(r, eight).publish(sid, CWD, [user(1), turn_end(1)])
    r.zrem(Keys().watchers, old.id)  # (its heartbeat went silent: the registry forgot it)
    new = Watcher(r, four, name="w4")
    new.run_once()
    assert r.get(Keys().shard_count) == b"4"
    assert not r.exists(Keys().dead)  # the paused watcher's shards are its own while it leases them
    assert letter_orphans(r, Keys(shards=4), "sweeper") == 0
    old._next_tick = 0.0
    with pytest.raises(ShardCountMismatch):
        old.run_once()
    old.close()
    assert not r.exists(Keys().lease(shard))
    assert letter_orphans(r, Keys(shards=4), "sweeper") == 2  # its lease gone: the entries left are lettered
    assert not log_lines(eight, sid)


@pytest.mark.parametrize("command", ["watch", "api", "work"])
def test_compactor_watch_api_or_work_with_another_shard_count_exits_2_naming_both(
        r: redis.Redis, eight: Settings, tmp_path: Path, command: str) -> None:
    """The API's events would go to streams their sessions do not hash to under the watchers'
    count: every one dead-lettered (``wrong_shard``); a worker's wait for a forced job's ``after``
    entry looked at the wrong stream (none there: taken as applied at once)."""
    live = Watcher(r, eight, name="w8")
    drain(live, r, eight)
    stop = threading.Event()
    running = threading.Thread(target=live.run, args=(stop,))  # (heartbeating all along)
    running.start()
    try:
        config = tmp_path / "codingcode.yaml"
        config.write_text("redis:\n  shards: 4\nwatcher:\n  leaseMs: 1000\n")
        done = subprocess.run([sys.executable, "-m", "compactor", command, "--config", str(config),
                               "--redis-url", eight.redis.url, "--data-dir", str(eight.data_dir),
                               *{"api": ["--port", "0"], "work": ["--burst"]}.get(command, [])],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stderr
        assert "redis.shards: is 4, but the watchers live on this Redis (prefix 'compaction') read 8 shards" \
            in done.stderr
        assert r.get(Keys().shard_count) == b"8" and sorted(live.leases.owned) == list(range(8))
    finally:
        stop.set()
        running.join(10)


def test_health_of_the_watcher_fails_under_another_shard_count(
        r: redis.Redis, eight: Settings, tmp_path: Path) -> None:
    """``compactor health --watcher`` said ok with any lease held: under a configuration with
    another ``redis.shards`` than the watchers' it now says which two differ."""
    from typer.testing import CliRunner

    from compactor.cli import app

    live = Watcher(r, eight, name="w8")
    drain(live, r, eight)
    config = tmp_path / "codingcode.yaml"
    base = ["health", "--json", "--watcher", "--config", str(config), "--redis-url", eight.redis.url]
    config.write_text("redis:\n  shards: 8\n")
    assert CliRunner().invoke(app, base).exit_code == 0
    config.write_text("redis:\n  shards: 4\n")
    report = CliRunner().invoke(app, base)
    assert report.exit_code == 1
    assert json.loads(report.stdout)["checks"]["watcher"] == \
        "error: the watchers read 8 shards (compaction:shards); this configuration's redis.shards is 4"


def test_the_live_shard_count_is_only_that_of_live_watchers(r: redis.Redis, eight: Settings) -> None:
    from compactor.shards import live_shard_count

    assert live_shard_count(r, Keys(), 1000) is None
    watcher = Watcher(r, eight, name="w8")
    drain(watcher, r, eight)
    assert live_shard_count(r, Keys(), 1000) == 8
    watcher.close()  # (the count stays recorded; no watcher reads with it now)
    assert r.get(Keys().shard_count) == b"8" and live_shard_count(r, Keys(), 1000) is None


def test_the_api_refuses_events_while_the_live_watchers_read_another_count(
        r: redis.Redis, eight: Settings, four: Settings) -> None:
    """An API started while no watcher was live (any count goes then), left running through a
    change of the count: it answered 202 to events every one of which was dead-lettered."""
    from fastapi.testclient import TestClient

    from producer.api import create_app

    with TestClient(create_app(eight, redis=r)) as client:
        watcher = Watcher(r, four, name="w4")
        drain(watcher, r, four)
        response = client.post("/api/sessions/s1/events", json={"cwd": CWD, "events": [user(1)]})
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["code"] == "shard_count_mismatch"
        assert error["message"].startswith("not published: redis.shards: is 8, but the watchers live on this "
                                           "Redis (prefix 'compaction') read 4 shards")
        assert not any(r.exists(stream) and r.xlen(stream) for stream in Keys(shards=8).all_streams())
    with TestClient(create_app(four, redis=r)) as client:  # (the same count: published)
        assert client.post("/api/sessions/s1/events", json={"cwd": CWD, "events": [user(1)]}).status_code == 202


def test_a_watcher_silent_past_its_lease_still_holds_its_count(r: redis.Redis, eight: Settings,
                                                               four: Settings) -> None:
    """A watcher deep in a long round beats late: taken for dead after one lease (1 s here), it let
    a newcomer with another count in. Its count stays in force for 3 leases, at least 30 s."""
    live = Watcher(r, eight, name="w8")
    drain(live, r, eight)
    r.zadd(Keys().watchers, {live.id: server_ms(r) - 1_500})  # (its last beat: past its lease, within 30 s)
    with pytest.raises(ShardCountMismatch):
        Watcher(r, four, name="w4").run_once()


@pytest.mark.parametrize("beats_again", [False, True])
def test_a_new_count_waits_out_killed_watchers_of_the_old_one(
        r: redis.Redis, eight: Settings, four: Settings, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, beats_again: bool) -> None:
    """Watchers killed (no word left) keep their count in force for the window (30 s at least): a
    watcher started with a new count right after was refused, and serve gave up on its children.
    Watchers silent past 2 leases are waited out; one that beats again is live: refused."""
    from compactor import shards

    monkeypatch.setattr(shards, "COUNT_WINDOW_MIN_MS", 5_000)  # (5 s here)
    old = Watcher(r, eight, name="w8")
    drain(old, r, eight)
    r.zadd(Keys().watchers, {old.id: server_ms(r) - 2_500})  # killed 2.5 s ago
    for n in range(8):
        r.delete(Keys().lease(n))
    if beats_again:
        threading.Timer(0.2, old.leases.heartbeat).start()  # (it was only slow)
    new = Watcher(r, four, name="w4")
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="compactor.shards"):
        if beats_again:
            with pytest.raises(ShardCountMismatch):
                new.run_once()
        else:
            drain(new, r, four)
    assert re.search(r"watchers of another redis\.shards stopped beating [23] s ago: waiting up to [123] s for "
                     r"them to count as gone", caplog.text), caplog.text
    if not beats_again:
        assert time.monotonic() - began >= 0.4 and r.get(Keys().shard_count) == b"4"
        assert sorted(new.leases.owned) == [0, 1, 2, 3]


def test_a_long_round_of_held_sessions_renews_and_beats_between_sessions(r: redis.Redis, eight: Settings) -> None:
    """Sessions whose logs another process holds locked are held back after 0.5 s each: a round of
    them ran past the leases (the shards went to other watchers) and the registry's heartbeat."""
    watcher = Watcher(r, eight, name="w8")
    sessions = [f"s{i}" for i in range(6)]
    publisher = Publisher(r, eight)
    for sid in sessions:
        publisher.publish(sid, CWD, [user(1)])
    drain(watcher, r, eight)
    for sid in sessions:
        publisher.publish(sid, CWD, [turn_end(1)])
    logs = [SessionLog(eight.data_dir, CWD, sid) for sid in sessions]
    for log in logs:
        log.lock().__enter__()  # (another process's lock: this one's descriptor, not the watcher's)
    try:
        started_ms = int(r.zscore(Keys().watchers, watcher.id) or 0)
        began = time.monotonic()
        watcher.run_once()  # the round: 6 sessions held back, 0.5 s each
        assert time.monotonic() - began >= 2.5
        beat_ms = int(r.zscore(Keys().watchers, watcher.id) or 0)
        assert beat_ms - started_ms >= 2_000  # it beat during the round
        assert sorted(watcher.leases.owned) == list(range(8)) and all(map(watcher.leases.holds, range(8)))
    finally:
        for log in logs:
            log.lock().__exit__(None, None, None)
