"""Whether the watcher has applied a stream entry: the read-your-writes check of ``GET
.../context?after=``, ``POST .../compact`` with ``after`` and ``Publisher.request_compaction``
(a forced job queued right after a new session's first events ran before the watcher had
written its log, and failed ``SessionNotFound``).

An entry is *settled* once delivered to the watchers' group and acked: applied to its log, or
dead-lettered. A session's entries are acked in order (a held session's later entries wait with
it), so every one of its entries up to a settled one is settled too.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
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


def settled(client: redis.Redis, settings: Settings, session_id: str, entry_id: str) -> bool:
    """Whether the watcher is done with entry ``entry_id`` of ``session_id``'s shard: delivered
    and acked, so applied to the log or dead-lettered; or none of that id can be in its stream
    (past the newest entry ever added to it: nothing of it waits)."""
    keys = Keys(settings.redis.prefix, settings.redis.shards)
    stream = keys.stream_for(session_id)
    try:
        groups: list[Any] = client.xinfo_groups(stream)
    except redis.ResponseError:  # no such stream: nothing of it waits (Redis lost it, or no event was sent)
        return True
    group = next((g for g in groups if as_text(g["name"]) == keys.group), None)
    ms, seq = parse_stream_id(entry_id, "after")
    if group is None or stream_id_key(as_text(group["last-delivered-id"])) < (ms, seq):
        # not delivered yet (or the watchers are to recreate the group and read the stream again),
        # unless no entry of that id can be in the stream: past the newest ever added, Redis lost
        # it (a restart without persistence, an older snapshot restored: the event may be in the log
        # already) or it was never published; waited for, it held a forced compaction 300 s
        last = client.eval(_LAST_GENERATED, 1, stream)
        return bool(last) and stream_id_key(as_text(last)) < (ms, seq)
    return not client.xpending_range(stream, keys.group, f"{ms}-{seq}", f"{ms}-{seq}", 1)


def poll_pauses(timeout_s: float) -> Iterator[float]:
    """The pauses between looks of a wait for the watcher, ``timeout_s`` long in all: from
    ``APPLIED_POLL_S``, 1.5x as long each time, up to ``APPLIED_POLL_MAX_S``; none once it is over."""
    deadline = time.monotonic() + timeout_s
    pause = APPLIED_POLL_S
    while (left := deadline - time.monotonic()) > 0:
        yield min(pause, left)
        pause = min(pause * 1.5, APPLIED_POLL_MAX_S)


def wait_applied(client: redis.Redis, settings: Settings, session_id: str, entry_id: str,
                 timeout_s: float) -> bool:
    """``settled``, waiting for it up to ``timeout_s``; whether it is. A look that a dropped
    connection or a timeout cut short told nothing: the wait goes on (one dropped connection
    failed a forced job before it compacted)."""
    for pause in poll_pauses(timeout_s):
        if _looked(client, settings, session_id, entry_id):
            return True
        time.sleep(pause)
    return _looked(client, settings, session_id, entry_id)


def _looked(client: redis.Redis, settings: Settings, session_id: str, entry_id: str) -> bool:
    try:
        return settled(client, settings, session_id, entry_id)
    except (AuthenticationError, AuthorizationError):  # (ConnectionErrors in redis-py: an operator's to fix)
        raise
    except (redis.ConnectionError, redis.TimeoutError):
        return False
