"""Request and response bodies of the HTTP API (SPEC §7), as they appear in the OpenAPI schema.

Invariants: wire names are camelCase (``alias_generator=to_camel``); chat
messages inside ``ContextBody.messages`` keep the OpenAI snake_case names
(SPEC §4.4) and are passed through as plain dicts.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from events.models import CompressResult

__all__ = [
    "CompactRequest",
    "CompressResult",
    "ContextBody",
    "ErrorBody",
    "ErrorDetail",
    "EventsAccepted",
    "EventsRequest",
    "Health",
    "JobAccepted",
    "JobBody",
    "LlmError",
    "PendingJob",
    "SessionBody",
]


class _Body(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True,
                              serialize_by_alias=True)


class ErrorDetail(_Body):
    code: str = Field(description="machine-readable: bad_request, unauthorized, not_found, ...")
    message: str


class ErrorBody(_Body):
    """Every error response: ``{"error": {"code", "message"}}``."""

    error: ErrorDetail


class _Request(_Body):
    """A request body: an unknown field is a 400 naming it (``wait`` sent in the body was
    ignored, and the call waited)."""

    model_config = ConfigDict(extra="forbid")


class CompactRequest(_Request):
    cwd: str = Field(description="absolute working directory of the session")
    after: str | None = Field(None, description="a stream id POST .../events answered: the compaction waits for the "
                              "watcher to apply that event first (up to api.jobWaitSeconds), so it covers it")


class EventsRequest(_Request):
    cwd: str = Field(description="absolute working directory of the session")
    events: list[dict[str, Any]] = Field(description="SPEC §3 events, validated all-or-none")


class EventsAccepted(_Body):
    accepted: int = Field(description="how many events were published (the batch less its duplicates)")
    stream_ids: list[str] = Field(description="the published events' stream entry ids, in order")
    duplicates: list[int] = Field(
        description="indexes of the events not published because the session has their uuid already, or "
                    "this API published it in the last 10 minutes (a retry's: applied once)")


class JobAccepted(_Body):
    job_id: str


class LlmError(_Body):
    """A failed LLM call that ``context.fallbackModel`` answered for (the job still finished)."""

    kind: Literal["transient", "permanent", "invalid"] = Field(
        description="transient (rate limit, 5xx, timeout), permanent (auth, unknown model) or "
                    "invalid (a reply that failed validation)")
    error: str
    model: str = Field(description="the model that failed")
    fallback: str = Field(description="the summarizer that answered instead")


class JobBody(_Body):
    job_id: str
    status: str = Field(description="queued, started, deferred, scheduled, finished, failed, "
                                    "stopped or canceled; created: a forced job waiting for the "
                                    "session's pending job to end")
    result: CompressResult | None = None
    error: str | None = None
    llm_error: LlmError | None = Field(
        None, description="on a finished LLM job: the failed LLM call its fallback summarizer answered for")
    micro_step: CompressResult | None = Field(
        None, description="on a failed LLM job: the micro step it applied before its LLM call failed (SPEC §5 "
                          "runs it first; the failure does not undo it): tokens released, the estimate after")
    requeued_as: str | None = Field(
        None, description="on a forced job whose worker died (abandoned): the forced job queued in its "
                          "place, which answers the request (waits follow it)")
    requeued_from: str | None = Field(
        None, description="on a forced job queued in the place of an abandoned one: that job (this "
                          "one is not replaced in turn)")


class ContextBody(_Body):
    messages: list[dict[str, Any]] = Field(description="OpenAI chat messages (snake_case keys)")
    prompt_estimate: int
    current_turn_id: int
    applied: bool | None = Field(
        None, description="with ?after=<streamId>: whether the watcher had applied (or dead-lettered) the "
                          "session's events up to that entry when the view was read (absent without after)")


class PendingJob(_Body):
    job_id: str
    status: str | None = None


class HeldBack(_Body):
    since: float = Field(description="unix seconds (Redis's clock) since the watcher holding it first failed")
    error: str = Field(description="why its log cannot be written or read (the last failure)")
    watcher: str = Field(description="the id of the watcher holding it back")


class SessionBody(_Body):
    session_id: str
    cwd: str
    prompt_estimate: int
    context_window: int
    current_turn_id: int
    micro_threshold: int = Field(description="tokens: microCompactThreshold x contextWindow")
    compaction_threshold: int = Field(description="tokens: compactionThreshold x contextWindow")
    failures: int = Field(description="consecutive LLM compaction failures (24 h TTL)")
    breaker_open: bool = Field(description="failures >= maxFailures: no automatic LLM job")
    pending_job: PendingJob | None = None
    last_compaction: dict[str, Any] | None = None
    held_back: HeldBack | None = Field(
        None, description="set while a watcher holds the session back: its log cannot be written or read (a full "
                          "disk, a corrupt line...); its new events wait in the stream, applied in order once it can")


class Health(_Body):
    status: Literal["ok"]
    redis: Literal["ok"]


class DeadLetterBody(_Body):
    letter_id: str = Field(description="the letter's id in {p}:dead")
    written_at: float = Field(description="unix seconds (Redis's clock) the letter was written")
    session: str | None = Field(description="the refused entry's session field (as sent)")
    cwd: str | None
    reason: str = Field(description="why it was refused, naming the field")
    entry_id: str | None = Field(description="the refused entry's id in its stream")
    stream: str | None
    event: str | None = Field(description="the entry's event field, its first eventPreviewChars characters")
    event_chars: int = Field(description="the event field's length (characters) in the letter")
    truncated: str | None = Field(None, description="fields the letter keeps only the start of (name:bytes)")
    extra: dict[str, str] = Field(default_factory=dict, description="the entry's other fields")


class DeadLettersBody(_Body):
    letters: list[DeadLetterBody] = Field(description="newest first")
    scanned: int = Field(description="letters looked through")
    complete: bool = Field(description="false: the scan stopped at its bound (10 000 letters or 16 MiB) "
                                       "before the oldest letter, so older matching letters may exist")
    total: int = Field(description="letters the dead-letter stream holds")
