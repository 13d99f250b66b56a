"""Redis errors told apart: a server that is up but refuses to serve for now, from a bug.

A *refusal* is an error reply that says the server cannot serve the command at the
moment and will again by itself: ``MISCONF`` (its disk is full: the RDB/AOF write
failed, and every write, even ``PING``, is refused), ``NOREPLICAS`` (too few
replicas), ``READONLY`` (a replica), ``OOM``, ``LOADING``, ``BUSY`` (a script runs),
``MASTERDOWN``, ``TRYAGAIN``. The API answers them 503 and the workers wait them out;
any other error reply (``WRONGTYPE``, a script's error) is a bug and is reported as one.
"""

from __future__ import annotations

import re

import redis

# The first word of the reply starts the message, or follows "Command # 1 (...) of pipeline
# caused error: " when a pipeline's command was refused.
_REFUSAL = re.compile(r"(?:^|error: )(?:MISCONF|NOREPLICAS|READONLY|OOM|LOADING|BUSY|MASTERDOWN|TRYAGAIN)\b")


HEALTH_PROBE_MS = 60_000


def probe_writes(client: redis.Redis, key: str) -> None:
    """A write Redis must take for the service to work: PING alone answered under ``noeviction``
    OOM (and with the disk full, MISCONF aside), while every write was refused (the refusal raises)."""
    client.set(key, "1", px=HEALTH_PROBE_MS)


def is_refusal(error: BaseException) -> bool:
    """Whether ``error`` is Redis refusing to serve for now (see the module docstring)."""
    if isinstance(error, (redis.ReadOnlyError, redis.OutOfMemoryError)):
        return True
    return isinstance(error, redis.ResponseError) and _REFUSAL.search(str(error)) is not None
