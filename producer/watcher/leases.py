"""Shard leases and the registry of live watchers.

Invariants:
- A shard has at most one owner at a time: ``{p}:lease:{n}`` holds the owner's
  id with a PX expiry. Ids are unique per process (the watcher's name plus a
  random token), so a restarted or duplicated name never inherits a lease.
  Only the holder renews or releases it (compare-and-set in Lua).
- The holder trusts a lease until ``request start + lease_ms * VALIDITY_FRACTION``
  on its own monotonic clock, so it stops writing before Redis can hand the
  shard to anyone else, even with some clock drift. ``check`` is the guard run
  right before every log write; it renews early instead of failing when the
  lease is merely old.
- Every acquisition bumps the fencing counter ``{p}:fence:{n}``; the token is
  logged with the acquisition so an operator can order owners of a shard.
- Watchers heartbeat into the ``{p}:watchers`` zset, scored by the Redis
  server's clock (no skew between hosts). With ``live`` watchers, one takes at
  most ``ceil(shards / live)`` shards: it releases its excess between batches
  and takes free shards, including a dead watcher's once its lease expired.
- All live watchers read with one ``redis.shards``: each heartbeat records its
  count in ``{p}:shards``, and a watcher whose count differs from the recorded
  one while another watcher beat within ``count_window_ms`` (3 leases, at least
  30 s: a watcher deep in a long round beats late) is refused
  (``ShardCountMismatch``): a
  watcher with 4 shards beside one with 8 swept streams 4..7 as left behind by
  a lowered count, dead-lettering the entries the other was reading, and the
  quotas (``ceil(shards / live)``) of the two left shards unread. With no other
  watcher live the new count is recorded: the operator changed it.
"""

from __future__ import annotations

import logging
import math
import time
import zlib
from dataclasses import dataclass

import redis

from compactor.keys import Keys
from compactor.shards import ShardCountMismatch, count_window_ms
from events.errors import CompactorError

logger = logging.getLogger(__name__)

VALIDITY_FRACTION = 0.8  # of lease_ms: how long the holder trusts a lease after a renewal
RENEW_FRACTION = 1 / 3  # renew once this fraction of lease_ms has passed

# KEYS: lease, fence; ARGV: owner, lease_ms. The new fencing token, or 0 when taken.
_ACQUIRE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return redis.call('INCR', KEYS[2])
end
return 0
"""

# KEYS: lease; ARGV: owner, lease_ms. 1 when renewed, 0 when the lease is not ours.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

# KEYS: lease; ARGV: owner. Deletes the lease only when it is ours.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS: registry, shard count; ARGV: member, ttl_ms, shards, keep_ms. Forget the watchers silent for
# keep_ms; then, when the recorded shard count differs and another watcher beat within keep_ms:
# {-1, recorded}, nothing written; else heartbeat, record the count and {live (a beat within ttl_ms),
# previous count or 0 when unchanged}.
_HEARTBEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[4]))
local recorded = redis.call('GET', KEYS[2])
if recorded and recorded ~= ARGV[3] then
  local others = redis.call('ZCARD', KEYS[1])
  if redis.call('ZSCORE', KEYS[1], ARGV[1]) then others = others - 1 end
  if others > 0 then return {-1, tonumber(recorded) or 0} end
end
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('SET', KEYS[2], ARGV[3])
local previous = 0
if recorded and recorded ~= ARGV[3] then previous = tonumber(recorded) or -1 end
return {redis.call('ZCOUNT', KEYS[1], now - tonumber(ARGV[2]), '+inf'), previous}
"""


class LeaseLost(CompactorError):
    """This watcher no longer owns the shard; the batch in hand must not be written or acked."""

    def __init__(self, shard: int) -> None:
        self.shard = shard
        super().__init__(f"lease of shard {shard} lost")


@dataclass
class Lease:
    """A held lease: its fencing token and until when (monotonic seconds) it is trusted."""

    fence: int
    valid_until: float
    renewed_at: float


class ShardLeases:
    """The shards one watcher owns, and its place among the live watchers."""

    def __init__(self, client: redis.Redis, keys: Keys, owner: str, lease_ms: int) -> None:
        self.redis = client
        self.keys = keys
        self.owner = owner
        self.lease_ms = lease_ms
        self.owned: dict[int, Lease] = {}
        self._acquire = client.register_script(_ACQUIRE)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self._heartbeat = client.register_script(_HEARTBEAT)

    def heartbeat(self) -> int:
        """Record this watcher as live; the number of live watchers (at least 1). Raises
        ``ShardCountMismatch`` when live watchers read another shard count (this one is then not
        recorded); logs a change of the count (no other watcher live: the operator's)."""
        live, previous = (int(v) for v in self._heartbeat(
            keys=[self.keys.watchers, self.keys.shard_count],
            args=[self.owner, self.lease_ms, self.keys.shards, count_window_ms(self.lease_ms)]))
        if live < 0:
            raise ShardCountMismatch(self.keys, previous)
        if previous:
            logger.warning(
                "redis.shards changed from %s to %d (no watcher with the old count is live): entries still "
                "queued under the old count are dead-lettered as wrong_shard; replay them from %s "
                "(OPERATIONS: Changing redis.shards)", previous if previous > 0 else "an unreadable value",
                self.keys.shards, self.keys.dead)
        return max(1, live)

    def quota(self, live: int) -> int:
        """How many shards one of ``live`` watchers may own."""
        return math.ceil(self.keys.shards / max(1, live))

    def renew_due(self) -> None:
        """Renew every lease older than ``RENEW_FRACTION``; forget the ones lost."""
        due = [n for n, lease in self.owned.items() if self._age(lease) >= self.lease_ms * RENEW_FRACTION / 1000]
        if due:
            self._renew_many(due)

    def renew_all(self) -> None:
        """Renew every owned lease now; forget the ones lost."""
        if self.owned:
            self._renew_many(list(self.owned))

    def _renew_many(self, shards: list[int]) -> None:
        started = time.monotonic()
        pipe = self.redis.pipeline(transaction=False)
        for n in shards:
            self._renew(keys=[self.keys.lease(n)], args=[self.owner, self.lease_ms], client=pipe)
        for n, ok in zip(shards, pipe.execute()):
            if ok:
                self._trust(n, started)
            else:
                self.forget(n, "expired or taken")

    def rebalance(self, live: int) -> tuple[list[int], list[int]]:
        """Release shards above the quota and take free ones up to it; (acquired, released)."""
        quota = self.quota(live)
        released = self._release_excess(quota)
        acquired = self._acquire_free(quota - len(self.owned)) if len(self.owned) < quota else []
        return acquired, released

    def _release_excess(self, quota: int) -> list[int]:
        excess = sorted(self.owned, reverse=True)[: max(0, len(self.owned) - quota)]
        for n in excess:
            self.release(n)
        return excess

    def _acquire_free(self, wanted: int) -> list[int]:
        candidates = [n for n in self._preferred_order() if n not in self.owned]
        holders = self.redis.mget([self.keys.lease(n) for n in candidates])
        free = [n for n, holder in zip(candidates, holders) if holder is None]
        acquired: list[int] = []
        for n in free:
            if len(acquired) >= wanted:
                break
            if self.acquire(n):
                acquired.append(n)
        return acquired

    def _preferred_order(self) -> list[int]:
        """All shards, starting at one derived from this watcher's id (spreads first picks)."""
        start = zlib.crc32(self.owner.encode()) % self.keys.shards
        return [(start + i) % self.keys.shards for i in range(self.keys.shards)]

    def acquire(self, shard: int) -> bool:
        """Take the shard's lease if it is free; True when this watcher now owns it."""
        started = time.monotonic()
        fence = int(self._acquire(keys=[self.keys.lease(shard), self.keys.fence(shard)],
                                  args=[self.owner, self.lease_ms]))
        if not fence:
            return False
        self.owned[shard] = Lease(fence, 0.0, started)
        self._trust(shard, started)
        logger.info("lease acquired shard=%d owner=%s fence=%d", shard, self.owner, fence)
        return True

    def release(self, shard: int) -> None:
        """Give the shard up (only if the lease is still ours)."""
        if self.owned.pop(shard, None) is not None:
            self._release(keys=[self.keys.lease(shard)], args=[self.owner])
            logger.info("lease released shard=%d owner=%s", shard, self.owner)

    def release_all(self) -> None:
        """Release every lease and leave the registry (graceful stop)."""
        for n in list(self.owned):
            self.release(n)
        self.redis.zrem(self.keys.watchers, self.owner)

    def check(self, shard: int) -> None:
        """Raise LeaseLost unless the lease is ours and trusted; the guard before each write."""
        lease = self.owned.get(shard)
        if lease is not None and self._age(lease) >= self.lease_ms * RENEW_FRACTION / 1000:
            self._renew_many([shard])
            lease = self.owned.get(shard)
        if lease is None or time.monotonic() >= lease.valid_until:
            raise LeaseLost(shard)

    def holds(self, shard: int) -> bool:
        """Whether the lease is ours and still trusted, by the local clock (no Redis call)."""
        lease = self.owned.get(shard)
        return lease is not None and time.monotonic() < lease.valid_until

    def forget_all(self, reason: str) -> None:
        """Drop every lease locally (Redis lost them, or they cannot be trusted)."""
        for n in list(self.owned):
            self.forget(n, reason)

    def _trust(self, shard: int, started: float) -> None:
        lease = self.owned[shard]
        lease.renewed_at = started
        lease.valid_until = started + self.lease_ms * VALIDITY_FRACTION / 1000

    def forget(self, shard: int, reason: str) -> None:
        """Stop using a shard this watcher no longer holds (no Redis call)."""
        if self.owned.pop(shard, None) is not None:
            logger.warning("lease lost shard=%d owner=%s reason=%s", shard, self.owner, reason)

    @staticmethod
    def _age(lease: Lease) -> float:
        return time.monotonic() - lease.renewed_at
