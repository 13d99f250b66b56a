"""One ``redis.shards`` for all: the count the live watchers read with, recorded in ``{p}:shards``
at each heartbeat (``producer.watcher.leases``). A watcher, the API or a worker with another count
is refused: events published under it go to streams their sessions do not hash to (every one
dead-lettered, ``wrong_shard``), and a watcher reading with it beside the others swept their
streams as left behind by a lowered count."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import redis
from rq.utils import as_text

from compactor.keys import Keys
from events.errors import InvalidConfig

logger = logging.getLogger(__name__)


class ShardCountMismatch(InvalidConfig):
    """Live watchers on this Redis (and prefix) read with another ``redis.shards``."""

    def __init__(self, keys: Keys, recorded: int) -> None:
        self.recorded = recorded
        super().__init__("redis.shards", (
            f"is {keys.shards}, but the watchers live on this Redis (prefix {keys.prefix!r}) read "
            f"{recorded} shards (recorded in {keys.shard_count}): give this one the same count, or stop "
            f"them all first to change it (OPERATIONS: Changing redis.shards)"))


COUNT_WINDOW_MIN_MS = 30_000


def server_ms(client: redis.Redis) -> int:
    """Redis's clock (``TIME``) in milliseconds: the registry's beats are scored by it."""
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def count_window_ms(lease_ms: int) -> int:
    """How long a watcher's last heartbeat keeps its shard count in force: 3 leases, at least 30 s.
    (A watcher beats between sessions, but a round of sessions held back 0.5 s each, or a stalled
    disk, made it beat late: taken for dead at one lease, it let a newcomer with another count in.)"""
    return max(3 * lease_ms, COUNT_WINDOW_MIN_MS)


def live_shard_count(client: redis.Redis, keys: Keys, lease_ms: int) -> int | None:
    """The ``redis.shards`` the live watchers read with (recorded at their heartbeats), or None
    when no watcher has heartbeaten within ``count_window_ms`` (or none recorded a count)."""
    recorded = client.get(keys.shard_count)
    if recorded is None:
        return None
    if not client.zcount(keys.watchers, server_ms(client) - count_window_ms(lease_ms), "+inf"):
        return None
    try:
        return int(recorded)
    except ValueError:
        return None


def gone_quiet(client: redis.Redis, keys: Keys, lease_ms: int, *, me: str | None = None,
               stop: threading.Event | None = None) -> bool:
    """Whether the watchers keeping another shard count in force are gone: those whose last beat
    is within ``count_window_ms`` but none within 2 leases (killed, not stopped: they left no word)
    are waited out, up to the window; True once none is left, False as soon as one beats again
    (it is live: its count stands), or on ``stop``. A process started with a new count right after
    the old watchers were killed was refused for 30 s, and ``serve`` gave up on its children."""
    window = count_window_ms(lease_ms)
    said = False
    while True:
        now_ms = server_ms(client)
        found: list[Any] = client.zrangebyscore(keys.watchers, now_ms - window, "+inf",
                                                withscores=True)
        beats = [float(score) for member, score in found
                 if me is None or as_text(member) != me]
        if not beats:
            return True
        if max(beats) >= now_ms - 2 * lease_ms:
            return False
        if not said:
            logger.warning("watchers of another redis.shards stopped beating %.0f s ago: waiting up to %.0f s "
                           "for them to count as gone (stop watchers with SIGTERM to change it at once)",
                           (now_ms - max(beats)) / 1000, (min(beats) + window - now_ms) / 1000)
            said = True
        pause = min(1.0, max(0.05, (min(beats) + window - now_ms) / 1000 + 0.05))
        if stop is not None:
            if stop.wait(pause):
                return False
        else:
            time.sleep(pause)


SHARDS_CHECK_EVERY_S = 5.0  # how stale the API's view of the live watchers' count may be


class ShardGuard:
    """The API's check, before it publishes, that its ``redis.shards`` is the live watchers' (one
    Redis round trip each ``SHARDS_CHECK_EVERY_S`` at most): an API started while no watcher was
    live, left running through a change of the count, answered 202 to events its watchers then
    dead-lettered."""

    def __init__(self, keys: Keys, lease_ms: int) -> None:
        self.keys = keys
        self.lease_ms = lease_ms
        self._lock = threading.Lock()
        self._checked_at = float("-inf")
        self._live: int | None = None

    def check(self, client: redis.Redis) -> None:
        """Raise ``ShardCountMismatch`` when live watchers read with another count."""
        with self._lock:
            if time.monotonic() - self._checked_at >= SHARDS_CHECK_EVERY_S:
                self._live = live_shard_count(client, self.keys, self.lease_ms)
                self._checked_at = time.monotonic()
            live = self._live
        if live is not None and live != self.keys.shards:
            raise ShardCountMismatch(self.keys, live)
