"""The RQ job functions: thin, top level, ids and primitives in, a camelCase dict out.

``micro_compact(session_id, cwd)`` and ``llm_compact(session_id, cwd, forced=False)``
return the ``CompressResult`` as ``{"didCompress", "released", "promptEstimate"}``.
A failed LLM compaction raises (``LLMUnavailable`` / ``SummaryInvalid``), so RQ
records the job as failed with that message (the API answers 502 for a forced one).
When ``context.fallbackModel`` answered for a failed LLM call, the job succeeds and
its result also carries ``llmError: {kind, error, model, fallback}`` (``kind``:
``transient``, ``permanent`` or ``invalid``), as does its log line.

Invariant: however a job ends (result, exception, timeout), ``finish`` runs:
it frees the session's pending-job claim if this job holds it (an LLM job that
appended a summary freed it already, in its state save's round trip) and, when a
trigger was coalesced meanwhile, re-checks the thresholds from the stored
state and enqueues again, so no trigger is lost (the trigger stays recorded
until the re-check is done). A forced job that waited for this one (the
trigger ``forced:{id}``) is queued instead (``promote_forced``: it answers
every trigger, and stays recorded until it holds the claim; when the forced
job ends without a compaction, the session is re-checked, since the triggers it
absorbed while it waited were not recorded). For a job whose
worker was killed, or a claim whose job never came, the worker janitor (``worker.runner``) calls ``finish``
with ``abandoned=True``: the session is re-checked even without a trigger,
since the job that should have compacted it did not.
Each job logs one line: session, job, kind, outcome, duration.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from rq import get_current_job
from rq.exceptions import AbandonedJobError, NoSuchJobError
from rq.job import Job

from compactor import metrics
from compactor.applied import wait_applied
from compactor.keys import Keys
from compactor.queue import (
    FORCED_TRIGGER,
    defer_trigger,
    enqueue_compaction,
    enqueue_forced_compaction,
    keep_trigger,
    new_job_id,
    promote_forced,
    release_pending,
    settle_trigger,
)
from compactor.redis_errors import is_transient
from events.config import Settings
from events.errors import (
    JobAbandoned,
    LLMUnavailable,
    LogCorrupted,
    LogLocked,
    LogWriteFailed,
    SessionNotFound,
    SummaryInvalid,
)
from events.models import LLM_ERROR_FIELD, MICRO_STEP_FIELD, REQUEUED_AS_FIELD, REQUEUED_FROM_FIELD, CompressResult
from events.state import decide
from worker.compaction import STOPPING, JobRun, LlmFailure
from worker.context import WorkerContext, current

logger = logging.getLogger(__name__)

CORRUPT_RECHECK_S = 600.0  # a session whose log the re-check found corrupt: its trigger looked at again after this
REPLACED_TTL_S = 86_400  # how long the mark of an abandoned forced job's one replacement stays


def micro_compact(session_id: str, cwd: str) -> dict[str, Any]:
    """RQ job: micro compaction of one session."""
    return _run("micro", session_id, cwd, forced=False)


def llm_compact(session_id: str, cwd: str, forced: bool = False, after: str | None = None) -> dict[str, Any]:
    """RQ job: LLM compaction of one session (``forced`` skips thresholds and the breaker).
    ``after``: a stream entry id of the session the request was made after; the watcher is given
    up to ``after_wait_s`` to apply it first (queued right after a new session's first events,
    the job ran before the log was written and failed ``SessionNotFound``)."""
    started = time.monotonic()  # (the job's timeout runs from here: the wait counts against it)
    context = current()
    wait_s = after_wait_s(context.settings, get_current_job())
    if after and not wait_applied(context.redis, context.settings, session_id, after, wait_s,
                                  stop=STOPPING.is_set):  # ("": none)
        logger.warning("entry %s of session=%s not applied %s: compacting the log as it is", after, session_id,
                       "(the worker is stopping)" if STOPPING.is_set() else f"after {wait_s:.0f} s",
                       extra={"session_id": session_id})
    return _run("llm", session_id, cwd, forced=forced, started=started)


def after_wait_s(settings: Settings, job: Job | None) -> float:
    """How long a forced job waits for the watcher to apply its ``after`` entry: ``api.jobWaitSeconds``,
    as the API's own wait does (``?wait=false`` leaves that wait to the job), and at most half the
    job's timeout (the rest is its LLM calls'). (10 s, fixed: a watcher paused or restarting for
    longer failed a new session's job ``SessionNotFound`` after its 202, or compacted an older
    session without the events the request was made after.)"""
    timeout = job.timeout if job is not None and isinstance(job.timeout, (int, float)) and job.timeout > 0 \
        else settings.worker.job_timeout_seconds
    return min(settings.api.job_wait_seconds, timeout / 2)


def _run(kind: str, session_id: str, cwd: str, *, forced: bool, started: float | None = None) -> dict[str, Any]:
    context = current()
    job = get_current_job()
    job_id = job.id if job is not None else ""
    started = time.monotonic() if started is None else started
    outcome = "error"
    result: CompressResult | None = None
    llm_failed = write_failed = False
    run = JobRun(job_id)
    if forced and job_id:  # (its summary found in the log if it runs again: ``Compactor.llm``)
        run.answers = tuple(j for j in (job_id, (job.meta or {}).get(REQUEUED_FROM_FIELD) if job else None) if j)
    if job is not None and isinstance(job.timeout, (int, float)) and job.timeout > 0:
        run.deadline = started + job.timeout  # (a chunked summary stops short of it: JobRun.covered)
    try:
        if job is not None:  # (run by RQ: a job's claim is its own at its start, unless it was handed on)
            context.compactor.check_not_handed_on(session_id, run)
        if kind == "micro":
            result = context.compactor.micro(session_id, cwd, run=run)
        else:
            result = context.compactor.llm(session_id, cwd, forced=forced, run=run)
        outcome = "compressed" if result.did_compress else "nothing_to_do"
        value = result.model_dump(by_alias=True)
        if run.llm_failure is not None:  # the fallback answered: the LLM's failure goes with the result
            value[LLM_ERROR_FIELD] = run.llm_failure.to_wire()
        return value
    except LLMUnavailable as e:
        outcome, llm_failed = "llm_transient" if e.transient else "llm_permanent", True
        raise
    except SummaryInvalid:
        outcome, llm_failed = "summary_invalid", True
        raise
    except SessionNotFound:
        outcome = "session_not_found"
        raise
    except JobAbandoned:
        outcome = "abandoned"  # (counted by the janitor that declared it so)
        raise
    except LogWriteFailed:
        write_failed = True
        raise
    finally:
        if result is None and outcome != "abandoned":  # failed: its micro step, if it took one (whatever failed it)
            result = _keep_micro_step(job, run)
        seconds = time.monotonic() - started
        if outcome != "abandoned":
            metrics.observe_job(kind, outcome, seconds, result.released if result else None)
        failure = run.llm_failure
        logger.info(
            "compaction job session=%s job=%s kind=%s forced=%s outcome=%s released=%s estimate=%s duration_ms=%.1f%s",
            session_id, job_id, kind, forced, outcome,
            result.released if result else "", result.prompt_estimate if result else "",
            seconds * 1000, f" llm_error={failure.kind} fallback={failure.fallback}" if failure else "",
            extra=_job_fields(session_id, job_id, kind, forced, outcome, seconds, result, failure),
        )
        # (a forced job the LLM failed took its micro step; re-checked, it queued the same LLM call at
        # once: two calls and two failures counted for one request. The next turn_end re-triggers.)
        compressed = result is not None and result.did_compress
        # a summary of part of the targets (its chunks stopped short of the timeout): re-checked
        # now, the next job goes on at once rather than at the agent's next turn_end
        # (the re-check waits FINISH_LOCK_WAIT_S at most for the log's lock, then leaves it to the janitor:
        # a job past its timeout, no alarm armed any more, waited for a paused process's lock as long as
        # that one was stopped, 16 minutes, its worker held and still "started")
        # (a job that could not write its lines (disk full, EIO) leaves the session to the janitor's
        # re-check, STALE_CLAIM_GRACE_S later: its trigger used up, an automatic one's session stayed
        # over its threshold for good once the disk was fine again; re-checked at once, it paid for
        # another LLM call the full disk threw away)
        finish(context, session_id, job_id, released=run, lock_wait_s=FINISH_LOCK_WAIT_S, retry_later=write_failed,
               forced_without_compaction=(forced and not compressed and not llm_failed) or run.covered is not None)


FINISH_LOCK_WAIT_S = 5.0  # a finished job's re-check waits this long for the log's lock, then the janitor's
T = TypeVar("T")
RELEASE_WAITS_S = (1.0, 2.0, 4.0)  # a job's own last writes are tried again this far apart while Redis drops
# connections or refuses


def _retried(write: Callable[[], T], what: str, session_id: str, job_id: str) -> T:
    """``write()``, tried again (``RELEASE_WAITS_S``, ~7 s in all, as the runner records the job's
    success) while Redis drops the connection or refuses: a Redis restarting as the job ended
    left the claim to the janitor, the session's next jobs held up meanwhile. No wait once the
    worker is told to stop: then the janitor's."""
    for wait in (*RELEASE_WAITS_S, None):
        try:
            return write()
        except redis.RedisError as error:
            if wait is None or STOPPING.is_set() or not is_transient(error):
                raise
            logger.warning("%s failed session=%s job=%s: %s; again in %.0f s", what, session_id, job_id, error, wait)
            time.sleep(wait)
    raise AssertionError("not reached")


def _keep_micro_step(job: Any, run: JobRun) -> CompressResult | None:
    """A failed LLM job's micro step, when it took one: kept in the job's meta, where
    ``GET /api/jobs/{id}`` (``microStep``) and ``compactor compact`` find it (the log holds its
    ``compact`` line whatever the job's status says)."""
    step = run.micro_step
    if step is not None and job is not None:
        try:
            job.meta[MICRO_STEP_FIELD] = step.model_dump(by_alias=True)
            job.save_meta()
        except Exception:  # (the job's own failure is what it reports)
            logger.exception("keeping the micro step of a failed job failed job=%s", job.id)
    return step


def _job_fields(session_id: str, job_id: str, kind: str, forced: bool, outcome: str,
                seconds: float, result: CompressResult | None, failure: LlmFailure | None) -> dict[str, Any]:
    """The structured fields of a job's log line (``extra=``)."""
    fields: dict[str, Any] = {"session_id": session_id, "job_id": job_id, "kind": kind,
                              "forced": forced, "outcome": outcome,
                              "duration_ms": round(seconds * 1000, 1)}
    if result is not None:
        fields.update(released=result.released, prompt_estimate=result.prompt_estimate)
    if failure is not None:
        fields.update(llm_error=failure.kind, fallback=failure.fallback)
    return fields


def finish(
    context: WorkerContext, session_id: str, job_id: str, *, abandoned: bool = False,
    released: JobRun | None = None, forced_without_compaction: bool = False, lock_wait_s: float | None = None,
    retry_later: bool = False,
) -> str | None:
    """Free the session's claim held by ``job_id`` and honour a coalesced trigger.

    ``released``: the job freed its claim already, with its last writes (an LLM
    job that appended a summary); its reply is used instead of a round trip.
    ``forced_without_compaction`` (also passed for a job whose summary covers only part of its
    targets: the rest is re-checked at once): a forced job that compacted nothing (nothing
    to summarize, SPEC §5, or it failed, but for the LLM: then it took its micro step, and
    the next turn_end re-triggers the LLM; re-checked at once, it called the LLM again). The triggers that came while it
    waited for the claim were not recorded (it was to answer them), so the
    session is re-checked as after an abandoned job. A forced job that
    compacted answered them: it took the micro step and summarized all it could.
    ``lock_wait_s``: how long the re-check waits for the session log's lock (None: as long as
    it takes); past it (a paused process holds it) a trigger is kept for the janitor.
    ``retry_later``: the job could not write to the log; the session is left to the janitor's
    re-check (a trigger kept) rather than re-checked now, unless a forced job waits for it.
    Returns the id of the job enqueued by the re-check, if any. Never raises: a
    failure here is logged, and the trigger stays recorded for the janitor.
    """
    try:
        if released is not None and released.sent is not None:
            try:
                released.collect()
            except Exception:  # the claim is freed below in a round trip of its own
                logger.exception("the last writes failed session=%s job=%s", session_id, job_id)
        if released is not None and released.reset_owed:  # (a success: SPEC §5's reset, sent with the last
            # writes, lost with them: the breaker stayed open a day after a forced job's success; before the
            # claim is freed, so that no failure of a job after this one is forgotten)
            try:
                _retried(lambda: context.compactor.failures.reset(session_id), "forgetting the failures",
                         session_id, job_id)
            except Exception:  # (the claim is freed all the same)
                logger.exception("forgetting the failures failed session=%s job=%s", session_id, job_id)
        if released is not None and released.done:
            trigger = released.trigger
        else:
            trigger = _retried(lambda: release_pending(context.redis, context.settings, session_id, job_id),
                               "freeing the claim", session_id, job_id)
        forced_waits = trigger is not None and trigger.startswith(FORCED_TRIGGER)
        if retry_later and not forced_waits:
            keep_trigger(context.redis, context.settings, session_id)
            return None
        if trigger is None and not (abandoned or forced_without_compaction):
            return None
        if trigger is not None and forced_waits:  # a forced job waited for this one
            forced = trigger[len(FORCED_TRIGGER):]
            try:
                return forced if promote_forced(context.redis, context.settings, session_id, forced) else None
            except NoSuchJobError:  # (gone from Redis, dropped: the triggers it was to answer are re-checked)
                if retry_later:
                    keep_trigger(context.redis, context.settings, session_id)
                    return None
        enqueued = recheck(context, session_id, lock_wait_s=lock_wait_s)
        settle_trigger(context.redis, context.settings, session_id)
        return enqueued
    except LogLocked as e:  # (the janitor's: waiting on, it held up its worker's heartbeats for good)
        logger.warning("re-check deferred session=%s job=%s: %s", session_id, job_id, e)
        try:
            keep_trigger(context.redis, context.settings, session_id)
        except Exception:
            logger.exception("finishing job failed session=%s job=%s", session_id, job_id)
        return None
    except LogWriteFailed as e:  # (the log the job failed on: its error says it, a traceback chained
        # twice over 50 lines said nothing more; a trigger kept is re-checked at the janitor's next pass)
        logger.error("finishing job failed session=%s job=%s: the re-check cannot use the log: %s",
                     session_id, job_id, e)
        return None
    except LogCorrupted as e:  # (an operator's to repair: re-read and logged at every janitor pass, for good)
        logger.error("finishing job failed session=%s job=%s: the re-check cannot use the log: %s; "
                     "re-checked again in %.0f min", session_id, job_id, e, CORRUPT_RECHECK_S / 60)
        try:
            defer_trigger(context.redis, context.settings, session_id, CORRUPT_RECHECK_S)
        except Exception:
            logger.exception("finishing job failed session=%s job=%s", session_id, job_id)
        return None
    except Exception:
        logger.exception("finishing job failed session=%s job=%s", session_id, job_id)
        return None


def recheck(context: WorkerContext, session_id: str, *, lock_wait_s: float | None = None) -> str | None:
    """Enqueue the compaction the session's state calls for now, if any.

    The state is brought up to date with the log first (under its lock) and stored: the watcher
    appends a turn and records its trigger before its deferred state save runs, so the stored
    state can lag the very turn whose trigger is being answered; and a job that appended its
    summary but whose state save failed (Redis killed meanwhile: the janitor re-checks its
    session) left the stored state behind its log until the session's next event.
    """
    store = context.compactor.store
    state = store.load(session_id)
    if state is None:
        return None
    log = store.log(session_id, state.cwd, create=False)  # (deleted meanwhile: SessionNotFound, not an empty log)
    if lock_wait_s is not None:
        log.lock_wait_s = lock_wait_s  # (LogLocked past it)
    if not log.exists():  # deleted: a job would only end session_not_found
        return None
    state = store.apply(session_id, state.cwd, [], log=log, cached=state, stored=state).state  # (caught up, stored)
    breaker_open = context.compactor.failures.is_open(session_id)
    kind = decide(state, context.settings.context, breaker_open=breaker_open)
    if kind is None:
        logger.debug("coalesced trigger no longer needed session=%s", session_id)
        return None
    return enqueue_compaction(context.redis, context.settings, session_id, state.cwd, kind)


def replace_if_abandoned(job: Job, connection: Any, exc_type: Any, *exc: Any) -> None:
    """RQ's failure callback of a forced job: when RQ finds it abandoned (its worker died while it
    ran: a serve stopped during a call longer than its children's 15 s grace, a kill -9), a forced
    job is queued in its place (``replace_abandoned``), before the failure is recorded, so a wait
    on it never sees it failed without ``requeuedAs``. Never raises (RQ would record its error as
    the job's)."""
    if exc_type is AbandonedJobError:
        replace_abandoned(job, "its worker died while it ran")


def replace_abandoned(job: Job, why: str) -> str | None:
    """Queue a forced job in the place of the forced ``job``, abandoned (``why``), once: its request
    was accepted (a 202, or a wait cut by a stopping API), and the session, maybe under its
    thresholds, got no compaction from it. A replacement is not replaced in turn (a job that kills
    its worker each time would run for good); one that joined a forced job already waiting is that
    job, whose own request keeps its replacement. Its id is recorded on ``job`` (``requeuedAs``)
    first, then the job queued under it: waits follow it. The replacement's id, or None."""
    session_id = job.args[0] if job.args else "?"
    try:
        meta = job.meta or {}
        if not job.kwargs.get("forced") or meta.get(REQUEUED_AS_FIELD):
            return None
        if meta.get(REQUEUED_FROM_FIELD):
            logger.warning("abandoned forced job not queued again session=%s job=%s (%s): it replaced %s already",
                           session_id, job.id, why, meta[REQUEUED_FROM_FIELD], extra={"session_id": session_id})
            return None
        context = current()
        guard = Keys(context.settings.redis.prefix, context.settings.redis.shards).replaced(job.id)
        # (one replacement: RQ's maintenance and the janitor each clean the registry up, and one
        # fetched the job before the other recorded its replacement, both were queued)
        if not context.redis.set(guard, replacement_id := new_job_id(session_id, "llm"), nx=True,
                                 ex=REPLACED_TTL_S):
            return None
        try:  # (the guard taken back on any failure: set, the other cleaner would replace it no more)
            job.meta[REQUEUED_AS_FIELD] = replacement_id
            job.save_meta()  # type: ignore[no-untyped-call]
            replacement = enqueue_forced_compaction(context.redis, context.settings, session_id, job.args[1],
                                                    after=job.kwargs.get("after"), job_id=replacement_id,
                                                    meta={REQUEUED_FROM_FIELD: job.id})
        except Exception:  # (no replacement: the record taken back, or waits followed it to a job never made)
            job.meta.pop(REQUEUED_AS_FIELD, None)
            with contextlib.suppress(Exception):
                job.save_meta()  # type: ignore[no-untyped-call]
            with contextlib.suppress(Exception):
                context.redis.delete(guard)
            raise
        if replacement != replacement_id:  # (it joined the forced job already waiting: that one answers)
            job.meta[REQUEUED_AS_FIELD] = replacement
            job.save_meta()  # type: ignore[no-untyped-call]
        logger.warning("abandoned forced job queued again session=%s job=%s (%s) as=%s", session_id, job.id, why,
                       replacement, extra={"session_id": session_id, "job_id": replacement})
        return replacement
    except Exception:  # (its request is answered job_abandoned, as before; RQ's handling goes on)
        logger.exception("abandoned forced job %s not queued again session=%s", job.id, session_id)
        return None
