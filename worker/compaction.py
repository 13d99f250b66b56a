"""Micro and LLM compaction of one session (SPEC §5), called by the RQ jobs.

Invariants:
- The log is the source of truth and is only appended to, through
  ``SessionStore.apply(..., log=log)`` while this module holds the same
  ``SessionLog`` object's lock; the decision what to append is taken from the
  log as read under that lock. So a job run twice (a retry, a duplicate
  enqueue) appends once: the second run finds no candidates / no new targets.
- The LLM call runs *outside* the lock (it may take minutes; the watcher keeps
  appending meanwhile). Before its summary is appended, the lines written since
  the snapshot are checked under the lock: a ``summary`` or ``rollback`` among
  them means the targets are stale, and no summary is appended.
- An LLM job's micro step (over its threshold, or forced) is *decided* from the
  snapshot but *appended with the summary*: ``compact`` then ``summary`` in one
  append, one state save (so the LLM sees the outputs elided, and the stored
  state never holds the intermediate estimate). The log is read in one pass
  (``events.view.llm_pass``): the targets as shown once the compact is
  appended, rendered, and the state once the pair is appended
  (``events.state.state_after_summary``; a rebuild when the log breaks uuid
  uniqueness); no target is tokenized, what stays visible is counted exactly. When no
  summary is appended (nothing to summarize, the breaker open without a
  fallback, a failed LLM call, a stale snapshot) the micro step is applied on
  its own, with exact counts, from the log as it is then (after a failure or
  a stale snapshot: read again, so a compact never follows a rollback it
  would contradict). A worker killed during the LLM call loses its micro step
  (no line was written); the next job redoes it.
- Before the LLM call the token stamps of elided targets (by the pending micro
  step or an earlier compact) are estimates (the stamp scaled by the shown /
  original length); they only size the prompt (planning and chunks keep
  ``summaryReserveTokens`` of slack), never the stored estimate.
- The stored state after a job equals ``events.state.rebuild`` of the log,
  its ``promptEstimate`` exact (SPEC §4.5).
- A summary replaces exactly the target uuids plus the previous visible
  summary's uuid, with ``lastSummarizedTurnId = endTurn``; the most recent
  ``keepRecentTurns`` turns are never summarized.
- Failures (LLM error, timeout, invalid reply) increment the session's failure
  counter; a successful LLM summary deletes it (jobs of one session never run
  at once, so a counter read as zero at the start needs no delete). A summary
  produced by the offline ``extractive`` fallback leaves the counter alone (it
  says nothing about the LLM's health; the breaker keeps reporting the LLM as
  failing).
- ``released`` = promptEstimate right before the job's append − right after it
  (micro step included): what the compaction freed. Turns the agent added
  while the LLM answered count in both, so they do not make it negative;
  ``promptEstimate`` is the estimate after, those turns included.
- A micro job (and an LLM job's micro step applied on its own) takes the
  estimate of the lines it read from the stored state, brought up to date
  under the lock (exact: ``SessionStore.current`` rebuilds one derived under
  other settings), and counts only what its compact elides on top: the
  outputs earlier compacts elided are not counted again.

Redis, for an LLM job that appends: one round trip for the stored state and
the failure counter (sent before the log is read, answered while it is
read), one for the state save (with the counter's delete when there is one).
The job's claim is freed in the state save's round trip, which is sent under
the lock and answered while the job frees its memory, logs and counts
(``JobRun``; ``worker.jobs.finish`` reads the reply: ``compactor.deferred``).
A micro job makes the same two round trips: its stored state (no counter) read
while the log is, and the state save that frees its claim.
The worker's own lines carry new random uuids (uuid4), which no log holds: they
are not looked up. A forced job's summary (and micro step) carry uuids derived
from its job id (``job_line_uuid``), unique too: a forced job that runs again
finds its summary by it and answers with that run's result (``_answered``).

Model choice: ``compactionModel``, else the session's model. When the
compaction model's window (litellm's max input tokens, else the default)
cannot hold the prompt + ``summaryReserveTokens``, the session's model (and
window) is used. When even that cannot hold it, the targets are summarized in
consecutive chunks, each chunk's call getting the running summary as the
previous summary. Prompt tokens are estimated from the lines' token stamps
plus the fixed prompt (no re-tokenization of the transcript).

Fallback (``context.fallbackModel``, e.g. ``extractive``): used instead of the
LLM when the breaker is open for an automatic job, and after a failed LLM call
(the failure is counted first). Without a fallback, an automatic job with the
breaker open does nothing, and a failed call fails the job (forced or not).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus

from compactor.deferred import Deferred
from compactor.queue import pending_job_id, queue_release, redis_time_s, released_trigger
from compactor.redis_errors import is_transient
from compactor.signal_safe import SignalSafeEvent
from compactor.store import UNREAD, ApplyResult, SessionStore, Stored
from events.config import ContextSettings, Settings
from events.errors import (
    CompactorError,
    JobAbandoned,
    LLMUnavailable,
    LogWriteFailed,
    SessionNotFound,
    SummaryInvalid,
)
from events.log import SessionLog
from events.models import TURN_SCOPED_TYPES, CompressResult, iso_time
from events.state import SessionState, state_after_summary, stored_state
from events.tokens import (
    MESSAGE_OVERHEAD_TOKENS,
    TOKEN_COUNT_FIELD,
    TOKEN_ENCODING_FIELD,
    arguments_json,
    count_tokens,
    encoding_for_model,
    event_tokens,
    model_max_input_tokens,
    stamped_tokens,
)
from events.view import (
    ContextView,
    LlmPass,
    LlmTargets,
    build_view,
    current_turn_id,
    elide,
    llm_pass,
    micro_candidates,
    str_or_empty,
    tool_calls,
    turn_of,
)
from worker.extractive import EXTRACTIVE_MODEL, extractive_summary
from worker.failures import FailureCounter
from worker.summarize import (
    SYSTEM_PROMPT,
    Summarizer,
    build_messages,
    extract_summary,
    merged_summaries,
    neutralized,
    quoted_headings,
    render_event,
    render_transcript,
    says_nothing,
    with_messages_kept,
)

logger = logging.getLogger(__name__)

SUMMARY_ROOM_BYTES = 65_536  # free bytes below which no LLM is called (a disk full, not one short of a summary
# of the largest size allowed: one with a few hundred kB left still takes the usual summary of a few kB)
PROMPT_FRAME_TOKENS = 200  # delimiters, the request lines and chat framing around the data
BLOCK_HEADER_TOKENS = 6  # "[tool:name]\n" and the blank line, per transcript block
# "-> tool call " and the parentheses and line break around a call's name and arguments (which its
# event's stamp counts): 5 at most, measured (95 turns of 300 calls each went in one call of 255 560
# tokens to a 200 000-token window, estimated without them; one 133 521 to a 128 000-token compactionModel)
CALL_LINE_TOKENS = 5
MIN_CHUNK_BUDGET_TOKENS = 1_000  # below this a window is hopeless; chunk at this size anyway
CLIP_TRIES = 6  # counted cuts of an event larger than a chunk, to fill ~85-100 % of its budget
SNAPSHOT_TAIL_BYTES = 4_096  # of the log an LLM job checks is still there before it appends its summary
MIN_SUMMARY_LIMIT_TOKENS = 1_000  # the limit on a summary's size in a small window (see ``summary_limit``)


@dataclass(frozen=True)
class _Session:
    """What planning needs of the session: its model, window and token encoding."""

    model: str | None
    window: int
    encoding: str


# A job running this long checks it still holds its session's claim before it appends a summary:
# below ``worker.runner.EXECUTION_TTL_S`` (20 s), the least a job can be silent before the janitor
# hands its session on (a worker paused 25 s, then resumed, appended a summary while the job that
# replaced it made its own LLM call).
ABANDON_CHECK_AFTER_S = 10.0

# Set when this worker process was asked to stop (a warm shutdown: ``CompactionWorker.request_stop``):
# the job in hand finishes its LLM call but makes no further one (the next chunk, a model fallback),
# so it ends within one call of the stop (compose's ``stop_grace_period``, serve's 15 s to its
# children): a fallback after a timed-out call, or a backlog's chunks, outlasted the grace, and the
# job was SIGKILLed, then run again from the start.
STOPPING = SignalSafeEvent()  # (set by a signal handler)


def _abandoned(run: JobRun | None, what: str) -> JobAbandoned:
    """The error of a job found handed on (``Compactor._handed_on``), saying ``what`` it did not do."""
    job_id = run.job_id if run is not None else "?"
    return JobAbandoned(f"job {job_id} no longer holds its session's claim: declared abandoned while it ran (its "
                        f"worker sent no heartbeat for 20 s: paused or frozen?) and the session handed on, or run "
                        f"again by hand (rq requeue) after its claim was freed: {what}")


# A job's final writes (its append and state save) get at least this long, whatever is left of its
# timeout, and what follows them (freeing its claim, its log line) at least FINAL_GRACE_S.
FINAL_WRITES_S = 60
FINAL_GRACE_S = 10


@contextlib.contextmanager
def _past_the_timeout() -> Iterator[None]:
    """The job's final writes (its append and state save, under the log's lock), not cut short by
    RQ's job timeout (``UnixSignalDeathPenalty``: SIGALRM, raised in the main thread): an alarm
    that fired during the append raised in the middle of it, so the summary was in the log and the
    job reported FAILED (a forced request answered 502), or only the ``compact`` of the two lines
    landed. The alarm is pushed to ``FINAL_WRITES_S`` from now while they run (a Redis that hangs
    is still cut), then set back to what is left of the timeout, at least ``FINAL_GRACE_S``.
    Entered once the lock is held: a wait for a stuck holder stays bounded by the timeout."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    entered = time.monotonic()
    left = signal.alarm(0)  # (an alarm that went off just before raises here: nothing written yet)
    if left:
        signal.alarm(max(left, FINAL_WRITES_S))
    try:
        yield
    finally:
        if left:
            signal.alarm(max(FINAL_GRACE_S, round(left - (time.monotonic() - entered))))


# A failed LLM call's kind (``LlmFailure.kind``) -> the outcome a job failing on it logs (``worker.jobs``).
FAILURE_OUTCOMES = {"transient": "llm_transient", "permanent": "llm_permanent", "invalid": "summary_invalid"}


@dataclass(frozen=True)
class LlmFailure:
    """A failed LLM call that the fallback summarizer answered for: ``kind`` is
    ``transient`` (rate limit, 5xx, timeout), ``permanent`` (auth, unknown model) or
    ``invalid`` (a reply that failed validation)."""

    kind: str
    error: str
    model: str
    fallback: str

    def to_wire(self) -> dict[str, str]:
        return {"kind": self.kind, "error": self.error, "model": self.model, "fallback": self.fallback}


@dataclass
class JobRun:
    """One job's run, shared by ``worker.jobs`` and ``Compactor.micro`` / ``Compactor.llm``.

    ``job_id`` holds the session's claim: a micro job, and an LLM job that appends a
    summary, free it with their last writes, sent under the log's lock but read
    afterwards (``sent``; ``collect`` reads it: ``done``, and ``trigger`` the coalesced
    trigger the release returned), else ``worker.jobs.finish`` does. ``llm_failure``:
    the failed LLM call the fallback answered for (the job succeeds; its result
    reports it). ``micro_step``: what the micro step of an LLM job that failed released (kept in
    the job's meta, ``MICRO_STEP_FIELD``: the job's failure does not undo it).
    """

    job_id: str
    done: bool = False
    trigger: str | None = None
    llm_failure: LlmFailure | None = None
    sent: Deferred | None = None
    deadline: float | None = None  # time.monotonic() the job's timeout ends at (RQ's), when known
    covered: int | None = None  # the targets summarized, when the chunks stopped short of the deadline
    micro_step: CompressResult | None = None  # a failed LLM job's micro step, applied (the job still fails)
    # a forced job: the ids of the jobs whose summary answers its request (its own, and the one it was queued
    # in the place of): its lines' uuids derive from its id (``job_line_uuid``), found again if it runs twice
    answers: tuple[str, ...] = ()
    reset_owed: bool = False  # the failures' reset was sent with the last writes, its reply not yet read
    started: float = field(default_factory=time.monotonic)
    started_at: float = field(default_factory=time.time)  # (the wall clock: a suspended VM stops the other)

    def may_have_been_abandoned(self) -> bool:
        """Whether the job has run long enough that the worker janitor may have declared it
        abandoned (its heartbeats missed for ``worker.runner.EXECUTION_TTL_S``: its process was
        paused or frozen) and handed its session to another job."""
        return bool(self.job_id) and max(time.monotonic() - self.started,
                                         time.time() - self.started_at) >= ABANDON_CHECK_AFTER_S

    def collect(self) -> None:
        """Read the replies of the last writes sent (the state save, the claim's release).

        Raises what Redis answered (then ``done`` stays False: the claim is to be
        freed again; the state save, guarded by its ``logSize``, may or may not have
        landed, and the next writer catches the state up either way).
        """
        sent, self.sent = self.sent, None
        if sent is not None:
            replies = sent.replies()
            self.done, self.trigger, self.reset_owed = True, released_trigger(replies[-1]), False


@dataclass(frozen=True)
class Plan:
    """The model to call and the window it was chosen for."""

    model: str
    window: int


class Compactor:
    """Runs compactions for any session; one per worker process, shared by its jobs."""

    def __init__(
        self,
        client: redis.Redis,
        settings: Settings,
        summarizer: Callable[[], Summarizer],
    ) -> None:
        self.settings = settings
        self.ctx: ContextSettings = settings.context
        self.store = SessionStore(client, settings)
        self.failures = FailureCounter(client, settings)
        self._summarizer_factory = summarizer
        self._summarizer: Summarizer | None = None

    @property
    def summarizer(self) -> Summarizer:
        if self._summarizer is None:
            self._summarizer = self._summarizer_factory()
        return self._summarizer

    # -- micro ---------------------------------------------------------------------------

    def micro(self, session_id: str, cwd: str, *, run: JobRun | None = None) -> CompressResult:
        """Mark the turns of old long compactable outputs compacted (one ``compact`` event).

        ``run``: the job's claim is freed in the state save's round trip, sent here
        and read by ``run.collect`` (as an LLM job's that appends a summary).
        """
        log = self._log(session_id, cwd)
        with log.lock(), _past_the_timeout():
            with _StateRead(self.store, None, session_id) as stored:
                events = log.read()  # while Redis answers
            events, view, state = self._micro_view(session_id, cwd, log, events, stored.state)
            if run is None:
                applied = self._micro_locked(session_id, cwd, log, events, view, cached=state)
            else:
                pipe = self.store.redis.pipeline(transaction=False)
                applied = self._micro_locked(session_id, cwd, log, events, view, cached=state, pipeline=pipe)
                self._send_last_writes(pipe, session_id, run)
        return _result(bool(applied.appended), view.prompt_estimate, applied.state.prompt_estimate)

    def _current(
        self, session_id: str, cwd: str, log: SessionLog, events: list[dict[str, Any]], stored: Stored,
    ) -> tuple[list[dict[str, Any]], SessionState]:
        """The log's events (read again when the stored state lagged them) and the state
        brought up to date with them (call under the lock; ``events`` as read under it,
        ``stored`` the state read meanwhile)."""
        state = self.store.current(session_id, cwd, log, stored=stored)
        if state.events != len(events):  # the stored state lagged: caught up (or rebuilt) from the log
            events = log.read()
        return events, state

    def _micro_view(
        self, session_id: str, cwd: str, log: SessionLog, events: list[dict[str, Any]], stored: Stored,
    ) -> tuple[list[dict[str, Any]], ContextView, SessionState]:
        """``_current``, and the events' view (call under the lock). The view counts nothing:
        its estimate is the state's, exact for the settings in force (``SessionStore.current``
        rebuilds a state derived under others); the compact's elisions are counted on top
        (``extend_view``), so the outputs earlier compacts elided are not counted again."""
        events, state = self._current(session_id, cwd, log, events, stored)
        return events, build_view(events, self.ctx, messages=False, estimate=state.prompt_estimate), state

    def _micro_locked(
        self, session_id: str, cwd: str, log: SessionLog, events: list[dict[str, Any]], view: ContextView,
        cached: SessionState | None = None, event: dict[str, Any] | None = None, pipeline: Any | None = None,
    ) -> ApplyResult:
        """Append the compact event if there are candidates (the state is stored either way).

        ``events`` is the whole log as read under the lock and ``view`` its view;
        the state after the append is rebuilt from them, not from a re-read.
        ``event`` is the compact ``_compact_event`` already made of them, if any.
        With ``pipeline`` the state save is queued there (if newer), for the caller to send.
        """
        if event is None:
            event = _compact_event(events, self.ctx, view)
        if event is None:  # stores the exact state anyway
            return self.store.apply(session_id, cwd, [], log=log, cached=cached, pipeline=pipeline)
        applied = self.store.apply(session_id, cwd, [event], log=log, cached=cached, known=events, known_view=view,
                                   taken=set(), pipeline=pipeline)  # a new uuid4: in no log
        logger.debug("micro compact session=%s turns=%d..%d", session_id, event["startTurnId"], event["endTurnId"])
        return applied

    def _micro_again(self, session_id: str, cwd: str, log: SessionLog) -> ApplyResult:
        """The micro step of an LLM job whose summary was not appended, from the log as it is now."""
        with log.lock():
            events, view, state = self._micro_view(session_id, cwd, log, log.read(), UNREAD)
            return self._micro_locked(session_id, cwd, log, events, view, cached=state)

    # -- llm -----------------------------------------------------------------------------

    def llm(
        self, session_id: str, cwd: str, *, forced: bool = False, run: JobRun | None = None,
    ) -> CompressResult:
        """Summarize the turns before the most recent ones; see the module docstring.

        The stored state (brought up to date under the lock) gives the estimate,
        window and model; the log is read once, and read through once
        (``llm_pass``). The micro step's ``compact`` is decided here but
        appended with the summary (one append, one state save); the targets are
        shown as they are after it (the outputs it elides shown elided, their
        tokens estimated). When no summary is appended, the micro step is
        applied on its own, with exact counts.
        ``run``: when the summary is appended, the job's claim is freed in the
        same round trip as the state save, sent here and read by ``run.collect``
        (``run.sent``); a failed LLM call the fallback answered for is recorded in
        ``run.llm_failure``.
        """
        log = self._log(session_id, cwd)
        with log.lock():
            with _StateRead(self.store, self.failures, session_id) as stored:
                events = log.read()  # while Redis answers
            breaker_open = not forced and stored.failures >= self.failures.max_failures
            events, state = self._current(session_id, cwd, log, events, stored.state)
            if run is not None and run.answers:  # (a forced job's: ``worker.jobs``)
                answered = _answered(events, run.answers, self.ctx)
                if answered is not None:
                    logger.warning("forced job already answered session=%s job=%s: its summary is in the log "
                                   "(the job ran again: Redis lost that it had ended)", session_id, run.job_id,
                                   extra={"session_id": session_id})
                    return answered
            before = state.prompt_estimate
            # a forced job skips both thresholds (SPEC §5): its micro step runs whenever there are candidates
            # and something to summarize (with nothing, SPEC §5 fixes the answer: nothing written, DESIGN)
            over_micro = forced or before > self.ctx.micro_limit(state.window)
            reading = llm_pass(events, self.ctx, micro=over_micro and _has_old_candidate(state),
                               render=render_event, block_tokens=BLOCK_HEADER_TOKENS, call_tokens=CALL_LINE_TOKENS)
            compact = None
            if reading.compact_turns is not None:
                compact = _new_line("compact", startTurnId=reading.compact_turns[0], endTurnId=reading.compact_turns[1])
            targets = reading.targets
            nothing = targets.end_turn < 1 or not targets.events
            if nothing and forced:  # SPEC §5: {didCompress: false, released: 0, promptEstimate: E}, nothing written
                return _result(False, before, before)
            if nothing or (breaker_open and not self.ctx.fallback_past_breaker):
                if breaker_open and not nothing:
                    logger.info("llm compaction skipped session=%s: breaker open", session_id)
                if compact is None:
                    return _result(False, before, before)
                view = build_view(events, self.ctx, messages=False, estimate=before)  # the state is current
                applied = self._micro_locked(session_id, cwd, log, events, view, cached=state, event=compact)
                return _result(True, before, applied.state.prompt_estimate)
            snapshot = _Snapshot(state.log_size, events, reading, state, compact,
                                 log.bytes_before(state.log_size, SNAPSHOT_TAIL_BYTES))
            try:  # (a disk that cannot take a summary: no LLM call paid for and thrown away; the janitor comes back)
                log.check_room(SUMMARY_ROOM_BYTES)
            except LogWriteFailed:
                if compact is not None:  # (its micro step, a line, may still fit: what the job can do)
                    try:
                        view = build_view(events, self.ctx, messages=False, estimate=before)
                        applied = self._micro_locked(session_id, cwd, log, events, view, cached=state, event=compact)
                        if run is not None:
                            run.micro_step = _result(True, before, applied.state.prompt_estimate)
                    except LogWriteFailed:
                        pass  # (it did not fit either: the room's error is the job's)
                    except Exception:  # (the room's error is the job's: a janitor's retry follows it)
                        logger.exception("micro step of an llm compaction with no room failed session=%s",
                                         session_id)
                raise
        session = _Session(state.model, state.window, state.encoding)
        try:
            summary_text, reset = self._summary_text(session_id, reading, session, breaker_open=breaker_open,
                                                     run=run)
        except Exception:
            if compact is not None:
                self._micro_after_failure(session_id, cwd, log, run)
            raise
        # (jobs of one session never run at once: only this job could have counted a failure since)
        reset = reset and stored.failures > 0
        return self._append_summary(session_id, cwd, log, summary_text, reset, snapshot, run,
                                    covered=run.covered if run is not None else None, forced=forced)

    def _micro_after_failure(self, session_id: str, cwd: str, log: SessionLog, run: JobRun | None) -> None:
        """Apply the micro step of an LLM job that failed (its error is what the job reports; what
        the step released goes in ``run.micro_step``)."""
        try:
            applied = self._micro_again(session_id, cwd, log)
            if applied.appended and run is not None:
                run.micro_step = _result(True, applied.before, applied.state.prompt_estimate)
        except Exception:
            logger.exception("micro step after a failed llm compaction failed session=%s", session_id)

    def _append_summary(
        self, session_id: str, cwd: str, log: SessionLog, text: str, reset: bool,
        snapshot: _Snapshot, run: JobRun | None = None, covered: int | None = None, forced: bool = False,
    ) -> CompressResult:
        """Append the micro step's compact (if any) and the summary, unless a summary/rollback
        landed since the snapshot: then only the micro step, re-derived from the log as it is.

        ``reset`` (a successful LLM call, the counter not zero) deletes the failure
        counter, and ``run``'s claim is freed, in the same round trip as
        the state save when the summary is appended; with ``run`` that round trip's
        reply is left to ``run.collect`` (``worker.jobs.finish``).
        """
        reading = snapshot.reading
        replaces, end_turn = reading.replaces, reading.targets.end_turn
        if covered is not None:  # the turns before the first target not summarized
            replaces, end_turn = _covered(reading, covered)
        mine = run.answers[0] if run is not None and run.answers else None  # (a forced job's own id: ``_answered``)
        event = _new_line("summary", replaces=replaces, summaryText=text, lastSummarizedTurnId=end_turn,
                          line_uuid=job_line_uuid(mine, "summary") if mine else None)
        lines = [event] if snapshot.compact is None else [snapshot.compact, event]
        with log.lock(), _past_the_timeout():
            if self._handed_on(session_id, run):
                raise _abandoned(run, "its summary is not appended")
            since = _lines_since(log, snapshot.size, snapshot.tail)
            if since is None or _overtaken(since, end_turn, snapshot.compact, snapshot.events, self.ctx):
                logger.warning("summary dropped session=%s: the log %s meanwhile", session_id,
                               "shrank or was rewritten" if since is None else "got a summary/rollback")
                if reset:
                    self.failures.reset(session_id)
                if snapshot.compact is not None:
                    applied = self._micro_again(session_id, cwd, log)
                    return _result(bool(applied.appended), applied.before, applied.state.prompt_estimate)
                # (the log's estimate: the writer of those lines may not have saved its state yet; a log
                # rewritten under the stored size is folded whole: caught up from it, it read mid-line)
                now = self.store.current(session_id, cwd, log) if since is not None else self.store.rebuild(
                    session_id, cwd, log)
                return _result(False, 0, now.prompt_estimate)
            if not forced and reading.exact and covered is None and not _smaller(event, reading):
                return self._not_smaller(session_id, cwd, log, event, reading, snapshot, reset)
            known = snapshot.events + since if since else snapshot.events
            if mine and snapshot.compact is not None:  # (its place in the log in its uuid: unique per run)
                lines[0] = {**snapshot.compact, "uuid": job_line_uuid(mine, f"compact:{len(known)}")}
            pipe = self.store.redis.pipeline(transaction=False) if reset or run else None
            if pipe is not None and reset:
                self.failures.reset(session_id, pipe)
            derive = None
            if not since and reading.exact and covered is None:  # the state after is known from the pass
                def derive(appended: list[dict[str, Any]], log_size: int) -> SessionState:
                    return state_after_summary(snapshot.state, reading, appended, self.ctx, log_size)
            try:
                applied = self.store.apply(
                    session_id, cwd, lines, log=log, pipeline=pipe, cached=snapshot.state, known=known,
                    derive=derive, taken=set(),  # new uuids (uuid4, or a forced job's own): in no log
                )
            except Exception:
                if reset:  # the LLM call did succeed
                    self.failures.reset(session_id)
                raise
            if pipe is not None:
                if run is None:
                    pipe.execute()
                else:
                    run.reset_owed = reset  # (until the replies are read: ``finish`` does it again else)
                    self._send_last_writes(pipe, session_id, run)
        # released: what the append freed; the turns another writer added during the LLM call are in both
        return _result(True, applied.before, applied.state.prompt_estimate)

    def _not_smaller(self, session_id: str, cwd: str, log: SessionLog, event: dict[str, Any], reading: LlmPass,
                     snapshot: _Snapshot, reset: bool) -> CompressResult:
        """An automatic job's summary that would leave the context no smaller than it is (what it
        replaces is a few short turns; a model's long reply) is not appended, the micro step alone
        applied: appended, an 1 850-token reply over 13 tokens of targets took a session past its
        window, and went back to the model as the previous summary in every job after. No
        failure: the call did answer. (A forced job appends it: asked for, on a session of a few
        lines it is larger than they are, and ``released`` says so.)"""
        logger.warning("summary not appended session=%s: its %d tokens are not fewer than those of what it replaces "
                       "(%d turns)", session_id, stamped_tokens(event, reading.encoding), reading.targets.end_turn -
                       reading.targets.start_after, extra={"session_id": session_id})
        if reset:
            self.failures.reset(session_id)
        if snapshot.compact is None:  # (the log's estimate as it is now: lines came during the call)
            return _result(False, 0, self.store.current(session_id, cwd, log).prompt_estimate)
        applied = self._micro_again(session_id, cwd, log)
        return _result(bool(applied.appended), applied.before, applied.state.prompt_estimate)

    def _send_last_writes(self, pipe: Any, session_id: str, run: JobRun) -> None:
        """Queue the release of ``run``'s claim after the writes on ``pipe`` and send them all;
        ``run.collect`` reads the replies once the job is done (call under the log's lock)."""
        queue_release(pipe, self.settings, session_id, run.job_id)  # last: after the save it follows
        try:
            if Deferred.supported(self.store.redis):
                run.sent = Deferred.pipeline(self.store.redis, pipe)
            else:  # a single-connection client: no side channel
                run.done, run.trigger = True, released_trigger(pipe.execute()[-1])
                run.reset_owed = False
        except redis.RedisError as error:
            # (Redis restarting as the job ended: what it appended is in the log, so the job succeeds;
            # ``finish`` frees the claim, and forgets the failures, in round trips of its own, and the
            # next writer catches the state up. Raised, the job failed with its summary written, and
            # its replacement answered the forced request "nothing compressed"; a micro job's compact alike.)
            if not is_transient(error):
                raise
            logger.warning("the last writes failed session=%s job=%s: %s (what it appended is in the log)",
                           session_id, run.job_id, error)

    def _summary_text(
        self, session_id: str, reading: LlmPass, view: _Session, *, breaker_open: bool, run: JobRun | None = None,
    ) -> tuple[str, bool]:
        """The new summary text and whether the failure counter is to be reset (an LLM
        success). ``breaker_open`` (an automatic job; the caller checked that the fallback calls
        no LLM) sends the targets to the fallback instead of the LLM. A failed LLM call
        the fallback answers for is recorded in ``run.llm_failure``."""
        fallback = self.ctx.fallback_model
        if breaker_open and self.ctx.fallback_past_breaker:
            logger.info("breaker open session=%s: using fallback %s", session_id, fallback)
            return self._summarize_with(fallback, reading, view, run=run), False
        plan = self.plan(reading.targets, view, reading.target_tokens)
        try:
            text = self._summarize_with(plan.model, reading, view, plan, run=run)
        except (LLMUnavailable, SummaryInvalid) as failure:
            error: LLMUnavailable | SummaryInvalid = failure
        else:
            return text, plan.model != EXTRACTIVE_MODEL
        # (past the handler: a fallback's call made inside it had the first call's error for its
        # context, and its own error was classified, and named, by that one's causes)
        if self._handed_on(session_id, run):  # (a call that ran out while the worker was paused is
            # no failure of the LLM: counted after the job that replaced it succeeded, it left the
            # session a failure short of an open breaker)
            raise _abandoned(run, f"its LLM call's failure is not counted: {error}")
        kind = self._count_failure(session_id, plan.model, error, run.job_id if run is not None else None)
        if not fallback or fallback == plan.model:
            raise error
        if isinstance(error, LLMUnavailable) and error.job_timed_out:  # (RQ's alarm is spent: a fallback's
            # call ran on unbounded by it, 5 s past a 2 s job timeout for a 5 s llmTimeoutSeconds)
            logger.warning("llm failed session=%s: the job's timeout ran out, no call to the fallback %s",
                           session_id, fallback)
            raise error
        if STOPPING.is_set() and fallback != EXTRACTIVE_MODEL:  # (the extractive one calls no LLM)
            logger.warning("llm failed session=%s: the worker is stopping, no call to the fallback %s",
                           session_id, fallback)
            raise error
        logger.warning("llm failed session=%s: using fallback %s", session_id, fallback)
        try:  # (with ``run``: its chunks stop before the job's timeout, or the worker's stop, as the
            # first model's do; without, a backlog of chunks timed out every job, never summarized)
            text = self._summarize_with(fallback, reading, view, run=run)
        except LLMUnavailable as failed:  # the job's error names both: the fallback's alone hid the first
            raise LLMUnavailable(f"{failed}; the fallback was called after: {error}",
                                 transient=failed.transient, job_timed_out=failed.job_timed_out) from None
        except SummaryInvalid as failed:
            raise SummaryInvalid(f"{failed}; the fallback {fallback} was called after: {error}") from None
        if run is not None:
            run.llm_failure = LlmFailure(kind, str(error), plan.model, fallback)
        return text, False

    def check_not_handed_on(self, session_id: str, run: JobRun) -> None:
        """Raise JobAbandoned when ``run``'s job, about to start, was declared abandoned already and
        its session handed on (``_handed_on`` without its wait): one handed to a worker that was
        frozen then (its clock starts at its start) ran when the worker resumed, beside the
        session's next job, its LLM call paid for."""
        if run.job_id and self._handed_on(session_id, run, started=True):
            raise JobAbandoned(f"job {run.job_id} did not run: at its start its session was another job's (its "
                               "worker frozen past its heartbeats, the janitor handed the session on; or its claim "
                               "freed after an enqueue whose reply was lost, and taken by a later job)")

    def _handed_on(self, session_id: str, run: JobRun | None, *, started: bool = False) -> bool:
        """Whether ``run``'s job was declared abandoned while it ran (its worker paused or frozen past
        its heartbeats) and its session handed on: another job claims the session, or none does
        and RQ failed this one (the janitor's ``AbandonedJobError``: the job that replaced it is
        done). Asked only of a job that ran long enough for that (``may_have_been_abandoned``),
        or (``started``) of one starting."""
        if run is None or not (started or run.may_have_been_abandoned()):
            return False
        claim = pending_job_id(self.store.redis, self.settings, session_id)
        if claim is not None:
            return claim != run.job_id
        try:  # (no claim: freed, and not taken yet, or Redis lost it: the job goes on unless RQ failed it)
            return bool(Job.fetch(run.job_id, connection=self.store.redis).get_status() == JobStatus.FAILED)
        except NoSuchJobError:
            return False

    def _count_failure(self, session_id: str, model: str, error: CompactorError, job_id: str | None) -> str:
        """Count a failed LLM call and log it; its kind (see ``LlmFailure``)."""
        kind = ("transient" if error.transient else "permanent") if isinstance(error, LLMUnavailable) else "invalid"
        count = self.failures.record_failure(session_id, job_id=job_id, outcome=FAILURE_OUTCOMES[kind])
        logger.warning("llm compaction failed session=%s model=%s kind=%s failures=%d error=%s",
                       session_id, model, kind, count, error)
        return kind

    # -- planning and calling ------------------------------------------------------------

    def plan(self, targets: LlmTargets, view: _Session, target_tokens: int | None = None) -> Plan:
        """The model and window for these targets (SPEC §5's window rule); ``target_tokens``:
        their ``_events_tokens`` when known."""
        session_model = view.model
        session_window = view.window
        model = self.ctx.compaction_model or session_model
        if not model:
            if self.ctx.fallback_model:
                model = self.ctx.fallback_model
                return Plan(model, session_window if model == EXTRACTIVE_MODEL else self.model_window(model))
            raise LLMUnavailable("no compaction model: set context.compactionModel", transient=False)
        if model == EXTRACTIVE_MODEL:
            return Plan(model, session_window)
        if model == session_model:
            return Plan(model, session_window)
        if not session_model:  # (no turn ended yet: the session's window is the default, not this model's)
            return Plan(model, self.model_window(model))
        window = self.model_window(model)
        # counted as that model reads them: in the session's encoding, Hindi targets of ~44k o200k
        # tokens counted ~151k, a compactionModel of a 128k window was taken for too small, and the other
        # way round one was taken for large enough and its request sent in chunks past SPEC's reserve
        encoding = encoding_for_model(model)
        if target_tokens is None or encoding != view.encoding:
            target_tokens = _events_tokens(targets.events, encoding)
        frame = self.prompt_tokens([], targets.previous_summaries, encoding, 0)
        target_tokens, _ = _sized(targets.events, encoding, target_tokens,
                                  window - self.ctx.summary_reserve_tokens - frame)
        needed = frame + target_tokens
        if needed + self.ctx.summary_reserve_tokens > window:
            logger.info("compaction model %s too small (%d < %d): using session model %s",
                        model, window, needed + self.ctx.summary_reserve_tokens, session_model)
            return Plan(session_model, session_window)
        return Plan(model, window)

    def model_window(self, model: str) -> int:
        """litellm's max input tokens for ``model``, else the configured default."""
        return model_max_input_tokens(model) or self.ctx.default_context_window

    def prompt_tokens(
        self, events: list[dict[str, Any]], previous: list[dict[str, Any]], encoding: str,
        events_tokens: int | None = None,
    ) -> int:
        """An estimate of the prompt's tokens from the lines' stamps (no re-tokenizing), with the
        ``previous`` summaries; ``events_tokens``: ``_events_tokens(events, encoding)`` when known."""
        total = _system_tokens(encoding) + PROMPT_FRAME_TOKENS
        for summary in previous:
            total += stamped_tokens(summary, encoding)
        return total + (_events_tokens(events, encoding) if events_tokens is None else events_tokens)

    def _summarize_with(self, model: str, reading: LlmPass, view: _Session, plan: Plan | None = None,
                        run: JobRun | None = None) -> str:
        """The summary of ``reading``'s targets (in chunks when they do not fit the window). With
        ``run``'s deadline, the chunks stop once another LLM call might outlast it, after a turn
        boundary past the previous summary's: ``run.covered`` says how many targets the summary
        covers (a backlog needing more calls than fit in one job was never summarized: each job
        timed out, its chunks lost, and the next began again)."""
        targets = reading.targets
        previous_text = merged_summaries([text for summary in targets.previous_summaries
                                          if isinstance(text := summary.get("summaryText"), str)])
        limit = self.summary_limit(view.window)
        if model == EXTRACTIVE_MODEL:
            return extractive_summary(targets.events, previous_text, view.encoding, limit_tokens=limit,
                                      full_outputs=targets.full_outputs)
        # the window and the encoding of the model called: a fallback that is the session's model
        # has the session's window (its turn_end's contextWindow: litellm may not know the model, and
        # the default window let a whole backlog go in one request), and one of another encoding
        # counts in its own (chunks counted in the session's went over its window)
        own = model == view.model
        window = plan.window if plan else view.window if own else self.model_window(model)
        encoding = view.encoding if own else encoding_for_model(model)
        whole_previous = previous_text  # (its user messages, put back: the cut one's were a head, a mark, a tail)
        previous_text = self._previous_that_fits(previous_text, window, encoding)
        running = previous_text
        chunks = self.chunks(targets.events, previous_text, window, encoding,
                             reading.target_tokens if encoding == view.encoding else None, running=lambda: running)
        done = 0
        # (a stop never leaves a folded summary covering more turns than the new one: in its text, and
        # replaced, its turns past the new lastSummarizedTurnId were no longer hidden by their rollback)
        folded_through = max((through for summary in targets.earlier_summaries
                              if type(through := summary.get("lastSummarizedTurnId")) is int), default=0)
        for chunk in chunks:
            # the whole targets in one call: the pass rendered them already
            transcript = "\n\n".join(reading.blocks) if chunk is targets.events else render_transcript(chunk)
            messages = build_messages(transcript, running, limit)
            summary = extract_summary(self.summarizer.complete(model, messages), user_messages=_user_messages_in(chunk),
                                      quoted=quoted_headings(messages))
            kept = with_messages_kept(summary, whole_previous if done == 0 else running)
            if kept is not summary and count_tokens(kept, view.encoding) > limit:  # (the service's addition is
                logger.warning("the previous summary's user messages not put back in the summary: over the "  # no
                               "%d-token limit with them", limit)  # failure of the LLM's)
                kept = summary
            running = kept
            size = count_tokens(running, view.encoding)
            if size > limit:
                raise SummaryInvalid(f"the summary is {size} tokens, over the {limit} a summary may take "
                                     f"(a quarter of the session's {view.window}-token window, at least "
                                     f"{MIN_SUMMARY_LIMIT_TOKENS})")
            done += len(chunk)
            if (done >= len(targets.events) or run is None
                    or turn_of(targets.events[done]) - 1 <= max(targets.start_after, folded_through - 1)):
                continue  # (all summarized; or no turn boundary past the previous summaries' yet)
            if run.deadline is not None and time.monotonic() + self.ctx.llm_timeout_seconds > run.deadline:
                why = "another LLM call might outlast the job's timeout"
            elif STOPPING.is_set():
                why = "the worker is stopping"
            else:
                continue
            logger.warning("summarizing stopped after %d of %d targets: %s; the next job goes on",
                           done, len(targets.events), why)
            run.covered = done
            break
        assert running is not None  # targets are never empty here
        return running

    def _beside_frame_and_reply(self, window: int, encoding: str) -> int:
        """What a request in ``window`` has for the running summary and a chunk: the window less
        the prompt's frame and room for the reply (the reserve, at most a quarter of the window)."""
        return (window - _system_tokens(encoding) - PROMPT_FRAME_TOKENS
                - min(self.ctx.summary_reserve_tokens, window // 4))

    def _previous_that_fits(self, previous_text: str | None, window: int, encoding: str) -> str | None:
        """The previous summary, cut to its head and tail when it leaves no room in ``window`` for
        the prompt's frame, the reply and a chunk (``MIN_CHUNK_BUDGET_TOKENS``): one written under a
        larger window (the agent moved to a smaller model, or a producer wrote it) was sent whole
        with every chunk, a request far over the window that a provider refuses: every job failed."""
        if not previous_text:
            return previous_text
        beside = self._beside_frame_and_reply(window, encoding)
        # (in a window too small for the frame, the reply and a whole chunk, half of what is left:
        # cut to a few tokens, the previous summary was all but lost, and the new one replaced it)
        room = max(beside - MIN_CHUNK_BUDGET_TOKENS, beside // 2)
        if count_tokens(previous_text, encoding) <= room:
            return previous_text
        budget = max(room, BLOCK_HEADER_TOKENS + 1)  # (the window may leave it less than nothing)
        cut = _clipped({"type": "summary", "summaryText": previous_text}, budget, encoding)
        logger.warning("previous summary cut to fit a %d-token window (%d tokens kept of it)", window, budget)
        return str(cut["summaryText"])

    def summary_limit(self, window: int) -> int:
        """The most tokens a summary may take in a session of ``window`` tokens: a quarter of the
        window, at least ``MIN_SUMMARY_LIMIT_TOKENS`` (ten sections need a few hundred). A larger
        one left the session over its window for good (17 937 tokens of summary in an
        8 000-token window), and was sent back as the next call's previous summary."""
        return max(window // 4, MIN_SUMMARY_LIMIT_TOKENS)

    def chunks(
        self, events: list[dict[str, Any]], previous_text: str | None, window: int, encoding: str,
        events_tokens: int | None = None, *, running: Callable[[], str | None] | None = None,
    ) -> Iterator[list[dict[str, Any]]]:
        """``[events]`` itself when their prompt fits ``window`` with the reserve
        (``summaryReserveTokens``); else consecutive slices of them, each planned when it is
        asked for, to fit ``window`` beside the running summary as it is then (``running()``;
        ``previous_text`` without it) and room for the reply: the reserve, at most a quarter
        of the window. ``events_tokens``: ``_events_tokens(events, encoding)`` when known.

        (Each slice once budgeted at the reserve for the reply *and* for the running summary:
        2 × 25 000 tokens, so under a ~51k window every slice fell to ``MIN_CHUNK_BUDGET_TOKENS``
        and a user message of a few thousand tokens was cut to its head and tail.)
        """
        fixed = _system_tokens(encoding) + PROMPT_FRAME_TOKENS
        if events_tokens is None:
            events_tokens = _events_tokens(events, encoding)
        previous_tokens = count_tokens(previous_text or "", encoding)
        room = window - fixed - self.ctx.summary_reserve_tokens - previous_tokens
        total, counted = _sized(events, encoding, events_tokens, room)
        if total <= room:
            yield events
            return
        sizes: list[int | None] = list(counted) if counted is not None else [None] * len(events)
        current = running or (lambda: previous_text)
        room = self._beside_frame_and_reply(window, encoding)
        position, count = 0, 0
        while position < len(events):
            budget = max(room - count_tokens(current() or "", encoding), MIN_CHUNK_BUDGET_TOKENS)
            chunk: list[dict[str, Any]] = []
            used = 0
            while position < len(events):
                event, tokens = events[position], sizes[position]  # (each counted once: the one a
                if tokens is None:  # chunk had no room for is the next one's first)
                    tokens = sizes[position] = _sent_tokens(event, encoding)
                if tokens > budget:
                    event = _clipped(event, budget, encoding)
                    tokens = _sent_tokens(event, encoding)
                if chunk and used + tokens > budget:
                    break
                chunk.append(event)
                used += tokens
                position += 1
            count += 1
            logger.info("summarizing chunk %d (%d events, window %d, budget %d tokens)", count, len(chunk), window,
                        budget)
            yield chunk

    # -- helpers -------------------------------------------------------------------------

    def _log(self, session_id: str, cwd: str) -> SessionLog:
        # never created by a job: one deleted while the LLM call ran stays deleted (SessionNotFound)
        log = self.store.log(session_id, cwd, create=False)
        if not log.exists():
            raise SessionNotFound(f"no log for session {session_id} in {cwd}")
        return log


class _StateRead:
    """The session's stored state and failure count, asked for on entry, read on exit.

    A job sends the request, reads the log while Redis answers, then takes the
    reply: the round trip overlaps the read (``compactor.deferred``). Without a
    counter (a micro job) only the state is read.
    """

    def __init__(self, store: SessionStore, failures: FailureCounter | None, session_id: str) -> None:
        self.store = store
        self.counter = failures
        self.session_id = session_id
        self.state: SessionState | None = None
        self.failures = 0
        self._sent: Deferred | None = None

    def __enter__(self) -> _StateRead:
        client = self.store.redis
        if Deferred.supported(client):
            commands: list[tuple[str, ...]] = [("HGETALL", self.store.keys.session(self.session_id))]
            if self.counter is not None:
                commands.append(("GET", self.counter.keys.failures(self.session_id)))
            self._sent = Deferred(client, commands)
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        sent, self._sent = self._sent, None
        if sent is None:
            if kind is None:
                self.state = self.store.load(self.session_id)
                self.failures = self.counter.count(self.session_id) if self.counter is not None else 0
            return
        if kind is not None:
            sent.discard()
            return
        raw, *count = sent.replies()
        fields = dict(raw.items() if isinstance(raw, dict) else zip(raw[::2], raw[1::2]))
        self.state = stored_state(fields, self.session_id)
        self.failures = int(count[0]) if count and count[0] else 0


def _has_old_candidate(state: SessionState) -> bool:
    """Whether the state records a micro candidate in a turn before ``currentTurnId - 1``."""
    return state.min_candidate_turn != 0 and state.min_candidate_turn < state.current_turn_id - 1


@dataclass(frozen=True)
class _Snapshot:
    """The log as the LLM job last saw it under the lock: its size, events, their reading
    and state, and the micro step's compact decided from them (appended with the summary)."""

    size: int
    events: list[dict[str, Any]]
    reading: LlmPass  # of ``events``
    state: SessionState
    compact: dict[str, Any] | None
    tail: bytes  # the log's last bytes before ``size``: the same log still, when the summary is appended?


def _compact_event(events: list[dict[str, Any]], ctx: ContextSettings, view: ContextView) -> dict[str, Any] | None:
    """The micro step's ``compact`` for the log ``events`` (``view`` is theirs), or None without candidates."""
    candidates = micro_candidates(events, ctx, view=view)
    if not candidates:
        return None
    turns = [turn_of(e) for e in candidates]
    return _new_line("compact", startTurnId=min(turns), endTurnId=max(turns))


def _overtaken(since: list[dict[str, Any]], end_turn: int, compact: dict[str, Any] | None,
               before: list[dict[str, Any]], ctx: ContextSettings) -> bool:
    """Whether the lines appended during the LLM call (``since``, after the log's ``before``) make
    the summary (of turns up to ``end_turn``) and the micro step's ``compact`` wrong to append:
    another summary, a rollback hiding one of the turns they cover, or one that leaves them
    reaching into the turns SPEC §5 keeps (the summary past ``currentTurnId - keepRecentTurns -
    1``, the compact at ``currentTurnId - 1`` or later: an agent undoing its last turn while the
    turn before was summarized had that turn, now its most recent, in the summary only). A
    rollback of later turns only (an agent undoing its last step while an old part of the
    session was summarized) leaves both right: appended after it, they cover turns it did not
    hide; the summary was dropped all the same, and a forced compaction answered
    ``didCompress: false`` after a successful LLM call."""
    covers = max(end_turn, compact["endTurnId"] if compact is not None else 0)
    rolled = False
    for event in since:
        kind = event.get("type")
        if kind == "summary":
            return True
        if kind == "rollback":
            through = event.get("throughTurnId")
            if not isinstance(through, int) or through <= covers:
                return True
        elif kind in TURN_SCOPED_TYPES and rolled and not (isinstance(turn := event.get("turnId"), int)
                                                          and turn > covers):
            return True  # (after a rollback, an event in a covered turn: the plan is not the log's any more)
        rolled = rolled or kind == "rollback"
    if not rolled:
        return False
    current = current_turn_id(before + since)  # (the log as it is now: after the rollbacks, and what followed)
    return end_turn > current - ctx.keep_recent_turns - 1 or (
        compact is not None and compact["endTurnId"] >= current - 1)


def _new_line(kind: str, *, line_uuid: str | None = None, **fields: Any) -> dict[str, Any]:
    """A line of the worker's own, as ``to_wire(with_identity(<model>(...)))`` makes it (a new
    uuid, or ``line_uuid``, the time, then the fields), without the pydantic round trip: the
    worker's values (turn ids and uuids read from the log, the checked summary text) need no
    validation."""
    return {"uuid": line_uuid or str(uuid.uuid4()), "timestamp": iso_time(redis_time_s()), "type": kind, **fields}


def job_line_uuid(job_id: str, what: str) -> str:
    """The uuid of the line ``what`` a forced job writes: ``summary``, or ``compact:{n}`` (its micro
    step's ``compact``, ``n`` the lines before it: a job that ran again writes another)."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"compactor:job:{job_id}:{what}"))


def _answered(events: list[dict[str, Any]], job_ids: tuple[str, ...], ctx: ContextSettings) -> CompressResult | None:
    """The result of the forced job (of ``job_ids``) whose summary the log holds, as it was: the
    estimate right before its lines (its micro step's compact included) and right after its
    summary; None when none of them wrote one. A job that ran again (Redis restored from a
    snapshot taken while it was queued put it back in the queue; its worker died after its
    append, before its end was recorded, and the job queued in its place runs) answered its
    request "nothing compacted", or wrote a second summary over the turns since."""
    summaries = {job_line_uuid(job_id, "summary") for job_id in job_ids}
    for i in range(len(events) - 1, -1, -1):
        line = events[i]
        if line.get("type") != "summary" or line.get("uuid") not in summaries:
            continue
        start = i
        if i > 0 and events[i - 1].get("type") == "compact" and events[i - 1].get("uuid") in {
                job_line_uuid(job_id, f"compact:{i - 1}") for job_id in job_ids}:
            start = i - 1
        before = build_view(events[:start], ctx, messages=False).prompt_estimate
        return _result(True, before, build_view(events[:i + 1], ctx, messages=False).prompt_estimate)
    return None


def _covered(reading: LlmPass, covered: int) -> tuple[list[str], int]:
    """A summary of the first ``covered`` targets: its ``replaces`` and ``lastSummarizedTurnId``,
    the turn before the first target left out (its turn's targets summarized already stay
    visible, and are summarized again by the next job)."""
    targets = reading.targets
    end_turn = turn_of(targets.events[covered]) - 1
    replaces = [e["uuid"] for e in targets.events[:covered] if isinstance(e.get("uuid"), str) and turn_of(e) <= end_turn]
    replaces.extend(summary["uuid"] for summary in targets.previous_summaries if isinstance(summary.get("uuid"), str))
    return replaces, end_turn


def _lines_since(log: SessionLog, snapshot: int, tail: bytes = b"") -> list[dict[str, Any]] | None:
    """The events written since byte ``snapshot``; None when the log shrank, or its bytes before
    ``snapshot`` are no longer ``tail`` (call under the lock): an older copy restored meanwhile,
    then appended to past that size, was read from the middle of a line, or, when a line ended
    there, given a summary of turns it no longer had."""
    size = log.complete_size()
    if size < snapshot or (tail and log.bytes_before(snapshot, len(tail)) != tail):
        return None
    return log.read(snapshot) if size > snapshot else []


def _sent_tokens(event: dict[str, Any], encoding: str) -> int:
    """An event's block as a chunk sends it, counted (``BLOCK_HEADER_TOKENS`` included): its
    tool-call lines and the reply tags the prompt writes as entities too. (A chunk sized from the
    stamps went over its window: ~5 tokens per tool call, ~4 per ``<summary>`` tag the stamps do
    not count; 15 449 tokens for an 8 192-token window.)"""
    return _rendered_tokens(event, encoding) + BLOCK_HEADER_TOKENS


def _rendered_tokens(event: dict[str, Any], encoding: str) -> int:
    """An event's block as the prompt writes it (the reply tags as entities), counted."""
    return count_tokens(neutralized(render_event(event)), encoding)


def _clipped(event: dict[str, Any], budget_tokens: int, encoding: str) -> dict[str, Any]:
    """A copy of an event too large for one chunk, its texts (the output or content, each tool
    call's arguments) cut to their head and tail so that its block takes at most ``budget_tokens``
    (``BLOCK_HEADER_TOKENS`` included), counted as rendered; its stamp is that count.

    (The cut once kept ~3 characters per token and trusted it: code, hex or CJK text takes a
    token per character or two, and a 5 239-token budget sent a 9 609-token chunk; and a tool
    call's arguments were never cut: a 60 000-word ``write_file`` went whole into an 8 000-token
    window.)
    """
    target = max(budget_tokens - BLOCK_HEADER_TOKENS, 1)
    keep = target * 3 // 2  # characters per head and per tail: a first guess, then counted
    best: tuple[dict[str, Any], int] | None = None
    for _ in range(CLIP_TRIES):
        clipped = _cut_texts(event, keep)
        tokens = _rendered_tokens(clipped, encoding)
        if tokens <= target:
            if best is None or tokens > best[1]:
                best = (clipped, tokens)
            if tokens * 100 >= target * 85:
                break
        scaled = keep * target * 95 // (100 * max(tokens, 1))  # aim at 95 % of the budget
        if scaled == keep:
            break
        keep = scaled
    if best is None:  # still over after the tries: the texts cut to nothing (the markers alone) first,
        # then the most kept that fits, searched (each step a render and a count: shrunk by a tenth
        # at a time, an event of 8 000 tool calls was rendered 81 times, 6 s of every job of its session)
        clipped = _cut_texts(event, 0)
        best = (clipped, _rendered_tokens(clipped, encoding))
        if best[1] <= target:
            fits, over = 0, keep
            while over - fits > max(1, over // 20):
                middle = (fits + over) // 2
                clipped = _cut_texts(event, middle)
                tokens = _rendered_tokens(clipped, encoding)
                if tokens <= target:
                    fits, best = middle, (clipped, tokens)
                else:
                    over = middle
        calls = len(tool_calls(event))  # how many tool calls are kept, once cutting the texts is not enough
        while best[1] > target and calls > 0:
            calls //= 2
            clipped = _cut_texts(event, 0, calls)
            best = (clipped, _rendered_tokens(clipped, encoding))
    clipped, tokens = best
    return {**clipped, TOKEN_COUNT_FIELD: tokens, TOKEN_ENCODING_FIELD: encoding}


def _cut_texts(event: dict[str, Any], keep: int, calls_kept: int | None = None) -> dict[str, Any]:
    """``event`` with each of its texts cut to ``keep`` characters of head and of tail, shared
    among them (a tool result's output and tool name; an assistant's content, its calls' names
    and arguments, as JSON), and only its first ``calls_kept`` tool calls when given."""
    kind = event.get("type")
    if kind == "tool_result":
        output, name = str_or_empty(event.get("output")), str_or_empty(event.get("toolName"))
        cut = _cut_all([output, name], keep)
        return {**event, "output": cut[0], "toolName": cut[1]}
    if kind != "assistant":
        field = "summaryText" if kind == "summary" else "content"  # (the text ``render_event`` shows)
        text = event.get(field)
        return {**event, field: elide(text, keep)} if isinstance(text, str) else event
    calls = tool_calls(event)
    omitted = ""
    if calls_kept is not None and calls_kept < len(calls):
        omitted = f"\n[… {len(calls) - calls_kept} more tool calls omitted …]"  # (after the cut: kept whole)
        calls = calls[:calls_kept]
    cut = _cut_all([str_or_empty(event.get("content")), *(str_or_empty(c.get("name")) for c in calls),
                    *(arguments_json(c.get("arguments")) for c in calls)], keep)
    names, arguments = cut[1:1 + len(calls)], cut[1 + len(calls):]
    return {**event, "content": cut[0] + omitted,
            "toolCalls": [{**call, "name": name, "arguments": text}
                          for call, name, text in zip(calls, names, arguments)]}


def _cut_all(texts: list[str], keep: int) -> list[str]:
    return [elide(text, share) for text, share in zip(texts, _shares([len(t) // 2 for t in texts], keep))]


def _shares(wants: list[int], keep: int) -> list[int]:
    """``keep`` split among texts that want ``wants`` each: the short ones get what they want,
    the long ones share the rest equally."""
    shares = [0] * len(wants)
    left = keep
    for done, index in enumerate(sorted(range(len(wants)), key=wants.__getitem__)):
        shares[index] = min(wants[index], left // (len(wants) - done))
        left -= shares[index]
    return shares


def _events_tokens(events: list[dict[str, Any]], encoding: str) -> int:
    """The events' stamps plus ``BLOCK_HEADER_TOKENS`` each and ``CALL_LINE_TOKENS`` per tool call
    (read inline): the estimate that decides whether the targets go in one call (a chunk is sized
    by ``_sent_tokens``), as ``llm_pass`` makes it."""
    total = BLOCK_HEADER_TOKENS * len(events)
    for event in events:
        count = event.get(TOKEN_COUNT_FIELD)
        if type(count) is int and event.get(TOKEN_ENCODING_FIELD) == encoding:
            total += count
        else:
            total += stamped_tokens(event, encoding)
        if event.get("type") == "assistant" and type(calls := event.get("toolCalls")) is list:
            total += CALL_LINE_TOKENS * len(calls)
    return total


def _sized(events: list[dict[str, Any]], encoding: str, estimate: int, room: int) -> tuple[int, list[int] | None]:
    """``estimate`` (``_events_tokens``) when it is over twice ``room`` (it overstates a tool call's
    line by 3 tokens at most: ~1.6 times for events of calls alone), or at most a third of it (what
    is sent is at most ``SENT_OVER_STAMPS`` times it); else the events counted as their blocks
    are sent (``_sent_tokens``): the stamps leave out what the transcript adds to a text, each
    reply tag written as an entity and each line that poses as a header escaped (16 turns of a
    C# file of 40 ``/// <summary>`` comments each, 22 % over their stamps, went in one request
    of 20 863 tokens to a 20 000-token window; one-line ``<summary>N</summary>`` comments are
    ~58 % over, inline ``</summary><analysis>`` 150 %). A real job near its window pays the
    count (~0.2 s for 190 000 tokens) beside a call of seconds; one far from it does not. With
    it, each event's count (``_sent_tokens``), for the chunks to reuse."""
    if estimate > 2 * room or estimate * SENT_OVER_STAMPS <= room:
        return estimate, None
    sizes = [_sent_tokens(event, encoding) for event in events]
    return sum(sizes), sizes


SENT_OVER_STAMPS = 3  # a target's block as sent over its stamp, at most: a text of reply tags only (~2.5)


_SYSTEM_TOKENS: dict[str, int] = {}


def _system_tokens(encoding: str) -> int:
    known = _SYSTEM_TOKENS.get(encoding)
    if known is None:
        known = _SYSTEM_TOKENS[encoding] = count_tokens(SYSTEM_PROMPT, encoding) + 2 * MESSAGE_OVERHEAD_TOKENS
    return known


def _smaller(summary: dict[str, Any], reading: LlmPass) -> bool:
    """Whether ``summary`` takes fewer tokens than what it replaces as shown once the micro step
    elided what it elides (``reading``'s targets and the previous summary): what the context would
    be without it. (Against the estimate before the micro step, a summary larger than the elided
    targets passed, the micro step's savings counted for it.)"""
    targets, encoding = reading.targets, reading.encoding
    # (an output shown elided counted as shown: the pass's estimate of it, its stamp scaled by the share
    # of characters shown, was 1 104 tokens for 216 shown, or 196 for 932, the kept ends denser)
    replaced = sum(event_tokens(event, encoding) if id(event) in targets.full_outputs else
                   stamped_tokens(event, encoding) for event in targets.events)
    for previous in targets.previous_summaries:
        replaced += stamped_tokens(previous, encoding)
    return stamped_tokens(summary, encoding) < replaced


def _result(did_compress: bool, before: int, after: int) -> CompressResult:
    return CompressResult(did_compress=did_compress, released=before - after if did_compress else 0,
                          prompt_estimate=after)


def _user_messages_in(chunk: Sequence[dict[str, Any]]) -> bool:
    """Whether ``chunk`` holds a user message that says something (``says_nothing``: a message "?"
    or "none", quoted whole, is a reply's placeholder too), which its summary's All User Messages
    must then keep. (The previous summary's are not asked for: a model's own words there, "No
    user messages were sent.", read as messages, had the next reply's "None." refused.)"""
    return any(event.get("type") == "user" and isinstance(text := event.get("content"), str)
               and not says_nothing(text) for event in chunk)
