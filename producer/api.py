"""The HTTP API (SPEC §7): forced compaction, event intake, context, session state, jobs.

Routes:

    POST /api/sessions/{id}/compact   {cwd}           -> CompressResult | 202 {jobId}
    POST /api/sessions/{id}/events    {cwd, events}   -> 202 {accepted, streamIds, duplicates}
    GET  /api/sessions/{id}/context?cwd=[&after=]     -> {messages, promptEstimate, currentTurnId, applied}
    GET  /api/sessions/{id}?cwd=                       -> session state (see SessionBody)
    GET  /api/jobs/{jobId}                             -> {jobId, status, result?, error?}
    GET  /api/dead-letters?session=&limit=            -> the refused entries, newest first, with reasons
    GET  /healthz (and HEAD)                           -> 200 when Redis answers, else 503
    GET  /metrics                                      -> Prometheus text (producer.api_metrics)
    GET  /, /api/overview, /api/sessions, .../history  -> the status page (producer.status_page)

Invariants:
- The session id and cwd are validated before any path is built or any key is read.
- A JSON body is read strictly (``api_errors.JsonBodyRoute``): JSON content type,
  UTF-8, no value the log would change or refuse (``NaN``, a 65-bit integer ...).
- ``POST .../events`` validates every event before the first one is published
  (all or none): each alone by the Publisher (one validation path for Python
  and HTTP clients), then the batch as the watcher will apply it (a uuid twice,
  a turn going backwards: ``events.checks.check_batch``), then against what
  Redis already holds of the session (its bound cwd, its turn when nothing
  waiting in the stream can change it: ``_refuse_backwards``); a 400 names the
  index and field (``events[2].turnId: ...``). An event whose uuid the session
  has already is a retry's: left out of what is published (``duplicates``).
- A forced compaction never hangs the request: past ``api.jobWaitSeconds`` it
  answers 202 with the job id.
- Settings and the Redis client come from dependencies (``get_settings``,
  ``get_redis``) that tests override; ``create_app`` builds no global state.
- The OpenAPI schema declares the errors each route really answers (all
  ``{"error": {code, message}}``) and no 422: a validation error is a 400 here.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Annotated, Any
from urllib.parse import quote

import anyio.to_thread
import orjson
import redis
from fastapi import APIRouter, Depends, FastAPI, Header, Query, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from rq.utils import as_text
from starlette.routing import Mount, Route

from compactor import __version__
from compactor import metrics as compactor_metrics
from compactor.applied import parse_stream_id
from compactor.keys import Keys
from compactor.queue import ABANDONED_WORDS, enqueue_forced_compaction
from compactor.redis_errors import probe_writes
from compactor.serve import client_redis_url
from compactor.shards import ShardCountMismatch, ShardGuard
from compactor.signal_safe import SignalSafeEvent
from compactor.store import SessionStore, bound_elsewhere, check_logged_cwd
from events.checks import check_past_turns
from events.config import Settings
from events.errors import InvalidEvent, InvalidInput, JobLost, LogCorrupted, SessionNotFound
from events.log import SessionLog
from events.models import EVENT_ADAPTER, TURN_SCOPED_TYPES, validate_cwd, validate_session_id
from events.state import SessionState
from producer.api_errors import (
    PUBLIC_PATHS,
    ApiError,
    BadBody,
    JsonBodyRoute,
    RequestGuard,
    error_response,
    install_error_handlers,
)
from producer.api_jobs import error_message, job_body, wait_for_job_async
from producer.api_metrics import HttpMetrics, ProcessMetrics, scrape_registry
from producer.api_models import (
    CompactRequest,
    CompressResult,
    ContextBody,
    DeadLettersBody,
    ErrorBody,
    EventsAccepted,
    EventsRequest,
    Health,
    JobAccepted,
    JobBody,
    SessionBody,
)
from producer.api_sessions import (
    context_body,
    current_state,
    rebuilt_lock_free,
    dead_letters_body,
    not_found,
    session_body,
    wait_settled,
)
from producer.publisher import Publisher, check_idempotency_key

logger = logging.getLogger(__name__)

REDIS_SOCKET_TIMEOUT_S = 5.0
Responses = dict[int | str, dict[str, Any]]
ERROR_CASES = {
    400: "bad input: a bad field (named), session id or cwd; a body not JSON",
    401: "api.token is set and the token is missing or wrong",
    404: "no log file for the session",
    413: "body over limits.maxBodyBytes",
    500: "log_unreadable: the session's log has a line that is not a JSON event (named); "
         "log_write_failed; internal_error",
    502: "the compaction job failed",
    503: "Redis unreachable",
}


def errors(*statuses: int, described: Mapping[int, str] | None = None) -> Responses:
    """OpenAPI ``responses`` for error statuses (``{"error": {code, message}}``), described as in
    ``ERROR_CASES`` unless ``described`` says otherwise."""
    text = {**ERROR_CASES, **(described or {})}
    return {status: {"model": ErrorBody, "description": text[status]} for status in statuses}


ERRORS = errors(400, 401)  # every route under /api


def get_settings(request: Request) -> Settings:
    """The app's settings (override in tests with ``app.dependency_overrides``)."""
    settings: Settings = request.app.state.settings
    return settings


def get_redis(request: Request) -> redis.Redis:
    """The app's Redis client (bytes responses, as RQ needs)."""
    client: redis.Redis = request.app.state.redis
    return client


SettingsDep = Annotated[Settings, Depends(get_settings)]
RedisDep = Annotated[redis.Redis, Depends(get_redis)]
CwdQuery = Annotated[str, Query(description="absolute working directory of the session")]
IdempotencyKey = Annotated[str | None, Header(
    alias="Idempotency-Key", description="the events without a uuid get one derived from this key, their "
    "index and the batch's content (timestamps aside): the same batch sent again with the same key (a retry) is "
    "applied once, and another batch under a key used before is not taken for it",
    json_schema_extra={"minLength": 1, "maxLength": 255, "pattern": "^[!-~]+$"})]  # (checked by the Publisher)


def make_redis(settings: Settings) -> redis.Redis:
    """A client for the configured Redis, or the embedded one ``compactor serve`` runs."""
    return redis.Redis.from_url(client_redis_url(settings),
                                socket_timeout=REDIS_SOCKET_TIMEOUT_S,
                                socket_connect_timeout=REDIS_SOCKET_TIMEOUT_S)


def _checked(session_id: str, cwd: str, *, new: bool = False) -> tuple[str, str]:
    """``new``: the cwd comes in with events (``validate_cwd``: refused as the watcher refuses it)."""
    return validate_session_id(session_id), validate_cwd(cwd, new=new)


def _require_log(client: redis.Redis, settings: Settings, session_id: str, cwd: str) -> None:
    if not SessionLog(settings.data_dir, cwd, session_id).found():
        raise not_found(SessionStore(client, settings), session_id, cwd)


def _require_log_unless_waiting(client: redis.Redis, settings: Settings, session_id: str, cwd: str,
                                after: str | None) -> None:
    """``_require_log``, but for a session whose events sent before ``after`` still wait in its
    shard (a new session's first events: its log does not exist yet). In a thread: the 404's
    look at Redis, on the event loop, held every other request up while Redis was slow."""
    if after is None or SessionLog(settings.data_dir, cwd, session_id).exists() or not _waiting_in_shard(
            client, settings, session_id, cwd):
        _require_log(client, settings, session_id, cwd)


SENT_WINDOW_S = 600.0  # the uuids POST .../events published are remembered this long (Keys.sent)


def _publish(client: redis.Redis, settings: Settings, session_id: str, cwd: str,
             events: list[dict[str, Any]], idempotency_key: str | None = None) -> tuple[list[str], list[int]]:
    """Validate each event, the batch, and the batch against the session; then publish it all
    but the events the session has already (a retry's): their stream ids, and those events' indexes."""
    publisher = Publisher(client, settings)
    batch = publisher.prepare(session_id, cwd, events, idempotency_key=idempotency_key)  # each, then the batch
    duplicates = _check_against_session(client, settings, session_id, cwd, batch.events)
    ids, sent_meanwhile = publisher.send_unsent(batch.without(duplicates), SENT_WINDOW_S)
    kept = [i for i in range(len(batch.events)) if i not in duplicates]  # (send_unsent's indexes are of these)
    return ids, sorted(duplicates | {kept[i] for i in sent_meanwhile})


def _check_against_session(client: redis.Redis, settings: Settings, session_id: str, cwd: str,
                           wires: Sequence[dict[str, Any]]) -> set[int]:
    """Refuse what the watcher would refuse from the session's stored state (one round trip; the
    log searched for the batch's uuids when Redis has no state of the session):
    a session bound to another cwd, and a turn going backwards when that is certain
    (``_refuse_backwards``). The indexes of the events whose uuid the session has already: a
    retry's (a uuid is the event's identity: the watcher would dead-letter the copy); the others
    are checked without them. (A retry of events still in the stream passes these checks, as
    nothing is certain while they wait there; ``Publisher.send_unsent`` leaves them out.)"""
    store = SessionStore(client, settings)
    found = store.lookup({session_id: list(wires)}, load=[session_id])
    state = found.stored.get(session_id)
    taken = found.taken.get(session_id, set())
    if state is not None:
        if state.cwd != cwd:
            raise bound_elsewhere(session_id, state.cwd, cwd)
        log = store.log(session_id, cwd)
        if log.complete_size() < state.log_size:  # the log shrank under its state (restored from an older
            # copy): its uuid index holds the uuids of lines no longer there, and the events sent again
            # were answered duplicates, never applied; the log says which it holds (the watcher rebuilds
            # the state and the index at the session's next event)
            asked = {uuid for event in wires if isinstance(uuid := event.get("uuid"), str)}
            taken = log.uuids_among(asked)
    else:  # Redis lost it (or never had it): the log's session_meta keeps the binding (a path that is
        # no file: LogCorrupted naming it, a 500, not a 202 the watcher holds back)
        log = store.log(session_id, cwd)
        check_logged_cwd(session_id, cwd, log.first_of_type("session_meta"))
        if not log.exists():  # a new session: bound by the first batch published for it, if it still waits
            _check_waiting_cwd(client, settings, session_id, cwd)
        # ... and the log holds a retry's uuids, which the uuid index Redis lost with the state (or
        # its idle TTL) no longer does: the retry was "accepted", then dead-lettered by the watcher.
        # Searched for in the log as it is (no lock, nothing created), until the watcher applies the
        # session's next event and stores its state and index again.
        asked = {uuid for event in wires if isinstance(uuid := event.get("uuid"), str) and uuid not in taken}
        taken = taken | log.uuids_among(asked)
    duplicates = {index for index, event in enumerate(wires) if event.get("uuid") in taken}
    if len(duplicates) == len(wires):
        return duplicates
    wires = [event for index, event in enumerate(wires) if index not in duplicates]
    try:
        _check_new_events(client, settings, store, session_id, cwd, state, wires, taken)
    except InvalidInput as e:  # (located in the batch as sent)
        if e.index is None:
            raise
        raise e.at([i for i in range(len(wires) + len(duplicates)) if i not in duplicates][e.index]) from e
    return duplicates


def _check_waiting_cwd(client: redis.Redis, settings: Settings, session_id: str, cwd: str) -> None:
    """A 400 ``cwd`` when the session, new (no state, no log), had a batch published with another
    cwd in the last 10 minutes (``Keys.bound``, set by the publishers) of which an entry still
    waits, which the watcher will bind it to: the batch was a 202, then the watcher's dead letter.
    (Two first batches sent at once both pass; so does one after a producer's raw XADD, which
    sets no such key; and so does one while the shard's backlog is past ``UNAPPLIED_SCAN``: not
    certain, the watcher decides, as for the turns.) The usual batch costs one GET."""
    bound = client.get(Keys(settings.redis.prefix, settings.redis.shards).bound(session_id))
    if bound is None or as_text(bound) == cwd:
        return
    # ... and an entry of it still waits (a batch the watcher dead-lettered whole, a producer's first
    # mistake, bound nothing: its key alone refused the right cwd for 10 minutes)
    waiting = _waiting_entries(client, settings, session_id)
    if waiting is not None and any(as_text(fields.get(b"cwd", b"")) == as_text(bound) for fields in waiting):
        raise bound_elsewhere(session_id, as_text(bound), cwd)


def _check_new_events(client: redis.Redis, settings: Settings, store: SessionStore, session_id: str, cwd: str,
                      state: SessionState | None, wires: Sequence[dict[str, Any]], taken: set[str]) -> None:
    if state is None:  # Redis lost it (or its idle TTL ran out): the log's, when there is one
        log = store.log(session_id, cwd)
        if log.exists():
            state = rebuilt_lock_free(log, session_id, cwd, settings, log.complete_size())
    if state is not None:
        _refuse_backwards(client, settings, store, state, wires, taken)
    else:
        _refuse_past_a_new_sessions_turns(client, settings, store, session_id, cwd, wires)


UNAPPLIED_SCAN = 200  # entries of a shard looked through for the session's own; past that: not certain


def _refuse_backwards(client: redis.Redis, settings: Settings, store: SessionStore, state: SessionState,
                      wires: Sequence[dict[str, Any]], taken: set[str]) -> None:
    """Refuse (400 ``events[i].turnId``) a turn-scoped event below the session's
    ``currentTurnId`` (or, ``events[i].lastSummarizedTurnId`` / ``endTurnId``, a summary or
    compact past its highest turn), when the stored state is certainly the session's as the
    watcher will see it (``_settled``: it matches the log's size, and no entry of the session
    waits in its shard, undelivered, or delivered and not acked). Otherwise a rollback published
    earlier may still lower the turn: the event is published, and the watcher decides (it
    dead-letters it if it does go backwards). The usual batch costs nothing here; one holding a
    rollback is checked past it (``_refuse_around_a_rollback``)."""
    if any(event.get("type") == "rollback" for event in wires):
        _refuse_around_a_rollback(client, settings, store, state, wires, taken)
        return
    current = state.current_turn_id
    problem: InvalidEvent | None = None
    for index, event in enumerate(wires):
        kind, turn = event.get("type"), event.get("turnId")
        if kind in TURN_SCOPED_TYPES and isinstance(turn, int) and turn < current:
            problem = InvalidEvent("turnId", f"goes backwards: {turn} < currentTurnId {current}", index)
            break
    try:  # a summary or compact past the session's turns, likewise
        check_past_turns(wires, state.current_turn_id)
    except InvalidEvent as e:
        problem = e if problem is None or (e.index or 0) < (problem.index or 0) else problem
    if problem is None:
        return
    if problem.field == "turnId" and _only_rising(client, settings, store, state):
        raise problem  # (what waits cannot lower currentTurnId: it goes backwards whatever it is)
    if not _settled(client, settings, store, state):
        return
    raise problem


def _only_rising(client: redis.Redis, settings: Settings, store: SessionStore, state: SessionState) -> bool:
    """Whether nothing the watcher has yet to fold into ``state`` can lower the session's
    ``currentTurnId``: no rollback among the session's entries waiting in its shard, nor among
    the log's lines past the state's size (the lines of a save on its way). Without one a turn
    only rises, so an event below the stored ``currentTurnId`` certainly goes backwards: published
    with a 202 beside events that were applied, it was dead-lettered, the batch half applied."""
    waiting = _waiting_entries(client, settings, state.session_id)
    if waiting is None or any(_is_rollback(fields.get(b"event", b"")) for fields in waiting):
        return False
    log = store.log(state.session_id, state.cwd)
    size = log.complete_size()
    if size < state.log_size:  # (cut back or replaced under its state: the watcher rebuilds it)
        return False
    try:
        return size == state.log_size or not any(event.get("type") == "rollback"
                                                 for event in log.read(state.log_size))
    except LogCorrupted:
        return False


def _is_rollback(event: bytes) -> bool:
    try:
        parsed = orjson.loads(event)
    except orjson.JSONDecodeError:
        return False  # (dead-lettered: it lowers nothing)
    return isinstance(parsed, dict) and parsed.get("type") == "rollback"


def _settled(client: redis.Redis, settings: Settings, store: SessionStore, state: SessionState) -> bool:
    """Whether ``state`` is certainly the session's as the watcher will see it: it matches the
    log's size, and no entry of the session waits in its shard."""
    return (store.log(state.session_id, state.cwd).complete_size() == state.log_size
            and not _waiting_in_shard(client, settings, state.session_id))


def _refuse_around_a_rollback(client: redis.Redis, settings: Settings, store: SessionStore, state: SessionState,
                              wires: Sequence[dict[str, Any]], taken: set[str]) -> None:
    """``_refuse_backwards`` for a batch holding a rollback: what comes after it is checked
    against what the rollback leaves (the log replayed, as the watcher will), when the state is
    settled. A batch ``[rollback 4, user 2]`` was a 202: the rollback applied, the user event
    dead-lettered (goes backwards: 2 < 4), the client told "accepted"."""
    settled = _settled(client, settings, store, state)
    if not settled and not _only_rising(client, settings, store, state):
        return
    # (what waits without a rollback only raises the turn: a turn going backwards past the batch's own
    # rollback does so whatever is applied first; not a summary or compact past the turns, which one
    # waiting may end)
    refused = [(event, error) for event, error in store.refusals(state, list(wires), taken)
               if settled or error.field == "turnId"]
    if refused:
        event, error = refused[0]
        raise error.at(next(i for i, wire in enumerate(wires) if wire is event))


def _refuse_past_a_new_sessions_turns(client: redis.Redis, settings: Settings, store: SessionStore,
                                      session_id: str, cwd: str, wires: Sequence[dict[str, Any]]) -> None:
    """``_refuse_backwards``' summary / compact check for a session with no state and no log,
    when that is certain: no entry of it waits in its shard, and still no log once that is known
    (the watcher writes the log before it acks). A summary sent as a new session's first event
    was a 202, then the watcher's dead letter."""
    try:
        check_past_turns(wires, 1)  # (an empty log's currentTurnId)
    except InvalidEvent:
        if store.log(session_id, cwd).exists() or _waiting_in_shard(client, settings, session_id) \
                or store.log(session_id, cwd).exists():
            return
        raise


def _waiting_in_shard(client: redis.Redis, settings: Settings, session_id: str, cwd: str | None = None) -> bool:
    """Whether an entry of ``session_id`` (sent with ``cwd``, when given) may not be applied yet:
    one in its shard not delivered to the watchers' group, or delivered and not acked (True when
    more than ``UNAPPLIED_SCAN`` entries would have to be looked through)."""
    waiting = _waiting_entries(client, settings, session_id)
    return waiting is None or any(cwd is None or as_text(fields.get(b"cwd", b"")) == cwd for fields in waiting)


def _waiting_entries(client: redis.Redis, settings: Settings, session_id: str) -> list[dict[bytes, bytes]] | None:
    """The fields of the entries of ``session_id`` that may not be applied yet (``_waiting_in_shard``),
    in stream order; None when more than ``UNAPPLIED_SCAN`` entries would have to be looked through."""
    keys = Keys(settings.redis.prefix, settings.redis.shards)
    stream = keys.stream_for(session_id)
    groups = {as_text(g["name"]): g for g in client.xinfo_groups(stream)} if client.exists(stream) else {}
    group = groups.get(keys.group)
    after = as_text(group["last-delivered-id"]) if group else "0-0"
    undelivered: list[Any] = client.xrange(stream, f"({after}", "+", count=UNAPPLIED_SCAN) or []
    pending: list[Any] = client.xpending_range(stream, keys.group, "-", "+", UNAPPLIED_SCAN) if group else []
    if len(undelivered) >= UNAPPLIED_SCAN or len(pending) >= UNAPPLIED_SCAN:
        return None
    entries = list(undelivered)
    if pending:
        pipe = client.pipeline(transaction=False)
        for item in pending:
            pipe.xrange(stream, item["message_id"], item["message_id"])
        entries = [entry for reply in pipe.execute() for entry in reply] + entries  # (pending ones are older)
    return [fields for _, fields in entries if fields and as_text(fields.get(b"session", b"")) == session_id]


sessions = APIRouter(prefix="/api/sessions", tags=["sessions"], responses=ERRORS, route_class=JsonBodyRoute)
JOB_ID_HEADER = "X-Compactor-Job-Id"  # on a forced compaction's 200: the job that answered
LLM_ERROR_HEADER = "X-Compactor-LLM-Error"  # ... and the failed LLM call its fallback answered for


@sessions.post(
    "/{session_id}/compact", response_model=CompressResult,
    responses={**errors(404, 413, 500, 502, 503),
               202: {"model": JobAccepted, "description": "queued (wait=false or wait timed out)"}},
)
async def compact(session_id: str, body: CompactRequest, settings: SettingsDep,
                  client: RedisDep, request: Request, response: Response, wait: bool = True) -> Any:
    """Force an LLM compaction (thresholds and breaker skipped) and wait for its result.

    When the fallback summarizer answered for a failed LLM call, the answer says so in
    ``X-Compactor-LLM-Error: <kind>; fallback=<model>`` (and ``GET /api/jobs/{id}`` in ``llmError``).
    """
    sid, cwd = _checked(session_id, body.cwd)
    timeout = settings.api.job_wait_seconds
    deadline = time.monotonic() + timeout  # (one for both waits: a wait for `after`, then a whole second
    # one for the job, answered past twice jobWaitSeconds)
    if body.after is not None:  # (a new session's first events sent just before: its log did not exist yet, a 404)
        parse_stream_id(body.after, "after")
        if wait:  # (wait=false answers at once: the job waits for them itself, as long)
            await wait_settled(client, settings, sid, body.after, timeout, stop=request.app.state.stopping)
    await anyio.to_thread.run_sync(_require_log_unless_waiting, client, settings, sid, cwd, body.after)
    job_id = await anyio.to_thread.run_sync(
        functools.partial(enqueue_forced_compaction, client, settings, sid, cwd, after=body.after))
    logger.info("forced compaction queued session=%s job=%s", sid, job_id)
    if not wait:
        return _accepted(job_id)
    queue = Keys(settings.redis.prefix, settings.redis.shards).queue
    try:
        job = await wait_for_job_async(client, job_id, queue, max(0.0, deadline - time.monotonic()),
                                       stop=request.app.state.stopping)
    except JobLost as e:  # (a 404 said the session was unknown; the job may have run)
        return error_response(500, str(e), "job_lost", headers={JOB_ID_HEADER: job_id})
    job_id = job.job_id  # (a job abandoned mid-run: the one queued in its place, followed)
    if job.status == "finished" and job.result is not None:
        response.headers[JOB_ID_HEADER] = job_id
        if job.llm_error is not None:
            fallback = _header_text(job.llm_error.fallback)
            response.headers[LLM_ERROR_HEADER] = f"{job.llm_error.kind}; fallback={fallback}"
        return job.result
    if job.error is not None:  # the job id in the header too, as on a 200: GET /api/jobs/{id} has the rest
        status, code = _job_failure_status(job.error)
        step = job.micro_step  # (SPEC §5 runs it before the LLM call: the failure does not undo it)
        applied = (f" (its micro step was applied: released {step.released} tokens, promptEstimate now "
                   f"{step.prompt_estimate})") if step is not None else ""
        return error_response(status, f"compaction job {job_id} {job.status}: {error_message(job.error)}{applied}", code,
                              headers={JOB_ID_HEADER: job_id})
    return _accepted(job_id)


def _header_text(text: str) -> str:
    """``text`` as a header value can hold it: percent-encoded (RFC 3986) past printable ASCII, and
    its ``%``. (A fallback model named ``openai/模型`` made the 200 of a compaction that had been
    appended a 500, no job id in it: Starlette writes header values as Latin-1.)"""
    return quote(text, safe="".join(chr(c) for c in range(0x21, 0x7F) if chr(c) != "%"))


# A forced job that failed before any LLM call answers as the other session routes do for the
# same cause (its error line starts with the exception's class); any other failure is a 502.
_JOB_FAILURES = {
    "events.errors.LogCorrupted": (500, "log_unreadable"),
    "events.errors.LogWriteFailed": (500, "log_write_failed"),
    "events.errors.SessionNotFound": (404, None),
    "events.errors.InvalidEvent": (400, None),
    "events.errors.InvalidInput": (400, None),
    "events.errors.JobAbandoned": (500, "job_abandoned"),  # (taken for dead, then went on: worker.compaction)
}


def _job_failure_status(error: str) -> tuple[int, str | None]:
    """The status and code of a forced compaction whose job failed with ``error`` (its last line).
    A job whose worker died is a 500 ``job_abandoned``, not SPEC §7's 502 (no LLM call failed; the
    janitor re-checks the session, so a retry of the request finds it compacted or compacts it)."""
    if any(words in error for words in ABANDONED_WORDS):
        return 500, "job_abandoned"
    return _JOB_FAILURES.get(error.partition(":")[0], (502, None))


def _accepted(job_id: str) -> JSONResponse:
    return JSONResponse(JobAccepted(job_id=job_id).model_dump(by_alias=True), status_code=202)


@sessions.post(
    "/{session_id}/events", status_code=202, response_model=EventsAccepted, responses=errors(413, 500, 503),
)
def push_events(request: Request, session_id: str, body: EventsRequest, settings: SettingsDep, client: RedisDep,
                idempotency_key: IdempotencyKey = None) -> EventsAccepted:
    """Validate every event, then publish them all to the session's stream shard.

    The whole batch is validated before its one MULTI/EXEC, so a bad event (400
    ``events[i].field: ...``; an event over ``limits.maxEventBytes`` is a bad
    event too: ``events[i].event``; so is one the watcher would refuse after
    the others: ``events[1].uuid: 'u' duplicates events[0]``) means nothing
    was published.

    Retries: an event whose ``uuid`` the session has already is not published
    again (its index is in ``duplicates``). Send each event's ``uuid``, or an
    ``Idempotency-Key`` header (the events without a uuid get one derived from
    it, their index and the whole batch's content), and a batch sent again after a lost reply
    or a 503 is applied once.
    """
    keys = request.headers.getlist("idempotency-key")
    if len(keys) > 1:  # (FastAPI reads the first: a retry sent with the second was published again)
        raise BadBody(f"Idempotency-Key: given {len(keys)} times; give it once")
    if idempotency_key is not None:
        check_idempotency_key(idempotency_key, "Idempotency-Key")
    # (a control character in it: answered 202, then every entry dead-lettered by the watcher)
    sid, cwd = _checked(session_id, body.cwd, new=True)
    try:
        request.app.state.shard_guard.check(client)
    except ShardCountMismatch as e:  # (every event would be dead-lettered as wrong_shard)
        raise ApiError(503, f"not published: {e}", "shard_count_mismatch") from e
    ids, duplicates = _publish(client, settings, sid, cwd, body.events, idempotency_key)
    logger.info("events accepted session=%s count=%d duplicates=%d", sid, len(ids), len(duplicates))
    return EventsAccepted(accepted=len(ids), stream_ids=ids, duplicates=duplicates)


@sessions.get("/{session_id}/context", response_model=ContextBody, response_model_exclude_unset=True,
              responses=errors(404, 500, 503))
async def get_context(
    request: Request, session_id: str, cwd: CwdQuery, settings: SettingsDep, client: RedisDep,
    after: Annotated[str | None, Query(description="a stream id POST .../events answered: first wait until "
                                                   "the watcher applied the session's events up to it")] = None,
    timeout: Annotated[float, Query(ge=0, le=60, allow_inf_nan=False,
                                    description="seconds to wait for `after` at most")] = 5.0,
) -> ContextBody:
    """The context view (SPEC §4) computed from the log. A 202 from ``POST .../events`` means
    published, not yet applied: with ``after`` (its last stream id) the view waits for them
    (``applied`` says whether they were, within ``timeout``). Without it, Redis is not needed."""
    sid, cwd = _checked(session_id, cwd)
    applied = None
    unapplied = None
    if after is not None:
        parse_stream_id(after, "after")
        applied = await wait_settled(client, settings, sid, after, timeout, stop=request.app.state.stopping)
        if not applied:  # (no log yet: an empty view while the session's own entries wait in its shard)
            unapplied = functools.partial(_waiting_in_shard, client, settings, sid, cwd)
    return await anyio.to_thread.run_sync(context_body, settings, sid, cwd, applied, unapplied)


@sessions.get("/{session_id}", response_model=SessionBody, responses=errors(404, 500, 503))
def get_session(session_id: str, cwd: CwdQuery, settings: SettingsDep,
                client: RedisDep) -> SessionBody:
    """The session's estimate, thresholds in tokens, breaker, pending job, last compaction."""
    sid, cwd = _checked(session_id, cwd)
    return session_body(client, settings, current_state(client, settings, sid, cwd))


jobs = APIRouter(prefix="/api/jobs", tags=["jobs"], responses=ERRORS, route_class=JsonBodyRoute)


@jobs.get("/{job_id}", response_model=JobBody, response_model_exclude_none=True,
          responses=errors(404, 503, described={404: "no such job"}))
def get_job(job_id: str, settings: SettingsDep, client: RedisDep) -> JobBody:
    """A compaction job's status, with its CompressResult or error when it has ended."""
    return job_body(client, job_id, Keys(settings.redis.prefix, settings.redis.shards).queue)


ops = APIRouter(tags=["operations"], route_class=JsonBodyRoute)


@ops.get("/api/dead-letters", response_model=DeadLettersBody, responses={**ERRORS, **errors(503)})
def dead_letters(
    settings: SettingsDep, client: RedisDep,
    session: Annotated[str | None, Query(max_length=1_000, description="only this session's letters")] = None,
    limit: Annotated[int, Query(ge=1, le=1_000, description="letters returned at most")] = 50,
) -> DeadLettersBody:
    """The entries the watcher refused (``{p}:dead``), newest first, with the reason of each: how
    an agent finds out what became of events it was answered 202 for."""
    return dead_letters_body(client, settings, session, limit)


@ops.get("/healthz", response_model=Health, responses=errors(503))
def healthz(client: RedisDep, settings: SettingsDep) -> Health:
    """Liveness: 200 when Redis takes a write (no token needed; HEAD too, for probes that send it):
    PING alone answered while Redis refused every write (OOM under noeviction), and the API 503'd."""
    probe_writes(client, Keys(settings.redis.prefix, settings.redis.shards).health)
    return Health(status="ok", redis="ok")


@ops.get("/metrics", response_class=Response,
         responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text"}, **errors(401)})
def metrics(request: Request) -> Response:
    """Prometheus metrics: process counters (all processes under serve), Redis-side gauges."""
    registry: CollectorRegistry = request.app.state.scrape_registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def _install_openapi(app: FastAPI, bearer: bool) -> None:
    """The schema as the app answers: FastAPI's 422 (a validation error is our 400) taken off
    every route, a 401 on every route but the public ones, and, when a token is configured,
    the Bearer scheme."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            _declare_errors(schema)
            _declare_events(schema)
            if bearer:
                schema.setdefault("components", {})["securitySchemes"] = {
                    "bearer": {"type": "http", "scheme": "bearer"}}
                schema["security"] = [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _declare_events(schema: dict[str, Any]) -> None:
    """The events of ``POST .../events`` as SPEC §3's types, discriminated by ``type`` (the body
    takes plain objects, so that a bad one is named ``events[i].field`` by the Publisher's own
    validation: the schema said only "object", and a client generated from it knew no event)."""
    event = EVENT_ADAPTER.json_schema(ref_template="#/components/schemas/{model}", by_alias=True)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name, definition in event.pop("$defs", {}).items():
        components.setdefault(name, definition)
    events = components.get("EventsRequest", {}).get("properties", {}).get("events")
    if events is not None:
        events["items"] = event


def _declare_errors(schema: dict[str, Any]) -> None:
    error = {"description": "", "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/ErrorBody"}}}}
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            if responses.pop("422", None) is not None:
                responses.setdefault("400", {**error, "description": ERROR_CASES[400]})
            if path not in PUBLIC_PATHS:
                responses.setdefault("401", {**error, "description": ERROR_CASES[401]})
            if "503" in responses:  # (api_errors.RETRY_AFTER)
                responses["503"].setdefault("headers", {})["Retry-After"] = {
                    "description": "seconds to wait before a retry", "schema": {"type": "integer"}}
    schemas = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)


def create_app(settings: Settings, redis: redis.Redis | None = None) -> FastAPI:
    """The API app for ``settings``; ``redis`` defaults to a client built from the settings."""
    # (redirect_slashes: ``/api/sessions/s/`` answered a bodyless 307 to an absolute http:// URL,
    # the wrong scheme behind a TLS proxy; a path is exact, as the docs list it: else a 404)
    app = FastAPI(title="compactor", version=__version__, redirect_slashes=False,
                  description="Context compaction service for LLM coding agents (SPEC §7).")
    app.state.settings = settings
    app.state.stopping = SignalSafeEvent()  # set on SIGTERM/SIGINT (``compactor api``): waits answer 202 at once
    app.state.redis = redis if redis is not None else make_redis(settings)
    app.state.shard_guard = ShardGuard(Keys(settings.redis.prefix, settings.redis.shards), settings.watcher.lease_ms)
    from producer.status_page import STATUS_ROUTERS, install_status_page

    compactor_metrics.init_series()  # (the counters of the API's own enqueues; alone, the process's series)
    app.state.registry = registry = CollectorRegistry()  # this app's HTTP metrics
    app.state.process_metrics = process = ProcessMetrics(registry)
    app.state.scrape_registry = scrape_registry(process, app.state.redis, settings)
    install_status_page(app)  # before the sessions router: /api/sessions/{id}/history
    for router in (sessions, jobs, ops):
        app.include_router(router)
    install_error_handlers(app)
    app.add_middleware(RequestGuard, token=settings.api.token, allowed_hosts=settings.api.allowed_hosts,
                       max_body_bytes=settings.limits.max_body_bytes)
    routes = [route for router in (*STATUS_ROUTERS, sessions, jobs, ops) for route in router.routes]
    app.add_middleware(HttpMetrics, registry=registry,  # the routers in the order they were included, then
                       routes=[*routes, *(route for route in app.routes  # the docs' routes and the static files
                                          if isinstance(route, (Route, Mount)))])
    _install_openapi(app, bearer=bool(settings.api.token))
    return app
