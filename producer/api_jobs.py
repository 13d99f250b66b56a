"""Forced compactions and RQ job status, shared by the HTTP API and the CLI.

Invariants:
- A forced compaction is answered by a forced job that has not started when
  it is asked for (``compactor.queue.enqueue_forced_compaction``): queued at
  once when the session has no pending job, else waiting (RQ status
  ``created``) until that job ends; a request made while a forced job waits
  joins it. So a caller never gets the result of an automatic job, nor of a
  compaction that began before its request, and the session never has two
  jobs queued or running (SPEC §5).
- Waiting never hangs: every wait has a deadline; past it the caller gets the
  job id (HTTP 202) and can poll ``GET /api/jobs/{jobId}``.
- A job's ``result`` is the ``CompressResult`` its function returned; ``error``
  is the last line of its traceback (the exception, not the stack); ``llmError``
  the failed LLM call a finished job's fallback summarizer answered for.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

import anyio.to_thread
import redis
from rq.exceptions import DeserializationError, NoSuchJobError
from rq.job import Job, JobStatus

from compactor.queue import JOB_FUNCTIONS
from events.errors import JobLost
from events.models import LLM_ERROR_FIELD, MICRO_STEP_FIELD, REQUEUED_AS_FIELD, REQUEUED_FROM_FIELD, CompressResult
from producer.api_errors import ApiError
from producer.api_models import JobBody, LlmError

logger = logging.getLogger(__name__)

_JOB_FUNCTIONS = frozenset(JOB_FUNCTIONS.values())

# The service's ids are ``{20 digits}-{micro|llm}-{sessionId}``: up to 155 characters for a 128-character session id.
JOB_ID_MAX = 160
JOB_ID_RE = re.compile(rf"^[A-Za-z0-9][A-Za-z0-9_.:-]{{0,{JOB_ID_MAX - 1}}}$")
POLL_INTERVAL_S = 0.05
MAX_FOLLOWED = 3  # abandoned jobs' replacements a wait follows (one per job, once)
OUTAGE_POLL_INTERVAL_S = 0.25  # while Redis does not answer, ``wait_for_job`` tries it again this often
TERMINAL_STATUSES = frozenset({
    JobStatus.FINISHED.value, JobStatus.FAILED.value,
    JobStatus.STOPPED.value, JobStatus.CANCELED.value,
})


QUALIFIED_ERROR_RE = re.compile(r"(?:[A-Za-z_]\w*\.)+([A-Za-z_]\w*)(?:: (.*))?", re.DOTALL)


def error_message(error: str) -> str:
    """A job's error line without the exception's module path: ``events.errors.SessionNotFound:
    no log ...`` is ``no log ...``; an exception with no message keeps its class name."""
    match = QUALIFIED_ERROR_RE.fullmatch(error)
    if match is None:
        return error
    return match.group(2) or match.group(1)


def validate_job_id(job_id: str) -> str:
    if not JOB_ID_RE.fullmatch(job_id):
        raise ApiError(400, f"jobId: must be 1-{JOB_ID_MAX} letters, digits, '_', '.', ':' or '-', starting with a "
                            "letter or digit")
    return job_id


def _error_line(job: Job) -> str:
    result = job.latest_result()
    text = (getattr(result, "exc_string", None) or "").strip() if result is not None else ""
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else "job failed"


def job_body(client: redis.Redis, job_id: str, queue: str) -> JobBody:
    """The job's status, with its result when finished and its error when failed.

    Only a compaction job of this deployment (its RQ queue ``queue``) is answered: RQ's job
    keys are shared by every queue and application on the Redis, and another's job would
    show its error, or a result that is no ``CompressResult``; any other job is a 404.
    """
    validate_job_id(job_id)
    try:
        job = Job.fetch(job_id, connection=client)
        ours = job.origin == queue and job.func_name in _JOB_FUNCTIONS
    except NoSuchJobError as e:
        raise ApiError(404, f"no job {job_id}") from e
    except DeserializationError:  # a job hash no RQ of ours wrote
        ours = False
    if not ours:
        raise ApiError(404, f"no job {job_id} (RQ holds one, but it is no compaction job of this deployment)")
    status = job.get_status(refresh=False)
    value = status.value if isinstance(status, JobStatus) else str(status or "unknown")
    body = JobBody(job_id=job_id, status=value)
    if value == JobStatus.FINISHED.value:
        returned = job.return_value()
        if isinstance(returned, dict) and LLM_ERROR_FIELD in returned:  # the fallback answered
            returned = dict(returned)
            body.llm_error = LlmError.model_validate(returned.pop(LLM_ERROR_FIELD))
        body.result = _as_result(returned)
    elif value in TERMINAL_STATUSES:
        body.error = _error_line(job)
        step = (job.meta or {}).get(MICRO_STEP_FIELD)
        if isinstance(step, dict):
            body.micro_step = CompressResult.model_validate(step)
        requeued = (job.meta or {}).get(REQUEUED_AS_FIELD)
        if isinstance(requeued, str) and requeued:
            body.requeued_as = requeued
    replaced = (job.meta or {}).get(REQUEUED_FROM_FIELD)
    if isinstance(replaced, str) and replaced:
        body.requeued_from = replaced
    return body


def _as_result(value: Any) -> CompressResult | None:
    if value is None:
        return None
    if isinstance(value, CompressResult):
        return value
    return CompressResult.model_validate(value)


def wait_for_job(client: redis.Redis, job_id: str, queue: str, timeout_s: float) -> JobBody:
    """Poll until the job ends or ``timeout_s`` passes; the last status seen. Redis unreachable
    meanwhile (restarted: the workers wait it out and run the job) is waited out too, up to the
    same deadline, where its error is raised: ``compactor compact`` printed "nothing compacted"
    on a restart of a second, and the job it had queued then compacted. A job gone from Redis
    (``job_id`` is one that was queued) is waited for too (a worker running it writes it back
    when it ends), up to the deadline, where ``JobLost`` is raised. A forced job abandoned mid-run
    is followed to the one queued in its place (``requeued_as``): the body is its
    (or, when that one was never made, the abandoned job's own)."""
    deadline = time.monotonic() + timeout_s
    following = _Following(job_id)
    while True:
        try:
            body = _polled(client, following.job_id, queue)
        except (redis.ConnectionError, redis.TimeoutError, JobLost) as e:  # (BusyLoadingError too: a restart's load)
            if isinstance(e, JobLost) and following.origin is not None:
                return following.origin
            if time.monotonic() >= deadline:
                raise
            time.sleep(OUTAGE_POLL_INTERVAL_S)
            continue
        if following.follows(body):
            continue
        if body.status in TERMINAL_STATUSES or time.monotonic() >= deadline:
            return body
        time.sleep(POLL_INTERVAL_S)


async def wait_for_job_async(client: redis.Redis, job_id: str, queue: str, timeout_s: float,
                             stop: threading.Event | None = None) -> JobBody:
    """``wait_for_job`` without blocking the event loop; it ends early once ``stop`` is set (the
    API is stopping: the caller answers as for a wait that timed out, the job runs on). A Redis
    outage is waited out the same way (the API answered 503 at once, and a client that sent the
    request again paid a second LLM call while the first job went on), and past the deadline or
    at ``stop`` the last status seen is returned (``queued`` when none was): the caller answers
    202 with the job id, as for any wait that ran out. ``JobLost`` past the deadline only."""
    deadline = time.monotonic() + timeout_s
    last = JobBody(job_id=job_id, status=JobStatus.QUEUED.value)
    following = _Following(job_id)
    while True:
        try:
            body = await anyio.to_thread.run_sync(_polled, client, following.job_id, queue)
        except (redis.ConnectionError, redis.TimeoutError, JobLost) as e:
            if isinstance(e, JobLost) and following.origin is not None:
                return following.origin
            if time.monotonic() >= deadline and isinstance(e, JobLost):
                raise
            if time.monotonic() >= deadline or (stop is not None and stop.is_set()):
                return last
            await asyncio.sleep(OUTAGE_POLL_INTERVAL_S)
            continue
        if following.follows(body):
            last = JobBody(job_id=following.job_id, status=JobStatus.QUEUED.value)
            continue
        last = body
        if body.status in TERMINAL_STATUSES or time.monotonic() >= deadline or (stop is not None and stop.is_set()):
            return body
        await asyncio.sleep(POLL_INTERVAL_S)


@dataclass
class _Following:
    """The job a wait polls: a forced job abandoned mid-run is followed to the one queued in its
    place (``MAX_FOLLOWED`` at most). ``origin``: the abandoned job last followed, until its
    replacement is seen (one recorded but never made, an outage's: the wait answers with it)."""

    job_id: str
    followed: int = 0
    origin: JobBody | None = None

    def follows(self, body: JobBody) -> bool:
        """Whether ``body`` was replaced: the wait polls its replacement next."""
        if body.requeued_as and self.followed < MAX_FOLLOWED:
            self.job_id, self.followed, self.origin = body.requeued_as, self.followed + 1, body
            return True
        self.origin = None
        return False


def _polled(client: redis.Redis, job_id: str, queue: str) -> JobBody:
    """``job_body`` of a job the caller queued: gone from Redis, ``JobLost`` (not ``job_body``'s 404
    for an unknown job: ``compactor compact`` died with a traceback, and the API answered a 404, a
    session unknown to its client, for a compaction that could still be running)."""
    try:
        return job_body(client, job_id, queue)
    except ApiError as e:
        if e.status != 404:
            raise
        raise JobLost(f"Redis lost compaction job {job_id} while it was waited for (a restart without persistence, "
                      f"FLUSHDB, a restore of an older snapshot); it may have run all the same: the session's "
                      f"context or history says") from e
