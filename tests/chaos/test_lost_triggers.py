"""Triggers that die with their job: found by the Redis-restart and worker-kill chaos runs.

A compaction trigger is consumed when its job is enqueued. Three ways of ending a
job used to lose it without counting an LLM failure, so a session over its
threshold got no compaction until its next ``turn_end``: a Redis error while the
worker re-checked a coalesced trigger, a killed worker's job recovered by the
janitor, and an enqueuer killed between the claim and the RQ enqueue. Each test
reproduces one case deterministically (fixed in f9221fc; see docs/RELIABILITY.md).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis

from compactor import queue as compaction_queue
from compactor.keys import Keys
from compactor.queue import enqueue_compaction, pending_job_id
from events.config import Settings
from tests.worker.conftest import CWD, write_session
from worker.context import WorkerContext
from worker.jobs import finish

pytestmark = [pytest.mark.chaos]


def _over_llm_threshold(client: redis.Redis, settings: Settings, sid: str) -> None:
    write_session(client, settings, sid, 4, window=1000)  # ~4 x 130 tokens + 4 x 400 chars: far over 0.9 x 1000


class _RedisDropsOnce(redis.Redis):
    """A client whose first EVAL of the claim script fails as if Redis had just restarted."""

    dropped = False

    def eval(self, script: Any, numkeys: int, *keys_and_args: Any) -> Any:  # type: ignore[override]
        if script == compaction_queue._CLAIM and not self.dropped:
            type(self).dropped = True
            raise redis.ConnectionError("Connection reset by peer")
        return super().eval(script, numkeys, *keys_and_args)


def test_a_redis_error_while_finishing_a_job_keeps_the_coalesced_trigger(
    r: redis.Redis, settings: Settings, redis_url: str,
) -> None:
    """Invariant: a trigger coalesced while a job ran is enqueued (or still recorded) after the job
    ends, even when Redis drops the connection once while the worker re-checks it."""
    _over_llm_threshold(r, settings, "ft-1")
    first = enqueue_compaction(r, settings, "ft-1", CWD, "micro")
    assert first is not None
    assert enqueue_compaction(r, settings, "ft-1", CWD, "llm") is None  # coalesced
    flaky = _RedisDropsOnce.from_url(redis_url)
    context = WorkerContext.build(settings, flaky)
    finish(context, "ft-1", first)
    keys = Keys(settings.redis.prefix, settings.redis.shards)
    assert pending_job_id(r, settings, "ft-1") is not None or r.get(keys.retrigger("ft-1")) is not None


def test_an_abandoned_job_of_a_session_over_its_threshold_is_replaced(
    r: redis.Redis, settings: Settings,
) -> None:
    """Invariant: when the janitor recovers the job of a killed worker, a session still over its
    LLM threshold (no summary, no failure counted) gets a new job, not only at its next turn_end."""
    _over_llm_threshold(r, settings, "ab-1")
    abandoned = enqueue_compaction(r, settings, "ab-1", CWD, "llm")
    assert abandoned is not None
    context = WorkerContext.build(settings, r)
    finish(context, "ab-1", abandoned, abandoned=True)  # what run_janitor does for an abandoned job
    assert pending_job_id(r, settings, "ab-1") not in (None, abandoned)


def test_a_claim_left_by_a_killed_enqueuer_is_freed_by_the_janitor(r: redis.Redis, settings: Settings) -> None:
    """Invariant: a session never keeps a pending-job claim with no job behind it. A watcher or
    worker SIGKILLed between ``_claim`` and the RQ enqueue leaves such a claim; the janitor frees
    it (and re-checks the session) once the claim is older than the stale-claim grace period."""
    from worker.runner import run_janitor

    _over_llm_threshold(r, settings, "orphan-1")
    keys = Keys(settings.redis.prefix, settings.redis.shards)
    old_ns = time.time_ns() - int((compaction_queue.STALE_CLAIM_GRACE_S + 60) * 1e9)
    orphan = f"{old_ns:020d}-llm-orphan-1"
    # What the killed enqueuer left: the claim (made by the real script), no job; a minute ago.
    assert compaction_queue._claim(r, settings, "orphan-1", orphan, "llm")
    r.zadd(keys.claims, {"orphan-1": time.time() - compaction_queue.STALE_CLAIM_GRACE_S - 60})
    run_janitor(WorkerContext.build(settings, r))
    assert pending_job_id(r, settings, "orphan-1") != orphan
