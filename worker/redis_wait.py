"""How a worker rides out a Redis that refuses to serve or does not answer.

A Redis whose disk is full answers ``MISCONF`` to every write for as long as it
lasts (``compactor.redis_errors``), and one that restarts drops its connections.
RQ's work loop retries a dropped connection only while it waits for a job; any
other failure (a refused heartbeat, a job's end not recorded) ended the loop, so
each worker quit ~45 s into a full disk and did not come back when there was room.

Invariant: a worker's loop never ends because Redis refused a command or dropped
its connection. It waits (1, 2, 4 … ``WAIT_MAX_S`` seconds between tries) and
logs one line when it starts, one every ``REPEAT_S`` while it lasts, and one
when Redis serves again; a job whose start or end could not be recorded is left
to the janitor (``worker.runner``), as a killed worker's is. What passes by itself
is ``compactor.redis_errors.is_transient``.
"""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger(__name__)

WAIT_MAX_S = 10.0  # the longest wait between two tries
REPEAT_S = 60.0  # how often a lasting refusal is logged again


class RedisWait:
    """One worker's record of Redis not serving it: what it logs and how long it waits."""

    def __init__(self, worker_name: str) -> None:
        self.worker_name = worker_name
        self._lock = threading.Lock()  # (the worker's loop and its keeper thread both report)
        self._since: float | None = None
        self._said = 0.0
        self._wait = 1.0

    def failed(self, what: str, error: BaseException) -> None:
        """Note that Redis did not serve ``what`` (logged when the outage starts, then each ``REPEAT_S``)."""
        with self._lock:
            now = time.monotonic()
            if self._since is None:
                self._since, self._said = now, now
                logger.warning("Redis does not serve worker=%s (%s): %s; waiting for it",
                               self.worker_name, what, error)
            elif now - self._said >= REPEAT_S:
                self._said = now
                logger.warning("Redis still does not serve worker=%s after %.0f s (%s): %s",
                               self.worker_name, now - self._since, what, error)

    def next_wait(self) -> float:
        """The seconds to wait before trying again: 1, 2, 4 … ``WAIT_MAX_S`` while the outage lasts."""
        with self._lock:
            wait, self._wait = self._wait, min(self._wait * 2, WAIT_MAX_S)
            return wait

    def served(self) -> None:
        """Note that Redis served a write (logs the end of an outage)."""
        if self._since is None:
            return
        with self._lock:
            if self._since is not None:
                logger.info("Redis serves worker=%s again after %.0f s", self.worker_name,
                            time.monotonic() - self._since)
                self._since, self._wait = None, 1.0

    @property
    def waiting(self) -> bool:
        return self._since is not None
