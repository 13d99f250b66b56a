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
