"""A shard stream key holding another type (a stray key, a collision): only its shard stops.

One such key failed the read, the blocking wait and the start of every shard: no
entry was applied anywhere, and the watcher logged a bare WRONGTYPE every 5 s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from compactor.keys import Keys
from events.config import Settings
from producer.publisher import Publisher
from producer.watcher import Watcher
from producer.watcher.orphans import letter_orphans
from tests.producer.conftest import CWD, fast_settings, log_lines, sessions_on_shard, user

BAD = 3  # the shard whose key is turned into a string


def run_until(watcher: Watcher, done: Callable[[], bool], timeout_s: float = 20.0) -> None:
    """Run the watcher as ``run`` does (but raising any error) until ``done``."""
    watcher.run_once()  # (the first one loads the tokenizer and litellm: seconds on a loaded machine)
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "timed out"
        watcher.run_once(block_ms=watcher.settings.watcher.block_ms)


def run_for(watcher: Watcher, seconds: float) -> None:
    run_until(watcher, lambda end=time.monotonic() + seconds: time.monotonic() >= end, seconds + 20)


def applied(settings: Settings, session_id: str) -> list[str]:
    return [line["content"] for line in log_lines(settings, session_id) if line["type"] == "user"]


def errors_naming(caplog: pytest.LogCaptureFixture, key: str) -> list[str]:
    return [rec.getMessage() for rec in caplog.records
            if rec.levelno == logging.ERROR and rec.getMessage().startswith(f"{key} holds a string")]


def fix_and_publish(r: redis.Redis, settings: Settings, publisher: Publisher) -> str:
    """Delete the stray key and publish to its shard again; the session published."""
    r.delete(Keys(settings.redis.prefix, settings.redis.shards).stream(BAD))
    [session] = sessions_on_shard(settings, BAD, 1)
    publisher.publish(session, CWD, [user(1, "after the fix")])
    return session


def test_a_shard_key_of_another_type_at_start_stops_only_its_shard_until_deleted(
    r: redis.Redis, tmp_path: Path, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    settings = fast_settings(tmp_path / "data", redis_url)
    bad = Keys(settings.redis.prefix, settings.redis.shards).stream(BAD)
    r.set(bad, "x")
    publisher = Publisher(r, settings)
    [healthy] = sessions_on_shard(settings, 0, 1)
    publisher.publish(healthy, CWD, [user(1, "one")])
    watcher = Watcher(r, settings, name="w")
    with caplog.at_level(logging.WARNING, logger="producer.watcher.core"):
        run_until(watcher, lambda: applied(settings, healthy) == ["one"])
        run_for(watcher, 1.5)  # (ticks every lease / 3: each takes the shard again, none logs it again)
        assert [*watcher.leases.owned] and BAD in watcher.leases.owned  # (kept: another would fail the same)
        [error] = errors_naming(caplog, bad)
        assert f"rename or delete it; shard {BAD} is not read until then" in error
        fixed = fix_and_publish(r, settings, publisher)
        run_until(watcher, lambda: applied(settings, fixed) == ["after the fix"])
    assert any(f"shard {BAD} is read again" in rec.getMessage() for rec in caplog.records)
    watcher.close()


def test_a_shard_key_turned_another_type_while_running_stops_only_its_shard(
    r: redis.Redis, tmp_path: Path, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    settings = fast_settings(tmp_path / "data", redis_url)
    bad = Keys(settings.redis.prefix, settings.redis.shards).stream(BAD)
    publisher = Publisher(r, settings)
    [healthy] = sessions_on_shard(settings, 0, 1)
    [other] = sessions_on_shard(settings, BAD, 1)
    publisher.publish(healthy, CWD, [user(1, "first")])
    publisher.publish(other, CWD, [user(1, "before")])
    watcher = Watcher(r, settings, name="w")
    run_until(watcher, lambda: applied(settings, healthy) == ["first"] and applied(settings, other) == ["before"])
    run_for(watcher, 0.3)  # (every shard caught up: the loop blocks on all of them)
    r.delete(bad)
    r.set(bad, "x")
    publisher.publish(healthy, CWD, [user(1, "second")])
    with caplog.at_level(logging.WARNING, logger="producer.watcher.core"):
        run_until(watcher, lambda: applied(settings, healthy) == ["first", "second"])
        run_for(watcher, 1.5)
        assert len(errors_naming(caplog, bad)) == 1
        r.delete(bad)
        publisher.publish(other, CWD, [user(2, "after the fix")])
        run_until(watcher, lambda: applied(settings, other) == ["before", "after the fix"])
    watcher.close()


def test_an_orphan_sweep_skips_a_key_of_another_type_and_letters_the_other_streams(
    r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    keys = Keys(shards=4)
    r.set(keys.stream(5), "x")
    r.xadd(keys.stream(6), {"session": "s1", "cwd": CWD, "event": '{"type":"user","turnId":1,"content":"hi"}'})
    with caplog.at_level(logging.ERROR, logger="producer.watcher.orphans"):
        assert letter_orphans(r, keys, "sweeper") == 1
    assert r.xlen(keys.dead) == 1
    assert any(rec.getMessage().startswith(f"{keys.stream(5)} holds a string, not a stream")
               for rec in caplog.records)
