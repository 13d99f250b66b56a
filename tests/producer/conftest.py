"""Helpers for the producer tests: fast watcher settings, draining, reading logs."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import redis

from compactor.keys import Keys
from events.config import Settings
from events.log import SessionLog
from producer.watcher import Watcher

CWD = "/work/project"


def fast_settings(data_dir: Path, redis_url: str, **overrides: Any) -> Settings:
    """Short leases and blocks so takeovers happen within a second or two."""
    data: dict[str, Any] = {
        "dataDir": str(data_dir),
        "redis": {"url": redis_url, "shards": overrides.pop("shards", 8)},
        "watcher": {"leaseMs": 1000, "blockMs": 50, "claimIdleMs": 1000,
                    "batchSize": overrides.pop("batch_size", 256)},
    }
    data.update(overrides)
    return Settings.model_validate(data)


@pytest.fixture
def fast(tmp_path: Path, redis_url: str) -> Settings:
    return fast_settings(tmp_path / "data", redis_url)


def backlog(r: redis.Redis, settings: Settings) -> int:
    """Entries not yet delivered plus entries delivered but not acked, over all shards."""
    keys = Keys(settings.redis.prefix, settings.redis.shards)
    total = 0
    for stream in keys.all_streams():
        if not r.exists(stream):
            continue
        for group in r.xinfo_groups(stream):
            undelivered = r.xrange(stream, b"(" + group["last-delivered-id"], "+")
            total += int(group["pending"]) + len(undelivered)
    return total


def drain(watcher: Watcher, r: redis.Redis, settings: Settings, timeout_s: float = 20.0) -> None:
    """Run the watcher until every shard is read and acked."""
    deadline = time.monotonic() + timeout_s
    watcher.run_once()
    while backlog(r, settings) or not watcher.leases.owned:
        assert time.monotonic() < deadline, "watcher did not drain the streams"
        if not watcher.run_once():
            time.sleep(0.01)


def log_lines(settings: Settings, session_id: str, cwd: str = CWD) -> list[dict[str, Any]]:
    log = SessionLog(settings.data_dir, cwd, session_id)
    return log.read() if log.exists() else []


def sessions_on_shard(settings: Settings, shard: int, count: int) -> list[str]:
    """``count`` session ids whose events go to ``shard``."""
    keys = Keys(settings.redis.prefix, settings.redis.shards)
    found = [f"s{i}" for i in range(10_000) if keys.shard_of(f"s{i}") == shard]
    return found[:count]


def user(turn: int, content: str = "hello world") -> dict[str, Any]:
    return {"type": "user", "turnId": turn, "content": content}


def turn_end(turn: int, window: int | None = None, model: str = "gpt-4") -> dict[str, Any]:
    event: dict[str, Any] = {"type": "turn_end", "turnId": turn, "model": model}
    if window is not None:
        event["contextWindow"] = window
    return event


CHROMIUM_SETUP_TIMEOUT_S = 1200


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The browser tests may install chromium first (``test_status_page.chromium``: apt-get, minutes
    on a fresh machine), in the setup of whichever runs first: the 120 s limit of each test counts
    its setup, and cut the install short (every browser test then failed)."""
    for item in items:
        if "chromium" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.timeout(CHROMIUM_SETUP_TIMEOUT_S))
