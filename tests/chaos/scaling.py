"""How the watcher's per-event cost grows with the number of sessions and with session length.

Not a test: a bounded measurement for docs/BENCHMARKS.md, run by hand:

    python -m tests.chaos.scaling            # 10, 100, 1 000, 10 000 sessions; 50, 500, 5 000 events per session
    python -m tests.chaos.scaling --json

Each point publishes 2 KB events (the turns of ``compactor.bench.ingest``: user,
assistant with a tool call, its result, an answer, turn_end; no threshold is ever
crossed) to a fresh key prefix on an embedded Redis, then times ``Watcher.run_once``
in this process until every event is applied (GC paused, as the bench does). Also
reported: Redis memory per session (``MEMORY USAGE`` of its state hash, its share of
the activity zset).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import redis  # noqa: E402

from compactor.bench.ingest import NO_TRIGGER_WINDOW, _drain_timed, _publish, _settings, _timed  # noqa: E402
from compactor.embedded import EmbeddedRedis  # noqa: E402
from events.config import Settings  # noqa: E402
from producer.watcher import Watcher  # noqa: E402

SESSION_COUNTS = (10, 100, 1_000, 10_000)
SESSION_LENGTHS = (50, 500, 5_000)
MIN_EVENTS = 10_000
EVENTS_PER_TURN = 5


def per_session_count(client: redis.Redis, tmp: str, url: str, sessions: int) -> dict[str, Any]:
    """Per-event apply time with ``sessions`` sessions interleaved round-robin."""
    settings = _settings(tmp, url, f"n{sessions}")
    total = max(MIN_EVENTS, sessions * EVENTS_PER_TURN)
    watcher = Watcher(client, settings, name="scaling")
    watcher.run_once()
    published = _publish(client, settings, [f"s{i}" for i in range(sessions)], total, NO_TRIGGER_WINDOW)
    done = 0
    with _timed() as elapsed:
        while done < published:
            done += watcher.run_once()
    seconds = elapsed()
    watcher.close()
    return {"sessions": sessions, "events": published, "us_per_event": round(seconds / published * 1e6, 1),
            "events_per_s": round(published / seconds),
            "redis_bytes_per_session": _state_bytes(client, settings, sessions)}


def _state_bytes(client: redis.Redis, settings: Settings, sessions: int) -> int:
    """MEMORY USAGE of a session's state hash (mean of up to 100) plus its share of the activity zset."""
    sample = [f"s{i}" for i in range(0, sessions, max(1, sessions // 100))]
    hashes = [int(client.memory_usage(f"{settings.redis.prefix}:session:{sid}") or 0) for sid in sample]
    zset = int(client.memory_usage(f"{settings.redis.prefix}:sessions") or 0)
    return round(sum(hashes) / len(hashes) + zset / sessions)


def per_session_length(client: redis.Redis, tmp: str, url: str, length: int) -> dict[str, Any]:
    """Per-event apply time when every session is ``length`` events long (10 000 events in all)."""
    settings = _settings(tmp, url, f"len{length}")
    watcher = Watcher(client, settings, name="scaling")
    watcher.run_once()
    count = max(1, MIN_EVENTS // length)
    seconds = _drain_timed(client, watcher, settings, [f"l{i}" for i in range(count)], count * length,
                           per_session=length)
    watcher.close()
    return {"events_per_session": length, "sessions": count, "us_per_event": round(seconds * 1e6, 1)}


def run() -> dict[str, list[dict[str, Any]]]:
    results: dict[str, list[dict[str, Any]]] = {"session_count": [], "session_length": []}
    with tempfile.TemporaryDirectory(prefix="compactor-scaling-") as tmp, \
            EmbeddedRedis(Path(tmp) / "redis", persist=False) as server:
        client = redis.Redis.from_url(server.url)
        for n in SESSION_COUNTS:
            started = time.monotonic()
            results["session_count"].append(per_session_count(client, tmp, server.url, n))
            print(f"  {n} sessions: {results['session_count'][-1]} ({time.monotonic() - started:.0f}s)", flush=True)
        for length in SESSION_LENGTHS:
            results["session_length"].append(per_session_length(client, tmp, server.url, length))
            print(f"  {length} events/session: {results['session_length'][-1]}", flush=True)
        client.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    results = run()
    if parser.parse_args().json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
