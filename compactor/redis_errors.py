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
from rq.defaults import RQ_KEY_PREFIX

from compactor.keys import Keys
from events.errors import CompactorError

# The first word of the reply starts the message, or follows "Command # 1 (...) of pipeline
# caused error: " when a pipeline's command was refused.
_REFUSAL = re.compile(r"(?:^|error: )(?:MISCONF|NOREPLICAS|READONLY|OOM|LOADING|BUSY|MASTERDOWN|TRYAGAIN)\b")


HEALTH_PROBE_MS = 60_000
_WATCHED_KEY_CHANGED = "Watched variable changed."  # redis-py's WatchError of an EXEC refused


def connection_lost(error: redis.WatchError) -> bool:
    """Whether a ``WatchError`` says a connection lost while watching (redis-py says it so too: a
    socket timeout while Redis stalled, perhaps after it ran an EXEC sent), not a watched key
    another client changed."""
    return str(error) != _WATCHED_KEY_CHANGED


def probe_writes(client: redis.Redis, key: str) -> None:
    """A write Redis must take for the service to work: PING alone answered under ``noeviction``
    OOM (and with the disk full, MISCONF aside), while every write was refused (the refusal raises)."""
    client.set(key, "1", px=HEALTH_PROBE_MS)


def is_refusal(error: BaseException) -> bool:
    """Whether ``error`` is Redis refusing to serve for now (see the module docstring)."""
    if isinstance(error, (redis.ReadOnlyError, redis.OutOfMemoryError)):
        return True
    return isinstance(error, redis.ResponseError) and _REFUSAL.search(str(error)) is not None


def is_transient(error: BaseException) -> bool:
    """A Redis error that passes by itself: a refusal, a dropped or timed-out connection (not a
    refused password or ACL, which are ``ConnectionError``s too in redis-py but need an operator)."""
    if isinstance(error, (redis.AuthenticationError, redis.exceptions.AuthorizationError)):
        return False
    return isinstance(error, (redis.ConnectionError, redis.TimeoutError)) or is_refusal(error)


def is_permission_error(error: BaseException) -> bool:
    """Whether ``error`` is Redis's ACL refusing a command, a key or a channel (in a script too)."""
    if isinstance(error, redis.exceptions.NoPermissionError):
        return True
    return isinstance(error, redis.ResponseError) and (
        "NOPERM" in str(error) or "The user executing the script can't" in str(error))


def acl_needs(prefix: str) -> str:
    """What the service's Redis user needs, in ACL words."""
    return (f"the service's Redis user needs the keys ~{prefix}:* ~{RQ_KEY_PREFIX}:*, the channels "
            f"&{RQ_KEY_PREFIX}:* and +@all, or the command categories docs/OPERATIONS.md lists under "
            f"'An external Redis'")


class AccessDenied(CompactorError):
    """Redis's ACL refuses this client something the service needs (its message says what)."""


def check_access(client: redis.Redis, prefix: str) -> None:
    """Raise ``AccessDenied`` naming what Redis's ACL refuses of what the service needs.

    Two round trips of harmless commands, one per kind of permission (each is refused with
    ``NOPERM`` when missing): a write and a stream read on the prefix's keys, a write on RQ's keys,
    a publish on RQ's channels (a worker's command channel), a Lua script (RQ's rate limits),
    ``TIME`` (the watcher's lease scripts), then a transaction. A user without them failed later,
    mid-start or on the first job, with a traceback. (``INFO`` is not required: RQ asks it for
    the server's version and assumes an old one when refused.)"""
    keys = Keys(prefix)
    probes: list[tuple[str, tuple[object, ...]]] = [
        (f"write the keys {prefix}:*", ("SET", keys.health, "1", "PX", HEALTH_PROBE_MS)),
        (f"read the streams {prefix}:events:*", ("XLEN", keys.stream(0))),
        (f"write RQ's keys {RQ_KEY_PREFIX}:*", ("DEL", f"{RQ_KEY_PREFIX}:compactor:access-probe")),
        (f"publish on RQ's channels {RQ_KEY_PREFIX}:*",
         ("PUBLISH", f"{RQ_KEY_PREFIX}:pubsub:compactor-access-probe", "")),
        ("run Lua scripts", ("EVAL", "return 1", 0)),
        ("run TIME", ("TIME",)),
    ]
    pipe = client.pipeline(transaction=False)
    for _, command in probes:
        pipe.execute_command(*command)  # type: ignore[no-untyped-call]
    replies = pipe.execute(raise_on_error=False)
    refused = [f"{what} ({reply})" for (what, _), reply in zip(probes, replies, strict=True)
               if isinstance(reply, redis.exceptions.NoPermissionError)]
    try:
        with client.pipeline(transaction=True) as transaction:
            transaction.get(keys.health)
            transaction.execute()
    except redis.ResponseError as error:  # (MULTI alone refused: EXEC answers "EXEC without MULTI")
        if is_permission_error(error) or "without MULTI" in str(error):
            refused.append(f"run transactions, MULTI/EXEC ({error})")
    if refused:
        raise AccessDenied(f"Redis's ACL refuses to let this user {'; '.join(refused)}: {acl_needs(prefix)}")
