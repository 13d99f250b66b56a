"""The compaction queue: RQ queue name, job function paths, one job per session.

Invariants:
- At most one compaction job per session is queued or running (SPEC §5):
  ``{p}:job:{sid}`` holds its id, claimed atomically (Lua) before the RQ
  enqueue. A trigger that arrives while the job has not started is answered
  by it (it reads the log, the trigger's turn in it, when it starts), unless it
  is an LLM trigger and the job a micro one. Any other trigger that arrives
  while it is pending is recorded in
  ``{p}:retrigger:{sid}`` by the same script, so it is coalesced, never lost:
  when the job ends, ``release_pending`` frees the claim and hands the
  recorded trigger back to the worker, which re-checks the thresholds and
  then ``settle_trigger``s it; until then it stays recorded, so a crash or a
  Redis error while re-checking cannot lose it.
- ``{p}:claims`` indexes the sessions with a claim or an unsettled trigger;
  the worker janitor looks at the ones waiting longer than the grace period
  and frees a claim whose job never came (an enqueuer killed between claim
  and enqueue) or ended unnoticed, then re-checks the session.
- A forced job claims the session like any job. While another job holds the
  claim, the forced job is created (RQ status ``created``: its id can be
  waited on) but not queued, and ``forced:{id}`` is recorded as the trigger;
  a later forced request joins it (its id is returned), an automatic trigger
  never overwrites nor clears it. When the holder ends, ``release_pending``
  hands it back and ``promote_forced`` claims the session for it and queues
  it (the janitor does the same for a holder that died).
- Every job of a session carries ``RateLimit(key="{p}:{sid}", concurrency=1)``,
  so two jobs of one session never run at once across all workers (RQ keeps
  the others ``rate_limited`` and releases them in job-id order).
- Job ids are ``{time_ns:020d}-{kind}-{sid}``: sortable, so jobs of a session
  enqueued within the same second are released in enqueue order, and each
  names its session (the worker's janitor relies on that for killed jobs).
  The stamp is in Redis's time (``sync_clock``: each enqueuer measures its
  clock's offset to Redis's once a minute), as the claims are aged by it.
- A claim whose job is gone or already ended (a crashed enqueuer, a worker
  killed before it could release) is stale and replaced on the next trigger.

The RQ functions take a Redis client with ``decode_responses=False`` (RQ pickles).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal

import redis
from rq import Callback, Queue
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.rate_limit import RateLimit
from rq.utils import as_text

from compactor.keys import Keys
from compactor.redis_errors import connection_lost, is_refusal
from compactor.applied import STREAM_ID_RE
from compactor.store import bound_elsewhere, check_logged_cwd, stream_id_key
from events.config import Settings
from events.log import SessionLog

logger = logging.getLogger(__name__)

Kind = Literal["micro", "llm"]

JOB_FUNCTIONS: dict[str, str] = {
    "micro": "worker.jobs.micro_compact",
    "llm": "worker.jobs.llm_compact",
}
JOB_RESULT_TTL_S = 86_400  # a forced job's result readable by GET /api/jobs/{id} for a day
JOB_FAILURE_TTL_S = 7 * 86_400  # a failed forced job kept a week for inspection
# An automatic job's (nobody waits for it; ~0.8 per turn, 5.7 kB each in Redis: kept as long as a
# forced one's, they were 80 % of Redis's memory after half an hour of a busy service, growing
# ~100 MB/h for a day): its result an hour, a failed one a day (the breaker's counter's lifetime).
AUTO_JOB_RESULT_TTL_S = 3_600
AUTO_JOB_FAILURE_TTL_S = 86_400
STALE_CLAIM_GRACE_S = 30.0  # a claim whose job hash is missing is stale after this
JANITOR_BATCH = 200  # sessions the janitor looks at per run
REPLACE_ABANDONED = "worker.jobs.replace_if_abandoned"  # a forced job's failure callback
CALLBACK_TIMEOUT_S = 30
# RQ's words for a job whose worker died: mid-job (its cleanup of the started registry, the
# janitor's or its own maintenance's) or after taking it from the queue, before it started
STRANDED_WORDS = "Job was stuck in intermediate queue"
ABANDONED_WORDS = ("due to AbandonedJobError", STRANDED_WORDS)
ENDED_STATUSES = frozenset({
    JobStatus.FINISHED, JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED,
})

JOINED_AFTER_FIELD = "compactor_joined_after"  # on a waiting forced job's hash: the latest ``after`` that joined it
FORCED_TRIGGER = "forced:"  # the recorded trigger of a forced job waiting for the claim: forced:{job id}

# Lua shared by the claim scripts: whether the claimed job ``cur`` has ended, or has no RQ hash
# (read under ``prefix``) and is older than ``grace`` seconds by the time in its id (a claim
# whose job never came); whether a recorded trigger is a forced job waiting (``forced:{id}``).
_LUA_HELPERS = """
local function is_stale(cur, prefix, grace)
  local status = redis.call('HGET', prefix .. cur, 'status')
  if status then
    return status == 'finished' or status == 'failed' or status == 'stopped' or status == 'canceled'
  end
  local stamp = tonumber(string.sub(cur, 1, 20))
  local now = redis.call('TIME')
  return (not stamp) or string.sub(cur, 21, 21) ~= '-'
    or (tonumber(now[1]) + tonumber(now[2]) / 1e6 - stamp / 1e9) > tonumber(grace)
end
local FORCED = 'FORCED_TRIGGER'
local function is_forced(t)
  return t and string.sub(t, 1, #FORCED) == FORCED
end
""".replace("FORCED_TRIGGER", FORCED_TRIGGER)

# KEYS: job claim, retrigger, claims index, failure counter.
# ARGV: new job id, kind, session id, breaker check ("1" or "0"), max failures,
#       kind when the breaker is open ("" none), RQ job key prefix, stale grace (s),
#       the new job id for the breaker-open kind.
# One round trip for a trigger (the watcher's hot path): with the breaker check
# on and the failure counter at max failures or more, the kind becomes the
# breaker-open kind (nothing happens without one). Then the claim: free (or
# held by a stale job: ended, or absent past the grace period, read from the
# RQ job hash named by the claim) -> claimed; else the trigger is recorded
# ("llm" wins over "micro"; a forced job's trigger is never replaced). Returns
# {outcome, claimed job id or kind, pending or replaced job id} with outcome
# "claimed", "replaced", "pending" or "skipped". The trigger is recorded only when the pending
# job has started (RQ status ``started``), or is a micro job and the trigger an LLM one: a job not
# started yet reads the log after the trigger's turn was appended, so it answers it; recorded, an
# automatic LLM job that failed was queued again at once by its re-check, with the same input (two
# calls and two failures counted for one turn). A new claim clears an old
# trigger (the new job reads the latest state, so it answers every trigger
# before it), but not a forced job's: that job still has to run. (The job hash is not among KEYS: fine on a single Redis,
# which is what RQ needs anyway.)
_CLAIM = _LUA_HELPERS + """
local cur = redis.call('GET', KEYS[1])
-- run again (redis-py resends a script whose reply was lost): its claim landed, so its job is queued
-- now (answered 'pending', the claim waited unqueued for the janitor, past the grace)
if cur and (cur == ARGV[1] or cur == ARGV[9]) then return {'claimed', cur, ''} end
local kind, id = ARGV[2], ARGV[1]
if ARGV[4] == '1' then
  local failures = tonumber(redis.call('GET', KEYS[4]) or '0') or 0
  if failures >= tonumber(ARGV[5]) then kind = ARGV[6]; id = ARGV[9] end
end
if kind == '' then return {'skipped', '', ''} end
local outcome = 'claimed'
if cur then
  if not is_stale(cur, ARGV[7], ARGV[8]) then
    local t = redis.call('GET', KEYS[2])
    if t ~= 'llm' and not is_forced(t) and (redis.call('HGET', ARGV[7] .. cur, 'status') == 'started'
        or (kind == 'llm' and string.match(cur, '^%d+%-(%w+)%-') ~= 'llm')) then
      redis.call('SET', KEYS[2], kind)
    end
    return {'pending', kind, cur}
  end
  outcome = 'replaced'
end
redis.call('SET', KEYS[1], id)
if not is_forced(redis.call('GET', KEYS[2])) then redis.call('DEL', KEYS[2]) end
redis.call('ZADD', KEYS[3], redis.call('TIME')[1], ARGV[3])
return {outcome, id, cur or ''}
"""

# KEYS: job claim, retrigger, claims index. ARGV: the forced job's id, session id, RQ job key
# prefix, stale grace (s), the request's ``after`` ('' none), '1' for the promotion of the one
# waiting ('' a request). A promotion of a job the trigger no longer names -> {'gone', id}: a
# request or another promotion claimed for it and queued it already (claimed again, it was queued
# twice, and RQ runs a job queued twice twice; or, once it had run, once more). The claim free
# (or stale): claimed by the forced job waiting if there is one, else by this one, and the
# recorded trigger cleared (the forced job answers it) -> {'claimed', the id to queue}. Else the
# forced job waits as the trigger ``forced:{id}`` -> {'waiting', id}, unless one already waits
# -> {'pending', its id}: the caller joins it, its ``after`` kept on that job's hash if later
# than any kept there (``_with_joined_after``). For a request, a waiting job whose RQ hash is
# gone (evicted), or that was cancelled (``_ENDED_WAITING``), is none: the request's own job
# takes its place (joined, the request waited for a job that could never run, and was answered
# job_lost, or a 502 for the cancelled one).
_FORCE = _LUA_HELPERS + """
local function later(a, b)
  if not b then return true end
  local am, as = string.match(a, '^(%d+)%-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)%-(%d+)$')
  if not bm then return true end
  if not am then return false end
  am, as, bm, bs = tonumber(am), tonumber(as), tonumber(bm), tonumber(bs)
  return am > bm or (am == bm and as > bs)
end
local cur = redis.call('GET', KEYS[1])
local t = redis.call('GET', KEYS[2])
-- a request's script run again (redis-py resends it when its reply was lost): its claim landed
if ARGV[6] ~= '1' and cur == ARGV[1] then return {'claimed', ARGV[1], ''} end
if ARGV[6] == '1' and t ~= FORCED .. ARGV[1] then return {'gone', ARGV[1], cur or ''} end
local waiting = is_forced(t) and string.sub(t, #FORCED + 1) or nil
if waiting and ARGV[6] ~= '1' then
  local status = redis.call('HGET', ARGV[3] .. waiting, 'status')
  if not status or status == 'canceled' or status == 'stopped' or status == 'failed' then
    waiting = nil  -- its job gone from Redis (evicted) or cancelled: this request's own job takes its place
  end
end
if cur and not is_stale(cur, ARGV[3], ARGV[4]) then
  if waiting then
    local hash = ARGV[3] .. waiting
    if ARGV[5] ~= '' and later(ARGV[5], redis.call('HGET', hash, 'JOINED_AFTER')) then
      redis.call('HSET', hash, 'JOINED_AFTER', ARGV[5])
    end
    return {'pending', waiting, cur}
  end
  redis.call('SET', KEYS[2], FORCED .. ARGV[1])
  redis.call('ZADD', KEYS[3], redis.call('TIME')[1], ARGV[2])
  return {'waiting', ARGV[1], cur}
end
local id = waiting or ARGV[1]
redis.call('SET', KEYS[1], id)
redis.call('DEL', KEYS[2])
redis.call('ZADD', KEYS[3], redis.call('TIME')[1], ARGV[2])
return {'claimed', id, cur or ''}
""".replace("JOINED_AFTER", JOINED_AFTER_FIELD)


# KEYS: job claim, retrigger, claims index; ARGV: ending job id, session id.
# Frees the claim when it is this job's (or there is none) and returns the
# recorded trigger, which stays recorded (and indexed) until ``settle_trigger``
# says it was handled, so a crash while re-checking it cannot lose it.
_RELEASE = """
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[1] then return false end
if cur then redis.call('DEL', KEYS[1]) end
local t = redis.call('GET', KEYS[2])
if t then
  redis.call('ZADD', KEYS[3], redis.call('TIME')[1], ARGV[2])
else
  redis.call('ZREM', KEYS[3], ARGV[2])
end
return t
"""

# KEYS: job claim, retrigger, claims index; ARGV: session id. After a re-check:
# with no claim now, the trigger has been handled; with one, it belongs to that job.
# A forced job's trigger is never settled here: only its claim (``_FORCE``) clears it.
_SETTLE = _LUA_HELPERS + """
if redis.call('EXISTS', KEYS[1]) == 0 then
  if is_forced(redis.call('GET', KEYS[2])) then return 0 end
  redis.call('DEL', KEYS[2])
  redis.call('ZREM', KEYS[3], ARGV[1])
end
return 1
"""

class _Unchecked:
    """The default of ``breaker_open_kind``: the breaker is not read."""


UNCHECKED = _Unchecked()

_id_lock = threading.Lock()
_last_ns = 0
CLOCK_SYNC_EVERY_S = 60.0  # how often an enqueuer re-reads its clock's offset to Redis's
_clock_offset_ns = 0  # Redis's clock minus this host's, as last measured
_clock_synced_at: float | None = None  # time.monotonic() of that measure


def sync_clock(client: redis.Redis) -> None:
    """Measure this host's clock against Redis's (one ``TIME``, at most once a minute), so the
    job ids it stamps are in Redis's time, as the claim scripts and the janitor age them: a host
    whose clock was a minute behind Redis's minted claims that looked dead at once (any other
    enqueuer replaced them before their job was queued), one ahead kept a dead claim for longer."""
    global _clock_offset_ns, _clock_synced_at
    now = time.monotonic()
    if _clock_synced_at is not None and now - _clock_synced_at < CLOCK_SYNC_EVERY_S:
        return
    before = time.time_ns()
    seconds, micros = client.time()
    after = time.time_ns()
    with _id_lock:
        _clock_offset_ns = (int(seconds) * 1_000_000 + int(micros)) * 1000 - (before + after) // 2
        _clock_synced_at = now


def redis_time_s() -> float:
    """This host's clock moved to Redis's (as last synced by ``sync_clock``), in seconds."""
    return (time.time_ns() + _clock_offset_ns) / 1e9


def _next_ns() -> int:
    """A nanosecond stamp in Redis's time (as last synced), strictly increasing within this process."""
    global _last_ns
    with _id_lock:
        _last_ns = max(time.time_ns() + _clock_offset_ns, _last_ns + 1)
        return _last_ns


def new_job_id(session_id: str, kind: str) -> str:
    """A sortable job id naming its session: ``{time_ns:020d}-{kind}-{sid}``."""
    return f"{_next_ns():020d}-{kind}-{session_id}"


def parse_job_id(job_id: str) -> tuple[int, str, str] | None:
    """``(time_ns, kind, session_id)`` of an id made by ``new_job_id``, else None."""
    stamp, _, rest = job_id.partition("-")
    kind, _, session_id = rest.partition("-")
    if not (stamp.isascii() and stamp.isdigit()) or kind not in JOB_FUNCTIONS or not session_id:
        return None
    return int(stamp), kind, session_id


def compaction_queue(client: redis.Redis, settings: Settings) -> Queue:
    """The RQ queue compaction jobs go to (named ``Keys.queue``)."""
    keys = Keys(settings.redis.prefix, settings.redis.shards)
    return Queue(keys.queue, connection=client, default_timeout=settings.worker.job_timeout_seconds)


def rate_limit_for(settings: Settings, session_id: str) -> RateLimit:
    """The per-session concurrency limit shared by every job of the session."""
    return RateLimit(key=f"{settings.redis.prefix}:{session_id}", concurrency=1)


@dataclass(frozen=True)
class Trigger:
    """A session whose state calls for a job of ``kind`` (``breaker_open_kind``: see ``enqueue_compaction``)."""

    session_id: str
    cwd: str
    kind: Kind
    breaker_open_kind: Kind | None | _Unchecked = UNCHECKED


def enqueue_compaction(
    client: redis.Redis,
    settings: Settings,
    session_id: str,
    cwd: str,
    kind: Kind,
    *,
    forced: bool = False,
    breaker_open_kind: Kind | None | _Unchecked = UNCHECKED,
    after: str | None = None,
) -> str | None:
    """Enqueue a compaction job; the job id, or None when one is already pending (coalesced).

    ``forced`` (an ``llm`` job): ``enqueue_forced_compaction`` (with ``after``), whose id is
    returned (never None). With ``breaker_open_kind`` the session's LLM breaker is read in the same
    round trip as the claim: at ``maxFailures`` failures or more the job is of
    that kind instead (None: no job, and None is returned). The watcher passes
    what ``decide`` says with the breaker open, so a trigger costs one round
    trip, not three (failures, claim, the pending job's status).
    """
    if kind not in JOB_FUNCTIONS:
        raise ValueError(f"unknown compaction kind {kind!r}")
    if forced:
        if kind != "llm":
            raise ValueError("a forced compaction is an llm one")
        return enqueue_forced_compaction(client, settings, session_id, cwd, after=after)
    sync_clock(client)
    job_id = new_job_id(session_id, kind)
    reply = client.eval(*_claim_call(settings, Trigger(session_id, cwd, kind, breaker_open_kind), job_id))
    claimed = _claimed(session_id, reply)
    if claimed is None:
        return None
    return _enqueue_claimed(client, settings, session_id, cwd, claimed)


def check_bound_cwd(client: redis.Redis, settings: Settings, session_id: str, cwd: str) -> None:
    """Refuse (``InvalidInput`` on ``cwd``) a cwd other than the one the session is bound to:
    another spelling of it (``/app/``, ``/APP`` for ``/app``) finds the same log."""
    bound = client.hget(Keys(settings.redis.prefix, settings.redis.shards).session(session_id), "cwd")
    if not bound:  # Redis lost it (or never had it): the log's session_meta keeps it
        check_logged_cwd(session_id, cwd, SessionLog(settings.data_dir, cwd, session_id).first_of_type("session_meta"))
    elif as_text(bound) != cwd:
        raise bound_elsewhere(session_id, as_text(bound), cwd)


def enqueue_forced_compaction(client: redis.Redis, settings: Settings, session_id: str, cwd: str, *,
                              after: str | None = None, meta: dict[str, Any] | None = None,
                              job_id: str | None = None) -> str:
    """A forced LLM compaction (SPEC §5: no thresholds, no breaker; still one job per session at a
    time): the id of the forced job that will answer it. That job is queued now when the session
    has no pending job; else it waits (RQ status ``created``) until the pending one ends; when a
    forced job already waits, this request joins it (its id is returned, no second job).
    ``after``: a stream entry id of the session; the job first waits (``worker.jobs.after_wait_s``
    at most) for the watcher to apply it, so it compacts the events published before the request.
    ``meta``: RQ meta of the request's own job, saved with it (not given to a job it joins);
    ``job_id``: that job's id (``new_job_id``), when the caller records it beforehand.

    A session bound to another cwd is refused here (``InvalidInput`` on ``cwd``), not by a job
    that fails: another spelling of the cwd (``/app/`` for ``/app``) finds the same log.
    """
    check_bound_cwd(client, settings, session_id, cwd)
    sync_clock(client)
    queue = compaction_queue(client, settings)
    job = queue.create_job(**_job_spec(settings, session_id, cwd, job_id or new_job_id(session_id, "llm"), True,
                                       after), status=JobStatus.CREATED)
    job.meta.update(meta or {})
    try:
        job.save()  # before the claim: once recorded as the trigger, the holder's end may queue it
        outcome, job_id = _force(client, settings, session_id, job.id, after)
        if outcome == "claimed" and job_id != job.id:  # the forced job that waited: this request joins it
            try:
                _enqueue_forced(client, settings, session_id, job_id, after)
            except NoSuchJobError:  # (gone from Redis, its claim freed: this request's own job instead)
                outcome, job_id = _force(client, settings, session_id, job.id, after)
            else:
                _delete_unused(job)
                return job_id
    except BaseException:  # (kept, it stayed ``created`` with no TTL for good; a claim or trigger a script
        _delete_unused(job)  # made all the same, its reply lost, finds it gone and is dropped: a stale
        raise  # claim, a waiting job no request joins and its promotion drops)
    if job_id != job.id:
        _delete_unused(job)
    if outcome == "claimed":
        try:
            _enqueue_forced(client, settings, session_id, job_id)
        except (redis.ConnectionError, redis.TimeoutError):  # its own job, saved and claimed: the janitor
            # queues it past the grace (``queue_unqueued_claim``), and it answers the request (raised, the
            # request was a 503, and its retry's job waited behind this one: two compactions)
            return job_id
        except redis.ResponseError as e:  # (the same for Redis refusing for now; not for a bug, an ACL)
            if is_refusal(e):
                return job_id
            raise
    else:
        if outcome != "waiting":  # (a job of its own that waits is counted enqueued once queued, not folded)
            from compactor import metrics  # (not at import: see _enqueued)

            metrics.JOBS_COALESCED.labels("forced").inc()
        logger.info("forced compaction %s session=%s job=%s", "waits for the pending job" if outcome == "waiting"
                    else "joins the forced job already waiting", session_id, job_id,
                    extra={"session_id": session_id, "job_id": job_id, "kind": "llm", "outcome": outcome})
    return job_id


_ENDED_WAITING = frozenset({JobStatus.CANCELED, JobStatus.STOPPED, JobStatus.FAILED})  # a forced job's, unqueued
# (the same three are written in ``_FORCE``)
_ENDED_WORDS = {"canceled": "was cancelled", "stopped": "was stopped", "failed": "failed"}


def _delete_unused(job: Job) -> None:
    """Delete a request's own forced job that did not answer it (it joined another); a failure is
    logged, not raised: the request was answered (raised, a request that had joined the waiting
    job was a 503)."""
    try:
        job.delete()
    except Exception as e:
        logger.warning("forced job %s, not used, could not be deleted: %s", job.id, e, extra={"job_id": job.id})


def promote_forced(client: redis.Redis, settings: Settings, session_id: str, job_id: str) -> bool:
    """Queue the forced job ``job_id`` that waited for the session's claim, if the claim is free
    now (else it keeps waiting, recorded); True when it was queued."""
    outcome, claimed = _force(client, settings, session_id, job_id, promote=True)
    if outcome != "claimed":
        return False
    _enqueue_forced(client, settings, session_id, claimed)
    return True


def _force(client: redis.Redis, settings: Settings, session_id: str, job_id: str,
           after: str | None = None, *, promote: bool = False) -> tuple[str, str]:
    """Run ``_FORCE`` for the forced job ``job_id`` (asked for after stream entry ``after``;
    ``promote``: the job waiting, named by the trigger): (outcome, the id of the job that answers)."""
    reply: Any = client.eval(_FORCE, 3, *_session_keys(settings, session_id), job_id, session_id, Job.key_for(""),
                             STALE_CLAIM_GRACE_S, after or "", "1" if promote else "")
    outcome, answering, _ = (as_text(part) for part in reply)
    return outcome, answering


def _enqueue_forced(client: redis.Redis, settings: Settings, session_id: str, job_id: str,
                    after: str | None = None) -> None:
    """RQ-enqueue the forced job ``job_id`` (created already, its claim made), the ``after`` of the
    requests that joined it while it waited folded in (``after``: one more's). On an error the
    claim stays the job's and the janitor queues it later (``queue_unqueued_claim``); a job gone
    from Redis, or cancelled while it waited, is dropped, its claim freed."""
    try:
        if not _enqueue_if_still_created(client, settings, session_id, job_id, after):
            return  # (queued by another: the janitor and a stalled enqueuer, both; RQ ran it twice)
    except NoSuchJobError as e:  # its record is gone (evicted, deleted by hand), or it was cancelled: dropped, its
        release_pending(client, settings, session_id, job_id)  # claim freed (put back as the trigger, it failed
        logger.warning("forced job %s of session %s %s: dropped", job_id,  # every later request and promotion)
                       session_id, e, extra={"session_id": session_id, "job_id": job_id})
        raise
    except Exception as e:
        if not _queued_all_the_same(client, job_id):
            # the claim stays the job's: the janitor queues a claimed job still ``created`` past the grace
            # (``queue_unqueued_claim``), as after an enqueuer stopped between the two. (Freed, and the job put
            # back as the waiting trigger, one whose enqueue had landed, its reply and the status read lost,
            # was queued again by the next promotion: RQ ran it twice.)
            logger.warning("forced job %s of session %s not queued (%s): left claimed, for the worker janitor",
                           job_id, session_id, e, extra={"session_id": session_id, "job_id": job_id})
            raise
        # (the enqueue landed and its reply was lost)
        logger.warning("forced job %s of session %s was queued, its enqueue's reply lost: %s", job_id, session_id,
                       e, extra={"session_id": session_id, "job_id": job_id})
    _enqueued(session_id, job_id, True)


def _queued_all_the_same(client: redis.Redis, job_id: str) -> bool:
    """Whether the forced job ``job_id``, whose enqueue raised, is past RQ status ``created``."""
    try:
        status = client.hget(Job.key_for(job_id), "status")
    except redis.RedisError:
        return False
    return status is not None and as_text(status) != JobStatus.CREATED


def trigger_compactions(client: redis.Redis, settings: Settings, triggers: list[Trigger]) -> list[str | None]:
    """``enqueue_compaction`` for several sessions, their claims in one round trip; per
    trigger the job id, or None (coalesced, or nothing to do with the breaker open).

    A Redis error from the claims is raised (the claims that did land and have no
    job yet are stale after the grace period: the janitor frees them and re-checks).
    The claimed jobs are enqueued together; an error frees their claims and is raised.
    """
    sync_clock(client)
    pipe = client.pipeline(transaction=False)
    for trigger in triggers:
        if trigger.kind not in JOB_FUNCTIONS:
            raise ValueError(f"unknown compaction kind {trigger.kind!r}")
        pipe.eval(*_claim_call(settings, trigger, new_job_id(trigger.session_id, trigger.kind)))
    replies = pipe.execute()
    claimed = [(trigger, _claimed(trigger.session_id, reply)) for trigger, reply in zip(triggers, replies)]
    _enqueue_together(client, settings, [(t.session_id, t.cwd, job_id) for t, job_id in claimed if job_id])
    return [job_id for _, job_id in claimed]


def _enqueue_together(client: redis.Redis, settings: Settings, claimed: list[tuple[str, str, str]]) -> None:
    """RQ-enqueue claimed jobs ``(session_id, cwd, job_id)`` in one MULTI/EXEC; frees their claims on error.

    RQ's ``enqueue_call`` refuses a pipeline for a rate-limited job (so that the
    caller cannot save the job over its promotion afterwards); its rate-limited
    enqueue itself takes one (``Queue._enqueue_rate_limited_job``), and nothing
    here touches the jobs after it. Through ``enqueue_call`` a job costs three
    round trips (0.36 ms measured); this way one round trip for all, ~0.12 ms
    a job: what keeps a burst of new sessions crossing a threshold at once from
    delaying the last of them, and a lone trigger from costing three round trips.
    Without that method (another RQ) they are enqueued one by one.
    """
    if not claimed:
        return
    queue = compaction_queue(client, settings)
    together = getattr(queue, "_enqueue_rate_limited_job", None)
    if together is None:
        for session_id, cwd, job_id in claimed:
            _enqueue_claimed(client, settings, session_id, cwd, job_id)
        return
    try:
        pipe = client.pipeline(transaction=True)
        pipe.sadd(queue.redis_queues_keys, queue.key)
        for session_id, cwd, job_id in claimed:
            job = queue.create_job(**_job_spec(settings, session_id, cwd, job_id, False))
            job.origin = queue.name
            together(job, pipeline=pipe)
        pipe.execute()
    except Exception:
        for session_id, _, job_id in claimed:
            release_pending(client, settings, session_id, job_id)
        raise
    for session_id, _, job_id in claimed:
        _enqueued(session_id, job_id, False)


def _enqueue_claimed(client: redis.Redis, settings: Settings, session_id: str, cwd: str, job_id: str) -> str:
    """RQ-enqueue the automatic job ``job_id`` names (its claim made); frees the claim on error."""
    try:
        compaction_queue(client, settings).enqueue_call(**_job_spec(settings, session_id, cwd, job_id, False))
    except Exception:
        release_pending(client, settings, session_id, job_id)
        raise
    _enqueued(session_id, job_id, False)
    return job_id


def _enqueued(session_id: str, job_id: str, forced: bool) -> None:
    kind = _kind_of(job_id)
    # (imported here, not with the module: a producer importing the publisher, PROMETHEUS_MULTIPROC_DIR set,
    # left a metrics file of its own in the shared directory per run, read by every scrape)
    from compactor import metrics

    metrics.JOBS_ENQUEUED.labels(kind, "true" if forced else "false").inc()
    logger.info("enqueued session=%s job=%s kind=%s forced=%s", session_id, job_id, kind, forced,
                extra={"session_id": session_id, "job_id": job_id, "kind": kind, "forced": forced,
                       "outcome": "enqueued"})


def _kind_of(job_id: str) -> str:
    """The kind a job id names (the claim may be of the breaker-open kind: the id says which)."""
    return job_id.split("-", 2)[1]


def _session_keys(settings: Settings, session_id: str) -> tuple[str, str, str]:
    keys = Keys(settings.redis.prefix, settings.redis.shards)
    return keys.job(session_id), keys.retrigger(session_id), keys.claims


def release_pending(client: redis.Redis, settings: Settings, session_id: str, job_id: str) -> str | None:
    """Free the session's claim if ``job_id`` holds it; the coalesced trigger's kind, if any.

    The trigger stays recorded until ``settle_trigger`` (call it once re-checked).
    """
    return released_trigger(client.eval(*_release_call(settings, session_id, job_id)))


def queue_release(pipeline: Any, settings: Settings, session_id: str, job_id: str) -> None:
    """``release_pending`` queued on ``pipeline`` (a job's last writes: one round trip);
    pass its reply to ``released_trigger``."""
    pipeline.eval(*_release_call(settings, session_id, job_id))


def _release_call(settings: Settings, session_id: str, job_id: str) -> tuple[Any, ...]:
    return (_RELEASE, 3, *_session_keys(settings, session_id), job_id, session_id)


def released_trigger(reply: Any) -> str | None:
    """The coalesced trigger's kind from the release script's reply, if any."""
    return as_text(reply) if reply else None


def settle_trigger(client: redis.Redis, settings: Settings, session_id: str) -> None:
    """Forget a recorded trigger once the session was re-checked (unless a new job owns it)."""
    client.eval(_SETTLE, 3, *_session_keys(settings, session_id), session_id)


# KEYS: job claim, retrigger, claims index; ARGV: session id. A session whose re-check could not
# run now: a trigger recorded (unless one is) and the session indexed, so the janitor comes back.
_KEEP = """
redis.call('SET', KEYS[2], 'micro', 'NX')
redis.call('ZADD', KEYS[3], redis.call('TIME')[1], ARGV[1])
"""


# KEYS: job claim, retrigger, claims index; ARGV: session id, delay (s). A session whose re-check
# cannot use its log (corrupt: its repair is an operator's): a trigger recorded (unless one is) and
# looked at again past the delay, unless a job claimed the session meanwhile (its claim's age is the
# janitor's to watch).
_DEFER = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('SET', KEYS[2], 'micro', 'NX')
  redis.call('ZADD', KEYS[3], redis.call('TIME')[1] + tonumber(ARGV[2]), ARGV[1])
end
"""


def defer_trigger(client: redis.Redis, settings: Settings, session_id: str, delay_s: float) -> None:
    """Have the janitor re-check the session ``delay_s`` from now, not at its next pass (a trigger
    kept, or recorded when there was none): one whose log is corrupt was re-read and logged every
    30 s, for good; one with no trigger left the janitor's index, and once its log was repaired
    nothing re-checked it before its next event."""
    client.eval(_DEFER, 3, *_session_keys(settings, session_id), session_id, int(delay_s))


def keep_trigger(client: redis.Redis, settings: Settings, session_id: str) -> None:
    """Have the janitor re-check the session later (its re-check could not run now)."""
    client.eval(_KEEP, 3, *_session_keys(settings, session_id), session_id)


def redis_now(client: redis.Redis) -> float:
    """Redis's clock (``TIME``), in seconds: the claims are scored by it, in the scripts."""
    seconds, micros = client.time()
    return float(seconds) + micros / 1e6


# KEYS: claims index; ARGV: the max score, a count, and the place (a session id and its score
# then; none: the index's start). Entries of the index from the one past the place, ``count`` at
# most, with their scores, up to the max score. The place is found by the session's rank while it
# is still there with the same score; else past the ids of that score that sort before it
# (sessions claimed in the same second share it: begun again at the first of them, a pass looked at
# the live ones among them again and got one stale claim further each time). A rank kept from a
# pass before skipped as many sessions as were settled meanwhile.
_LOOK_AT = """
local function after(a, b)  -- byte by byte, as the index orders ids of one score (Lua's < follows a locale)
  for i = 1, math.min(#a, #b) do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x > y end
  end
  return #a > #b
end
local start = 0
if ARGV[3] then
  local score = redis.call('ZSCORE', KEYS[1], ARGV[3])
  if score and tonumber(score) == tonumber(ARGV[4]) then
    start = redis.call('ZRANK', KEYS[1], ARGV[3]) + 1
  else
    -- (a binary search among the ranks of that score: thousands claimed in one second are one
    -- backlog's, and a walk over them all took 40 ms of Redis's time a pass for 10 000)
    start = redis.call('ZCOUNT', KEYS[1], '-inf', '(' .. ARGV[4])
    local past = redis.call('ZCOUNT', KEYS[1], '-inf', ARGV[4])
    while start < past do
      local middle = math.floor((start + past) / 2)
      if after(redis.call('ZRANGE', KEYS[1], middle, middle)[1], ARGV[3]) then
        past = middle
      else
        start = middle + 1
      end
    end
  end
end
local found = redis.call('ZRANGE', KEYS[1], start, start + tonumber(ARGV[2]) - 1, 'WITHSCORES')
local out = {}
for i = 1, #found, 2 do
  if tonumber(found[i + 1]) > tonumber(ARGV[1]) then break end
  out[#out + 1] = found[i]
  out[#out + 1] = found[i + 1]
end
return out
"""


def sessions_to_look_at(client: redis.Redis, settings: Settings, older_than_s: float,
                        now: float | None = None, after: tuple[float, str] | None = None,
                        ) -> list[tuple[str, float]]:
    """Sessions whose claim or trigger has waited longer than ``older_than_s`` (oldest first),
    with their scores, ``JANITOR_BATCH`` at most, past ``after`` (the score and id of the last one
    a pass before looked at).

    ``now``: Redis's clock (``redis_now``; asked for when not given). The claims are scored by
    it: a worker whose own clock lagged Redis's by a minute freed a dead job's claim a minute late.
    """
    keys = Keys(settings.redis.prefix, settings.redis.shards)
    now = redis_now(client) if now is None else now
    place = () if after is None else (after[1], repr(after[0]))
    found = client.eval(_LOOK_AT, 1, keys.claims, repr(now - older_than_s), JANITOR_BATCH, *place)
    return [(as_text(found[i]), float(found[i + 1])) for i in range(0, len(found), 2)]


def pending_job_id(client: redis.Redis, settings: Settings, session_id: str) -> str | None:
    """The id of the session's pending job (automatic or forced), if any."""
    value = client.get(Keys(settings.redis.prefix, settings.redis.shards).job(session_id))
    return as_text(value) if value else None


def _claim(
    client: redis.Redis, settings: Settings, session_id: str, job_id: str, kind: Kind,
    breaker_open_kind: Kind | None | _Unchecked = UNCHECKED,
) -> str | None:
    """Claim the session (one round trip); the claimed job id (``job_id``, or the same
    id renamed to ``breaker_open_kind`` when the breaker is open), or None when a live
    job already holds it (the trigger is then recorded) or the breaker leaves nothing
    to do."""
    reply = client.eval(*_claim_call(settings, Trigger(session_id, "", kind, breaker_open_kind), job_id))
    return _claimed(session_id, reply)


def _claim_call(settings: Settings, trigger: Trigger, job_id: str) -> tuple[Any, ...]:
    """The arguments of the EVAL of ``_CLAIM`` for ``trigger`` with the new ``job_id``."""
    keys = Keys(settings.redis.prefix, settings.redis.shards)
    sid, kind, other = trigger.session_id, trigger.kind, trigger.breaker_open_kind
    check = not isinstance(other, _Unchecked)
    other_kind = (other or "") if not isinstance(other, _Unchecked) else ""
    return (
        _CLAIM, 4, keys.job(sid), keys.retrigger(sid), keys.claims, keys.failures(sid),
        job_id, kind, sid, "1" if check else "0", settings.context.max_failures,
        other_kind, Job.key_for(""), STALE_CLAIM_GRACE_S, _rename(job_id, kind, other_kind) if other_kind else "",
    )


def _claimed(session_id: str, reply: Any) -> str | None:
    """The claimed job id from the claim script's reply; None when coalesced or skipped."""
    outcome, claimed, other = (as_text(part) for part in reply)
    if outcome == "skipped":
        logger.debug("no job session=%s: breaker open", session_id)
        return None
    if outcome == "pending":
        from compactor import metrics  # (not at import: see _enqueued)

        metrics.JOBS_COALESCED.labels(claimed).inc()  # here the trigger's kind
        logger.debug("coalesced session=%s kind=%s pending=%s", session_id, claimed, other)
        return None
    if outcome == "replaced":
        logger.warning("replaced stale claim session=%s stale_job=%s", session_id, other)
    return claimed


def _rename(job_id: str, kind: str, new_kind: str) -> str:
    stamp, _, rest = job_id.partition("-")
    return f"{stamp}-{new_kind}-{rest[len(kind) + 1:]}"


def claim_is_stale(client: redis.Redis, job_id: str, now: float | None = None) -> bool:
    """Whether a claimed job has ended, or never came to exist within the grace period (its age
    by ``now``, Redis's clock, as the claim scripts' ``is_stale`` has it; asked for when not given)."""
    status = client.hget(Job.key_for(job_id), "status")
    if status is not None:
        return as_text(status) in ENDED_STATUSES
    parsed = parse_job_id(job_id)
    now = redis_now(client) if now is None and parsed else now
    age_s = (now or 0.0) - parsed[0] / 1e9 if parsed else STALE_CLAIM_GRACE_S + 1
    return age_s > STALE_CLAIM_GRACE_S


def queue_unqueued_claim(client: redis.Redis, settings: Settings, session_id: str, job_id: str,
                         now: float) -> bool:
    """Queue the forced job ``job_id`` that holds the session's claim but was never queued (RQ status
    ``created`` since its claim, which is older than ``STALE_CLAIM_GRACE_S`` by ``now``, Redis's
    clock): its enqueuer stopped between the two (Ctrl-C, killed, or Redis gone, so its clean-up
    failed too). Such a claim is no stale one (its job did not end), and it was kept for good: the
    session got no compaction again, forced or automatic. True when it was queued."""
    status = client.hget(Job.key_for(job_id), "status")
    if status is None or as_text(status) != JobStatus.CREATED:
        return False
    # the claim's age, not the job's: a forced job that waited long for the claim is created as long,
    # and its claim is made (and the score set, by the same script) right before its enqueue
    claimed_at = client.zscore(Keys(settings.redis.prefix, settings.redis.shards).claims, session_id)
    if claimed_at is None or now - claimed_at <= STALE_CLAIM_GRACE_S:
        return False
    if not _enqueue_if_still_created(client, settings, session_id, job_id):
        return False
    _enqueued(session_id, job_id, True)
    return True


def _enqueue_if_still_created(client: redis.Redis, settings: Settings, session_id: str, job_id: str,
                              after: str | None = None) -> bool:
    """RQ-enqueue the claimed forced job ``job_id`` (``after``: see ``_with_joined_after``) if it is
    still ``created`` and the session's claim still its own, in one transaction watching both: False
    when another queued it first. (A request or promotion stalled past the grace between its claim
    and its enqueue (SIGSTOP, a frozen container) was overtaken by the janitor's
    ``queue_unqueued_claim``; both enqueued the job, and RQ ran it twice.) ``NoSuchJobError`` when
    the job is gone from Redis, or ended unqueued (``_ENDED_WAITING``: cancelled while it waited)."""
    queue = compaction_queue(client, settings)
    together = getattr(queue, "_enqueue_rate_limited_job", None)
    claim_key = Keys(settings.redis.prefix, settings.redis.shards).job(session_id)
    unanswered = False  # an EXEC sent, its reply lost (redis-py says it a WatchError): perhaps queued by it
    with client.pipeline(transaction=True) as pipe:
        while True:
            executing = False
            try:
                pipe.watch(Job.key_for(job_id), claim_key)  # type: ignore[no-untyped-call]
                status, claim = pipe.hget(Job.key_for(job_id), "status"), pipe.get(claim_key)
                if status is None:
                    raise NoSuchJobError("is gone from Redis")
                if as_text(status) in _ENDED_WAITING and claim is not None and as_text(claim) == job_id:
                    # (cancelled while it waited: promoted all the same, its claim held up the session 30 s)
                    raise NoSuchJobError(f"{_ENDED_WORDS.get(as_text(status), 'ended')} while it waited")
                if as_text(status) != JobStatus.CREATED or claim is None or as_text(claim) != job_id:
                    if unanswered:  # (its own EXEC's, most likely: counted queued, as _queued_all_the_same does)
                        logger.warning("forced job %s of session %s was queued, its enqueue's reply lost", job_id,
                                       session_id, extra={"session_id": session_id, "job_id": job_id})
                        return True
                    logger.info("forced job %s of session %s was queued by another: not again", job_id, session_id,
                                extra={"session_id": session_id, "job_id": job_id})
                    return False
                job = _with_joined_after(client, job_id, after)
                if together is None:  # (another RQ: its own enqueue, unguarded)
                    pipe.reset()
                    queue.enqueue_job(job)
                    return True
                pipe.multi()
                pipe.sadd(queue.redis_queues_keys, queue.key)
                job.origin = queue.name
                together(job, pipeline=pipe)
                executing = True
                pipe.execute()
                return True
            except redis.WatchError as e:  # (its status or the claim changed meanwhile: looked at again)
                unanswered = unanswered or (executing and connection_lost(e))
                continue


def _with_joined_after(client: redis.Redis, job_id: str, after: str | None = None) -> Job:
    """The forced job ``job_id``, about to be queued, waiting for the latest ``after`` of its own,
    ``after`` and those of the requests that joined it while it waited (``_FORCE`` keeps the latest
    on its hash): it waited for the first request's alone, and a joining caller's last events could
    be left out of the compaction it was answered with. Set in the job's arguments (saved by the
    enqueue) before it is queued (no worker has it yet; no request joins it since its claim), so a
    worker of any version runs it."""
    job = Job.fetch(job_id, connection=client)
    joined = as_text(client.hget(job.key, JOINED_AFTER_FIELD) or b"")
    own = job.kwargs.get("after")
    latest = max((entry for entry in (own, after, joined) if isinstance(entry, str) and STREAM_ID_RE.fullmatch(entry)),
                 key=stream_id_key, default=None)
    if latest is not None and latest != own and job.kwargs.get("forced"):
        job.kwargs = {**job.kwargs, "after": latest}
    return job


def _job_spec(settings: Settings, session_id: str, cwd: str, job_id: str, forced: bool,
              after: str | None = None) -> dict[str, Any]:
    """The RQ job (``Queue.create_job`` / ``enqueue_call`` arguments) of a compaction."""
    kind = _kind_of(job_id)
    kwargs: dict[str, Any] = {"forced": True} if forced and kind == "llm" else {}
    if after is not None and kwargs:
        kwargs["after"] = after
    return {
        "func": JOB_FUNCTIONS[kind],
        "args": (session_id, cwd),
        "kwargs": kwargs,
        "job_id": job_id,
        "timeout": settings.worker.job_timeout_seconds,
        "result_ttl": JOB_RESULT_TTL_S if forced else AUTO_JOB_RESULT_TTL_S,
        "failure_ttl": JOB_FAILURE_TTL_S if forced else AUTO_JOB_FAILURE_TTL_S,
        "description": f"{kind} compaction of {session_id}{' (forced)' if forced else ''}",
        "rate_limit": rate_limit_for(settings, session_id),
        # (a forced job RQ finds abandoned is replaced then, before its failure is recorded: worker.jobs)
        **({"on_failure": Callback(REPLACE_ABANDONED, timeout=CALLBACK_TIMEOUT_S)} if kwargs else {}),
    }


__all__ = [
    "FORCED_TRIGGER", "JOB_FUNCTIONS", "UNCHECKED", "Kind", "Trigger", "trigger_compactions", "claim_is_stale",
    "compaction_queue", "enqueue_compaction", "enqueue_forced_compaction", "new_job_id",
    "parse_job_id", "pending_job_id", "promote_forced", "queue_unqueued_claim", "rate_limit_for", "release_pending",
    "sync_clock",
    "sessions_to_look_at", "settle_trigger", "redis_now",
]
