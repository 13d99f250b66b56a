"""Sessions held back by a watcher (their log cannot be written): what the API, the status page,
``compactor status`` and the metrics show of them.

``{p}:held`` is a hash: session id -> JSON ``{since, until, error, watcher, shard}``, times in
Redis's clock (unix seconds: the scripts read ``TIME``). The watcher holding a session writes its
record (``HOLD``) when it holds it and again each time it logs it (every ``HELD_LOG_EVERY_S``,
60 s, while it lasts); a record still fresh keeps its ``since`` (a session held across a
takeover or a restart says since when it has been held, not since the last owner began). The
watcher deletes the record when the session is applied again, as does any watcher applying the
session in a sweep of its pending entries (the new owner of a shard whose former owner died
holding it); each watcher drops the stale records once a minute (``PRUNE``).

Invariants: a record is shown only while it is fresh (before its ``until``, ``HELD_RECORD_TTL_S``
after it was last written) *and* its watcher holds the session's shard: a former owner's write
that lands after the new owner applied the session (a paused process's pipeline) is never
shown. Readers never write. A record that does not parse is left out, never an error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import redis
from rq.utils import as_text

from compactor.keys import Keys

HELD_RECORD_TTL_S = 150.0  # 2.5 x the watcher's refresh (HELD_LOG_EVERY_S): a record outlives one late refresh

# KEYS: held hash. ARGV: session, seconds held so far (this watcher's count), ttl s, error, watcher, shard.
HOLD = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local since = now - tonumber(ARGV[2])
local old = redis.call('HGET', KEYS[1], ARGV[1])
if old then
  local ok, record = pcall(cjson.decode, old)
  if ok and type(record) == 'table' and tonumber(record['until']) and tonumber(record['until']) > now
     and tonumber(record['since']) and tonumber(record['since']) < since then
    since = tonumber(record['since'])
  end
end
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode({since = since, ['until'] = now + tonumber(ARGV[3]),
  error = ARGV[4], watcher = ARGV[5], shard = tonumber(ARGV[6])}))
return 1
"""

# KEYS: held hash. Deletes the records past their until; the number deleted.
PRUNE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local all = redis.call('HGETALL', KEYS[1])
local gone = 0
for i = 1, #all, 2 do
  local ok, record = pcall(cjson.decode, all[i + 1])
  if not ok or type(record) ~= 'table' or not tonumber(record['until']) or tonumber(record['until']) <= now then
    redis.call('HDEL', KEYS[1], all[i])
    gone = gone + 1
  end
end
return gone
"""


@dataclass(frozen=True)
class Held:
    """A session held back: since when (Redis's clock, unix s), why, by which watcher."""

    since: float
    until: float
    error: str
    watcher: str
    shard: int


def parse_held(raw: Any, now: float, holders: dict[int, str | None]) -> Held | None:
    """A record read from ``{p}:held``; None when absent, unreadable, stale at ``now``, or written
    by a watcher that no longer holds its shard (``holders``: shard -> its lease's holder)."""
    if raw is None:
        return None
    try:
        value = json.loads(as_text(raw))
        held = Held(since=float(value["since"]), until=float(value["until"]), error=str(value["error"]),
                    watcher=str(value["watcher"]), shard=int(value["shard"]))
    except (ValueError, TypeError, KeyError):
        return None
    return held if held.until > now and holders.get(held.shard) == held.watcher else None


def lease_holders(replies: list[Any]) -> dict[int, str | None]:
    """``{shard: holder}`` from the replies to ``GET {p}:lease:{n}`` for n = 0, 1, ... in order."""
    return {n: None if holder is None else as_text(holder) for n, holder in enumerate(replies)}


def held_sessions(client: redis.Redis, keys: Keys) -> dict[str, Held]:
    """Every session held back now (one round trip)."""
    pipe = client.pipeline(transaction=False)
    pipe.hgetall(keys.held)
    pipe.mget([keys.lease(n) for n in range(keys.shards)])
    pipe.time()
    records, leases, (seconds, micros) = pipe.execute()
    holders = lease_holders(leases)
    now = int(seconds) + int(micros) / 1e6
    parsed = {as_text(sid): parse_held(raw, now, holders) for sid, raw in records.items()}
    return {sid: held for sid, held in parsed.items() if held is not None}
