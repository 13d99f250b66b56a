"""Soak: many concurrent agent sessions through the real stack (2 watchers, 4 workers, a flaky LLM).

Bounded form by default (200 sessions x 6 turns, ~5 000 events); set
COMPACTOR_CHAOS_SCALE=5 for the 1 000-session run of the issue.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import redis

from events.config import Settings
from tests.chaos.conftest import (
    FlakyStub,
    Publishing,
    Stack,
    assert_exactly_once_in_order,
    assert_never_stuck,
    read_lines,
    scaled,
    wait_quiet,
)
from tests.support import wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(600)]

WINDOW = 800  # ~2.5 turns' worth: sessions cross the micro, then the LLM threshold mid-run
TURNS = 6


def _leases_held(client: redis.Redis, settings: Settings) -> bool:
    values = client.mget([f"{settings.redis.prefix}:lease:{n}" for n in range(settings.redis.shards)])
    owners = {v.split(b":")[0] for v in values if v}
    return all(values) and len(owners) == 2


def test_soak_sessions_through_two_watchers_and_four_workers_lose_and_duplicate_nothing(
    r: redis.Redis, redis_url: str, flaky_stub: FlakyStub, make_stack: Callable[..., Stack],
) -> None:
    """Invariant: after N sessions x 6 turns published concurrently, with LLM latency and 5 % errors,
    every published event is in its log exactly once and in order, every log parses (no torn
    line), every session that crossed 0.9·W has a summary, a counted failure or an open breaker,
    and no session keeps a job claim whose job is gone or ended."""
    stack = make_stack(redis_url, flaky_stub)
    settings = stack.settings
    stack.watcher()
    stack.watcher()
    stack.workers(4)
    wait_for(lambda: _leases_held(r, settings), 90, "two watchers to split the shards")
    sessions = [f"soak-{i}" for i in range(scaled(200))]
    started = time.monotonic()
    with Publishing(r, settings, sessions, TURNS, WINDOW, pace_s=0.004) as agents:
        agents.join(300)
    wait_quiet(r, settings, 240)
    elapsed = time.monotonic() - started
    assert_exactly_once_in_order(settings, agents.published)
    assert_never_stuck(r, settings, sessions)
    summaries = sum(any(e["type"] == "summary" for e in read_lines(settings, s)) for s in sessions)
    compacts = sum(any(e["type"] == "compact" for e in read_lines(settings, s)) for s in sessions)
    assert summaries > len(sessions) // 2, f"only {summaries} sessions summarized"
    assert compacts > 0
    assert flaky_stub.errors > 0 or len(flaky_stub.requests) < 40  # the 5 % errors did happen
    watchers = "".join(p.read_text() for p in stack.directory.glob("watch-*.log"))
    assert "Traceback" not in watchers, watchers[-3000:]
    assert "finishing job failed" not in stack.output()
    print(f"soak: {len(sessions)} sessions, {sum(map(len, agents.published.values()))} events, "
          f"{len(flaky_stub.requests)} LLM calls ({flaky_stub.errors} failed), {summaries} summarized, "
          f"{compacts} micro-compacted, {elapsed:.1f}s")
