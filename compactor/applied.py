"""Whether the watcher has applied a stream entry: the read-your-writes check of ``GET
.../context?after=``, ``POST .../compact`` with ``after`` and ``Publisher.request_compaction``
(a forced job queued right after a new session's first events ran before the watcher had
written its log, and failed ``SessionNotFound``).

An entry is *settled* once delivered to the watchers' group and acked: applied to its log, or
dead-lettered. A session's entries are acked in order (a held session's later entries wait with
it), so every one of its entries up to a settled one is settled too. A wait also ends for an
id past the newest entry ever added to the stream (``past_newest``): none of that id can come.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import redis
from redis.exceptions import AuthenticationError, AuthorizationError
from rq.utils import as_text

from compactor.keys import Keys
from compactor.store import stream_id_key
from events.config import Settings
from events.errors import InvalidInput

STREAM_ID_RE = re.compile(r"([0-9]{1,20})-([0-9]{1,20})")  # (``\d`` took "١-٠": Redis refused it, a 500)
MAX_ID_PART = 2**64 - 1  # each part of a Redis stream id is an unsigned 64-bit number
APPLIED_POLL_S = 0.005  # a wait for the watcher looks again after this, then 1.5x as long each time
APPLIED_POLL_MAX_S = 0.1


def parse_stream_id(value: str, field: str) -> tuple[int, int]:
    """A stream entry id ``ms-seq`` as a pair; InvalidInput naming ``field`` otherwise."""
    match = STREAM_ID_RE.fullmatch(value)
    if match is None or int(match[1]) > MAX_ID_PART or int(match[2]) > MAX_ID_PART:
        # (a part past 64 bits, which Redis never gives, waited out its whole timeout)
        raise InvalidInput(field, f"{value!r} is not a stream entry id (ms-seq, as POST .../events answers)")
    return int(match[1]), int(match[2])


# KEYS: stream. The id of the newest entry ever added to it (XINFO STREAM's last-generated-id,
# without the first and last entries the reply carries), or false when there is no such stream.
_LAST_GENERATED = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local info = redis.call('XINFO', 'STREAM', KEYS[1])
for i = 1, #info, 2 do
  if info[i] == 'last-generated-id' then return info[i + 1] end
end
return false
"""
NEWEST_LOOK_S = 5.0  # how often a wait looks whether its entry is past the stream's newest (``Settling``)


def settled(client: redis.Redis, settings: Settings, session_id: str, entry_id: str) -> bool:
    """Whether the watcher is done with entry ``entry_id`` of ``session_id``'s shard: delivered
    and acked, so applied to the log or dead-lettered."""
    keys = Keys(settings.redis.prefix, settings.redis.shards)
    stream = keys.stream_for(session_id)
    try:
        groups: list[Any] = client.xinfo_groups(stream)
    except redis.ResponseError:  # no such stream: nothing of it waits (Redis lost it, or no event was sent)
        return True
    group = next((g for g in groups if as_text(g["name"]) == keys.group), None)
    if group is None:  # (the watchers recreate it and read the stream again)
        return False
    ms, seq = parse_stream_id(entry_id, "after")
    if stream_id_key(as_text(group["last-delivered-id"])) < (ms, seq):
        return False
    return not client.xpending_range(stream, keys.group, f"{ms}-{seq}", f"{ms}-{seq}", 1)


def past_newest(client: redis.Redis, settings: Settings, session_id: str, entry_id: str) -> bool:
    """Whether ``entry_id`` is past the newest entry ever added to ``session_id``'s shard stream:
    none of that id can come (Redis lost it, a restart without persistence or an older snapshot
    restored, its event maybe in the log already; or it was never published), and nothing of it
    waits. (Waited for, it held a forced compaction 300 s.) A look copies the stream's first and
    last entries inside Redis: ~15 ms for entries of 4 MiB, so a wait makes one every
    ``NEWEST_LOOK_S`` (``Settling``), not one per poll."""
    stream = Keys(settings.redis.prefix, settings.redis.shards).stream_for(session_id)
    last = client.eval(_LAST_GENERATED, 1, stream)
    return bool(last) and stream_id_key(as_text(last)) < parse_stream_id(entry_id, "after")


class Settling:
    """The looks of one wait for entry ``entry_id``: ``settled``, or ``past_newest`` (first, then
    every ``NEWEST_LOOK_S`` at most: the stream can be lost during the wait too)."""

    def __init__(self, client: redis.Redis, settings: Settings, session_id: str, entry_id: str) -> None:
        self.client, self.settings, self.session_id, self.entry_id = client, settings, session_id, entry_id
        self._next_newest = 0.0

    def __call__(self) -> bool:
        if settled(self.client, self.settings, self.session_id, self.entry_id):
            return True
        if time.monotonic() < self._next_newest:
            return False
        self._next_newest = time.monotonic() + NEWEST_LOOK_S
        return past_newest(self.client, self.settings, self.session_id, self.entry_id)


def poll_pauses(timeout_s: float) -> Iterator[float]:
    """The pauses between looks of a wait for the watcher, ``timeout_s`` long in all: from
    ``APPLIED_POLL_S``, 1.5x as long each time, up to ``APPLIED_POLL_MAX_S``; none once it is over."""
    deadline = time.monotonic() + timeout_s
    pause = APPLIED_POLL_S
    while (left := deadline - time.monotonic()) > 0:
        yield min(pause, left)
        pause = min(pause * 1.5, APPLIED_POLL_MAX_S)


def wait_applied(client: redis.Redis, settings: Settings, session_id: str, entry_id: str,
                 timeout_s: float, stop: Callable[[], bool] | None = None) -> bool:
    """``Settling``, waiting for it up to ``timeout_s``; whether it is. A look that a dropped
    connection or a timeout cut short told nothing: the wait goes on (one dropped connection
    failed a forced job before it compacted). Ends early, False, once ``stop()`` (a worker told
    to stop: waiting on, it held its stop as long)."""
    look = Settling(client, settings, session_id, entry_id)
    for pause in poll_pauses(timeout_s):
        if _looked(look):
            return True
        if stop is not None and stop():
            return False
        time.sleep(pause)
    return _looked(look)


def _looked(look: Settling) -> bool:
    try:
        return look()
    except (AuthenticationError, AuthorizationError):  # (ConnectionErrors in redis-py: an operator's to fix)
        raise
    except (redis.ConnectionError, redis.TimeoutError):
        return False
