"""Per-session state in Redis, kept in step with the session log.

The log is the source of truth; the state hash ``{p}:session:{id}`` is a fold
over it that records how many bytes of the log it has seen (``logSize``).

Invariants, for every writer (watcher or worker):
- All appends to a log happen inside ``SessionLog.lock()``; the state is read,
  brought up to date with any lines past ``logSize`` (a crashed writer's), and
  saved with the new ``logSize`` — inside the same lock, or, when the watcher
  defers it into its batch pipeline, only if no state that has seen more of
  the log was stored meanwhile (``SAVE_STATE``), unless it was rebuilt from the
  whole log (the log shrank, or Redis lost the state): that one is the log's.
  Two writers never interleave, and any state that lags the log is caught up by
  the next writer before it is used.
- An entry whose ``streamId`` is at or below the session's last applied one is
  already in the log: it is reported as a duplicate and not written again.
- An event that fails a check (a turn id going backwards, a uuid the session
  already has) is refused with an ``InvalidEvent`` and not written; a session
  bound to another cwd refuses the whole batch.
- ``{p}:uuids:{id}`` holds every uuid in the log (SPEC §3: unique within the
  session). It is written with the state, extended when lines past ``logSize``
  are folded, and rebuilt with the state from the log when Redis lost it. Only a
  state rebuilt with it creates the session's hash (``SAVE_STATE``): a hash
  that exists vouches for the index.
- Missing or stale state is rebuilt from the log, never guessed.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson
import redis
from rq.utils import as_text

from compactor.keys import Keys
from events.config import Settings
from events.checks import COVERING, check_covered_turns
from events.errors import InvalidEvent, InvalidInput, LogCorrupted, LogLocked, LogWriteFailed, SessionNotFound
from events.log import SessionLog, first_time
from events.models import TURN_SCOPED_TYPES
from events.state import SessionState, fold, rebuild, rebuild_with_view, stored_state
from events.tokens import TOKEN_COUNT_FIELD, TOKEN_ENCODING_FIELD, arguments_json, encoding_for_model, stamp
from events.view import ContextView, VisibleTurns, extend_view

logger = logging.getLogger(__name__)

# a reader's store (the API, ``compactor status``) waits at most this long for a log's lock (to store
# a state rebuilt under other settings), then answers from the log read without it: one stopped
# process holding one log's lock had held the request as long, and the session list with it
READER_LOCK_WAIT_S = 0.5

Guard = Callable[[list[tuple[dict[str, Any], InvalidEvent]]], None]  # called with the events refused so far

_T = TypeVar("_T")
BIG_TEXT_CHARS = 256 * 1024  # an event with this much text is counted while the caller's progress is kept
KEEP_ALIVE_POLL_S = 0.05  # how often ``progress`` is called while such an event is counted
BIG_LOG_BYTES = 4 * 1024 * 1024  # a log (or a tail) this long is read and folded while the caller's progress is kept
UUID_INDEX_CHUNK = 10_000  # uuids per SADD when indexing a whole log

# A session's state and uuid index expire after this long without a write, and it leaves the
# active sessions' index: they are derived from its log, so a session that comes back is
# rebuilt from it (one read), as after Redis lost them. Without it every session ever seen kept
# ~6 kB of Redis for good (the uuid index growing with its events).
STATE_IDLE_TTL_S = 7 * 86_400

# KEYS: the session hash, its uuid index, the active sessions. ARGV: the new logSize, the
# "1" for a writer's save ("": a reader's, the session's place among the active ones and its TTL kept), the
# session id, "1" to store the state only if no state that has seen more of the log is stored,
# "1" when the state may create the hash (it and the uuid index were rebuilt from the whole
# log), the idle TTL (s), the number n of hash fields, n field/value pairs, the
# uuids of the lines appended (indexed even when the state is not stored: they are in the log).
# A state that may not create the hash finds it gone when Redis lost it (a restart without
# persistence, an eviction, the idle TTL): nothing is written then (-1), so the next writer,
# finding no state, rebuilds the state and the uuid index from the log. (Storing it would have
# left an index of the new uuids only, under a state whose logSize matches the log: nobody would
# have rebuilt it, and a producer's re-sent event would have been taken for a new one.) The hash
# and the index get their TTL together, in this script alone, so neither outlives the other;
# the sessions idle past it leave the index (scored by Redis's TIME: by the writers' clocks, a
# host behind ranked its sessions' activity behind the others', and pruned them late).
SAVE_STATE = """
if ARGV[5] ~= '1' and redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local ttl = tonumber(ARGV[6])
local n = tonumber(ARGV[7])
local first, last = 8 + 2 * n, #ARGV
for i = first, last, 1000 do
  redis.call('SADD', KEYS[2], unpack(ARGV, i, math.min(i + 999, last)))
end
if ARGV[2] ~= '' then
  local now = redis.call('TIME')
  local at = tonumber(now[1]) + tonumber(now[2]) / 1000000
  redis.call('ZADD', KEYS[3], string.format('%.6f', at), ARGV[3])
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', '(' .. (tonumber(now[1]) - ttl))
end
local stored_newer = false
if ARGV[4] == '1' then
  local stored = redis.call('HGET', KEYS[1], 'log_size')
  stored_newer = stored and stored ~= '' and tonumber(stored) > tonumber(ARGV[1])
end
if not stored_newer then redis.call('HSET', KEYS[1], unpack(ARGV, 8, 7 + 2 * n)) end
local left = ttl
if ARGV[2] == '' then  -- a reader's save: the state ages as it did (the index with it)
  left = redis.call('TTL', KEYS[1])
  if left <= 0 then left = ttl end
end
redis.call('EXPIRE', KEYS[1], left)
redis.call('EXPIRE', KEYS[2], left)
if stored_newer then return 0 end
return 1
"""

# KEYS: the active sessions' index. ARGV: the idle TTL (s), then optionally start and stop. The
# sessions idle past the TTL leave the index, then its size is returned, or with start and stop
# that page of it, most recent first, with the scores (one round trip): a writer's save prunes it
# (``SAVE_STATE``), but after a week with no write at all every session was still in it with its
# state expired: ``status`` said none had a log in the data dir ("is it the data dir they were
# written to?"), the API listed none while the overview and ``compactor_sessions`` counted them all.
PRUNE_IDLE = """
local now = redis.call('TIME')
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. (tonumber(now[1]) - tonumber(ARGV[1])))
if ARGV[3] then return redis.call('ZREVRANGE', KEYS[1], ARGV[2], ARGV[3], 'WITHSCORES') end
return redis.call('ZCARD', KEYS[1])
"""


def recent_sessions(client: redis.Redis, keys: Keys, start: int, stop: int) -> list[tuple[str, float]]:
    """The active sessions ranked ``start`` to ``stop`` (inclusive) by last activity, most recent
    first, with its time (unix s, Redis's clock); those idle past ``STATE_IDLE_TTL_S`` pruned first."""
    flat = client.eval(PRUNE_IDLE, 1, keys.sessions, STATE_IDLE_TTL_S, start, stop)
    return [(as_text(flat[i]), float(flat[i + 1])) for i in range(0, len(flat), 2)]


def known_sessions(client: redis.Redis, keys: Keys) -> int:
    """How many sessions are active: written to within ``STATE_IDLE_TTL_S``, by Redis's clock (the
    index's older members, whose states expired, pruned first)."""
    return int(client.eval(PRUNE_IDLE, 1, keys.sessions, STATE_IDLE_TTL_S))


class _Unread:
    """The default of ``stored``: the caller did not read the state; ``current`` does."""


UNREAD = _Unread()
Stored = SessionState | None | _Unread  # a ``stored`` argument: the state a caller read, or ``UNREAD``


@dataclass
class Lookup:
    """``SessionStore.lookup``: per session, the uuids already taken; the states it read; the
    sessions it was to check whose state is gone (Redis lost it)."""

    taken: dict[str, set[str]]
    stored: dict[str, SessionState | None]
    gone: set[str] = field(default_factory=set)


@dataclass
class ApplyResult:
    """What ``SessionStore.apply`` did: the new state, the lines written, what was refused.

    ``view`` is the view (built without messages) of the whole log after the
    append, when the state was rebuilt from the caller's ``known`` events; else None.
    ``before`` is the prompt estimate of the log right before the append (the lines
    another writer added since the caller last looked included). ``saved_at`` is the
    position of the state's save in the caller's ``pipeline`` (its reply: 1 stored, 0 a
    later state is there, -1 the session's hash is gone, so a state not rebuilt from the
    whole log was not stored: Redis lost it, or an operator deleted it).
    """

    state: SessionState
    before: int = 0
    appended: list[dict[str, Any]] = field(default_factory=list)
    duplicates: int = 0
    rejected: list[tuple[dict[str, Any], InvalidEvent]] = field(default_factory=list)
    view: ContextView | None = None
    saved_at: int | None = None
    discarded: bool = False  # the log this call created held nothing once the batch was refused: removed


def stream_id_key(stream_id: str) -> tuple[int, int]:
    """A Redis stream id (``ms-seq``) as a sortable tuple."""
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)


def is_applied(stream_id: str | None, last_applied: str | None) -> bool:
    """Whether the entry ``stream_id`` is at or before the last one applied."""
    if not stream_id or not last_applied:
        return False
    return stream_id_key(stream_id) <= stream_id_key(last_applied)


def _not_applied(events: list[dict[str, Any]], last_applied: str | None) -> list[dict[str, Any]]:
    """The events whose ``streamId`` is not at or before ``last_applied`` (``is_applied``)."""
    if not last_applied:
        return events
    last = stream_id_key(last_applied)
    return [e for e in events if not (stream_id := e.get("streamId")) or stream_id_key(stream_id) > last]


class SessionStore:
    """Loads, saves and advances session state next to the logs."""

    def __init__(self, client: redis.Redis, settings: Settings, *, lock_wait_s: float | None = None,
                 stores_rebuilt: bool = True) -> None:
        self.redis = client
        self.settings = settings
        self.lock_wait_s = lock_wait_s  # of the logs this store opens (``SessionLog.lock_wait_s``)
        # ``up_to_date`` stores a state it rebuilt (the service's readers); False: a one-off reader whose
        # settings may be another's (``compactor status`` run without the stack's config rewrote every
        # listed state under its own, and the watcher rewrote them back)
        self.stores_rebuilt = stores_rebuilt
        self.keys = Keys(settings.redis.prefix, settings.redis.shards)
        # session -> (stored size, log size) of the last "log shrank" warned of: a rebuild that fails
        # (a corrupt line) leaves the state as it was, and each retry (once a second) warned again
        # (and of the last "state catch-up" said, for the same reason: ``first_time``)
        self._shrank_warned: dict[str, tuple[int, int]] = {}
        self._caught_up_said: dict[str, tuple[int, int]] = {}

    def log(self, session_id: str, cwd: str, *, create: bool = True) -> SessionLog:
        """The session's log; ``create=False``: one its lock never creates (SessionNotFound)."""
        return SessionLog(self.settings.data_dir, cwd, session_id, fsync=self.settings.log.fsync, create=create,
                          lock_wait_s=self.lock_wait_s)

    def load_current(self, session_id: str) -> SessionState | None:
        """``load``, but a state derived under other context settings (the operator changed them
        since) is rebuilt from its log and stored: the status list, ``compactor status`` and
        ``GET /api/sessions/{id}`` showed the old estimate and window until the session's next
        event, an idle one for good. As stored when its log is gone or unreadable."""
        state = self.load(session_id)
        return self.up_to_date(state) if state is not None else None

    def up_to_date(self, state: SessionState) -> SessionState:
        """``load_current`` of a state already loaded."""
        if state.settings == self.settings.context.state_fingerprint:
            return state
        session_id = state.session_id
        try:
            log = self.log(session_id, state.cwd, create=False)
            if not self.stores_rebuilt:  # (read without the lock, stored nowhere)
                size = log.complete_size()
                return rebuild(session_id, state.cwd, log.read() if size else [], self.settings.context, size)
            return self.refresh(session_id, state.cwd, log, active=False)
        except (SessionNotFound, LogCorrupted, LogWriteFailed, LogLocked, InvalidInput) as e:  # (LogWriteFailed: the lock
            # opens the log to write; a log this reader may not write, one read-only one, failed the whole list)
            logger.info("state of session=%s kept as stored (derived under other settings): %s", session_id, e)
            return state

    def load(self, session_id: str) -> SessionState | None:
        """The stored state, or None when Redis has none."""
        raw = self.redis.hgetall(self.keys.session(session_id))
        return stored_state({as_text(k): as_text(v) for k, v in raw.items()}, session_id)

    def save(
        self, state: SessionState, pipeline: Any | None = None, *, if_newer: bool = False,
        uuids: Sequence[str] = (), create: bool = False, active: bool = True,
    ) -> None:
        """Store the state, index ``uuids`` (of the lines just appended) and mark the session
        active, in one command (``SAVE_STATE``; executed here unless ``pipeline`` is given).

        ``if_newer`` stores the state only when the stored one has not seen more of the
        log (a deferred save must not overwrite a worker's later one). ``create``: the
        state and the uuid index were rebuilt from the whole log, so the state may create
        the hash; any other state is stored only over one that is there. ``active`` False (a
        reader's save, nothing written to the log): the session's last activity is left as it was.
        """
        pipe = pipeline if pipeline is not None else self.redis.pipeline(transaction=False)
        mapping = state.to_hash()
        flat = [item for pair in mapping.items() for item in pair]
        pipe.eval(SAVE_STATE, 3, self.keys.session(state.session_id), self.keys.uuids(state.session_id),
                  self.keys.sessions, state.log_size, "1" if active else "", state.session_id,
                  "1" if if_newer else "0",
                  "1" if create else "0", STATE_IDLE_TTL_S, len(mapping), *flat, *uuids)
        if pipeline is None:
            pipe.execute()

    def rebuild(self, session_id: str, cwd: str, log: SessionLog | None = None, *,
                check_cwd: bool = False) -> SessionState:
        """Fold the whole log from scratch (does not save); ``check_cwd``: refuse a ``cwd`` other
        than the one the log's ``session_meta`` records (``check_logged_cwd``), for a caller that
        has no stored state to compare with. (Not after an append: what is written stays.)"""
        log = log or self.log(session_id, cwd)
        with log.lock():
            size = log.complete_size()
            events = log.read() if size else []
        if check_cwd:
            check_logged_cwd(session_id, cwd, _first_session_meta(events))
        return rebuild(session_id, cwd, events, self.settings.context, size)

    def refresh(self, session_id: str, cwd: str, log: SessionLog | None = None, *,
                active: bool = True) -> SessionState:
        """Rebuild the state and the uuid index from the log and save them (``active`` False: a
        reader's, the session's last activity left as it was: ``save``)."""
        log = log or self.log(session_id, cwd)
        with log.lock():
            return self._reindex(session_id, cwd, log, active=active)[0]

    def current(
        self,
        session_id: str,
        cwd: str,
        log: SessionLog | None = None,
        cached: SessionState | None = None,
        *,
        stored: Stored = UNREAD,
    ) -> SessionState:
        """The state brought up to date with the log on disk (call with the log locked).

        ``cached`` (a caller's in-process copy) is used as is when it matches the
        log's size, which saves the Redis read on the watcher's hot path;
        ``stored`` is what ``lookup`` just read from Redis for this session.
        """
        return self._current(session_id, cwd, log or self.log(session_id, cwd), cached, stored)[0]

    def _current(
        self, session_id: str, cwd: str, log: SessionLog, cached: SessionState | None,
        stored: Stored, pipeline: Any | None = None, progress: Callable[[], None] | None = None,
    ) -> tuple[SessionState, set[str] | None, set[str], bool]:
        """``current``; the log's uuids when the state was rebuilt from the whole log (the uuid
        index was rebuilt with it, on ``pipeline`` when given), else None; the uuids of the
        lines past the stored ``logSize`` that were caught up (a crashed writer's; indexed now);
        and whether the stored state had seen more of the log than it holds (it shrank).
        ``progress`` (the watcher's lease renewal) is kept while a big log is read and folded."""
        size = log.complete_size()  # a crashed writer's torn tail is not part of the log
        state = cached if cached is not None and cached.log_size == size else None
        if state is None:
            state = self.load(session_id) if isinstance(stored, _Unread) else stored
        _check_cwd(session_id, cwd, state)
        if (state is not None and size < state.log_size  # (it was silent: 47 lines gone, no word)
                and first_time(self._shrank_warned, session_id, (state.log_size, size))):
            logger.warning("log shrank session=%s path=%s from=%d to=%d bytes (truncated, replaced or restored from an "
                           "older copy): its state is rebuilt from what is left", session_id, log.path,
                           state.log_size, size, extra={"session_id": session_id})
        if state is None or size < state.log_size:
            return (*self._reindex(session_id, cwd, log, pipeline, progress), set(), state is not None)
        fresh = state.settings == self.settings.context.state_fingerprint
        if not fresh:
            logger.info("state rebuilt session=%s: derived under other settings (%s)", session_id,
                        state.settings or "none recorded")
        caught_up: set[str] = set()
        if size > state.log_size:
            # (a session held back on a bad line catches up at every retry, about once a second)
            if first_time(self._caught_up_said, session_id, (state.log_size, size)):
                logger.info("state catch-up session=%s from=%d to=%d", session_id, state.log_size, size)
            tail = log.read(state.log_size)
            self._index_uuids(session_id, tail)
            caught_up = set(_uuids(tail))
            if fresh:
                state = state.copy()
                folded = state  # False: the tail changes the past
                fresh = _keeping_progress(lambda: _fold_all(folded, tail, self.settings),
                                          progress if size - folded.log_size >= BIG_LOG_BYTES else None)
                state.log_size = size
        if not fresh:
            return self._rebuilt(session_id, cwd, log, progress), None, caught_up, False
        return state, None, caught_up, False

    def _rebuilt(self, session_id: str, cwd: str, log: SessionLog,
                 progress: Callable[[], None] | None) -> SessionState:
        """``rebuild`` for a caller holding the log's lock; a log of ``BIG_LOG_BYTES`` or more is
        read and folded while ``progress`` is kept (``_keeping_progress``)."""
        size = log.complete_size()

        def work() -> SessionState:
            return rebuild(session_id, cwd, log.read() if size else [], self.settings.context, size)

        return _keeping_progress(work, progress if size >= BIG_LOG_BYTES else None)

    def _reindex(
        self, session_id: str, cwd: str, log: SessionLog, pipeline: Any | None = None,
        progress: Callable[[], None] | None = None, *, active: bool = True,
    ) -> tuple[SessionState, set[str]]:
        """Rebuild the state and the uuid index from the whole log (Redis lost them); the
        state and the log's uuids. The index is rebuilt at once (for an empty log: with the
        state); with ``pipeline`` the caller saves the state (queued there, with ``create``),
        else it is stored here. (Queued with the state, the index stayed empty until the
        watcher's round ended: its next run of the session's entries, from the state cached,
        took the redelivered ones for entries of a lost stream and dead-lettered them as
        duplicate uuids; and a worker's line indexed meanwhile was deleted with it.)
        A log of ``BIG_LOG_BYTES`` or more is read and folded while ``progress`` is kept: a
        watcher that rebuilt a 100 MB log without stamps (17 s) outlived its shard leases, lost
        them all and rebuilt it again, every shard stalled, for good."""
        size = log.complete_size()

        def work() -> tuple[list[dict[str, Any]], SessionState]:
            events = log.read() if size else []
            return events, rebuild(session_id, cwd, events, self.settings.context, size)

        events, state = _keeping_progress(work, progress if size >= BIG_LOG_BYTES else None)
        check_logged_cwd(session_id, cwd, _first_session_meta(events))
        uuids = {e["uuid"] for e in events if isinstance(e.get("uuid"), str)}
        pipe = pipeline if pipeline is not None and not uuids else self.redis.pipeline(transaction=False)
        pipe.delete(self.keys.uuids(session_id))
        self._index_uuids(session_id, events, pipe)
        if pipeline is None:
            self.save(state, pipe, create=True, active=active)  # the hash again, vouching for the index
        if pipe is not pipeline:
            pipe.execute()
        return state, uuids

    def _index_uuids(self, session_id: str, events: list[dict[str, Any]], pipeline: Any | None = None) -> None:
        pipe = pipeline if pipeline is not None else self.redis.pipeline(transaction=False)
        self._index(session_id, _uuids(events), pipe)
        if pipeline is None and len(pipe):
            pipe.execute()

    def _index(self, session_id: str, uuids: Sequence[str], pipe: Any) -> None:
        for start in range(0, len(uuids), UUID_INDEX_CHUNK):
            pipe.sadd(self.keys.uuids(session_id), *uuids[start:start + UUID_INDEX_CHUNK])

    def taken_uuids(self, events_by_session: dict[str, list[dict[str, Any]]]) -> dict[str, set[str]]:
        """Per session, the uuids among its events that its log already holds (one round trip)."""
        return self.lookup(events_by_session).taken

    def lookup(self, events_by_session: dict[str, list[dict[str, Any]]], load: Iterable[str] = (),
               check: Iterable[str] = ()) -> Lookup:
        """In one round trip: per session, the uuids among its events its log already
        holds; the stored state of each session in ``load`` (None when Redis has none); and
        which sessions of ``check`` (those a caller holds a state of) Redis has no state of."""
        asked = {sid: [e["uuid"] for e in events if isinstance(e.get("uuid"), str)]
                 for sid, events in events_by_session.items()}
        asked = {sid: uuids for sid, uuids in asked.items() if uuids}
        loading, checking = list(load), list(check)
        if not asked and not loading and not checking:
            return Lookup({sid: set() for sid in events_by_session}, {})
        pipe = self.redis.pipeline(transaction=False)
        for sid, uuids in asked.items():
            pipe.smismember(self.keys.uuids(sid), uuids)
        for sid in loading:
            pipe.hgetall(self.keys.session(sid))
        for sid in checking:
            pipe.exists(self.keys.session(sid))
        replies = pipe.execute()
        hits = dict(zip(asked, replies))
        taken = {sid: {u for u, hit in zip(asked.get(sid, []), hits.get(sid, [])) if hit}
                 for sid in events_by_session}
        states = replies[len(asked):len(asked) + len(loading)]
        stored = {sid: stored_state(raw, sid) for sid, raw in zip(loading, states)}
        gone = {sid for sid, there in zip(checking, replies[len(asked) + len(loading):]) if not there}
        return Lookup(taken, stored, gone)

    def apply(
        self,
        session_id: str,
        cwd: str,
        events: Iterable[dict[str, Any]],
        *,
        log: SessionLog | None = None,
        guard: Guard | None = None,
        pipeline: Any | None = None,
        cached: SessionState | None = None,
        known: list[dict[str, Any]] | None = None,
        known_view: ContextView | None = None,
        derive: Callable[[list[dict[str, Any]], int], SessionState] | None = None,
        taken: set[str] | None = None,
        stored: Stored = UNREAD,
        progress: Callable[[], None] | None = None,
        claimed: Collection[str] = (),
        lettered: Callable[[list[str]], Collection[str]] | None = None,
        requalify: Callable[[dict[str, Any]], str | None] | None = None,
    ) -> ApplyResult:
        """Append ``events`` to the session's log exactly once and advance its state.

        An event carrying a ``streamId`` at or below the session's last applied
        one is counted as a duplicate and skipped when its line is in the log
        (else see ``_unwritten``); an event whose turn id goes
        backwards is returned in ``rejected`` and not written. ``guard`` runs
        inside the lock right before the write, with ``rejected`` (the watcher
        checks its shard lease there and dead-letters the refused entries: a
        crash after the write would otherwise leave them to be taken for
        duplicates of the lines written after them, and acked without a letter).
        With ``pipeline`` the state write is queued there (only if no
        later state was stored meanwhile) and the caller executes it, so a batch of
        sessions costs one round trip; a save lost with a crash is harmless, the
        next writer folds the lines past the stored ``logSize``.
        The state passed in as ``cached`` is never modified.

        ``known`` (workers) is every event of the log as the caller read it while
        holding this same ``log``'s lock (so nothing was appended since): a
        rebuild after a rollback/compact/summary then folds ``known`` + the
        appended lines instead of reading the log again, and ``result.view``
        is that rebuild's view. A ``known`` whose length does not match the
        lines the state has seen is not trusted (the log is read instead).
        ``known_view`` (optional) is the view of ``known`` (messages not needed):
        after one compact or one summary the new view is then derived from it
        (``events.view.extend_view``) instead of built over the whole log.
        ``derive`` (optional, with ``known``) gives the state after the append from
        the lines as written and the new log size (the LLM job's
        ``events.state.state_after_summary``): no view is built then (``result.view``
        stays None).
        ``taken`` is the result of ``taken_uuids`` for these events when the
        caller looked a whole batch up in one round trip (the watcher: it alone
        writes the session's producer events); it grows with the uuids applied,
        and is corrected when the state (and the uuid index) had to be rebuilt
        from the log. ``stored`` is the state ``lookup`` read in that round trip
        (see ``current``). ``progress`` (optional) is called after each event is stamped
        (its tokens counted: ~1 s for a 4 MiB output), before the lock's write: the watcher
        renews its shard leases there, so a long run does not outlive them.
        ``claimed``: the stream ids of entries the watcher claimed from another consumer of its
        group; one at or below the last applied id is refused unless its line is in the log
        (``_unwritten``). ``requalify``: the uuid an event whose uuid the watcher derived from its
        entry id takes when another event's line holds that uuid (None: not derived); see
        ``_unwritten``.
        """
        log = log or self.log(session_id, cwd)
        new = not log.exists()
        events = events if isinstance(events, list) else list(events)
        if new:  # the lock would create it: refuse another cwd's session before that
            self._refuse_other_cwd(session_id, cwd, cached, stored, log,
                                   opens=bool(events) and events[0].get("type") == "session_meta")
        with log.lock(), _discarded_if_it_fails(log, new):
            pipe = pipeline if pipeline is not None else self.redis.pipeline(transaction=False)
            current, log_uuids, caught_up, shrunk = self._current(session_id, cwd, log, cached, stored, pipe,
                                                                  progress)
            state = current.copy()
            if known is not None and len(known) != state.events:
                logger.warning("known events ignored session=%s: %d lines known, state has seen %d",
                               session_id, len(known), state.events)
                known = None
            batch = list(events)
            fresh = _not_applied(batch, state.last_stream_id)
            result = ApplyResult(state, before=state.prompt_estimate, duplicates=len(batch) - len(fresh))
            if result.duplicates:
                fresh = self._unwritten(session_id, batch, fresh, claimed, log_uuids, caught_up, result, lettered,
                                        requalified=self._requalified(log, batch, fresh, log_uuids, requalify))
            if log_uuids is not None:  # the index was rebuilt from the log: it, not the lookup, is right
                if taken is None:
                    taken = set()
                taken.clear()  # all of the log's, not this run's alone: the caller's later runs of the round
                taken.update(log_uuids)  # share the set, and their lookup ran before the index was rebuilt
            elif taken is None:
                taken = self.taken_uuids({session_id: fresh})[session_id]
            elif caught_up:  # looked up before the lock: a crashed writer's lines were not indexed then
                taken.update(e["uuid"] for e in fresh if e.get("uuid") in caught_up)
            needs_rebuild = self._admit(state, fresh, result, taken, self._replayer(log, known, result),
                                        progress)
            if result.appended:
                if guard is not None:
                    guard(result.rejected)
                state.log_size = log.append(result.appended)
                if needs_rebuild and known is not None and derive is not None:
                    state = derive(result.appended, state.log_size)
                elif needs_rebuild and known is not None:
                    ctx = self.settings.context
                    view = extend_view(known_view, result.appended, ctx) if known_view is not None else None
                    state, result.view = rebuild_with_view(
                        session_id, cwd, known + result.appended, ctx, state.log_size, view)
                elif needs_rebuild:
                    state = self._rebuilt(session_id, cwd, log, progress)
            elif new and log.discard_if_empty():  # a refused batch leaves no session behind
                result.discarded = True
                return result
            result.state = state
            # a state rebuilt because the log shrank (truncated, or restored from an older copy) is the
            # log's: it replaces the one that saw more bytes. Any other deferred save (the watcher's,
            # sent at the end of its round) yields to a later one: a state rebuilt for a session Redis
            # had no state of was stored over the micro job's that ran meanwhile (a backlog after a
            # watcher restart), and status showed the session over its threshold, uncompacted, until
            # its next event
            # (active: something appended, now or by a writer whose save was lost (caught up), or a state
            # rebuilt for a session Redis had none of; a batch refused whole, a redelivery of what the state
            # has seen, or a job that found nothing to write is no activity: it moved the session to the top
            # of every list, and kept one sent only refused entries from ever idling out)
            self.save(state, pipe, if_newer=pipeline is not None and not shrunk,
                      uuids=_uuids(result.appended), create=log_uuids is not None,
                      active=bool(result.appended) or log_uuids is not None or bool(caught_up))
            if pipeline is None:
                pipe.execute()
            else:
                result.saved_at = len(pipe) - 1
        return result

    def _unwritten(
        self, session_id: str, batch: list[dict[str, Any]], fresh: list[dict[str, Any]],
        claimed: Collection[str], log_uuids: set[str] | None, caught_up: set[str], result: ApplyResult,
        lettered: Callable[[list[str]], Collection[str]] | None = None, requalified: Collection[int] = (),
    ) -> list[dict[str, Any]]:
        """``fresh`` and the events at or before the last applied stream id (counted as
        ``duplicates``) whose line is not in the log (their uuid is not in the index; call
        under the lock), in batch order, but for the ``claimed`` ones among them, refused.

        A ``claimed`` one is an entry a hand-run reader took from the watchers' group, claimed
        by a later owner after later entries of its session were applied: out of order,
        refused (a dead letter; acked as a duplicate it was lost without a trace). Another is
        an entry the watcher refused, dead-lettered ahead of its ack, then had redelivered
        after a crash: a duplicate, its letter written; ``lettered`` (stream ids -> those
        lettered so, by id and content: the watcher's ``{p}:lettered:{n}``) tells them. Any
        other is an entry of a stream Redis lost and that numbers its entries from a lower id
        than the log's last (a producer had chosen ids in the future; a Redis restored on a
        host whose clock is behind): acked as duplicates, every new event of the session was
        dropped, unsaid, until the clock passed the old id. It is applied. Without
        ``lettered`` (no watcher), the entries are applied when the stream's newest entry is
        below that last id (``_renumbered``): that alone dropped the older of a lost stream's
        new entries once its newest had passed the old id (a clock 10 s behind, 12 s of
        entries before the watcher read them)."""
        kept = {id(event) for event in fresh}
        stale = [event for event in batch if id(event) not in kept and isinstance(event.get("uuid"), str)]
        if not stale:
            return fresh
        present: list[Any]
        if log_uuids is not None:  # just rebuilt from the log (queued, not yet stored)
            present = [event["uuid"] in log_uuids for event in stale]
        else:
            present = self.redis.smismember(self.keys.uuids(session_id), [event["uuid"] for event in stale])
        unwritten: list[dict[str, Any]] = []
        for event, there in zip(stale, present):
            if id(event) in requalified:  # a new entry under an old entry's id: not that line's redelivery
                there = False
            if there or event["uuid"] in caught_up:  # (caught up: written by a writer that crashed before its save)
                continue
            if event.get("streamId") in claimed:
                result.duplicates -= 1
                result.rejected.append((event, InvalidEvent(
                    "streamId", f"{event.get('streamId')} is not in the log, and later entries of the session "
                                "were applied (taken from the watchers' group by another reader?): out of order, "
                                "not written")))
                continue
            unwritten.append(event)
        if not unwritten:
            return fresh
        if lettered is not None:
            refused = lettered([str(event.get("streamId")) for event in unwritten])
            unwritten = [event for event in unwritten if str(event.get("streamId")) not in refused]
        elif not self._renumbered(session_id, result.state.last_stream_id):
            unwritten = []
        revived = {id(event) for event in unwritten}
        result.duplicates -= len(revived)
        if not revived:
            return fresh
        logger.warning("session=%s: %d entries below the last applied stream id %s are not in the log: applied "
                       "(the stream was lost, and its ids start lower now)", session_id, len(revived),
                       result.state.last_stream_id)
        return [event for event in batch if id(event) in kept or id(event) in revived]

    @staticmethod
    def _requalified(log: SessionLog, batch: list[dict[str, Any]], fresh: list[dict[str, Any]],
                     log_uuids: set[str] | None, requalify: Callable[[dict[str, Any]], str | None] | None,
                     ) -> set[int]:
        """The stale events (at or below the last applied id) of a state just rebuilt from the log
        (Redis lost it: ``log_uuids``) whose uuid the watcher derived from the entry id, that a line
        of other content holds: a lost stream renumbered from below, and a new entry given an old
        one's id (a producer's own ids; a restored Redis's clock behind) took its uuid, and was
        acked as its redelivery, dropped without a word. Each takes ``requalify``'s uuid (one of
        its content too: its own redelivery is known again); their ``id()``s. A redelivery's
        content is its line's (a producer's token stamp aside: the watcher's replaces it)."""
        if log_uuids is None or requalify is None:
            return set()
        kept = {id(event) for event in fresh}
        derived = [event for event in batch if id(event) not in kept and event.get("uuid") in log_uuids
                   and requalify(event) is not None]
        if not derived:
            return set()
        wanted = {event["uuid"] for event in derived}
        lines = {line["uuid"]: line for line in log.read() if line.get("uuid") in wanted}
        moved = set()
        for event in derived:
            line = lines.get(event["uuid"], {})
            if _unstamped(line) != _unstamped(event):  # (as bytes: True and 1 are two values here)
                event["uuid"] = requalify(event)
                if event["uuid"] not in log_uuids:
                    moved.add(id(event))
        return moved

    def refusals(self, state: SessionState, events: list[dict[str, Any]],
                 taken: set[str]) -> list[tuple[dict[str, Any], InvalidEvent]]:
        """What ``apply`` would refuse of ``events`` (none of them applied yet) on the session whose
        state is ``state``, when that is the log's (the caller made sure), ``taken`` being the
        uuids of ``events`` its log has (``taken_uuids``): checked as ``apply`` checks them, the
        log replayed past a rollback; nothing is written, locked or counted (no refusal depends on
        a token count: a 4 MB output took tiktoken seconds). For a batch holding a rollback: the
        turns after it are relative to what it leaves visible."""
        log = self.log(state.session_id, state.cwd)
        result = ApplyResult(state.copy(), before=state.prompt_estimate)
        self._admit(result.state, list(events), result, set(taken), self._replayer(log, None, result),
                    counted=False)
        return result.rejected

    def _renumbered(self, session_id: str, last_applied: str | None) -> bool:
        """Whether the session's stream no longer holds entries up to ``last_applied``: its newest
        is below it, so the stream was lost (or trimmed whole) and numbers its entries lower now."""
        if not last_applied:
            return False
        newest = self.redis.xrevrange(self.keys.stream_for(session_id), count=1)
        newest_id = newest[0][0] if newest else None
        return newest_id is None or stream_id_key(as_text(newest_id)) < stream_id_key(last_applied)

    def _admit(
        self, state: SessionState, events: list[dict[str, Any]], result: ApplyResult, taken: set[str],
        replayed: Callable[[], VisibleTurns], progress: Callable[[], None] | None = None, *, counted: bool = True,
    ) -> bool:
        """Stamp and fold each acceptable event into ``state``; True when a rebuild is due.

        Once an event cannot be folded (a rollback, compact or summary: it changes
        the past), ``state`` is left as it was. The turn order of the events is
        checked against the currentTurnId as the batch goes; from a rollback on,
        as ``replayed()`` keeps it: the visible turns of the log and of the lines
        admitted so far, told each line admitted after (a rollback lowers it to
        what it leaves visible). So an event is refused or not whatever batch it
        arrives in.
        """
        needs_rebuild = False
        order: SessionState | None = state  # folded while it can be; None: a rebuild is due
        current = state.current_turn_id  # the currentTurnId so far
        turns: VisibleTurns | None = None  # (from the first rollback on)
        ctx = self.settings.context
        # the session's encoding as each event comes (``events.state.fold``'s rule: a turn_end's model,
        # a session_meta's before any turn ended): a session_meta naming gpt-4o in the batch of turn 1
        # had turn 1 stamped with the state's cl100k_base before it, so every reader recounted it
        encoding, ended = state.encoding, state.last_ended_turn > 0
        for event in events:
            try:
                _check_unique(event, taken)
                kind = event.get("type")
                if kind in COVERING:  # (a compact or summary leaves the current turn as it was)
                    check_covered_turns(current, event)
                elif kind in TURN_SCOPED_TYPES:
                    _check_turn_order(current, event)
            except InvalidEvent as e:
                result.rejected.append((event, e))
                continue
            if kind == "rollback" and turns is None:  # (the log read and its turns noted once: read and
                turns = _keeping_progress(replayed, progress)  # rebuilt at each rollback, 128 took 26 s)
            if turns is not None:
                turns.add(event)
                current = turns.current
            elif kind in TURN_SCOPED_TYPES and type(turn := event.get("turnId")) is int:  # (``fold``'s rule)
                current = max(current, turn + 1 if kind == "turn_end" else turn)
            if isinstance(uuid := event.get("uuid"), str):  # taken once admitted: a refused one's is free
                taken.add(uuid)
            model = event.get("model")
            if kind == "turn_end":
                encoding, ended = (encoding_for_model(model) if isinstance(model, str) and model else encoding), True
            elif kind == "session_meta" and not ended and isinstance(model, str) and model:
                encoding = encoding_for_model(model)
            # a producer's stamp is never trusted: replaced (not ``counted``, a dry run: a stamp of 0 tokens)
            line = _stamped(event, encoding, progress) if counted else {
                **event, TOKEN_COUNT_FIELD: 0, TOKEN_ENCODING_FIELD: encoding}
            if progress is not None:
                progress()
            result.appended.append(line)
            if order is not None and not fold(order, line, ctx):
                needs_rebuild = True
                order = None
        return needs_rebuild

    @staticmethod
    def _replayer(log: SessionLog, known: list[dict[str, Any]] | None,
                  result: ApplyResult) -> Callable[[], VisibleTurns]:
        """What returns the visible turns of the log (``known``: its events, when the caller has
        them) and of the lines admitted so far (call under the lock)."""
        return lambda: VisibleTurns([*(known if known is not None else log.read()), *result.appended])

    def _refuse_other_cwd(self, session_id: str, cwd: str, cached: SessionState | None, stored: Stored,
                          log: SessionLog, *, opens: bool = False) -> None:
        """Refuse a session bound to another cwd (its log is elsewhere) before this cwd's log is
        created: a refusal leaves nothing on disk (SPEC §3). With no state of the session in
        Redis (a new session, or Redis lost its state), a log of it under another project binds
        it: after a loss, one entry of another cwd had started a second log and taken the
        session, every later entry of its own cwd dead-lettered (or, in the same round, split
        over the two logs). That look costs a ``stat`` per project of the data dir (13 ms with
        1 000 projects): a batch that ``opens`` with a ``session_meta``, as a new session's
        first does (STREAM_PROTOCOL), is taken for a new session and not looked for."""
        state = cached if cached is not None else self.load(session_id) if isinstance(stored, _Unread) else stored
        _check_cwd(session_id, cwd, state)
        if state is None and not opens:
            for other in log.elsewhere():
                try:
                    meta = other.first_of_type("session_meta")
                except LogCorrupted:  # (unreadable: it is there all the same)
                    meta = None
                logged = meta.get("cwd") if meta is not None else None
                if isinstance(logged, str):
                    raise bound_elsewhere(session_id, logged, cwd)
                raise InvalidEvent("cwd", f"session {session_id} is logged under another cwd ({other.path}; no "
                                          f"session_meta records which), not {cwd!r}")


def _stamped(event: dict[str, Any], encoding: str, progress: Callable[[], None] | None) -> dict[str, Any]:
    """``stamp(event, encoding)``; with ``progress``, an event of ``BIG_TEXT_CHARS`` or more is
    counted while ``progress`` is kept (``_keeping_progress``): one output of a single character
    repeated (``"." * 4_000_000``) took tiktoken ~7 s to count, longer than a watcher's lease, so
    the write was refused and the entry read again, forever, every shard of the watcher stalled."""
    if progress is None or _text_chars(event) < BIG_TEXT_CHARS:
        return stamp(event, encoding)
    return _keeping_progress(lambda: stamp(event, encoding), progress)


def _keeping_progress(work: Callable[[], _T], progress: Callable[[], None] | None) -> _T:
    """``work()``, run in a thread of its own while ``progress`` is called every
    ``KEEP_ALIVE_POLL_S`` in this one (tiktoken lets go of the GIL while it counts, and Python
    code gives it up every few ms); without ``progress``, here. What ``progress`` raises (the
    lease lost) is raised here; ``work`` then ends on its own, its result unused."""
    if progress is None:
        return work()
    done: list[_T] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            done.append(work())
        except BaseException as e:  # raised in the caller's thread below
            failed.append(e)

    worker = threading.Thread(target=run, name="keeping-progress", daemon=True)
    worker.start()
    worker.join(KEEP_ALIVE_POLL_S)
    while worker.is_alive():
        progress()
        worker.join(KEEP_ALIVE_POLL_S)
    if failed:
        raise failed[0]
    return done[0]


def _text_chars(event: dict[str, Any]) -> int:
    """The characters of what ``stamp`` counts in ``event`` (its tool calls' arguments as JSON)."""
    chars = 0
    for key in ("content", "output", "summaryText"):
        if isinstance(value := event.get(key), str):
            chars += len(value)
    if isinstance(calls := event.get("toolCalls"), list):
        for call in calls:
            if isinstance(call, dict):
                chars += len(arguments_json(call.get("arguments", "")))
    return chars


def _uuids(events: Iterable[dict[str, Any]]) -> list[str]:
    return [e["uuid"] for e in events if isinstance(e.get("uuid"), str)]


def _fold_all(state: SessionState, events: Iterable[dict[str, Any]], settings: Settings) -> bool:
    """Fold events into ``state``; False as soon as one needs a rebuild."""
    return all(fold(state, event, settings.context) for event in events)


def _check_unique(event: dict[str, Any], taken: set[str]) -> None:
    """Refuse a uuid the session already has (``taken``: grown by the caller with each event admitted)."""
    uuid = event.get("uuid")
    if isinstance(uuid, str) and uuid in taken:
        raise InvalidEvent("uuid", f"{uuid!r} duplicates an event already in this session")


@contextlib.contextmanager
def _discarded_if_it_fails(log: SessionLog, new: bool) -> Iterator[None]:
    """Under the lock of a log its lock just created (``new``): remove it, still empty, when the
    batch fails in any way (a disk full, a job's timeout while its tokens were counted): left,
    the session read as known and empty, a 200 where SPEC §7 has a 404 and no event had landed."""
    try:
        yield
    except BaseException:
        if new:
            try:
                log.discard_if_empty()
            except OSError:
                logger.warning("an empty new log could not be removed: %s", log.path, exc_info=True)
        raise


_STAMP_FIELDS = frozenset({TOKEN_COUNT_FIELD, TOKEN_ENCODING_FIELD})


def _unstamped(event: dict[str, Any]) -> bytes:
    """``event`` without its token stamp (the watcher's replaces a producer's), as sorted JSON."""
    return orjson.dumps({k: v for k, v in event.items() if k not in _STAMP_FIELDS}, option=orjson.OPT_SORT_KEYS)


def _check_cwd(session_id: str, cwd: str, state: SessionState | None) -> None:
    if state is not None and state.cwd != cwd:
        raise bound_elsewhere(session_id, state.cwd, cwd)


def check_logged_cwd(session_id: str, cwd: str, meta: dict[str, Any] | None) -> None:
    """Refuse ``cwd`` when the log's first ``session_meta`` (``meta``; None: the log has none)
    records another: another spelling of it (``/app/``, ``/APP`` for ``/app``) finds the same
    log, and a state rebuilt under it after Redis lost the session's hash bound the session to
    that spelling for good. (``SessionLog.first_of_type`` reads a log only up to it.)"""
    logged = meta.get("cwd") if meta is not None else None
    if isinstance(logged, str) and logged != cwd:
        raise bound_elsewhere(session_id, logged, cwd)


def bound_elsewhere(session_id: str, bound: str, cwd: str) -> InvalidEvent:
    """The refusal of ``cwd`` for a session bound to ``bound`` (a 400 from the API). Either past
    ASCII, both are written escaped: the refusal read "bound to cwd '/srv/café', not '/srv/café'"
    (another Unicode normalization, a combining joiner, a Cyrillic letter)."""
    if not (bound.isascii() and cwd.isascii()):
        return InvalidEvent("cwd", f"session {session_id} is bound to cwd {ascii(bound)}, not {ascii(cwd)}")
    return InvalidEvent("cwd", f"session {session_id} is bound to cwd {bound!r}, not {cwd!r}")


def _first_session_meta(events: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    return next((event for event in events if event.get("type") == "session_meta"), None)


def _check_turn_order(current: int, event: dict[str, Any]) -> None:
    turn = event.get("turnId")
    if isinstance(turn, int) and turn < current:
        raise InvalidEvent("turnId", f"goes backwards: {turn} < currentTurnId {current}")
