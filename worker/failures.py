"""The LLM failure counter per session: the breaker of SPEC §5.

``{p}:failures:{sessionId}`` counts consecutive failed LLM compactions. A
failure increments it and gives it a TTL of ``failureTtlSeconds`` only when it
has none (one Lua call, so the TTL runs from the *first* failure and a crash
can never leave a counter without one). A success deletes it. At
``maxFailures`` or more the breaker is open: the watcher enqueues no automatic
LLM job until the key expires. Forced jobs ignore the breaker.
"""

from __future__ import annotations

import logging

import redis

from compactor import metrics
from compactor.keys import Keys
from events.config import Settings

logger = logging.getLogger(__name__)

# KEYS: counter, failing index; ARGV: ttl seconds, session id. Returns the new count. The index
# ({p}:failing) keeps the session until its counter expires, for the breaker gauges; the sessions
# whose counters expired are pruned here too (only a /metrics scrape or the status page pruned
# them: unscraped, the index kept every session that ever failed).
_RECORD_FAILURE = """
local n = redis.call('INCR', KEYS[1])
if redis.call('TTL', KEYS[1]) < 0 then redis.call('EXPIRE', KEYS[1], ARGV[1]) end
local now = redis.call('TIME')
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. now[1])
redis.call('ZADD', KEYS[2], tonumber(now[1]) + redis.call('TTL', KEYS[1]), ARGV[2])
return n
"""


class FailureCounter:
    """Counts a session's consecutive LLM failures under a TTL."""

    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        self.redis = client
        self.keys = Keys(settings.redis.prefix, settings.redis.shards)
        self.max_failures = settings.context.max_failures
        self.ttl_s = settings.context.failure_ttl_seconds

    def record_failure(self, session_id: str, *, job_id: str | None = None, outcome: str | None = None) -> int:
        """Count one failure (of job ``job_id``, whose outcome it is: ``llm_transient``,
        ``llm_permanent`` or ``summary_invalid``); the count now."""
        count = int(self.redis.eval(_RECORD_FAILURE, 2, self.keys.failures(session_id), self.keys.failing,
                                    self.ttl_s, session_id))
        if count == self.max_failures:
            metrics.BREAKER_OPENS.inc()
        logger.info("llm failure counted session=%s failures=%d", session_id, count,
                    extra={"session_id": session_id, "job_id": job_id, "kind": "llm", "outcome": outcome,
                           "failures": count})
        return count

    def reset(self, session_id: str, pipeline: redis.client.Pipeline | None = None) -> None:
        """Forget the failures after a success."""
        pipe = pipeline if pipeline is not None else self.redis.pipeline(transaction=False)
        # (out of the index first: a failure counted in between is indexed again by it; the other
        # way round, it was counted and left out of the breaker gauges)
        pipe.zrem(self.keys.failing, session_id)
        pipe.delete(self.keys.failures(session_id))
        if pipeline is None:
            pipe.execute()

    def count(self, session_id: str) -> int:
        """The consecutive failures counted (0 when none or expired)."""
        value = self.redis.get(self.keys.failures(session_id))
        return int(value) if value else 0

    def is_open(self, session_id: str) -> bool:
        """Whether the breaker stops automatic LLM jobs for the session."""
        return self.count(session_id) >= self.max_failures
