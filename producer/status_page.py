"""The status page (``GET /``) and the JSON routes it reads.

    GET /                                   the page (static HTML + JS, no external assets)
    GET /static/{file}                      its script and style sheet
    GET /api/overview                       totals: sessions, breakers, queue, backlog, counters
    GET /api/sessions?limit=                the most recently active sessions with their state
    GET /api/sessions/{id}/history?cwd=     compaction history with tokens before/after, and
                                            the current context view with elided outputs marked

Invariants:
- With ``api.token`` set, the page, its static files and every ``/api`` route
  need the token, like the rest of the API (SPEC §7: all but ``/healthz``). A
  browser gets the token through HTTP Basic (its own login prompt: any user
  name, the token as password; ``producer.api_errors``) and sends it with the
  page's fetches.
- Readers never write: history and savings are computed from the log (the view
  at the line before and the line after each ``compact``/``summary``). They are
  cached per API process, keyed by what makes them stale (the log size, the
  compaction's uuid), so a refreshing page does not rebuild views of an idle
  session.
- A compaction line out of the view says why (``hiddenBy``): a later rollback
  (``events.view.undone_by_rollback``), else a later summary that replaced it.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import anyio.to_thread
import redis
from fastapi import APIRouter, FastAPI, Query, Request, Response
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from compactor.held import held_sessions
from compactor.keys import Keys
from compactor.queue import check_bound_cwd, compaction_queue
from compactor.shards import server_ms
from compactor.store import SessionStore, known_sessions
from events.config import ContextSettings, Settings
from events.errors import SessionNotFound
from events.log import SessionLog
from events.view import build_view, omitted_chars, undone_by_rollback
from producer.api import CwdQuery, RedisDep, SettingsDep, _checked, errors
from producer.api_errors import JsonBodyRoute
from producer.api_metrics import BreakerCollector, ProcessMetrics, StreamLagCollector
from producer.api_models import SessionBody
from producer.api_sessions import read_log, recent_session_bodies

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"
DEFAULT_SESSIONS_LISTED = 100
MAX_SESSIONS_LISTED = 1_000
MAX_HISTORY_ENTRIES = 50  # most recent compactions shown on a session page
CACHE_ENTRIES = 1_024
# sessions whose history is kept (one body each, that of the log's current size): a body of a
# ~1M-token session is ~2 MB, and one kept per size the log had grew the API by that per turn
HISTORY_CACHE_SESSIONS = 32
HISTORY_REUSE_FACTOR = 10  # a history is computed at most one tenth of the time a page asks for it
COUNTERS = {  # Overview.counters key -> compactor.metrics family
    "eventsIngested": "compactor_events_ingested",
    "deadLettered": "compactor_entries_dead_lettered",
    "jobsEnqueued": "compactor_jobs_enqueued",
    "jobsCoalesced": "compactor_jobs_coalesced",
    "jobsSucceeded": "compactor_jobs_succeeded",
    "jobsFailed": "compactor_jobs_failed",
    "tokensReleased": "compactor_tokens_released",
    "breakerOpens": "compactor_breaker_opens",
}


class _Body(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True,
                              serialize_by_alias=True)


class Savings(_Body):
    tokens_before: int = Field(description="promptEstimate at the line before the compaction")
    tokens_after: int = Field(description="promptEstimate with the compaction line")
    released: int


class SessionRow(SessionBody):
    last_activity: float | None = Field(None, description="unix seconds of the last event")
    last_savings: Savings | None = Field(None, description="what the last compaction released")


class Thresholds(_Body):
    micro: float = Field(description="context.microCompactThreshold: a fraction of the context window")
    llm: float = Field(description="context.compactionThreshold: a fraction of the context window")


HELD_LISTED = 100  # held-back sessions the overview names


class HeldSession(_Body):
    session_id: str
    since: float = Field(description="unix seconds (Redis's clock) since it was first held back")
    error: str


class Overview(_Body):
    sessions: int
    breakers_open: int
    sessions_failing: int
    breakers_truncated: bool = Field(False, description="more sessions with failures than are counted: the two "
                                                        "numbers above are lower bounds")
    queued_jobs: int
    failed_jobs: int
    dead_letters: int
    sessions_held_back: int = Field(description="sessions a watcher holds back: their log cannot be written or read")
    held_back: list[HeldSession] = Field(
        default_factory=list, description=f"those sessions, held longest first (at most {HELD_LISTED})")
    stream_backlog: int
    oldest_unapplied_seconds: float
    counters: dict[str, float] = Field(
        description="process counters (all processes under `compactor serve`): eventsIngested, "
                    "deadLettered, jobsEnqueued, jobsCoalesced, jobsSucceeded, jobsFailed, "
                    "tokensReleased, breakerOpens")
    thresholds: Thresholds = Field(description="the configured thresholds (the page's legend)")
    server_time: float


class Compaction(Savings):
    kind: str = Field(description="micro (a compact event) or llm (a summary event)")
    uuid: str | None
    timestamp: str | None
    start_turn_id: int | None = None
    end_turn_id: int | None = Field(None, description="last turn covered")
    replaced: int | None = Field(None, description="events a summary replaced")
    visible: bool = Field(description="still part of the view")
    hidden_by: Literal["rollback", "summary"] | None = Field(
        None, description="why it is not visible: a later rollback undid a turn it covers, or a "
                          "later summary replaced it; null when visible")


class Elided(_Body):
    message_index: int = Field(description="the tool message's position in ``messages``")
    tool_call_id: str
    original_chars: int
    shown_chars: int
    hidden_chars: int = Field(description="the characters left out, as the elision marker says")


class HistoryContext(_Body):
    messages: list[dict[str, Any]]
    prompt_estimate: int
    current_turn_id: int
    elided: list[Elided]


class History(_Body):
    session_id: str
    cwd: str
    compactions: list[Compaction] = Field(description="oldest first, the last 50 at most")
    context: HistoryContext


class _Lru:
    """A small LRU dict (one per app: the caches of this API process)."""

    def __init__(self, size: int = CACHE_ENTRIES) -> None:
        self.size = size
        self.items: OrderedDict[Any, Any] = OrderedDict()

    def get(self, key: Any) -> Any:
        if key in self.items:
            self.items.move_to_end(key)
            return self.items[key]
        return None

    def put(self, key: Any, value: Any) -> Any:
        self.items[key] = value
        self.items.move_to_end(key)
        while len(self.items) > self.size:
            self.items.popitem(last=False)
        return value


# -- computing from the log ------------------------------------------------------------


def compaction_at(events: list[dict[str, Any]], index: int, ctx: ContextSettings) -> Savings:
    """Tokens before and after the compaction line ``events[index]``."""
    before = build_view(events[:index], ctx).prompt_estimate
    after = build_view(events[:index + 1], ctx).prompt_estimate
    return Savings(tokens_before=before, tokens_after=after, released=before - after)


def compaction_history(events: list[dict[str, Any]], ctx: ContextSettings,
                       limit: int = MAX_HISTORY_ENTRIES) -> list[Compaction]:
    """Each ``compact``/``summary`` line (the last ``limit``) with its savings and, when it is
    no longer in the view, why."""
    visible = {id(e) for e in build_view(events, ctx).visible}
    undone = undone_by_rollback(events)
    indexes = [i for i, e in enumerate(events) if e.get("type") in ("compact", "summary")]
    history = []
    for i in indexes[-limit:]:
        event = events[i]
        micro = event["type"] == "compact"
        shown = id(event) in visible
        history.append(Compaction(
            **compaction_at(events, i, ctx).model_dump(), kind="micro" if micro else "llm",
            uuid=event.get("uuid"), timestamp=event.get("timestamp"),
            start_turn_id=event.get("startTurnId") if micro else None,
            end_turn_id=event.get("endTurnId") if micro else event.get("lastSummarizedTurnId"),
            replaced=None if micro else len(event.get("replaces") or []),
            visible=shown, hidden_by=None if shown else "rollback" if i in undone else "summary"))
    return history


def context_with_elisions(events: list[dict[str, Any]], ctx: ContextSettings) -> HistoryContext:
    """The context view, with the tool outputs shown shorter than logged listed in ``elided``."""
    view = build_view(events, ctx)
    # Each tool message is the next visible tool result with its call id and its content (pairing
    # drops messages, never reorders them): a call id reused by later turns labelled every one
    # of them with the last output's lengths when they were looked up by id.
    results = [e for e in view.visible if e.get("type") == "tool_result"]
    shown = {id(e): view.elided[i][0] for i, e in enumerate(view.visible) if i in view.elided}
    elided, next_result = [], 0
    for index, message in enumerate(view.messages):
        if message.get("role") != "tool":
            continue
        for position in range(next_result, len(results)):
            event = results[position]
            output = event.get("output")
            if event.get("toolCallId") == message.get("tool_call_id") and \
                    shown.get(id(event), output if isinstance(output, str) else "") == message.get("content"):
                next_result = position + 1
                if id(event) in shown and isinstance(output, str):
                    elided.append(Elided(
                        message_index=index, tool_call_id=message["tool_call_id"], original_chars=len(output),
                        shown_chars=len(shown[id(event)]),
                        hidden_chars=omitted_chars(output, shown[id(event)], ctx.micro_compact_keep_chars)))
                break
    return HistoryContext(messages=list(view.messages), prompt_estimate=view.prompt_estimate,
                          current_turn_id=view.current_turn_id, elided=elided)


@dataclass(frozen=True)
class _NoSavings:
    """A session's savings found missing (its compaction's uuid is not in its log of ``size``
    bytes: cut back or restored by hand) or unreadable (until ``until``, monotonic): not looked
    for again meanwhile (looked for on every refresh, it took the read budget of the rows after it)."""

    size: int
    until: float


def last_savings(cache: _Lru, settings: Settings, body: SessionBody, *, read: bool = True) -> Savings | None:
    """What the session's last compaction released (cached by its uuid); with ``read`` False,
    only a cached one (the log is not read)."""
    uuid = (body.last_compaction or {}).get("uuid")
    if not uuid:
        return None
    key = ("savings", body.session_id, body.cwd, uuid)
    cached = cache.get(key)
    if isinstance(cached, Savings):
        return cached
    log = SessionLog(settings.data_dir, body.cwd, body.session_id)
    if isinstance(cached, _NoSavings) and time.monotonic() < cached.until and (
            cached.size == -1 or cached.size == log.size()):
        return None
    if not read:
        return None
    size = log.size()
    try:
        events = read_log(settings.data_dir, body.session_id, body.cwd)
    except Exception:  # a missing or unreadable log must not hide the other sessions
        logger.warning("savings unavailable session=%s", body.session_id, exc_info=True)
        cache.put(key, _NoSavings(-1, time.monotonic() + UNREADABLE_RETRY_S))
        return None
    index = next((i for i in range(len(events) - 1, -1, -1) if events[i].get("uuid") == uuid), None)
    if index is None:
        cache.put(key, _NoSavings(size, time.monotonic() + MISSING_RETRY_S))
        return None
    return cache.put(key, compaction_at(events, index, settings.context))  # type: ignore[no-any-return]


UNREADABLE_RETRY_S = 30.0  # a log the savings could not be read from is tried again after this long
MISSING_RETRY_S = 300.0  # ... and one they were not found in, while its size stays the same (edited in place)
SAVINGS_READ_BUDGET_S = 0.3  # logs read for the savings column per request, past which rows wait for the next


def session_rows(request: Request, client: redis.Redis, settings: Settings,
                 limit: int) -> list[SessionRow]:
    """The ``limit`` most recently active sessions with their stored state and savings."""
    cache = request.app.state.status_cache
    rows = []
    deadline = time.monotonic() + SAVINGS_READ_BUDGET_S
    for body, activity in recent_session_bodies(client, settings, limit):
        # (each one not cached reads the session's whole log: 100 sessions of 1.2 MB, every one
        # just compacted, held the page's refresh 8-12 s; the rest come with the next refreshes)
        try:
            savings = last_savings(cache, settings, body, read=time.monotonic() < deadline)
        except Exception:  # (a cwd no log can be under...: the other sessions are listed all the same)
            logger.warning("savings unavailable session=%s", body.session_id, exc_info=True)
            savings = None
        rows.append(SessionRow(**body.model_dump(), last_activity=activity, last_savings=savings))
    return rows


def overview(request: Request, client: redis.Redis, settings: Settings) -> Overview:
    """Totals for the top of the page."""
    keys = Keys(settings.redis.prefix, settings.redis.shards)
    lag = StreamLagCollector(client, settings)
    now_ms = server_ms(client)  # Redis's clock, which stamped the entry ids (as the lag gauge does)
    shards = [lag.shard_lag(n, now_ms) for n in range(keys.shards)]
    breakers, failing, truncated = BreakerCollector(client, settings).count()
    held = held_sessions(client, keys)  # (a session whose log is unreadable is named only here)
    queue = compaction_queue(client, settings)
    process: ProcessMetrics = request.app.state.process_metrics
    totals = process.totals()
    return Overview(
        sessions=known_sessions(client, keys), breakers_open=breakers, sessions_failing=failing,
        breakers_truncated=truncated,
        queued_jobs=queue.count, failed_jobs=queue.failed_job_registry.count,
        dead_letters=client.xlen(keys.dead), sessions_held_back=len(held),
        held_back=[HeldSession(session_id=sid, since=h.since, error=h.error)
                   for sid, h in sorted(held.items(), key=lambda item: item[1].since)[:HELD_LISTED]],
        stream_backlog=sum(s[0] for s in shards),
        oldest_unapplied_seconds=max((s[2] for s in shards), default=0.0),
        counters={key: totals.get(name, 0.0) for key, name in COUNTERS.items()},
        thresholds=Thresholds(micro=settings.context.micro_compact_threshold,
                              llm=settings.context.compaction_threshold),
        server_time=time.time())


def history(request: Request, settings: Settings, session_id: str, cwd: str) -> History:
    """A session's compaction history and current context (cached while the log keeps its size:
    one body per session, of the ``HISTORY_CACHE_SESSIONS`` last asked for; and, once the log
    grew, for ``HISTORY_REUSE_FACTOR`` times as long as it took to compute: the history of a
    167 MB log took 18 s of CPU, and a page open on the active session asked for it every 3 s)."""
    cache: _Lru = request.app.state.history_cache
    log = SessionStore(request.app.state.redis, settings).log(session_id, cwd)
    if not log.found():  # (a 404 as on the other session routes, before the cwd's binding is told)
        raise SessionNotFound(f"no session {session_id} under cwd {cwd}")
    key, size = (session_id, cwd), log.size()
    cached = cache.get(key)
    if cached is not None and (cached[0] == size or time.monotonic() < cached[2]):
        return cached[1]  # type: ignore[no-any-return]
    try:  # (not another spelling of the cwd; the log alone answers while Redis does not)
        check_bound_cwd(request.app.state.redis, settings, session_id, cwd)
    except redis.RedisError as e:
        logger.debug("history of %s without the cwd check: %s", session_id, e)
    started = time.monotonic()
    events = read_log(settings.data_dir, session_id, cwd)
    body = History(session_id=session_id, cwd=cwd,
                   compactions=compaction_history(events, settings.context),
                   context=context_with_elisions(events, settings.context))
    done = time.monotonic()
    cache.put(key, (size, body, done + HISTORY_REUSE_FACTOR * (done - started)))
    return body


# -- routes ------------------------------------------------------------------------------

status_api = APIRouter(prefix="/api", tags=["status page"], route_class=JsonBodyRoute)
LimitQuery = Annotated[int, Query(ge=1, le=MAX_SESSIONS_LISTED,
                                  description="most recently active sessions listed")]


@status_api.get("/overview", response_model=Overview, responses=errors(503))
async def get_overview(request: Request, settings: SettingsDep, client: RedisDep) -> Overview:
    """Totals: sessions, open breakers, queue, stream backlog, process counters."""
    return await anyio.to_thread.run_sync(overview, request, client, settings)


@status_api.get("/sessions", response_model=list[SessionRow], responses=errors(400, 503))
async def list_sessions(request: Request, settings: SettingsDep, client: RedisDep,
                        limit: LimitQuery = DEFAULT_SESSIONS_LISTED) -> list[SessionRow]:
    """The most recently active sessions with their state (as ``GET /api/sessions/{id}``),
    last activity and the savings of their last compaction."""
    return await anyio.to_thread.run_sync(session_rows, request, client, settings, limit)


@status_api.get("/sessions/{session_id}/history", response_model=History, responses=errors(400, 404, 500))
async def get_history(request: Request, session_id: str, cwd: CwdQuery,
                      settings: SettingsDep) -> History:
    """Compaction history (tokens before/after each) and the context with elisions marked."""
    sid, cwd = _checked(session_id, cwd)
    return await anyio.to_thread.run_sync(history, request, settings, sid, cwd)


pages = APIRouter(include_in_schema=False, route_class=JsonBodyRoute)  # (no body: a query given twice is a 400)


@pages.get("/")
def index() -> FileResponse:
    """The status page (behind the token when one is set, like every route but /healthz)."""
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html; charset=utf-8",
                        headers={"Cache-Control": "no-cache", "Content-Security-Policy": PAGE_POLICY})


# the page's own files only, no inline script or style, no frame around it, no form, no <base>
PAGE_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
               "frame-ancestors 'none'; base-uri 'none'; form-action 'none'")


STATUS_ROUTERS = (status_api, pages)  # in the order ``install_status_page`` includes them


def install_status_page(app: FastAPI) -> None:
    """Mount the page, its static files and its JSON routes on ``app``."""
    app.state.status_cache = _Lru()
    app.state.history_cache = _Lru(HISTORY_CACHE_SESSIONS)
    app.include_router(status_api)
    app.include_router(pages)
    app.mount("/static", _Revalidated(directory=STATIC_DIR), name="static")


class _Revalidated(StaticFiles):
    """The page's files, each checked again at every load (``no-cache``; its ETag makes the check
    a 304): without a ``Cache-Control``, a browser kept a file 10 % of its age, a day for one ten
    days old, and ran an upgrade's page against the old script."""

    def file_response(self, *args: Any, **kwargs: Any) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers["Cache-Control"] = "no-cache"
        return response
