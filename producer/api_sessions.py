"""What the API and ``compactor status`` / ``context`` / ``dead-letters`` report about sessions.

Invariants:
- Session id and cwd are validated before any path is built.
- The log is the source of truth: a session is known iff its log file exists,
  and when the Redis state is missing, bound to another cwd or behind the log,
  the state reported is rebuilt from the log (and not saved: readers never write).
- Thresholds are reported in tokens: fraction x the session's context window.
- A session a watcher holds back says so (``heldBack``: since when, why), from a fresh record of
  the watcher holding its shard only (``compactor.held``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import redis
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.utils import as_text

from compactor.applied import Settling, poll_pauses
from compactor.dead_letters import read_dead_letters
from compactor.held import lease_holders, parse_held
from compactor.keys import Keys
from compactor.queue import pending_job_id
from compactor.store import READER_LOCK_WAIT_S, SessionStore, bound_elsewhere, check_logged_cwd, recent_sessions
from events.config import Settings
from events.errors import CompactorError, InvalidInput, LogLocked, LogWriteFailed, SessionNotFound
from events.log import LOG_SUFFIX, SessionLog, project_dirs
from events.models import validate_cwd, validate_session_id
from events.state import SessionState, rebuild
from events.view import build_view
from producer.api_models import ContextBody, DeadLetterBody, DeadLettersBody, HeldBack, PendingJob, SessionBody

logger = logging.getLogger(__name__)


def read_log(data_dir: Path, session_id: str, cwd: str) -> list[dict[str, Any]]:
    """All events of a session's log; SessionNotFound when there is no log file."""
    validate_session_id(session_id)
    validate_cwd(cwd)
    log = SessionLog(data_dir, cwd, session_id)
    if not log.found():
        raise SessionNotFound(f"no session {session_id} under cwd {cwd}")
    return log.read()


def context_body(settings: Settings, session_id: str, cwd: str, applied: bool | None = None,
                 unapplied: Callable[[], bool] | None = None) -> ContextBody:
    """SPEC §4's view of the log: messages, promptEstimate and currentTurnId. No log, and
    ``unapplied()`` says the session's own entries still wait in its shard (a wait for them ran
    out): a new session's first events, the empty view (it was a 404 "no session" an agent could
    not tell from an unknown session, which stays a 404)."""
    try:
        events = read_log(settings.data_dir, session_id, cwd)
    except SessionNotFound:
        if unapplied is None or not unapplied():
            raise
        events = []
    view = build_view(events, settings.context)
    body = ContextBody(messages=list(view.messages), prompt_estimate=view.prompt_estimate,
                       current_turn_id=view.current_turn_id)
    if applied is not None:  # (only then in the body: SPEC §7's three fields otherwise)
        body.applied = applied
    return body


async def wait_settled(client: redis.Redis, settings: Settings, session_id: str, entry_id: str, timeout_s: float,
                       stop: threading.Event | None = None) -> bool:
    """``Settling``, waiting for it up to ``timeout_s`` without holding a thread (each look is a
    short call in one; 40 blocked waits took every thread of the API, /healthz's included);
    whether it is. Ends early, False, once ``stop`` is set (the API is stopping)."""
    look = Settling(client, settings, session_id, entry_id)
    for pause in poll_pauses(timeout_s):
        if await anyio.to_thread.run_sync(look):
            return True
        if stop is not None and stop.is_set():
            return False
        await anyio.sleep(pause)
    return await anyio.to_thread.run_sync(look)


def current_state(client: redis.Redis, settings: Settings, session_id: str,
                  cwd: str) -> SessionState:
    """The session's state from Redis when it matches the log, else rebuilt from the log."""
    validate_session_id(session_id)
    validate_cwd(cwd)
    store = SessionStore(client, settings, lock_wait_s=READER_LOCK_WAIT_S)
    log = store.log(session_id, cwd)
    if not log.found():
        raise not_found(store, session_id, cwd)
    state = store.load_current(session_id)
    if state is not None and state.cwd != cwd:  # (another spelling of its cwd found its log)
        raise bound_elsewhere(session_id, state.cwd, cwd)
    if state is None or state.log_size != log.complete_size():
        try:
            state = store.rebuild(session_id, cwd, log, check_cwd=state is None)
        except (LogWriteFailed, LogLocked) as e:  # (the lock opens the log to write: a read-only one was a 500;
            # a lock a stopped process holds made the request wait as long, and the session list with it)
            logger.info("state of session=%s rebuilt without storing it: %s", session_id, e)
            if state is None:
                check_logged_cwd(session_id, cwd, log.first_of_type("session_meta"))
            state = rebuilt_lock_free(log, session_id, cwd, settings, log.complete_size())
    return state


def rebuilt_lock_free(log: SessionLog, session_id: str, cwd: str, settings: Settings, size: int) -> SessionState:
    """The state rebuilt from the log (``size``: the bytes of its complete lines), read without
    the lock and not stored: a reader that neither holds up the session's writers nor writes."""
    return rebuild(session_id, cwd, log.read() if size else [], settings.context, size)


def not_found(store: SessionStore, session_id: str, cwd: str) -> Exception:
    """What to answer for a session with no log under ``cwd``: a 400 naming the cwd it is bound to
    when Redis holds it under another (POST .../events says so; these said 404 'no session'), else
    SPEC §7's 404 (also when Redis does not answer: the log is known to be missing, and the 503
    a client would retry on could never become anything but this 404)."""
    state = bound_state(store, session_id, cwd)
    if state is not None:
        return bound_elsewhere(session_id, state.cwd, cwd)
    return SessionNotFound(f"no session {session_id} under cwd {cwd}")


def bound_state(store: SessionStore, session_id: str, cwd: str) -> SessionState | None:
    """The session's stored state when Redis holds it under another cwd than ``cwd`` (None when
    it holds it under that one, holds none, or does not answer)."""
    try:
        state = store.load(session_id)
    except redis.RedisError:
        return None
    return state if state is not None and state.cwd != cwd else None


def _pending(client: redis.Redis, settings: Settings, session_id: str) -> PendingJob | None:
    return _job_status(client, pending_job_id(client, settings, session_id))


def _job_status(client: redis.Redis, job_id: str | None) -> PendingJob | None:
    if not job_id:
        return None
    try:
        status = Job.fetch(job_id, connection=client).get_status(refresh=False)
    except NoSuchJobError:
        return PendingJob(job_id=job_id, status=None)
    return PendingJob(job_id=job_id, status=getattr(status, "value", status))


def _last_compaction(value: Any) -> dict[str, Any] | None:
    if not value:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return {"value": value}
    return value if isinstance(value, dict) else {"value": value}


def session_body(client: redis.Redis, settings: Settings, state: SessionState) -> SessionBody:
    """The ``GET /api/sessions/{id}`` body for a state."""
    keys = Keys(settings.redis.prefix, settings.redis.shards)
    pipe = client.pipeline(transaction=False)
    pipe.get(keys.failures(state.session_id))
    pipe.hget(keys.held, state.session_id)
    pipe.mget([keys.lease(n) for n in range(keys.shards)])
    pipe.time()
    failures, held, leases, now = pipe.execute()
    return _body(settings, state, _count(failures), _pending(client, settings, state.session_id),
                 _held(held, now, lease_holders(leases)))


REFILL_PAGES = 4  # ``recent_session_bodies`` looks through at most this many times ``limit`` sessions


def recent_session_bodies(client: redis.Redis, settings: Settings, limit: int, *,
                          stores_rebuilt: bool = True) -> list[tuple[SessionBody, float]]:
    """The ``limit`` most recently active sessions' bodies (of their stored states, rebuilt when
    derived under other settings: ``SessionStore.load_current``, or when the log shrank under
    them: ``_as_logged``) and last activity, most recent first, in three round trips (and one per
    pending job's status, one per rebuilt state; three more when sessions without a log leave
    places to fill): four per session made ``?limit=1000`` take ~0.5 s of the API's time on each
    refresh. ``stores_rebuilt``: as ``SessionStore``'s (False: ``compactor status``)."""
    keys = Keys(settings.redis.prefix, settings.redis.shards)
    store = SessionStore(client, settings, lock_wait_s=READER_LOCK_WAIT_S, stores_rebuilt=stores_rebuilt)
    bodies: list[tuple[SessionBody, float]] = []
    seen: set[str] = set()  # (one that became active meanwhile moved up: listed once)
    start, limit = 0, max(limit, 1)
    # a session whose log is gone is left out and the next ones fill its place (the page showed "the
    # 0 most recently active of 10" under an empty table), looking through REFILL_PAGES pages at most
    while len(bodies) < limit and start < REFILL_PAGES * limit:
        # (those idle past their states' TTL pruned first: listed, they had no state, "no log")
        ranked = recent_sessions(client, keys, start, start + limit - 1)
        if not ranked:
            break
        start += len(ranked)
        recent = [(sid, score) for sid, score in ranked if sid not in seen]
        seen.update(sid for sid, _ in recent)
        bodies += _ranked_bodies(client, settings, store, keys, recent)[:limit - len(bodies)]
    return bodies


def _ranked_bodies(client: redis.Redis, settings: Settings, store: SessionStore, keys: Keys,
                   recent: list[tuple[str, float]]) -> list[tuple[SessionBody, float]]:
    """``recent_session_bodies`` of these sessions (those with a log)."""
    ids = [sid for sid, _ in recent]
    stored = store.lookup({}, load=ids).stored if ids else {}
    pipe = client.pipeline(transaction=False)
    for sid in ids:
        pipe.get(keys.failures(sid))
        pipe.get(keys.job(sid))
    pipe.hmget(keys.held, ids)
    pipe.mget([keys.lease(n) for n in range(keys.shards)])
    pipe.time()
    replies = pipe.execute() if ids else []
    held, holders = (replies[-3], lease_holders(replies[-2])) if ids else ([], {})
    bodies = []
    projects: list[Path] | None = None  # (the data dir's, looked through once for those without a state)
    rebuilding_until = time.monotonic() + UNSTORED_BUDGET_S
    for index, (sid, activity) in enumerate(recent):
        state = stored.get(sid)
        if state is None:  # (lost by Redis, or deleted by hand: the session was left out, "without a log";
            if time.monotonic() < rebuilding_until:  # past the budget it still is)
                projects = project_dirs(store.settings.data_dir) if projects is None else projects
                state = _unstored(store, sid, projects)
        elif store.log(sid, state.cwd).exists():
            state = _as_logged(store, store.up_to_date(state))
        else:  # (no log: unknown, SPEC §7's 404; the dataDir changed, or the log was deleted: it was listed,
            state = None  # with its old numbers)
        if state is None:
            continue
        failures = _count(replies[2 * index])
        job_id = as_text(replies[2 * index + 1]) if replies[2 * index + 1] else None
        body = _body(settings, state, failures, _job_status(client, job_id), _held(held[index], replies[-1], holders))
        bodies.append((body, activity))
    return bodies


UNSTORED_BUDGET_S = 0.25  # a page's rebuilds of sessions without a state, from their logs (not stored:
# each refresh rebuilt them again; Redis evicting idle sessions' states under ``volatile-lru``, 100 logs of
# 1.2 MB held every refresh of the page seconds)


def _unstored(store: SessionStore, session_id: str, projects: list[Path]) -> SessionState | None:
    """A listed session whose state Redis no longer holds (evicted, or dropped by hand after a
    repair of its log, as the README says) while its log stays: the state its log gives, read without
    the lock and not stored (the session's next write stores it). The log is found by its file
    name under the data dir, and bound to the cwd its ``session_meta`` records; None when no log
    of that name records one that leads back to it, or two do (the same id under two cwds), or it
    cannot be read."""
    found: list[tuple[SessionLog, str]] = []
    try:
        paths = (project / "sessions" / f"{session_id}{LOG_SUFFIX}" for project in projects)
        for path in sorted(path for path in paths if path.is_file()):
            cwd = (SessionLog.at_path(path).first_of_type("session_meta") or {}).get("cwd")
            if isinstance(cwd, str) and (log := store.log(session_id, cwd, create=False)).path == path:
                found.append((log, cwd))
        if len(found) != 1:
            return None
        [(log, cwd)] = found
        return rebuilt_lock_free(log, session_id, cwd, store.settings, log.complete_size())
    except (CompactorError, OSError, ValueError) as e:
        logger.info("session=%s with no stored state left out of the list: %s", session_id, e)
        return None


def _as_logged(store: SessionStore, state: SessionState) -> SessionState:
    """``state``, or rebuilt from its log when the log shrank under it (cut back, replaced or
    restored by hand: GET /api/sessions/{id} showed the log, the list the stored state). Read
    without the lock and not stored: a reader neither holds up the session's writers nor creates
    anything; as stored when the log cannot be read (the session route names why). A log that
    grew past its state (a write whose state save is on its way, or a crashed writer's tail) is
    caught up by the session's next write."""
    log = store.log(state.session_id, state.cwd, create=False)
    try:
        size = log.complete_size()
        if size >= state.log_size:
            return state
        return rebuilt_lock_free(log, state.session_id, state.cwd, store.settings, size)
    except (CompactorError, OSError) as e:
        logger.info("state of session=%s listed as stored: %s", state.session_id, e)
        return state


def _count(raw: Any) -> int:
    try:
        return int(raw) if raw is not None else 0
    except ValueError:
        return 0


def _held(raw: Any, now: Any, holders: dict[int, str | None]) -> HeldBack | None:
    """A ``{p}:held`` record as the body shows it; ``now``: Redis's ``TIME`` reply; ``holders``:
    the shards' lease holders."""
    seconds, micros = now
    held = parse_held(raw, int(seconds) + int(micros) / 1e6, holders)
    return None if held is None else HeldBack(since=held.since, error=held.error, watcher=held.watcher)


def _body(settings: Settings, state: SessionState, failures: int, pending: PendingJob | None,
          held: HeldBack | None = None) -> SessionBody:
    ctx = settings.context
    return SessionBody(
        session_id=state.session_id, cwd=state.cwd, prompt_estimate=state.prompt_estimate,
        context_window=state.window, current_turn_id=state.current_turn_id,
        micro_threshold=ctx.micro_limit(state.window),
        compaction_threshold=ctx.compaction_limit(state.window),
        failures=failures, breaker_open=failures >= ctx.max_failures,
        pending_job=pending,
        last_compaction=_last_compaction(state.last_compaction),
        held_back=held,
    )


EVENT_PREVIEW_CHARS = 2_000  # of a dead letter's event, as GET /api/dead-letters shows it


def dead_letters_body(client: redis.Redis, settings: Settings, session: str | None, limit: int) -> DeadLettersBody:
    """The newest ``limit`` dead letters (of ``session`` only, when given): ``GET /api/dead-letters``
    and ``compactor dead-letters --json``."""
    found = read_dead_letters(client, Keys(settings.redis.prefix, settings.redis.shards), session=session,
                              limit=limit, letter_bytes=settings.limits.max_event_bytes)
    return DeadLettersBody(
        letters=[DeadLetterBody(
            letter_id=d.letter_id, written_at=d.written_at, session=d.session, cwd=d.cwd, reason=d.reason,
            entry_id=d.entry_id, stream=d.stream, event=None if d.event is None else d.event[:EVENT_PREVIEW_CHARS],
            event_chars=len(d.event or ""), truncated=d.truncated, extra=d.extra) for d in found.letters],
        scanned=found.scanned, complete=found.complete, total=found.total)
