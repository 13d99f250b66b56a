"""Sessions held back by a watcher (their log cannot be written): what the API, the status page,
``compactor status`` and the metrics show of them.

``{p}:held`` is a hash: session id -> JSON ``{since, until, error, watcher, shard}``, times in
Redis's clock (unix seconds, as ``compactor.queue`` keeps it). The watcher holding a session
writes its record when it holds it and again each time it logs it (every ``HELD_LOG_EVERY_S``,
60 s, while it lasts), and deletes it when the session is applied again; so does any watcher
that applies a session in a sweep of its pending entries (the new owner of a shard whose
former owner died holding the session).

Invariants: a record past its ``until`` (``HELD_RECORD_TTL_S`` after it was last written: its
watcher stopped, and no sweep applied the session since) is stale: readers leave it out (it
stays until a watcher applies or holds the session again; readers never delete, so a refresh
racing a reader is never lost). A record that does not parse is left out too, never an error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import redis
from rq.utils import as_text

from compactor.keys import Keys
from compactor.queue import redis_clock_s

HELD_RECORD_TTL_S = 150.0  # 2.5 x the watcher's refresh (HELD_LOG_EVERY_S): a record outlives one late refresh


@dataclass(frozen=True)
class Held:
    """A session held back: since when (Redis's clock, unix s), why, by which watcher."""

    since: float
    until: float
    error: str
    watcher: str
    shard: int


def held_record(since: float, error: str, watcher: str, shard: int) -> str:
    """The hash value for a session held since ``since`` (Redis's clock) by ``watcher``."""
    return json.dumps({"since": round(since, 3), "until": round(redis_clock_s() + HELD_RECORD_TTL_S, 3),
                       "error": error, "watcher": watcher, "shard": shard})


def parse_held(raw: Any, now: float) -> Held | None:
    """A record read from ``{p}:held``; None when absent, stale at ``now`` or unreadable."""
    if raw is None:
        return None
    try:
        value = json.loads(as_text(raw))
        held = Held(since=float(value["since"]), until=float(value["until"]), error=str(value["error"]),
                    watcher=str(value["watcher"]), shard=int(value["shard"]))
    except (ValueError, TypeError, KeyError):
        return None
    return held if held.until > now else None


def held_sessions(client: redis.Redis, keys: Keys, now: float) -> dict[str, Held]:
    """Every session held back at ``now`` (Redis's clock)."""
    records: dict[Any, Any] = client.hgetall(keys.held)
    parsed = {as_text(sid): parse_held(raw, now) for sid, raw in records.items()}
    return {sid: held for sid, held in parsed.items() if held is not None}
