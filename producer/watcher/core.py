"""The watcher: stream shards -> session logs -> compaction triggers.

Loop (``run_once``): a *tick* when due (heartbeat, renew leases, rebalance,
trim), a fenced read of every owned shard (one round trip), then for the whole
round: decode the entries, look up in one round trip the uuids already taken
and the states of sessions not in the cache, apply each session's valid
entries through ``SessionStore.apply`` (under the log lock, with the lease
checked right before the write), check the thresholds after a ``turn_end``,
claim the round's triggers in one round trip (and RQ-enqueue the claimed
jobs), and finally, in one pipeline, every state save then each shard's fenced
script that dead-letters its bad entries and XACKs the rest. When nothing was read it blocks on ``XREAD`` for new entries.

Invariants:
- Per session, entries are applied in stream order and exactly once. Order:
  one owner per shard reads the shard's single consumer in order; the PEL is
  swept from ``0`` before new entries are read whenever an owner starts, after
  any Redis error and after a session was held back (that sweep ends once
  every held session was held again: see ``batch``). Exactly once: an entry
  is acked only after its append, and the store drops a redelivered entry
  whose ``streamId`` it already applied (the check and the write happen under
  the log lock, so even a paused former owner cannot write out of order).
- A session whose append failed (``LogWriteFailed``: disk full), or whose log
  another process held locked past ``LOG_LOCK_WAIT_S`` (``LogLocked``: a
  paused worker), is *held back*: none of its later entries are applied or
  acked until a PEL sweep (every ``HOLD_RETRY_S``) applies the failed one.
  Other sessions go on.
- A bad entry (see ``entries``), one read from a shard its session does not
  hash to, or one the store refuses (cwd bound to another session, turn id
  going backwards), is dead-lettered to ``{p}:dead``
  with its reason and acked; the watcher never crashes on input.
- Thresholds are checked from the state the store returns; the log is never
  read here. A redelivered ``turn_end`` is checked again: enqueueing coalesces.
- Every live watcher reads with one ``redis.shards`` (``leases``: one with
  another count is refused, ``ShardCountMismatch``, exit 2, not retried), and
  writes to the data dir it started on, which Redis records
  (``compactor.datadir.DataDirWatch``, each tick: ``DataDirChanged``, exit 2).
- A shard whose stream key holds another type (``NotAStream``: a stray key, a
  collision) is set aside: no cursor, so no read, wait or trim touches it; its
  lease is kept (another watcher would only fail the same way), and it is taken
  afresh at each tick until the key is fixed. The other shards go on.
- On stop: the batch in hand is finished, leases are released, the watcher
  leaves the registry.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import redis
from rq.utils import as_text

from compactor import ignored_at_start, metrics
from compactor.datadir import DataDirChanged, DataDirWatch
from compactor.heap import freeze_heap
from compactor.held import HELD_RECORD_TTL_S, HOLD, PRUNE
from compactor.keys import Keys
from compactor.queue import UNCHECKED, Trigger, parse_job_id, trigger_compactions
from compactor.shards import ShardCountMismatch, gone_quiet
from compactor.signal_safe import SignalSafeEvent
from compactor.store import UNREAD, Lookup, SessionStore
from events.config import Settings
from events.errors import CompactorError, InvalidConfig, InvalidEvent, InvalidInput, LogLocked
from events.log import SessionLog
from events.state import SessionState, decide
from events.tokens import get_encoding, model_max_input_tokens
from producer.watcher.batch import HELD_LOG_EVERY_S, BatchOutcome, ShardCursor, runs
from producer.watcher.entries import Entry, Rejected, decode_entry, misrouted, requalified_uuid
from producer.watcher.leases import RENEW_FRACTION, LeaseLost, ShardLeases
from producer.watcher.orphans import ORPHAN_SWEEP_INTERVAL_S, letter_orphans
from producer.watcher.streams import NotAStream, RawEntry, ReadResult, ShardStreams, entry_mark

logger = logging.getLogger(__name__)

UNDER_QUOTA_TICK_S = 0.25  # tick this often while owning fewer shards than the quota
TRIM_INTERVAL_S = 10.0  # trim an owned stream at most this often (one stream per tick)
STATE_CACHE_SESSIONS = 10_000  # session states kept in memory (saves a Redis read per apply)
MAX_BACKOFF_S = 5.0  # longest pause after repeated Redis errors
FIRE_EVERY_S = 0.005  # within a long round, claim and enqueue the triggers noted so far this often
DEFAULT_ENCODING = "cl100k_base"
# the longest the watcher waits for a log another process holds locked (a worker's read takes a few ms)
# before it holds that session back and goes on: one paused holder had stopped every session's appends
LOG_LOCK_WAIT_S = 0.5
WARM_UP_MODEL = "gpt-4"  # any model litellm knows: the first lookup imports litellm
NOT_A_STREAM_LOG_EVERY_S = 60.0  # a shard key holding another type is logged when met, then this often
# a Redis that restarted (another run_id) may have lost its last writes, the triggers and jobs of the
# turn_ends applied then among them: the sessions with a turn_end applied this recently are re-checked
RESTART_RECHECK_S = 900.0
RESTART_RECHECK_FIRE_EVERY = 100  # claim and enqueue the re-check's triggers this many sessions at a time


class Watcher:
    """Consumes the stream shards this process owns; see the module docstring."""

    def __init__(self, redis_client: redis.Redis, settings: Settings, *, name: str | None = None) -> None:
        self.settings = settings
        self.name = name or default_name()
        self.id = f"{self.name}:{secrets.token_hex(4)}"
        self.redis = bytes_client(redis_client)
        self.keys = Keys(settings.redis.prefix, settings.redis.shards)
        self.leases = ShardLeases(self.redis, self.keys, self.id, settings.watcher.lease_ms)
        self.streams = ShardStreams(self.redis, self.keys, self.id)
        self.store = SessionStore(self.redis, settings, lock_wait_s=LOG_LOCK_WAIT_S)
        self.cursors: dict[int, ShardCursor] = {}
        self._sessions: OrderedDict[str, tuple[SessionState, SessionLogRef]] = OrderedDict()
        self._turn_ends: OrderedDict[str, tuple[str, float]] = OrderedDict()  # session -> cwd, last turn_end (monotonic)
        self._run_id: str | None = None  # the Redis server's run_id, read at each tick (``_check_server``)
        self._info_refused = False
        self._behind_shards: set[int] = set()  # shards whose sessions' logs are to be compared with their states
        self._triggers: list[tuple[Trigger, SessionState]] = []  # this round's, in stream order
        self._saves: dict[int, str] = {}  # this round: the position of each state save in its pipeline -> session
        self._stop = threading.Event()
        self._started = False
        self._next_tick = 0.0
        self._next_orphan_sweep = 0.0  # (at the first tick: entries left past a lowered redis.shards)
        self._next_held_prune = 0.0
        self._next_beat = 0.0  # (within a long round: renewals and heartbeat, ``_beat_if_due``)
        self._data_dir: DataDirWatch | None = None  # (at the start)
        self._not_streams: dict[int, float] = {}  # shards set aside (``_set_aside``) -> last logged, monotonic
        self._hold_record = self.redis.register_script(HOLD)
        self._prune_held = self.redis.register_script(PRUNE)

    # -- the loop ---------------------------------------------------------------

    def run(self, stop_event: threading.Event) -> None:
        """Run until ``stop_event`` is set; then finish the batch in hand and release the leases."""
        self._stop = stop_event
        logger.info("watcher started id=%s shards=%d", self.id, self.keys.shards)
        errors = 0
        try:
            while not stop_event.is_set():
                try:
                    self.run_once(block_ms=self.settings.watcher.block_ms)
                    errors = 0
                except (ShardCountMismatch, DataDirChanged):  # (a configuration to fix: exit 2, not retried)
                    raise
                except Exception as e:  # noqa: BLE001 - Redis down, or a bug: never let the loop die
                    errors += 1
                    self._after_error(e, errors)
                    stop_event.wait(min(MAX_BACKOFF_S, 0.1 * 2 ** min(errors, 6)))
        finally:
            self.close()

    def run_once(self, block_ms: int = 0) -> int:
        """One iteration: tick if due, read owned shards, apply, ack; the number of entries handled."""
        self._start()
        if time.monotonic() >= self._next_tick:
            self._tick()
        handled = self._handle_round(self._read())
        if handled == 0 and block_ms > 0:
            self._wait(block_ms)
        return handled

    def close(self) -> None:
        """Release every lease and leave the registry (best effort when Redis is gone)."""
        try:
            self.leases.release_all()
        except redis.RedisError as e:
            logger.warning("watcher stop: could not release leases id=%s error=%s", self.id, e)
        self.cursors.clear()
        if self._data_dir is not None:  # (its mark in the data dir, recorded in Redis)
            self._data_dir.close()
        logger.info("watcher stopped id=%s", self.id)

    def _start(self) -> None:
        if not self._started:
            warm_up()
            self._data_dir = DataDirWatch(self.redis, self.settings)
            self._first_beat()  # (first: a shard count other live watchers do not share is refused
            for n in range(self.keys.shards):  # before this one creates any group or takes any lease)
                try:
                    self.streams.ensure_group(n)
                except NotAStream as e:
                    self._set_aside(e)
            self._warn_of_eviction()
            self._started = True

    def _first_beat(self) -> None:
        """The first heartbeat; refused for another shard count (``ShardCountMismatch``) only once
        the watchers keeping it in force are not just killed ones waited out (``gone_quiet``)."""
        try:
            self.leases.heartbeat()
        except ShardCountMismatch:
            if not gone_quiet(self.redis, self.keys, self.settings.watcher.lease_ms, me=self.id, stop=self._stop):
                raise
            self.leases.heartbeat()

    def _warn_of_eviction(self) -> None:
        """Warn when Redis may evict any key: a session's uuid index evicted while its state
        survived let a re-sent event into the log twice (the state vouches for the index)."""
        try:
            policy = as_text(self.redis.config_get("maxmemory-policy").get("maxmemory-policy") or "")
        except redis.RedisError:  # (CONFIG refused: a managed Redis, an ACL user)
            return
        if policy.startswith(("allkeys-", "volatile-")):  # (volatile-*: the states and indexes have a TTL)
            logger.warning("Redis evicts keys (maxmemory-policy %s): an evicted uuid index lets a re-sent "
                           "event into a log twice; run it with noeviction (see OPERATIONS)", policy)

    def _after_error(self, error: Exception, attempt: int) -> None:
        """Entries in hand may be half-done: re-sweep every PEL, tick at once when back. The cached
        states go too: a round that died after its appends, before its state saves ran, left them
        ahead of Redis (the log's), and a state used from the cache is saved with the uuids of its
        own appends only: the dead round's stayed out of the uuid index (a re-send of one of them
        was appended again), and their redelivered entries read as unwritten. Loaded from Redis,
        each is caught up from its log, the lines it missed indexed."""
        if isinstance(error, redis.RedisError):
            logger.error("redis error id=%s attempt=%d error=%s", self.id, attempt, error)
        else:
            logger.exception("watcher loop error id=%s attempt=%d", self.id, attempt)
        self._start_afresh()
        self._next_tick = 0.0

    def _start_afresh(self) -> None:
        """Forget the cached states and sweep every owned shard's PEL again (after an error, and
        after Redis restarted: what Redis holds may be behind what this watcher saw)."""
        self._sessions.clear()
        for cursor in self.cursors.values():
            cursor.restart_sweep()

    # -- tick: registry, leases, trimming -----------------------------------------

    def _tick(self) -> None:
        if self._data_dir is not None:  # (its id file and Redis's record: DataDirChanged, exit 2)
            self._data_dir.check()
        self._check_server()
        live = self.leases.heartbeat()
        self._next_beat = time.monotonic() + self.settings.watcher.lease_ms * RENEW_FRACTION / 1000
        self.leases.renew_due()
        acquired, _ = self.leases.rebalance(live)
        for n in acquired:  # (a lease lost and taken back in one tick: another owner may have left entries
            self.cursors.pop(n, None)  # pending meanwhile, so the shard is taken afresh, its PEL swept from 0)
        for n in sorted(self.leases.owned):  # just acquired, or a take that failed: retried each tick
            if n not in self.cursors:
                try:
                    self._take(n)
                except NotAStream as e:
                    self._set_aside(e)
                except redis.RedisError as e:  # (one line: a traceback each tick buried the reason, an ACL's)
                    logger.error("taking shard %d failed; retried next tick id=%s error=%s", n, self.id, e)
        for n in [n for n in self.cursors if n not in self.leases.owned]:
            del self.cursors[n]
        self._behind_shards &= set(self.cursors)
        if self._behind_shards:
            try:
                self._recheck_behind()
            except redis.RedisError:
                raise
            except Exception:  # noqa: BLE001 - a bug here must not stop the tick (nor every read after it)
                logger.exception("re-check of the sessions ahead of their state failed shards=%s",
                                 sorted(self._behind_shards))
                self._behind_shards.clear()
        self._trim_due()
        if time.monotonic() >= self._next_orphan_sweep:
            self._next_orphan_sweep = time.monotonic() + ORPHAN_SWEEP_INTERVAL_S
            try:
                letter_orphans(self.redis, self.keys, self.id)
            except redis.RedisError as e:  # (never the shards' work: a Redis that refuses SCAN, say)
                logger.warning("entries of streams past redis.shards not swept; again in %.0f s error=%s",
                               ORPHAN_SWEEP_INTERVAL_S, e)
        if time.monotonic() >= self._next_held_prune:  # (records of a watcher that stopped, or of a session
            self._next_held_prune = time.monotonic() + HELD_LOG_EVERY_S  # whose entries left otherwise)
            try:
                self._prune_held(keys=[self.keys.held])
            except redis.RedisError as e:
                logger.warning("stale held-back records not pruned; again in %.0f s error=%s", HELD_LOG_EVERY_S, e)
        under_quota = len(self.leases.owned) < self.leases.quota(live)
        interval = UNDER_QUOTA_TICK_S if under_quota else self.settings.watcher.lease_ms * RENEW_FRACTION / 1000
        self._next_tick = time.monotonic() + interval

    def _server_run_id(self) -> str | None:
        """Redis's run_id (INFO server): another one each time the server starts. None when INFO
        is refused (an ACL, a managed Redis): restarts then go unnoticed (``_check_server``)."""
        try:
            info = self.redis.info("server")
        except redis.ResponseError as e:
            if not self._info_refused:
                self._info_refused = True
                logger.warning("Redis refuses INFO: a restart that lost its last writes is not noticed, "
                               "and a trigger lost with them waits for the session's next turn_end error=%s", e)
            return None
        run_id = info.get("run_id")
        return as_text(run_id) if run_id else None

    def _check_server(self) -> None:
        """A Redis that restarted since the last tick (another run_id) may have lost its last
        writes: with ``appendfsync everysec`` up to a second or two of them (a write held back
        behind a slow fsync), without persistence all of them. A ``turn_end`` applied then was in
        the log, its entry acked, its job's claim and RQ job lost with Redis: nothing asked for
        that compaction again until the session's next ``turn_end`` (a session ending its work
        there stayed over its threshold). So the cached states go (as after an error: each is
        loaded from Redis again and caught up from its log, the lines Redis lost indexed again),
        every session with a ``turn_end`` applied here in the last ``RESTART_RECHECK_S`` is
        re-checked (``_recheck``), and so is every session of the owned shards whose log is
        ahead of its stored state (``_recheck_behind``: those another watcher applied). The
        run_id is recorded once that is done, so a re-check that met an error is made again."""
        run_id = self._server_run_id()
        if run_id is None:
            return
        if self._run_id is None or self._run_id == run_id:
            self._run_id = run_id
            return
        self._start_afresh()
        since = time.monotonic() - RESTART_RECHECK_S
        recent = [(session_id, cwd) for session_id, (cwd, at) in self._turn_ends.items() if at >= since]
        logger.warning("Redis restarted (run_id %s, was %s): it may have lost its last writes; re-checking "
                       "the %d sessions with a turn_end applied in the last %.0f s",
                       run_id, self._run_id, len(recent), RESTART_RECHECK_S)
        self._recheck(recent)
        self._behind_shards.update(self.cursors)
        self._run_id = run_id

    def _recheck_behind(self) -> None:
        """The sessions of the shards just taken (or of every owned shard after a restart) active
        in the last ``RESTART_RECHECK_S`` (``{p}:sessions``, by Redis's clock) whose log is longer
        than their stored state says, re-checked (``_recheck``). A log ahead of its state is a
        write whose state save did not land: its watcher died between the two (its entries,
        unacked, come again and trigger again), or Redis lost its last writes, the entries'
        with them, and so their trigger too; when the watcher that applied them died as well (a
        host's crash, a killed ``serve``), none remembered them, and the session stayed over its
        threshold, its status showing the old estimate. (A session Redis holds no state of at
        all, one that began in the writes it lost, is not found so: its next ``turn_end``.)"""
        shards = set(self._behind_shards)
        since = int(self.redis.time()[0]) - RESTART_RECHECK_S
        shard_of = self.keys.shard_of
        active = self.redis.zrangebyscore(self.keys.sessions, since, "+inf")
        mine = [sid for sid in (as_text(m) for m in active if isinstance(m, (bytes, str))) if shard_of(sid) in shards]
        pipe = self.redis.pipeline(transaction=False)
        for session_id in mine:
            pipe.hmget(self.keys.session(session_id), "log_size", "cwd")
        behind = []
        for session_id, (size, cwd) in zip(mine, pipe.execute() if mine else []):
            if not size or not cwd:
                continue
            try:
                log = self.store.log(session_id, as_text(cwd), create=False)
                if log.size() > int(size):
                    behind.append((session_id, as_text(cwd)))
            except (CompactorError, ValueError, OSError):  # (the next write says what is wrong with it)
                continue
        if behind:
            logger.info("re-checking %d sessions whose log is ahead of their stored state shards=%s",
                        len(behind), sorted(shards))
            self._recheck(behind)
        self._behind_shards -= shards  # (last: a Redis error meanwhile has them looked through again)

    def _recheck(self, sessions: list[tuple[str, str]]) -> None:
        """Each ``(session_id, cwd)``: its state caught up from its log and stored, its thresholds
        checked, a due job claimed (coalesced into one pending), as a worker's end re-checks one."""
        for n, (session_id, cwd) in enumerate(sessions, 1):
            self._beat_if_due()
            try:
                log = self.store.log(session_id, cwd, create=False)
                if not log.exists():  # (deleted meanwhile)
                    continue
                # (caught up, stored; a long catch-up renews the leases as it goes, as an apply does)
                state = self.store.apply(session_id, cwd, [], log=log, progress=self._beat_if_due).state
            except CompactorError as e:  # (its log locked past LOG_LOCK_WAIT_S, unreadable: its next turn_end)
                logger.warning("session not re-checked session=%s error=%s", session_id, e,
                               extra={"session_id": session_id})
                continue
            except redis.RedisError:
                raise
            except Exception:  # noqa: BLE001 - a bug in one session's re-check must not stop the others
                logger.exception("session not re-checked session=%s", session_id, extra={"session_id": session_id})
                continue
            self._check_thresholds(session_id, cwd, state)
            if n % RESTART_RECHECK_FIRE_EVERY == 0 and self._triggers:
                self._fire()
        if self._triggers:
            self._fire()

    def _take(self, shard: int) -> None:
        """A shard just acquired: make sure its group exists, adopt strays, sweep its PEL first.
        The states cached of its sessions are forgotten: a shard is taken again after its lease
        was lost, as when Redis restarted without its data (the states and uuid indexes gone,
        which a cached state matching its log would never have noticed)."""
        self.streams.ensure_group(shard)  # (first: a key of another type is retried each tick, at one call)
        shard_of = self.store.keys.shard_of
        for sid in [sid for sid in self._sessions if shard_of(sid) == shard]:
            del self._sessions[sid]
        claimed = self.streams.claim_foreign(shard, self.settings.watcher.claim_idle_ms)
        self.streams.trim(shard)  # (before reading: a producer's trim of unread entries is seen)
        self.cursors[shard] = ShardCursor(claimed=claimed)
        self._behind_shards.add(shard)  # (``_recheck_behind``, at the end of the tick)
        if self._not_streams.pop(shard, None) is not None:
            logger.warning("shard %d is read again: %s is a stream id=%s", shard, self.keys.stream(shard), self.id)

    def _set_aside(self, error: NotAStream) -> None:
        """A shard whose key holds another type: its cursor dropped (``_tick`` takes it again
        each tick, which succeeds once the key is deleted or a stream); logged when met, then
        every ``NOT_A_STREAM_LOG_EVERY_S`` (each try, each tick, logged it)."""
        self.cursors.pop(error.shard, None)
        now = time.monotonic()
        logged = self._not_streams.get(error.shard)
        if logged is None or now - logged >= NOT_A_STREAM_LOG_EVERY_S:
            self._not_streams[error.shard] = now
            logger.error("%s id=%s", error, self.id)

    def _trim_due(self) -> None:
        """Trim the owned stream trimmed longest ago, if due: one per tick, so the loop never
        stops for all shards' trims at once (8 shards' ~10 s of entries took 17 ms)."""
        now = time.monotonic()
        due = [(cursor.trimmed_at, n) for n, cursor in self.cursors.items()
               if now - cursor.trimmed_at >= TRIM_INTERVAL_S]
        if due:
            _, n = min(due)
            self.cursors[n].trimmed_at = now
            try:
                self.streams.trim(n)
            except NotAStream as e:
                self._set_aside(e)

    # -- reading ------------------------------------------------------------------

    def _read(self) -> dict[int, ReadResult]:
        now = time.monotonic()
        for cursor in self.cursors.values():
            if cursor.held and not cursor.sweeping and now >= cursor.retry_at:
                cursor.retry_held()
        starts = {n: c.start for n, c in self.cursors.items() if self.leases.holds(n)}
        if not starts:
            return {}
        results = self.streams.read_many(starts, self.settings.watcher.batch_size)
        if self.streams.scripts_lost:  # Redis restarted (or flushed its scripts) since the last read: the
            self.streams.scripts_lost = False  # cached states may be ahead of what it kept (``_check_server``),
            self._sessions.clear()  # so this round's entries are applied from its states, caught up from
            self._next_tick = 0.0  # the logs; the tick right after it re-checks the recent sessions
        return results

    def _wait(self, block_ms: int) -> None:
        """Block until new entries or the next tick, whichever comes first."""
        until_tick_ms = max(1, int((self._next_tick - time.monotonic()) * 1000))
        block = min(block_ms, until_tick_ms)
        tops = {n: c.top for n, c in self.cursors.items() if not c.sweeping}
        if tops:
            try:
                self.streams.wait(tops, block)
            except NotAStream as e:  # (it turned since the read)
                self._set_aside(e)
        else:
            self._stop.wait(block / 1000)

    # -- one shard's batch ----------------------------------------------------------

    def _handle_round(self, results: dict[int, ReadResult]) -> int:
        """Apply what one read brought from every shard; the number of entries handled.

        The Redis work of the round is shared by its shards: one lookup of the
        uuids already taken and of the states not in the cache (none when every
        session is cached and no event came with a uuid of its own), and one pipeline
        with every state save followed by
        each shard's fenced dead-letter + ack script. So a round costs three round
        trips (read, uuids, saves + acks) plus two (claim, enqueue) for its
        thresholds crossed, however many shards it touched (entries arriving live
        come in small rounds). A round longer than ``FIRE_EVERY_S`` claims and
        enqueues its triggers as it goes, every ``FIRE_EVERY_S``, so a trigger
        early in a big round does not wait for the whole round; always before
        the acks, and in stream order per session.
        """
        batches: dict[int, list[RawEntry]] = {}
        for shard, result in results.items():
            if self._settle_read(shard, result):
                batches[shard] = result.entries
        if not batches:
            return 0
        outcomes: dict[int, BatchOutcome] = {}
        by_session: dict[int, dict[str, list[Entry]]] = {}
        for shard, raw in batches.items():
            outcomes[shard], by_session[shard] = self._decode(shard, raw)
        saves = self.redis.pipeline(transaction=False)
        self._saves = {}
        # A uuid the watcher derived from the entry id is new unless the entry is a redelivery,
        # which the session's last applied stream id catches: only producers' uuids are looked up.
        wanted = {sid: [e.event for e in entries if not e.derived_uuid] for shard, sessions in by_session.items()
                  for sid, entries in sessions.items() if sid not in self.cursors[shard].held}
        # A cached session whose events carry a producer's uuid is checked to be still stored: its
        # uuid index is asked in the same round trip, and one Redis lost would pass a re-sent event.
        found = self.store.lookup(wanted, load=[sid for sid in wanted if sid not in self._sessions],
                                  check=[sid for sid, events in wanted.items() if events and sid in self._sessions])
        for sid in found.gone:  # Redis lost the state (and the uuid index) of a session held here
            logger.warning("session state gone from Redis session=%s: rebuilt from its log", sid)
            self._sessions.pop(sid, None)
            found.stored[sid] = None
        lost: set[int] = set()
        fired = time.monotonic()
        try:
            for shard, sessions in by_session.items():
                cursor = self.cursors[shard]
                try:
                    for session_id, entries in sessions.items():
                        if session_id in found.taken:
                            self._apply_session(shard, cursor, session_id, entries, outcomes[shard], saves,
                                                found)
                        if self._triggers and time.monotonic() - fired >= FIRE_EVERY_S:
                            self._fire()
                            fired = time.monotonic()
                except LeaseLost:
                    lost.add(shard)
            if self._triggers:
                self._fire()
        except BaseException:
            self._triggers.clear()  # the entries stay pending: their redelivery triggers again
            saves.execute()  # what was appended keeps its state save; nothing is acked
            raise
        acked = self.streams.ack_many({n: (o.acks, o.dead) for n, o in outcomes.items() if n not in lost}, saves,
                                      saved=self._forget_unsaved)
        for shard in lost:
            self._lose(shard, "lease expired before the write")
        for shard, ok in acked.items():
            if not ok:
                self._lose(shard, "lease taken before the ack")
                continue
            metrics.count_dead_letters(outcomes[shard].reasons)
            swept = self.cursors.get(shard)
            if swept is not None and swept.sweeping:
                swept.swept(as_text(batches[shard][-1][0]), set(by_session.get(shard, {})))
        return sum(len(raw) for raw in batches.values())

    def _settle_read(self, shard: int, result: ReadResult) -> bool:
        """Handle a shard's read that brought no entries (lost lease, lost group, nothing new);
        True when it brought entries to apply."""
        cursor = self.cursors.get(shard)
        if cursor is None:
            return False
        if result.lost:
            self._lose(shard, "lease taken")
            return False
        if result.deferred:  # (the read's budget went to other shards: read next round, as it is)
            return False
        if result.not_stream:
            self._set_aside(self.streams.not_a_stream(shard))
            return False
        if result.no_group:  # Redis lost its data (a restart without persistence), the states with it:
            logger.warning("consumer group missing, recreating shard=%d", shard)
            self._sessions.clear()  # none cached is trusted; each is loaded, or rebuilt from its log
            try:
                self.streams.ensure_group(shard)
            except NotAStream as e:  # (it turned since the read)
                self._set_aside(e)
                return False
            cursor.restart_sweep()
            return False
        if not result.entries:
            if cursor.sweeping:
                cursor.swept_all()
            cursor.top = result.top
            return False
        return True

    def _decode(self, shard: int, raw: list[RawEntry]) -> tuple[BatchOutcome, dict[str, list[Entry]]]:
        """A shard's entries by session, in stream order; the bad ones (and those of sessions of
        another shard) already rejected."""
        outcome = BatchOutcome(self.keys.stream(shard), whole_up_to=self.settings.limits.max_event_bytes)
        by_session: dict[str, list[Entry]] = {}
        elsewhere: dict[str, str | None] = {}  # per session of the batch: why not this shard, if not
        for entry_id, fields in raw:
            decoded = decode_entry(entry_id, fields, self.settings.limits.max_event_bytes)
            if isinstance(decoded, Rejected):
                outcome.reject(decoded.id, decoded.reason, decoded.fields)
                continue
            sid = decoded.session_id
            if sid not in elsewhere:
                elsewhere[sid] = misrouted(self.keys, sid, shard)
            reason = elsewhere[sid]
            if reason is not None:
                outcome.reject(decoded.id, reason, decoded.fields)
            else:
                by_session.setdefault(sid, []).append(decoded)
        return outcome, by_session

    def _apply_session(
        self, shard: int, cursor: ShardCursor, session_id: str, entries: list[Entry],
        outcome: BatchOutcome, saves: Any, found: Lookup,
    ) -> None:
        """Apply a session's entries run by run (see ``runs``); hold the session back on failure.
        A held session is logged when held, then every ``HELD_LOG_EVERY_S`` while it stays held
        (each retry, once a second, logged it: 480 lines in 16 s for 30 sessions), and once when
        it is applied again."""
        self._beat_if_due()
        for run in runs(entries):
            try:
                self._apply_run(shard, session_id, run[0].cwd, run, outcome, saves, found)
            except InvalidInput as e:
                for entry in run:
                    outcome.reject(entry.id, str(e), entry.fields)
            except (LeaseLost, redis.RedisError):
                raise
            except CompactorError as e:  # LogWriteFailed, LogCorrupted, LogLocked: the disk, not the entry
                if cursor.held_log_due(session_id):
                    logger.log(logging.WARNING if isinstance(e, LogLocked) else logging.ERROR,
                               "append failed, session held back session=%s shard=%d error=%s", session_id,
                               shard, e, extra={"session_id": session_id})
                    self._record_held(shard, cursor, session_id, str(e), saves)
                cursor.hold(session_id, run[0].id)
                return
            except Exception as e:
                if cursor.held_log_due(session_id):
                    logger.exception("apply crashed, session held back session=%s shard=%d", session_id, shard,
                                     extra={"session_id": session_id})
                    self._record_held(shard, cursor, session_id, f"{type(e).__name__}: {e}", saves)
                cursor.hold(session_id, run[0].id)
                return
        held_s = cursor.released(session_id)
        if held_s is not None:
            logger.warning("session applied again session=%s shard=%d after %.0fs held back", session_id, shard,
                           held_s, extra={"session_id": session_id})
        if held_s is not None or cursor.sweeping:  # (a sweep: it may be a session a former owner held)
            saves.hdel(self.keys.held, session_id)

    def _record_held(self, shard: int, cursor: ShardCursor, session_id: str, error: str, saves: Any) -> None:
        """Say in Redis that ``session_id`` is held back, and why (``compactor.held``): sent with the
        round's state saves, when the hold is logged (then once a minute while it lasts)."""
        self._hold_record(keys=[self.keys.held], client=saves,
                          args=[session_id, cursor.held_for(session_id), HELD_RECORD_TTL_S, error, self.id, shard])

    def _lettered_ahead(self, shard: int, run: list[Entry], ids: list[str]) -> set[str]:
        """Of ``ids`` (entries of ``run``), those dead-lettered ahead of their ack by a watcher that
        died before it: in ``{p}:lettered:{n}`` under their id with their content's mark."""
        by_id = {entry.id: entry for entry in run}
        wanted = [entry_id for entry_id in ids if entry_id in by_id]
        marks = self.redis.hmget(self.keys.lettered(shard), wanted) if wanted else []
        return {entry_id for entry_id, mark in zip(wanted, marks)
                if mark is not None and as_text(mark) == entry_mark(by_id[entry_id].fields)}

    def _apply_run(
        self, shard: int, session_id: str, cwd: str, run: list[Entry], outcome: BatchOutcome, saves: Any,
        found: Lookup,
    ) -> None:
        log = self._log(session_id, cwd)
        stored = found.stored.pop(session_id, UNREAD)  # read this round; only the first run's is current
        ahead: set[str] = set()  # the ids the guard lettered: only their acks are left

        def guard(rejected: list[tuple[dict[str, Any], InvalidEvent]]) -> None:
            """Right before the append: our lease still, and the refused entries' letters written
            (once: kept in ``{p}:lettered:{n}`` until the ack, a retry, a restart or another
            watcher does not write them again)."""
            self.leases.check(shard)
            refused = _by_stream_id(rejected)
            letters = [outcome.letter(entry.id, str(refused[entry.id]), entry.fields)
                       for entry in run if entry.id in refused]
            if letters and not self.streams.ack(shard, [], letters, ahead=True):
                raise LeaseLost(shard)
            ahead.update(letter.entry_id for letter in letters)

        pending_claimed = self.cursors[shard].claimed
        claimed = {entry.id for entry in run if entry.id in pending_claimed} if pending_claimed else set()
        result = self.store.apply(
            session_id, cwd, [e.event for e in run], log=log, pipeline=saves, taken=found.taken[session_id],
            guard=guard, cached=self._cached(session_id), stored=stored, progress=self._keep_alive(shard),
            claimed=claimed, lettered=lambda ids: self._lettered_ahead(shard, run, ids),
            requalify=lambda event: requalified_uuid(session_id, event),
        )
        pending_claimed -= claimed
        if result.discarded:  # (its whole first batch refused: no log, no stored state)
            self._sessions.pop(session_id, None)
        else:
            self._remember(session_id, result.state, log)
        if result.saved_at is not None:
            self._saves[result.saved_at] = session_id
        # (counted once appended, not at the round's end: a watcher killed mid-round lost the count of
        # what it had appended, its redelivery then a duplicate, never counted)
        metrics.count_ingested(result.appended)
        refused = _by_stream_id(result.rejected)
        for entry in run:
            if entry.id in refused:
                outcome.reject(entry.id, str(refused[entry.id]), entry.fields, written=entry.id in ahead)
            else:
                outcome.acks.append(entry.id)
        if run[-1].event["type"] == "turn_end" and run[-1].id not in refused:
            self._turn_ended(session_id, cwd)
            self._check_thresholds(session_id, cwd, result.state)
        logger.debug("applied session=%s shard=%d entries=%d appended=%d duplicates=%d",
                     session_id, shard, len(run), len(result.appended), result.duplicates)

    def _beat_if_due(self) -> None:
        """Between the sessions of a round, once a renewal is due: renew the leases due and
        heartbeat. A round of sessions held back (0.5 s each, their logs locked) or a stalled disk
        ran past the leases: the shards went to other watchers, and the registry forgot this one
        (a newcomer with another shard count was let in). ShardCountMismatch when one was."""
        now = time.monotonic()
        if now < self._next_beat:
            return
        self._next_beat = now + self.settings.watcher.lease_ms * RENEW_FRACTION / 1000
        self.leases.renew_due()
        self.leases.heartbeat()

    def _keep_alive(self, shard: int) -> Callable[[], None]:
        """Called after each event of a run is stamped: a run of large events (their tokens counted,
        ~1 s per 4 MiB) outlived the lease, the write was refused, and the same run was read again,
        forever: the shard stopped, and the watcher's other leases lapsed meanwhile. Every so often
        (a sixth of the lease) the leases due are renewed; LeaseLost when ``shard``'s is gone."""
        every = self.settings.watcher.lease_ms * RENEW_FRACTION / 2000
        next_at = time.monotonic() + every

        def keep_alive() -> None:
            nonlocal next_at
            if time.monotonic() >= next_at:
                self.leases.renew_due()
                self.leases.check(shard)
                next_at = time.monotonic() + every

        return keep_alive

    def _check_thresholds(self, session_id: str, cwd: str, state: SessionState) -> None:
        """SPEC §5 after a turn_end: note an LLM or micro trigger when due (``_fire`` claims it).

        An LLM job depends on the breaker: the claim reads the failure counter
        itself and falls back to what the state calls for with the breaker open
        (a micro job, or nothing).
        """
        ctx = self.settings.context
        kind = decide(state, ctx, breaker_open=False)
        if kind is None:
            return
        if_open = decide(state, ctx, breaker_open=True) if kind == "llm" else UNCHECKED
        self._triggers.append((Trigger(session_id, cwd, kind, if_open), state))

    def _fire(self) -> None:
        """Claim the round's triggers in one round trip and enqueue the claimed jobs.

        Every turn_end's trigger is claimed, in stream order, as if one by one: of
        two triggers of one session in a round the first claims and the second is
        coalesced into it (recorded for the re-check when that job ends).

        Runs before the round's acks: a Redis error leaves the entries pending,
        so their redelivery triggers again (a trigger is never lost); a claim
        whose enqueue failed is freed, and the next turn_end checks again.
        """
        noted = list(self._triggers)
        self._triggers.clear()
        try:
            job_ids = trigger_compactions(self.redis, self.settings, [trigger for trigger, _ in noted])
        except redis.RedisError:
            raise
        except Exception:  # noqa: BLE001 - the events are in the log; the next turn_end checks again
            logger.exception("enqueue failed sessions=%s", [t.session_id for t, _ in noted])
            return
        for (trigger, state), job_id in zip(noted, job_ids):
            _log_trigger(trigger, state, job_id)

    def _forget_unsaved(self, replies: list[Any]) -> None:
        """Drop the cached state of each session whose save found its hash gone (-1): deleted by
        an operator (README's remedy for a repaired log) or lost. The cache matched the log, so
        it was used as is, and a save that may not create the hash never stored it again: the
        session was missing from ``status`` until an event with a producer's uuid. Now the next
        event of the session rebuilds it from the log (the uuid index with it)."""
        saves, self._saves = self._saves, {}
        for position, session_id in saves.items():
            reply = replies[position] if position < len(replies) else None
            if isinstance(reply, Exception):  # (refused: OOM, MISCONF; the cache is ahead of Redis, as above)
                self._sessions.pop(session_id, None)
            elif reply == -1 and self._sessions.pop(session_id, None):
                logger.info("session state gone from Redis session=%s: rebuilt at its next event", session_id)

    def _lose(self, shard: int, reason: str) -> None:
        self.leases.forget(shard, reason)
        self.cursors.pop(shard, None)

    # -- per-session cache -------------------------------------------------------------

    def _cached(self, session_id: str) -> SessionState | None:
        cached = self._sessions.get(session_id)
        return cached[0] if cached else None

    def _log(self, session_id: str, cwd: str) -> SessionLog:
        cached = self._sessions.get(session_id)
        if cached is not None and cached[1].cwd == cwd:
            return cached[1].log
        return SessionLogRef(cwd, self.store.log(session_id, cwd)).log

    def _turn_ended(self, session_id: str, cwd: str) -> None:
        """Note a turn_end applied (re-checked if Redis restarts: ``_check_server``)."""
        self._turn_ends[session_id] = (cwd, time.monotonic())
        self._turn_ends.move_to_end(session_id)
        if len(self._turn_ends) > STATE_CACHE_SESSIONS:
            self._turn_ends.popitem(last=False)

    def _remember(self, session_id: str, state: SessionState, log: SessionLog) -> None:
        """Keep the state the store returned (it checks it against the log size before use)."""
        self._sessions[session_id] = (state, SessionLogRef(state.cwd, log))
        self._sessions.move_to_end(session_id)
        if len(self._sessions) > STATE_CACHE_SESSIONS:
            self._sessions.popitem(last=False)


@dataclass(frozen=True)
class SessionLogRef:
    """A session's log object with the cwd it was built for (building one validates the path)."""

    cwd: str
    log: SessionLog


def warm_up() -> None:
    """Load the tokenizer and litellm's model map (seconds, once) before taking any lease."""
    get_encoding(DEFAULT_ENCODING)
    model_max_input_tokens(WARM_UP_MODEL)


def default_name() -> str:
    """``{hostname}-{pid}``: a label for logs and the registry (leases add a random token)."""
    return f"{socket.gethostname()}-{os.getpid()}"


def bytes_client(client: redis.Redis) -> redis.Redis:
    """``client`` itself when it returns bytes, else a twin that does (entries may hold invalid UTF-8)."""
    pool = client.connection_pool
    kwargs: dict[str, Any] = dict(pool.connection_kwargs)
    if not kwargs.get("decode_responses"):
        return client
    kwargs["decode_responses"] = False
    return redis.Redis(connection_pool=redis.ConnectionPool(connection_class=pool.connection_class, **kwargs))


def main(settings: Settings, *, name: str | None = None) -> None:
    """Run a watcher until SIGTERM/SIGINT (``compactor watch``); needs ``redis.url``."""
    if not settings.redis.url:
        raise InvalidConfig("redis.url", "the watcher alone needs a Redis URL (`compactor serve` embeds one)")
    stop = SignalSafeEvent()

    def _stop(signum: int, _frame: FrameType | None) -> None:
        logger.info("watcher stopping signal=%s", signal.Signals(signum).name)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # (a closed terminal killed it outright,
        if not ignored_at_start(signum):                            # its leases held until they ran out;
            signal.signal(signum, _stop)                            # one ignored at the start stays so)
    client = redis.Redis.from_url(settings.redis.url)
    try:
        watcher = Watcher(client, settings, name=name)
        metrics.init_series()
        prepare_heap()
        watcher.run(stop)
    finally:
        client.close()


def prepare_heap() -> None:
    """Load what the loop needs (``warm_up`` imports litellm), then ``freeze_heap``: an import
    after the freeze would put its objects back in every full collection's way."""
    warm_up()
    freeze_heap()


def _log_trigger(trigger: Trigger, state: SessionState, job_id: str | None) -> None:
    """One INFO line per job enqueued, naming the kind its id says (with the breaker open an LLM
    trigger's claim may enqueue a micro job); DEBUG only when none was (coalesced into the pending
    job, or nothing to do with the breaker open): a busy session coalesces on nearly every turn."""
    if job_id is None:
        logger.debug("compaction not enqueued session=%s called_for=%s estimate=%d window=%d",
                     trigger.session_id, trigger.kind, state.prompt_estimate, state.window)
        return
    parsed = parse_job_id(job_id)
    kind = parsed[1] if parsed is not None else trigger.kind
    logger.info("compaction triggered session=%s kind=%s job=%s estimate=%d window=%d",
                trigger.session_id, kind, job_id, state.prompt_estimate, state.window,
                extra={"session_id": trigger.session_id, "job_id": job_id, "kind": kind, "outcome": "enqueued"})


def _by_stream_id(rejected: list[tuple[dict[str, Any], InvalidEvent]]) -> dict[Any, InvalidEvent]:
    """The refused events' errors by the stream entry id each came from."""
    return {event.get("streamId"): error for event, error in rejected}
