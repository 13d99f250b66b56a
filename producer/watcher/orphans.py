"""Entries left on streams past ``redis.shards``: the shard count was lowered with a backlog
(or below 0: a producer's signed CRC-32).

A watcher reads shards ``0 .. shards - 1`` only. After ``redis.shards`` went down
(8 to 4, say), the entries still unapplied on ``{p}:events:4`` .. ``:7`` (and
those an agent still publishing under the old count adds there) were never read:
neither applied nor dead-lettered, and no gauge counted them. ``letter_orphans``
(run by the watcher at its start and every ``ORPHAN_SWEEP_INTERVAL_S``) moves
each such entry to ``{p}:dead`` with a ``wrong_shard`` reason, as an entry read
from the wrong shard is (OPERATIONS: replay them from there), then marks it
delivered in the stream's group and trims the stream up to it.

What counts as unapplied: the entries past the group's last-delivered id and
those pending in it (a pending one may have been applied before its watcher
died: its letter is then one too many, and a replay of it is refused as a
duplicate uuid). One watcher at a time sweeps (``{p}:orphans``, a lock). A crash
between the letters and the group's update letters those entries again on the
next sweep. A stream whose shard lease is held is not swept: a live watcher
reads it (one with a higher ``redis.shards`` is refused at the registry while
another count is live, but one paused past its heartbeat may hold a lease
still); its entries are swept once the lease is gone. A key there that holds
another type (a stray key, a collision) is no stream of entries: it is logged
(ERROR, at each sweep) and skipped, and the other streams are swept.
"""

from __future__ import annotations

import logging
from typing import Any

import redis
from rq.utils import as_text

from compactor import metrics
from compactor.keys import Keys
from events.config import MAX_SHARDS
from producer.watcher.batch import BatchOutcome
from producer.watcher.entries import DELETED, misrouted
from producer.watcher.streams import DEAD_LETTER_MAXLEN

logger = logging.getLogger(__name__)

ORPHAN_SWEEP_INTERVAL_S = 60.0
ORPHAN_LOCK_MS = 60_000
ORPHAN_BATCH = 500  # entries read and lettered per transaction


def orphan_streams(client: redis.Redis, keys: Keys) -> list[int]:
    """The ``n`` of the streams ``{p}:events:{n}`` with ``shards <= n < MAX_SHARDS``, or
    ``-MAX_SHARDS < n < 0`` (a producer whose CRC-32 is signed, as JavaScript's ``| 0`` or Java's
    ``int`` make it, and whose ``%`` keeps the sign: its entries were never read nor lettered),
    whose shard lease no watcher holds: one round trip of TYPE and EXISTS (a SCAN of the keyspace
    would stall the watcher's loop with every session's keys). Such a key of another type is
    logged and left out."""
    shards = [*range(keys.shards, MAX_SHARDS), *range(-MAX_SHARDS + 1, 0)]
    pipe = client.pipeline(transaction=False)
    for n in shards:
        pipe.type(keys.stream(n))
        pipe.exists(keys.lease(n))
    there = pipe.execute()
    found = [(n, as_text(kind)) for n, kind, leased in zip(shards, there[::2], there[1::2])
             if as_text(kind) != "none" and not leased]
    for n, kind in found:
        if kind != "stream":
            logger.error("%s holds a %s, not a stream: rename or delete it; it is not swept until then (%s)",
                         keys.stream(n), kind, _where(keys, n))
    return [n for n, kind in found if kind == "stream"]


def letter_orphans(client: redis.Redis, keys: Keys, owner: str) -> int:
    """Dead-letter the unapplied entries of every stream past the shard count; how many (0
    when another watcher holds the sweep's lock)."""
    if not client.set(keys.orphans, owner, nx=True, px=ORPHAN_LOCK_MS):
        return 0
    try:
        return sum(_letter_stream(client, keys, n) for n in orphan_streams(client, keys))
    finally:
        if as_text(client.get(keys.orphans) or b"") == owner:
            client.delete(keys.orphans)


def _letter_stream(client: redis.Redis, keys: Keys, shard: int) -> int:
    stream, group = keys.stream(shard), keys.group
    groups: dict[str, Any] = {as_text(g["name"]): g for g in client.xinfo_groups(stream)}
    if group not in groups:
        client.xgroup_create(stream, group, id="0-0", mkstream=True)  # never read: every entry is unapplied
        last = "0-0"
    else:
        last = as_text(groups[group]["last-delivered-id"])
    total = 0
    pending = _pending(client, stream, group)
    while pending:
        # (one deleted from the stream meanwhile: a letter of no fields, as a shard's own gets; it
        # was acked without a word)
        entries = [entry for pid in pending for entry in _range(client, stream, pid, pid) or [(pid, None)]]
        total += _letter(client, keys, shard, entries, acks=pending, delivered=None)
        pending = _pending(client, stream, group)
    while True:
        entries = _range(client, stream, f"({last}", "+", ORPHAN_BATCH)
        if not entries:
            return total
        last = as_text(entries[-1][0])
        total += _letter(client, keys, shard, entries, acks=[], delivered=last)


def _pending(client: Any, stream: str, group: str) -> list[str]:
    return [as_text(p["message_id"]) for p in client.xpending_range(stream, group, "-", "+", ORPHAN_BATCH)]


def _range(client: Any, stream: str, start: str, end: str, count: int | None = None) -> list[Any]:
    return client.xrange(stream, start, end, count=count) or []


def _letter(client: redis.Redis, keys: Keys, shard: int, entries: list[Any], *, acks: list[str],
            delivered: str | None) -> int:
    """Write the entries' letters, ack ``acks``, move the group past ``delivered``, trim: one
    transaction."""
    stream = keys.stream(shard)
    outcome = BatchOutcome(stream)
    for entry_id, fields in entries:
        flat = [item for pair in (fields or {}).items() for item in pair]
        outcome.reject(as_text(entry_id), DELETED if fields is None else _reason(keys, shard, fields), flat)
    lettered = keys.lettered(shard)  # (a watcher lettered ahead of their ack: not lettered again)
    ids = [letter.entry_id for letter in outcome.dead]
    marks = [as_text(mark) if mark else None for mark in client.hmget(lettered, ids)] if ids else []
    pipe = client.pipeline(transaction=True)
    for letter, mark in zip(outcome.dead, marks):
        if mark != letter.mark:
            pipe.execute_command("XADD", keys.dead, "MAXLEN", "~", DEAD_LETTER_MAXLEN, "*", *letter.fields)  # type: ignore[no-untyped-call]
    if acks:
        pipe.xack(stream, keys.group, *acks)
    if ids:
        pipe.hdel(lettered, *ids)
    if delivered is not None:
        pipe.xgroup_setid(stream, keys.group, delivered)
        pipe.xtrim(stream, minid=delivered, approximate=False)  # (the last one stays: the group's position)
    pipe.execute()
    metrics.count_dead_letters(outcome.reasons)
    if outcome.dead:
        logger.warning("dead-lettered %d entries of %s, %s", len(outcome.dead), stream, _where(keys, shard))
    return len(outcome.dead)


def _where(keys: Keys, shard: int) -> str:
    return (f"a stream past redis.shards ({keys.shards})" if shard >= 0
            else "a stream below 0 (a producer's signed CRC-32)")


def _reason(keys: Keys, shard: int, fields: dict[bytes, bytes]) -> str:
    """``misrouted``'s (a ``wrong_shard`` letter): no session hashes past the shard count."""
    session = fields.get(b"session")
    if not isinstance(session, bytes):
        return f"missing field 'session' (an entry of {keys.stream(shard)}, {_where(keys, shard)})"
    return misrouted(keys, session.decode("utf-8", "replace"), shard) or ""
