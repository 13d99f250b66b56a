"""The HTTP API (SPEC §7): forced compaction, event intake, context, session state, jobs.

Routes:

    POST /api/sessions/{id}/compact   {cwd}           -> CompressResult | 202 {jobId}
    POST /api/sessions/{id}/events    {cwd, events}   -> 202 {accepted, streamIds}
    GET  /api/sessions/{id}/context?cwd=               -> {messages, promptEstimate, currentTurnId}
    GET  /api/sessions/{id}?cwd=                       -> session state (see SessionBody)
    GET  /api/jobs/{jobId}                             -> {jobId, status, result?, error?}
    GET  /healthz                                      -> 200 when Redis answers, else 503
    GET  /metrics                                      -> Prometheus text (producer.api_metrics)
    GET  /, /api/overview, /api/sessions, .../history  -> the status page (producer.status_page)

Invariants:
- The session id and cwd are validated before any path is built or any key is read.
- ``POST .../events`` validates every event before the first one is published
  (all or none, by the Publisher: one validation path for Python and HTTP
  clients); a 400 names the index and field (``events[2].turnId: ...``).
- A forced compaction never hangs the request: past ``api.jobWaitSeconds`` it
  answers 202 with the job id.
- Settings and the Redis client come from dependencies (``get_settings``,
  ``get_redis``) that tests override; ``create_app`` builds no global state.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

import anyio.to_thread
import redis
from fastapi import APIRouter, Depends, FastAPI, Query, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from compactor import __version__
from compactor.queue import enqueue_forced_compaction
from compactor.serve import client_redis_url
from events.config import Settings
from events.errors import SessionNotFound
from events.log import SessionLog
from events.models import validate_cwd, validate_session_id
from producer.api_errors import ApiError, RequestGuard, install_error_handlers
from producer.api_jobs import job_body, wait_for_job_async
from producer.api_metrics import HttpMetrics, ProcessMetrics, scrape_registry
from producer.api_models import (
    CompactRequest,
    CompressResult,
    ContextBody,
    ErrorBody,
    EventsAccepted,
    EventsRequest,
    Health,
    JobAccepted,
    JobBody,
    SessionBody,
)
from producer.api_sessions import context_body, current_state, session_body
from producer.publisher import Publisher

logger = logging.getLogger(__name__)

REDIS_SOCKET_TIMEOUT_S = 5.0
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody, "description": text} for code, text in {
        400: "bad input", 401: "token required and missing or wrong",
        503: "Redis unreachable",
    }.items()
}
NOT_FOUND: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorBody, "description": "no log file for the session"}}


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


def make_redis(settings: Settings) -> redis.Redis:
    """A client for the configured Redis, or the embedded one ``compactor serve`` runs."""
    return redis.Redis.from_url(client_redis_url(settings),
                                socket_timeout=REDIS_SOCKET_TIMEOUT_S,
                                socket_connect_timeout=REDIS_SOCKET_TIMEOUT_S)


def _checked(session_id: str, cwd: str) -> tuple[str, str]:
    return validate_session_id(session_id), validate_cwd(cwd)


def _require_log(settings: Settings, session_id: str, cwd: str) -> None:
    if not SessionLog(settings.data_dir, cwd, session_id).exists():
        raise SessionNotFound(f"no session {session_id} under cwd {cwd}")


def _publish(client: redis.Redis, settings: Settings, session_id: str, cwd: str,
             events: list[dict[str, Any]]) -> list[str]:
    return Publisher(client, settings).publish(session_id, cwd, events)


sessions = APIRouter(prefix="/api/sessions", tags=["sessions"], responses=ERRORS)
JOB_ID_HEADER = "X-Compactor-Job-Id"  # on a forced compaction's 200: the job that answered
LLM_ERROR_HEADER = "X-Compactor-LLM-Error"  # ... and the failed LLM call its fallback answered for


@sessions.post(
    "/{session_id}/compact", response_model=CompressResult,
    responses={**NOT_FOUND,
               202: {"model": JobAccepted, "description": "queued (wait=false or wait timed out)"},
               502: {"model": ErrorBody, "description": "the compaction job failed"}},
)
async def compact(session_id: str, body: CompactRequest, settings: SettingsDep,
                  client: RedisDep, response: Response, wait: bool = True) -> Any:
    """Force an LLM compaction (thresholds and breaker skipped) and wait for its result.

    When the fallback summarizer answered for a failed LLM call, the answer says so in
    ``X-Compactor-LLM-Error: <kind>; fallback=<model>`` (and ``GET /api/jobs/{id}`` in ``llmError``).
    """
    sid, cwd = _checked(session_id, body.cwd)
    _require_log(settings, sid, cwd)
    timeout = settings.api.job_wait_seconds
    job_id = await anyio.to_thread.run_sync(enqueue_forced_compaction, client, settings, sid, cwd)
    logger.info("forced compaction queued session=%s job=%s", sid, job_id)
    if not wait:
        return _accepted(job_id)
    job = await wait_for_job_async(client, job_id, timeout)
    if job.status == "finished" and job.result is not None:
        response.headers[JOB_ID_HEADER] = job_id
        if job.llm_error is not None:
            response.headers[LLM_ERROR_HEADER] = f"{job.llm_error.kind}; fallback={job.llm_error.fallback}"
        return job.result
    if job.error is not None:
        raise ApiError(502, f"compaction job {job_id} {job.status}: {job.error}")
    return _accepted(job_id)


def _accepted(job_id: str) -> JSONResponse:
    return JSONResponse(JobAccepted(job_id=job_id).model_dump(by_alias=True), status_code=202)


@sessions.post(
    "/{session_id}/events", status_code=202, response_model=EventsAccepted,
    responses={413: {"model": ErrorBody, "description": "body over limits.maxBodyBytes"}},
)
def push_events(session_id: str, body: EventsRequest, settings: SettingsDep,
                client: RedisDep) -> EventsAccepted:
    """Validate every event, then publish them all to the session's stream shard.

    The Publisher validates the whole batch before its one MULTI/EXEC, so a bad
    event (400 ``events[i].field: ...``; an event over ``limits.maxEventBytes``
    is a bad event too: ``events[i].event``) means nothing was published.
    """
    sid, cwd = _checked(session_id, body.cwd)
    ids = _publish(client, settings, sid, cwd, body.events)
    logger.info("events accepted session=%s count=%d", sid, len(ids))
    return EventsAccepted(accepted=len(ids), stream_ids=ids)


@sessions.get("/{session_id}/context", response_model=ContextBody, responses=NOT_FOUND)
def get_context(session_id: str, cwd: CwdQuery, settings: SettingsDep) -> ContextBody:
    """The context view (SPEC §4) computed from the log."""
    sid, cwd = _checked(session_id, cwd)
    return context_body(settings, sid, cwd)


@sessions.get("/{session_id}", response_model=SessionBody, responses=NOT_FOUND)
def get_session(session_id: str, cwd: CwdQuery, settings: SettingsDep,
                client: RedisDep) -> SessionBody:
    """The session's estimate, thresholds in tokens, breaker, pending job, last compaction."""
    sid, cwd = _checked(session_id, cwd)
    return session_body(client, settings, current_state(client, settings, sid, cwd))


jobs = APIRouter(prefix="/api/jobs", tags=["jobs"], responses=ERRORS)


@jobs.get("/{job_id}", response_model=JobBody, response_model_exclude_none=True,
          responses={404: {"model": ErrorBody, "description": "no such job"}})
def get_job(job_id: str, client: RedisDep) -> JobBody:
    """A compaction job's status, with its CompressResult or error when it has ended."""
    return job_body(client, job_id)


ops = APIRouter(tags=["operations"])


@ops.get("/healthz", response_model=Health,
         responses={503: {"model": ErrorBody, "description": "Redis unreachable"}})
def healthz(client: RedisDep) -> Health:
    """Liveness: 200 when Redis answers PING (no token needed)."""
    client.ping()
    return Health(status="ok", redis="ok")


@ops.get("/metrics", response_class=Response,
         responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text"}})
def metrics(request: Request) -> Response:
    """Prometheus metrics: process counters (all processes under serve), Redis-side gauges."""
    registry: CollectorRegistry = request.app.state.scrape_registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def _with_bearer_scheme(app: FastAPI) -> None:
    """Declare the Bearer scheme in the OpenAPI schema when a token is configured."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            schema.setdefault("components", {})["securitySchemes"] = {
                "bearer": {"type": "http", "scheme": "bearer"}}
            schema["security"] = [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def create_app(settings: Settings, redis: redis.Redis | None = None) -> FastAPI:
    """The API app for ``settings``; ``redis`` defaults to a client built from the settings."""
    app = FastAPI(title="compactor", version=__version__,
                  description="Context compaction service for LLM coding agents (SPEC §7).")
    app.state.settings = settings
    app.state.redis = redis if redis is not None else make_redis(settings)
    from producer.status_page import install_status_page

    app.state.registry = registry = CollectorRegistry()  # this app's HTTP metrics
    app.state.process_metrics = process = ProcessMetrics(registry)
    app.state.scrape_registry = scrape_registry(process, app.state.redis, settings)
    install_status_page(app)  # before the sessions router: /api/sessions/{id}/history
    for router in (sessions, jobs, ops):
        app.include_router(router)
    install_error_handlers(app)
    app.add_middleware(RequestGuard, token=settings.api.token,
                       max_body_bytes=settings.limits.max_body_bytes)
    app.add_middleware(HttpMetrics, registry=registry)
    if settings.api.token:
        _with_bearer_scheme(app)
    return app
