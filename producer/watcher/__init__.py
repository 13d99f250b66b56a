"""The watcher: consumes the stream shards, appends to the session logs, triggers compaction.

``Watcher(redis, settings, name=...)`` with ``run(stop_event)`` / ``run_once()``;
``main(settings)`` runs one until SIGTERM/SIGINT (``compactor watch``). The parts:
``entries`` (decoding and dead-letter reasons), ``streams`` (fenced stream ops),
``leases`` (shard ownership), ``core`` (the loop).
"""

from __future__ import annotations

from producer.watcher.core import Watcher, main
from producer.watcher.leases import LeaseLost

__all__ = ["LeaseLost", "Watcher", "main"]
