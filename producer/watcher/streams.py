"""The watcher's Redis stream operations on one shard, each fenced by the shard's lease.

Invariants:
- Every shard stream has the consumer group ``{p}-watchers`` with a single
  consumer, ``shard-{n}``, which only the lease holder reads. So the shard's
  unacked entries are exactly that consumer's PEL, in stream order, and a new
  owner resumes by reading the PEL from ``0`` before any new entry.
- Reads are ``XREADGROUP`` inside a Lua script (one call for all the shards
  of a round) that first checks each shard's lease: a
  watcher that paused past its lease cannot move entries into the PEL of a
  shard someone else now owns. (Blocking happens outside, with a plain
  ``XREAD BLOCK`` that touches no group state.)
- Acks and dead letters are one script per batch, also fenced: an entry is
  dead-lettered and acked together or not at all.
- Groups are created with ``MKSTREAM`` from id ``0`` (entries published before
  any watcher ran are read); a ``NOGROUP`` error means Redis lost them, and the
  group is recreated the same way.
- Trimming keeps every entry at or above the oldest one any group still needs
  (its oldest pending entry, else its last-delivered one), so a pending entry
  is never trimmed.
- ``claim_foreign`` moves every entry pending under any other consumer name
  (an older deployment, a hand-run reader) into ``shard-{n}`` with XAUTOCLAIM
  when the shard is taken, before anything is read: the shard's cursor then
  sweeps them in id order with its own pending entries, ahead of new ones, so
  a session's older entry is never applied after a newer one (nor taken for a
  duplicate of it). Applying is idempotent, so claiming an entry a foreign
  reader still works on is harmless. Such consumers are deleted only when they
  hold nothing and have been idle for ``claimIdleMs``. Valkey 8 / Redis < 8.4 have
  no ``XREADGROUP ... CLAIM``, so redis-py's ``claim_min_idle_time`` is not used.
- A shard stream key holding another type (a stray ``SET``, a collision) fails
  that shard alone: the read script answers -4 for it and the other shards are
  read; ``ensure_group``, ``trim`` and ``wait`` raise ``NotAStream`` naming the
  key and the shard (the caller sets the shard aside until the key is fixed).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import redis
from rq.utils import as_text

from compactor import metrics
from compactor.keys import Keys
from producer.watcher.entries import DELETED, UNREAD_DELETED

logger = logging.getLogger(__name__)

NEW_ENTRIES = ">"
PEL_START = "0-0"
DEAD_LETTER_MAXLEN = 100_000  # approximate cap of {p}:dead
ACK_CHUNK = 1000  # ids per XACK call inside the script (Lua's unpack limit)
READ_CHUNK = 16  # entries per XREADGROUP inside the read script, at most
READ_BUDGET_BYTES = 8 * 2**20  # the entries' bytes one read brings, all shards together (and one chunk past it)
LETTERED_TTL_S = 30 * 86_400  # {p}:lettered:{n} outlives its last letter written ahead by this long
CLAIM_CHUNK = 1000  # entries of foreign consumers claimed per script call (Lua's unpack limit)


class Letter(NamedTuple):
    """A dead letter: its entry's id, ``entry_mark`` of the entry's fields, the letter's flat fields."""

    entry_id: str
    mark: str
    fields: list[bytes]


def entry_mark(fields: list[bytes]) -> str:
    """A digest of an entry's flat fields: ``{p}:lettered:{n}`` keeps it under the entry's id, so
    an entry lettered ahead is known again by its id *and* its content (a lost stream numbers its
    new entries from where it can, and an id may come again for another entry)."""
    digest = hashlib.blake2b(digest_size=12)
    for item in fields:
        digest.update(len(item).to_bytes(8, "little"))
        digest.update(item)
    return digest.hexdigest()


# KEYS: per shard its lease and its stream; ARGV: owner, group, count, byte budget, then per shard
# its consumer, start id and first chunk's size. Per shard: -1 not our lease; -2 no such group
# (NOGROUP); -3 not read, the call's budget spent on the shards before it; -4 the key holds another
# type (WRONGTYPE: one stray key failed the read of every shard); {entries}: what was read;
# a string: nothing to read, the stream's top id. A shard is read in chunks of READ_CHUNK entries at
# most (fewer once the entries are seen large, here or in the shard's last read) until ``count`` or
# the budget (the entries' bytes, all shards together): one read of 256 entries per shard, each
# under maxEventBytes, was a reply of gigabytes, built inside Redis (every client waited) past the
# watcher's socket timeout, and read again at each retry, for good.
_READ = """
local out = {}
local count, budget, used = tonumber(ARGV[3]), tonumber(ARGV[4]), 0
for i = 1, #KEYS / 2 do
  local lease, stream = KEYS[2 * i - 1], KEYS[2 * i]
  if redis.call('GET', lease) ~= ARGV[1] then
    out[i] = -1
  elseif used >= budget then
    out[i] = -3
  else
    local consumer, id, step = ARGV[2 + 3 * i], ARGV[3 + 3 * i], tonumber(ARGV[4 + 3 * i])
    local got = {}
    while #got < count and used < budget do
      local ask = math.min(step, count - #got)
      local r = redis.pcall('XREADGROUP', 'GROUP', ARGV[2], consumer, 'COUNT', ask, 'STREAMS', stream, id)
      if type(r) == 'table' and r.err then
        if #got == 0 and string.find(r.err, 'NOGROUP', 1, true) then got = -2; break end
        if #got == 0 and string.find(r.err, 'WRONGTYPE', 1, true) then got = -4; break end
        return r
      end
      if not r or #r[1][2] == 0 then break end
      local entries, size = r[1][2], 0
      for _, e in ipairs(entries) do
        got[#got + 1] = e
        if e[2] then for j = 1, #e[2] do size = size + #e[2][j] end end
      end
      used = used + size
      if #entries < ask then break end
      if id ~= '>' then id = entries[#entries][1] end
      step = math.max(1, math.min(READ_CHUNK, math.floor((budget - used) * #entries / math.max(size, 1))))
    end
    if got == -2 or got == -4 then
      out[i] = got
    elseif #got > 0 then
      out[i] = got
    else
      local top = redis.call('XREVRANGE', stream, '+', '-', 'COUNT', 1)
      if top[1] then out[i] = top[1][1] else out[i] = '0-0' end
    end
  end
end
return out
""".replace("READ_CHUNK", str(READ_CHUNK))

# KEYS: lease, stream, claimed; ARGV: owner, group, our consumer, most, the other consumers' names...
# Up to ``most`` entries pending under those consumers moved to ours (XCLAIM JUSTID: no payload
# comes back), each id recorded in claimed (until its ack) in the same step: whoever reads the
# shard next knows them for claimed ones, this watcher or, should it stop first, the next owner.
# Returns {moved, ids XCLAIM dropped (deleted from the stream: Redis 7 drops them from the pending
# list)}; -1: not our lease.
_CLAIM = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
local most = tonumber(ARGV[4])
local moved, gone = 0, {}
for c = 5, #ARGV do
  if most <= 0 then break end
  local pending = redis.call('XPENDING', KEYS[2], ARGV[2], '-', '+', most, ARGV[c])
  if #pending > 0 then
    local args = {'XCLAIM', KEYS[2], ARGV[2], ARGV[3], '0'}
    for _, entry in ipairs(pending) do args[#args + 1] = entry[1] end
    args[#args + 1] = 'JUSTID'
    local got = redis.call(unpack(args))
    local kept = {}
    for _, id in ipairs(got) do kept[id] = true end
    for _, entry in ipairs(pending) do
      if not kept[entry[1]] then gone[#gone + 1] = entry[1] end
    end
    if #got > 0 then
      redis.call('SADD', KEYS[3], unpack(got))
      redis.call('EXPIRE', KEYS[3], LETTERED_TTL_S)
    end
    moved = moved + #got
    most = most - #pending
  end
end
return {moved, gone}
""".replace("LETTERED_TTL_S", str(LETTERED_TTL_S))

# KEYS: lease, stream, dead, lettered, claimed; ARGV: owner, group, dead maxlen, ahead ("1": the letters'
# entries are not acked here: each is kept in lettered, id -> mark, until its ack), n ids, ids...,
# then per dead letter: its entry's id, its entry's mark, 2k, field1, value1, ... fieldk, valuek.
# A letter whose entry is in lettered (the same id and mark) was written already (ahead, by this
# watcher or one before it): it is not written again. -1: not our lease.
_ACK = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
local n = tonumber(ARGV[5])
local i = 6 + n
while i <= #ARGV do
  local id, mark, c = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  if redis.call('HGET', KEYS[4], id) ~= mark then
    local args = {'XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*'}
    for j = i + 3, i + 2 + c do args[#args + 1] = ARGV[j] end
    redis.call(unpack(args))
    if ARGV[4] == '1' then redis.call('HSET', KEYS[4], id, mark) end
  end
  if ARGV[4] == '1' then redis.call('EXPIRE', KEYS[4], LETTERED_TTL_S) end
  i = i + c + 3
end
local acked = 0
local first = 6
local lettered = redis.call('EXISTS', KEYS[4]) == 1
local claimed = redis.call('EXISTS', KEYS[5]) == 1
while first < 6 + n do
  local last = math.min(first + ACK_CHUNK - 1, 5 + n)
  acked = acked + redis.call('XACK', KEYS[2], ARGV[2], unpack(ARGV, first, last))
  if lettered then redis.call('HDEL', KEYS[4], unpack(ARGV, first, last)) end
  if claimed then redis.call('SREM', KEYS[5], unpack(ARGV, first, last)) end
  first = last + 1
end
return acked
""".replace("ACK_CHUNK", str(ACK_CHUNK)).replace("LETTERED_TTL_S", str(LETTERED_TTL_S))

# KEYS: lease, stream, dead, unread; ARGV: owner, group, dead maxlen, reason. First, entries deleted
# before the group read them (a producer's MAXLEN / XTRIM / XDEL; the watchers' own trims, and the
# orphan sweep's, keep the entry at the group's last-delivered-id and every one after it):
# - the stream's first entry past the group's position (or the stream empty): the entries between
#   were trimmed. Redis 7 counts say how many were unread: `entries-added` A - `length` L entries
#   were deleted, `entries-read` R delivered (0 at 0-0, where groups start), none of them kept
#   (the first entry is past the position), so A - L - R unread (a trim that took read entries
#   only, none unread, is no loss). Lettered, and the group's counter set to A - L (XGROUP SETID
#   ... ENTRIESREAD), which makes the loss lettered once: Redis adds 1 per entry delivered, so
#   a trimmed gap read across (a loss between two checks) leaves it behind the position on
#   Redis 7.0 (Valkey 8 sets it right as it reads across: such a loss goes unseen there);
# - the group caught up (its position the stream's last id) with fewer entries read than added:
#   a trimmed loss it read across (Redis 7.0), lettered then, the counter set to A (an XDEL read
#   across sets the counter right as it goes when the tombstones are past the entry delivered: that
#   loss goes unseen);
# - the stream's max-deleted-entry-id past the group's position (not at 0-0: a group recreated
#   there would take any old XDEL for one): an entry deleted amid unread ones (once per id, kept
#   in unread, marked "unsettled"; how many, unknown). Redis 7.0 adds 1 for an entry delivered past
#   tombstones behind it, and the counts rules then lettered the same loss again (caught up) or a
#   loss that never was (a trim after): the first check once the group has read across the mark
#   settles it and letters nothing, the counter set to A when caught up, else made unknown until the
#   group reaches the end (Redis then sets it right; a trim loss in that window goes unseen, the one
#   the settling check itself finds too: Valkey 8 has no count then, Redis 7.0's is short by each
#   deleted entry read across, so a trim of read entries only could not be told from a loss).
# Otherwise a loss the group read across between two checks is not seen. Then trims below the
# oldest entry any group needs. -1: not our lease; else {trimmed, last delivered, entries lost (at least; 0:
# unknown), highest id deleted} (the delivered id empty: no loss found).
_TRIM = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
if redis.call('EXISTS', KEYS[2]) == 0 then return {0, '', 0, ''} end
local function key(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local function older(a, b)
  local am, as = key(a)
  local bm, bs = key(b)
  return am < bm or (am == bm and as < bs)
end
local floor, delivered, read = nil, nil, nil
for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[2])) do
  local info = {}
  for k = 1, #g, 2 do info[g[k]] = g[k + 1] end
  local need = info['last-delivered-id']
  if info['name'] == ARGV[2] then
    delivered, read = need, tonumber(info['entries-read'])
    if need == '0-0' and not read then read = 0 end
  end
  if tonumber(info['pending']) > 0 then
    need = redis.call('XPENDING', KEYS[2], info['name'])[2]
  end
  if floor == nil or older(need, floor) then floor = need end
end
local out = {0, '', 0, ''}
if delivered then
  local info, s = {}, redis.call('XINFO', 'STREAM', KEYS[2])
  for k = 1, #s, 2 do info[s[k]] = s[k + 1] end
  local added, length = tonumber(info['entries-added']), tonumber(info['length'])
  local first = info['first-entry'] and info['first-entry'][1] or nil
  local gone = info['max-deleted-entry-id']
  local lost, deleted, found = 0, '', false
  local mark = redis.call('GET', KEYS[4])
  local lettered = mark and string.match(mark, '^%S+') or nil
  local unsettled = mark and string.find(mark, ' unsettled', 1, true) ~= nil
  local caught_up = delivered == info['last-generated-id']
  if unsettled and not older(delivered, lettered) then
    -- the XDEL lettered below, read across since: Redis 7.0 counted 1 for the entry delivered past it,
    -- so the counts rules would letter it again (caught up) or a loss that never was (a later trim)
    redis.call('SET', KEYS[4], lettered)
    if caught_up and added and read and added > read then
      redis.call('XGROUP', 'SETID', KEYS[2], ARGV[2], delivered, 'ENTRIESREAD', added)
    elseif not (caught_up and added and read and added == read) then  -- (counted right: Valkey 8)
      redis.call('XGROUP', 'SETID', KEYS[2], ARGV[2], delivered)  -- unknown until it reaches the end
    end
  elseif added and read and (first == nil or older(delivered, first)) and added - length > read then
    lost, found = added - length - read, true
    redis.call('XGROUP', 'SETID', KEYS[2], ARGV[2], delivered, 'ENTRIESREAD', added - length)
  elseif added and read and caught_up and added > read then
    lost, found = added - read, true  -- (read across: every entry added is read or gone)
    redis.call('XGROUP', 'SETID', KEYS[2], ARGV[2], delivered, 'ENTRIESREAD', added)
  end
  if gone and delivered ~= '0-0' and older(delivered, gone) and lettered ~= gone then
    deleted, found = gone, true
    redis.call('SET', KEYS[4], gone .. ' unsettled')
  end
  if found then
    redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'reason', ARGV[4], 'id', deleted,
               'stream', KEYS[2], 'after', delivered, 'lost', lost)
    out = {0, delivered, lost, deleted}
  end
end
if floor ~= nil and floor ~= '0-0' then out[1] = redis.call('XTRIM', KEYS[2], 'MINID', '~', floor) end
return out
"""

Fields = list[bytes]
RawEntry = tuple[bytes, Fields | None]


@dataclass(frozen=True)
class ReadResult:
    """One fenced read: ``entries`` in stream order, ``top`` when there were none, ``lost`` lease."""

    entries: list[RawEntry]
    top: str = PEL_START
    lost: bool = False
    no_group: bool = False
    deferred: bool = False  # not read: the read's budget went to the shards before it
    not_stream: bool = False  # not read: the key holds another type (``ShardStreams.not_a_stream``)


class NotAStream(redis.ResponseError):
    """A shard's stream key holds another type (WRONGTYPE): the shard cannot be read until the
    key is renamed or deleted. A ``ResponseError``, so a caller that does not set the shard aside
    still treats it as the Redis error it was."""

    def __init__(self, shard: int, key: str, kind: str) -> None:
        held = f"a {kind}" if kind != "none" else "another type"  # (none: deleted since)
        super().__init__(f"{key} holds {held}, not a stream: rename or delete it; "
                         f"shard {shard} is not read until then")
        self.shard = shard
        self.key = key


def wrong_type(error: Exception) -> bool:
    """Whether ``error`` is Redis's WRONGTYPE (a command, or a script's ``redis.call``)."""
    return isinstance(error, redis.ResponseError) and "WRONGTYPE" in str(error)


class ShardStreams:
    """Fenced reads, acks, dead letters and trims on the shard streams of one prefix."""

    def __init__(self, client: redis.Redis, keys: Keys, owner: str) -> None:
        self.redis = client
        self.keys = keys
        self.owner = owner
        self._read = client.register_script(_READ)
        self._first: int | None = None  # the shard the last read began with
        self._next: int | None = None  # the first shard the last read deferred: the next one begins with it
        self._entry_bytes: dict[int, float] = {}  # per shard, the mean size of the entries its last read brought
        self.scripts_lost = False  # a read found Redis without its script: it restarted (or flushed them)
        self._ack = client.register_script(_ACK)
        self._claim = client.register_script(_CLAIM)
        self._trim = client.register_script(_TRIM)

    def _queue(self, pipe: Any, script: Any, keys: list[str], args: list[Any]) -> tuple[Any, list[str], list[Any]]:
        """Queue ``script`` on ``pipe`` as a bare EVALSHA; the call, to redo if Redis lacks the script.

        (A ``Script`` object in a pipeline makes redis-py send ``SCRIPT EXISTS``
        first: a second round trip on every read and every ack.)
        """
        pipe.evalsha(script.sha, len(keys), *keys, *args)
        return script, keys, args

    def _redo_missing(self, calls: list[tuple[Any, list[str], list[Any]]], replies: list[Any]) -> list[Any]:
        """Run again, through the script objects (which load them), the calls Redis did not
        know the script of (it restarted or flushed its script cache): nothing of those ran."""
        return [script(keys=keys, args=args) if isinstance(reply, redis.exceptions.NoScriptError) else reply
                for (script, keys, args), reply in zip(calls, replies)]

    def not_a_stream(self, shard: int) -> NotAStream:
        """The error for a shard whose key held another type, naming it (one ``TYPE`` call)."""
        key = self.keys.stream(shard)
        return NotAStream(shard, key, as_text(self.redis.type(key)))

    def ensure_group(self, shard: int) -> None:
        """Create the shard's group (and stream) reading from the start; no-op when it exists;
        ``NotAStream`` when the key holds another type."""
        try:
            self.redis.xgroup_create(self.keys.stream(shard), self.keys.group, id="0", mkstream=True)
            logger.info("consumer group created shard=%d group=%s", shard, self.keys.group)
        except redis.ResponseError as e:
            if wrong_type(e):
                raise self.not_a_stream(shard) from e
            if "BUSYGROUP" not in str(e):
                raise

    def read_many(self, starts: dict[int, str], count: int, budget: int | None = None) -> dict[int, ReadResult]:
        """Read up to ``count`` entries of each shard from its start id: one script call for
        all the shards (a round with nothing new costs one call, not one per shard), up to
        ``budget`` bytes of entries in all (``READ_BUDGET_BYTES``; and one chunk past it): the
        shards past it are ``deferred``. The next call starts at the first shard deferred (else at the shard after
        this call's first), so a shard of large entries that spends the budget keeps no other
        waiting more than one call (a turn by one shard each call left the shard after it
        deferred 7 calls in 8)."""
        if not starts:
            return {}
        shards = list(starts)
        if self._next in starts:
            first = shards.index(self._next)
        else:
            first = (shards.index(self._first) + 1) % len(shards) if self._first in starts else 0
        shards = shards[first:] + shards[:first]
        self._first = shards[0]
        keys = [key for n in shards for key in (self.keys.lease(n), self.keys.stream(n))]
        budget = READ_BUDGET_BYTES if budget is None else budget
        args: list[Any] = [self.owner, self.keys.group, count, budget]
        for n in shards:  # (a shard's first chunk: as many of its last read's entries as the budget takes)
            size = self._entry_bytes.get(n)
            args += [self.keys.consumer(n), starts[n],
                     max(1, min(count, READ_CHUNK, READ_CHUNK if size is None else int(budget // size)))]
        try:
            reply = self.redis.evalsha(self._read.sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:  # Redis restarted or flushed its scripts: nothing ran
            self.scripts_lost = True
            reply = self._read(keys=keys, args=args)
        results = {n: self._result(n, shard_reply) for n, shard_reply in zip(shards, reply)}
        self._next = next((n for n in shards if results[n].deferred), None)
        for n, result in results.items():
            if result.entries:
                self._entry_bytes[n] = sum(len(item) for _, fields in result.entries
                                           for item in fields or ()) / len(result.entries) or 1.0
        return results

    def _result(self, shard: int, reply: Any) -> ReadResult:
        if reply == -2:
            return ReadResult([], no_group=True)
        if reply == -1:
            return ReadResult([], lost=True)
        if reply == -3:
            return ReadResult([], deferred=True)
        if reply == -4:
            return ReadResult([], not_stream=True)
        if isinstance(reply, (bytes, str)):
            return ReadResult([], top=as_text(reply))
        return ReadResult([(entry[0], entry[1] or None) for entry in reply])

    def ack(self, shard: int, ids: list[str], dead: list[Letter], pipeline: Any | None = None, *,
            ahead: bool = False) -> bool:
        """Dead-letter ``dead`` and XACK ``ids`` atomically; False when not our lease. An entry
        whose letter was written ahead of its ack is not lettered again. ``ahead``: the
        letters' entries are acked later (the watcher: a run's refused entries, right before its
        append): their ids are kept in ``{p}:lettered:{n}`` until then.

        With ``pipeline`` the fenced script runs after the commands already queued
        there (the batch's state saves), all in one round trip.
        """
        return self.ack_many({shard: (ids, dead)}, pipeline, ahead=ahead)[shard]

    def ack_many(
        self, batches: dict[int, tuple[list[str], list[Letter]]], pipeline: Any | None = None,
        *, saved: Callable[[list[Any]], None] | None = None, ahead: bool = False,
    ) -> dict[int, bool]:
        """``ack`` for several shards in one round trip (after what ``pipeline`` holds);
        per shard, False when it is not our lease. ``saved`` gets the replies of what
        ``pipeline`` held (the state saves), in order."""
        pipe = pipeline if pipeline is not None else self.redis.pipeline(transaction=False)
        shards = [n for n, (ids, dead) in batches.items() if ids or dead]
        calls = []
        for n in shards:
            ids, dead = batches[n]
            args: list[Any] = [self.owner, self.keys.group, DEAD_LETTER_MAXLEN, int(ahead), len(ids), *ids]
            for letter in dead:
                args += [letter.entry_id, letter.mark, len(letter.fields), *letter.fields]
            keys = [self.keys.lease(n), self.keys.stream(n), self.keys.dead, self.keys.lettered(n),
                    self.keys.claimed(n)]
            calls.append(self._queue(pipe, self._ack, keys, args))
        replies = pipe.execute(raise_on_error=False) if len(pipe) else []
        acks = self._redo_missing(calls, replies[len(replies) - len(shards):])
        for reply in replies[:len(replies) - len(shards)]:
            if isinstance(reply, Exception):  # a state save failed: the next writer catches up
                logger.warning("state save failed before ack error=%s", reply)
        if saved is not None:
            saved(replies[:len(replies) - len(shards)])
        result = {n: True for n in batches}
        for n, reply in zip(shards, acks):
            if isinstance(reply, redis.ResponseError) and "NOGROUP" in str(reply):
                continue  # Redis lost the group: nothing is pending any more
            if wrong_type(reply):  # (the stream turned since the read, or {p}:dead: name the key)
                raise self._wrong_keys(n) or reply
            if isinstance(reply, Exception):
                raise reply
            result[n] = int(reply) >= 0
        return result

    def trim(self, shard: int) -> int:
        """Drop entries no group needs any more; the number trimmed. First dead-letter, once, the
        loss of entries deleted before the watchers' group read them (see ``UNREAD_DELETED``)."""
        keys = [self.keys.lease(shard), self.keys.stream(shard), self.keys.dead, self.keys.unread_deleted(shard)]
        try:
            reply = self._trim(keys=keys, args=[self.owner, self.keys.group, DEAD_LETTER_MAXLEN, UNREAD_DELETED])
        except redis.ResponseError as e:
            named = self._wrong_keys(shard) if wrong_type(e) else None
            if named is None:
                raise
            raise named from e
        if reply == -1:
            return 0
        trimmed, delivered, lost, deleted = int(reply[0]), as_text(reply[1]), int(reply[2]), as_text(reply[3])
        if delivered:
            logger.error("entries deleted unread shard=%d stream=%s after=%s lost=%s up_to=%s: a producer trimmed or "
                         "deleted entries the watchers had not read; their events are lost (never trim the shard "
                         "streams: docs/STREAM_PROTOCOL.md)", shard, self.keys.stream(shard), delivered,
                         lost or "unknown", deleted or "-")
            metrics.count_dead_letters([UNREAD_DELETED])
        if trimmed > 0:
            logger.debug("trimmed shard=%d entries=%d", shard, trimmed)
        return trimmed

    def wait(self, tops: dict[int, str], block_ms: int) -> bool:
        """Block until an entry newer than ``tops`` arrives on any shard; True when one did.
        ``NotAStream`` for a shard whose key holds another type (False: none does now)."""
        if not tops or block_ms <= 0:
            return False
        streams: dict[Any, Any] = {self.keys.stream(n): top for n, top in tops.items()}
        try:
            return bool(self.redis.xread(streams, count=1, block=block_ms))
        except redis.ResponseError as e:
            if not wrong_type(e):
                raise
            pipe = self.redis.pipeline(transaction=False)
            for key in streams:
                pipe.type(key)
            for n, kind in zip(tops, pipe.execute()):
                if as_text(kind) not in ("stream", "none"):
                    raise NotAStream(n, self.keys.stream(n), as_text(kind)) from e
            return False

    def _wrong_keys(self, shard: int) -> redis.ResponseError | None:
        """A script's WRONGTYPE made plain: ``NotAStream`` when the shard's stream is the key at
        fault, an error naming ``{p}:dead`` when that is (no letter can be written), else None."""
        stream, dead = self.keys.stream(shard), self.keys.dead
        pipe = self.redis.pipeline(transaction=False)
        pipe.type(stream)
        pipe.type(dead)
        kind, dead_kind = (as_text(reply) for reply in pipe.execute())
        if kind not in ("stream", "none"):
            return NotAStream(shard, stream, kind)
        if dead_kind not in ("stream", "none"):
            return redis.ResponseError(f"{dead} holds a {dead_kind}, not a stream: rename or delete it; "
                                       "no entry can be dead-lettered until then")
        return None

    def claim_foreign(self, shard: int, min_idle_ms: int) -> set[str]:
        """Move every entry pending under another consumer name into ``shard-{n}``; the ids of the
        shard's entries that were another's and are not acked yet (``{p}:claimed:{n}``, this take's
        and an earlier owner's: ``SessionStore.apply``'s ``claimed``).

        Claimed ``CLAIM_CHUNK`` at a time, ids only (the entries' payloads come through the
        budgeted reads: XAUTOCLAIM of the whole pending list brought every pending entry, the
        shard's own backlog too, in one reply, 800 MB to move one entry), each recorded in Redis
        as it is moved (remembered in memory only, one whose claimer stopped before applying it
        was written by the next owner after later entries of its session, out of order). Such
        consumers left with nothing pending and idle ``min_idle_ms`` are deleted.
        """
        stream, group, mine = self.keys.stream(shard), self.keys.group, self.keys.consumer(shard)
        try:
            consumers = self.redis.xinfo_consumers(stream, group)
        except redis.ResponseError:
            consumers = []
        foreign = [c for c in consumers if as_text(c["name"]) != mine]
        names = [c["name"] for c in foreign if int(c["pending"])]
        keys = [self.keys.lease(shard), stream, self.keys.claimed(shard)]
        moved = 0
        while names:
            reply = self._claim(keys=keys, args=[self.owner, group, mine, CLAIM_CHUNK, *names])
            if reply == -1:  # (the lease lost meanwhile: the shard's next owner claims the rest)
                break
            count, gone = int(reply[0]), [as_text(entry_id) for entry_id in reply[1]]
            moved += count
            if gone:
                self._letter_deleted(shard, gone)
            if count + len(gone) < CLAIM_CHUNK:
                break
        for c in self.redis.xinfo_consumers(stream, group) if foreign else []:
            if as_text(c["name"]) != mine and int(c["pending"]) == 0 and int(c["idle"]) >= min_idle_ms:
                self.redis.xgroup_delconsumer(stream, group, c["name"])
        if moved:
            logger.warning("claimed foreign entries shard=%d entries=%d", shard, moved)
        return {as_text(entry_id) for entry_id in self.redis.smembers(self.keys.claimed(shard))}

    def _letter_deleted(self, shard: int, ids: list[str]) -> None:
        """Dead-letter the entries another consumer held that were deleted from the stream before
        they were applied (XAUTOCLAIM dropped them from the pending list: they were lost without a
        word), as one of the watcher's own is (``producer.watcher.entries``)."""
        reason, stream = DELETED, self.keys.stream(shard)
        letters = [Letter(entry_id, entry_mark([]),
                          [b"reason", reason.encode(), b"id", entry_id.encode(), b"stream", stream.encode()])
                   for entry_id in ids]
        if self.ack(shard, [], letters):
            from producer.watcher.batch import dead_letter_fields  # (batch imports this module)

            for entry_id in ids:  # (the structured fields every dead-letter line carries: OPERATIONS, Logs)
                logger.warning("dead-lettered session=- stream=%s id=%s reason=%s", stream, entry_id, reason,
                               extra=dead_letter_fields(stream, entry_id, reason, []))
            metrics.count_dead_letters([reason] * len(ids))
