"""worker.failures: the per-session LLM failure counter with its TTL."""

from __future__ import annotations

import redis

from compactor.keys import Keys
from events.config import Settings
from worker.failures import FailureCounter


def test_first_failure_sets_the_ttl_and_later_ones_keep_it(r: redis.Redis, settings: Settings) -> None:
    counter = FailureCounter(r, settings)
    assert counter.record_failure("s1") == 1
    key = Keys().failures("s1")
    assert 86_390 < r.ttl(key) <= 86_400
    r.expire(key, 100)
    assert counter.record_failure("s1") == 2
    assert r.ttl(key) <= 100


def test_a_counter_without_ttl_gets_one(r: redis.Redis, settings: Settings) -> None:
    key = Keys().failures("s1")
    r.set(key, 1)
    FailureCounter(r, settings).record_failure("s1")
    assert r.ttl(key) > 0


def test_breaker_opens_at_max_failures_and_reset_closes_it(r: redis.Redis, settings: Settings) -> None:
    counter = FailureCounter(r, settings)
    for expected in (False, False, True):
        counter.record_failure("s1")
        assert counter.is_open("s1") is expected
    counter.reset("s1")
    assert counter.count("s1") == 0 and not counter.is_open("s1")
    assert r.exists(Keys().failures("s1")) == 0


def test_a_failure_prunes_the_sessions_whose_counters_expired_from_the_failing_index(
        r: redis.Redis, settings: Settings) -> None:
    """Only a /metrics scrape or the status page pruned ``{p}:failing``: with neither, every session
    that ever failed stayed in it (2 000 sessions, 193 kB, for good)."""
    failing = Keys().failing
    counter = FailureCounter(r, settings)
    for i in range(50):
        counter.record_failure(f"old{i}")
    now, _ = r.time()
    r.zadd(failing, {f"old{i}": now - 1 for i in range(50)})  # as if their counters expired a second ago
    counter.record_failure("new")
    assert [m.decode() for m in r.zrange(failing, 0, -1)] == ["new"]
