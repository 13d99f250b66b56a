"""Per-session derived state: kept by an O(1) fold per event, or rebuilt from the log.

Invariants:
- ``fold`` over a log's events, one by one from an empty state, gives the same
  ``prompt_estimate``, ``current_turn_id``, ``min_candidate_turn``, model,
  encoding and window as ``rebuild`` of the whole log (and as ``build_view``).
  Where an O(1) update cannot guarantee that, ``fold`` returns False and the
  caller must ``rebuild``: for ``rollback``, ``compact`` and ``summary`` (they
  change what is visible far back), for a ``turn_end`` / ``session_meta`` that
  changes the token encoding, and for a turn-scoped event in a compacted turn
  (its output may be shown elided). A turn going backwards (which the watcher
  dead-letters anyway) folds exactly and needs no rebuild.
- ``fold`` never reads the log and never tokenizes a stamped line.
- ``log_size`` is set by the caller (the byte size of the log the state covers).
- ``to_hash`` / ``from_hash`` round-trip exactly through a Redis hash of strings.
- A state records the settings it was derived under (``settings``: the
  ``ContextSettings.state_fingerprint``); the store rebuilds one derived under
  others (``compactor.store.SessionStore.current``), so it can be trusted as
  exact: a micro job adds to its estimate rather than counting the log again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Any, Literal, Mapping

import orjson

from events.config import ContextSettings
from events.tokens import DEFAULT_ENCODING, encoding_for_model, model_max_input_tokens, stamped_tokens
from events.view import ContextView, LlmPass, build_view, candidate_min_chars

logger = logging.getLogger(__name__)

Decision = Literal["llm", "micro"]
_CONTEXT_TYPES = frozenset({"user", "assistant", "tool_result"})
_INT_FIELDS = frozenset({
    "window", "current_turn_id", "max_turn", "last_ended_turn", "prompt_estimate",
    "min_candidate_turn", "log_size", "events", "compacted_through",
})


@dataclass
class SessionState:
    """What the watcher knows about a session without reading its log."""

    session_id: str
    cwd: str
    model: str | None = None
    encoding: str = DEFAULT_ENCODING
    window: int = 0
    current_turn_id: int = 1
    max_turn: int = 0
    last_ended_turn: int = 0
    prompt_estimate: int = 0
    min_candidate_turn: int = 0  # smallest turn with an uncompacted compactable long output; 0 none
    log_size: int = 0
    events: int = 0  # lines folded
    last_stream_id: str | None = None
    last_compaction: dict[str, Any] | None = None
    compacted_through: int = 0  # highest turn a visible compact covers; 0 none
    settings: str = ""  # ``ContextSettings.state_fingerprint`` of the settings it was derived under

    def copy(self) -> SessionState:
        """A shallow copy (``dataclasses.replace`` costs five times more: it calls ``__init__``)."""
        twin = object.__new__(SessionState)
        twin.__dict__.update(self.__dict__)
        return twin

    @classmethod
    def empty(cls, session_id: str, cwd: str, ctx: ContextSettings) -> SessionState:
        """The state of a session with an empty log."""
        return cls(session_id=session_id, cwd=cwd, window=context_window(None, None, ctx),
                   settings=ctx.state_fingerprint)

    def to_hash(self) -> dict[str, str]:
        """The state as a Redis hash (str -> str); None is stored as an empty string."""
        out: dict[str, str] = {}
        for name in _FIELD_NAMES:
            value = getattr(self, name)
            if name == "last_compaction":
                out[name] = "" if value is None else orjson.dumps(value).decode()
            else:
                out[name] = "" if value is None else str(value)
        return out

    @classmethod
    def from_hash(cls, data: Mapping[Any, Any]) -> SessionState:
        """The state from ``to_hash`` output (keys and values may be bytes, as Redis returns them);
        ValueError naming the field when one cannot be read."""
        raw = {_decode(k): _decode(v) for k, v in data.items()}
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in raw:
                continue
            text = raw[f.name]
            if f.name in _INT_FIELDS:
                try:
                    values[f.name] = int(text)
                except ValueError:
                    raise ValueError(f"{f.name}: {text!r} is not an integer") from None
            elif f.name == "last_compaction":
                try:
                    values[f.name] = orjson.loads(text) if text else None
                except orjson.JSONDecodeError:
                    raise ValueError(f"{f.name}: {text[:80]!r} is not JSON") from None
            elif f.name in ("model", "last_stream_id"):
                values[f.name] = text or None
            else:
                values[f.name] = text
        return cls(**values)


_FIELD_NAMES = tuple(f.name for f in fields(SessionState))


def stored_state(data: Mapping[Any, Any], session_id: str) -> SessionState | None:
    """The state in a session's Redis hash; None when there is none, or when a field cannot be
    read: the state is derived from the log, which rebuilds it as after a loss of Redis (an
    unreadable number had failed every ``compactor status`` and held the session's events)."""
    if not data:
        return None
    try:
        return SessionState.from_hash(data)
    except ValueError as e:
        logger.warning("stored state of session=%s unreadable, rebuilt from its log: %s", session_id, e)
        return None


def _decode(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, (bytes, bytearray)) else str(value)


def context_window(model: str | None, event_window: Any, ctx: ContextSettings) -> int:
    """The turn_end's contextWindow, else litellm's max input tokens, else the configured default."""
    if type(event_window) is int and event_window > 0:
        return event_window
    if model:
        known = model_max_input_tokens(model)
        if known:
            return known
    return ctx.default_context_window


def _is_candidate(event: dict[str, Any], ctx: ContextSettings) -> bool:
    output = event.get("output")
    name = event.get("toolName")
    return (
        isinstance(output, str) and len(output) > candidate_min_chars(ctx)
        and isinstance(name, str) and ctx.is_compactable(name)
    )


def _fold_turn_scoped(state: SessionState, event: dict[str, Any], turn: int, ctx: ContextSettings) -> None:
    kind = event["type"]
    if kind in _CONTEXT_TYPES:
        state.prompt_estimate += stamped_tokens(event, state.encoding)
    if kind == "tool_result" and _is_candidate(event, ctx):
        if state.min_candidate_turn == 0 or turn < state.min_candidate_turn:
            state.min_candidate_turn = turn
    if turn > state.max_turn:
        state.max_turn = turn
    if kind == "turn_end" and turn > state.last_ended_turn:
        state.last_ended_turn = turn
    state.current_turn_id = max(state.last_ended_turn + 1, state.max_turn)


def _fold_model(state: SessionState, model: str | None, window: Any, ctx: ContextSettings) -> bool:
    """Adopt a new session model; False when its encoding differs (the caller rebuilds)."""
    if encoding_for_model(model) != state.encoding:
        return False
    state.model = model
    state.window = context_window(model, window, ctx)
    return True


def fold(state: SessionState, event: dict[str, Any], ctx: ContextSettings) -> bool:
    """Update ``state`` for one appended event in O(1); False when a rebuild is needed instead."""
    kind = event.get("type")
    if kind in ("user", "assistant", "tool_result", "turn_end"):
        turn = event.get("turnId")
        if type(turn) is not int or turn <= state.compacted_through:
            return False
        if kind == "turn_end" and not _fold_model(state, _model_of(event), event.get("contextWindow"), ctx):
            return False
        _fold_turn_scoped(state, event, turn, ctx)
    elif kind == "session_meta":
        model = _model_of(event)
        if model is not None and state.last_ended_turn == 0 and not _fold_model(state, model, None, ctx):
            return False
    elif kind in ("rollback", "compact", "summary"):
        return False
    _note_line(state, event)
    return True


def _model_of(event: dict[str, Any]) -> str | None:
    model = event.get("model")
    return model if isinstance(model, str) and model else None


def _note_line(state: SessionState, event: dict[str, Any]) -> None:
    state.events += 1
    stream_id = event.get("streamId")
    if isinstance(stream_id, str) and stream_id:
        state.last_stream_id = stream_id


def _last_stream_id(events: list[dict[str, Any]]) -> str | None:
    for event in reversed(events):
        stream_id = event.get("streamId")
        if isinstance(stream_id, str) and stream_id:
            return stream_id
    return None


def _last_compaction(view: ContextView) -> dict[str, Any] | None:
    for event in reversed(view.visible):
        kind = event.get("type")
        if kind in ("compact", "summary"):
            return {
                "kind": "micro" if kind == "compact" else "llm",
                "uuid": event.get("uuid"),
                "timestamp": event.get("timestamp"),
            }
    return None


def state_from_view(
    session_id: str, cwd: str, view: ContextView, ctx: ContextSettings, *, log_size: int, events: int,
    last_stream_id: str | None = None,
) -> SessionState:
    """The state a built view implies (for callers that already have the view)."""
    return SessionState(
        session_id=session_id,
        cwd=cwd,
        model=view.model,
        encoding=view.encoding,
        window=context_window(view.model, view.context_window, ctx),
        current_turn_id=view.current_turn_id,
        max_turn=view.max_turn,
        last_ended_turn=view.last_ended_turn,
        prompt_estimate=view.prompt_estimate,
        min_candidate_turn=view.min_candidate_turn,
        log_size=log_size,
        events=events,
        last_stream_id=last_stream_id,
        last_compaction=_last_compaction(view),
        compacted_through=view.compacted[-1][1] if view.compacted else 0,
        settings=ctx.state_fingerprint,
    )


def rebuild(
    session_id: str, cwd: str, events: list[dict[str, Any]], ctx: ContextSettings, log_size: int
) -> SessionState:
    """The state of a session from all of its log's events (no chat messages are built)."""
    return rebuild_with_view(session_id, cwd, events, ctx, log_size)[0]


def rebuild_with_view(
    session_id: str, cwd: str, events: list[dict[str, Any]], ctx: ContextSettings, log_size: int,
    view: ContextView | None = None,
) -> tuple[SessionState, ContextView]:
    """``rebuild``, also returning the view (built without messages) the state came from.

    ``view``, when given, must be the view of ``events`` (e.g. from ``events.view.extend_view``).
    """
    if view is None:
        view = build_view(events, ctx, messages=False)
    state = state_from_view(
        session_id, cwd, view, ctx, log_size=log_size, events=len(events),
        last_stream_id=_last_stream_id(events),
    )
    return state, view


def state_after_summary(
    before: SessionState, reading: LlmPass, appended: list[dict[str, Any]], ctx: ContextSettings, log_size: int,
) -> SessionState:
    """The state once ``appended`` (the micro step's compact, if any, then the summary of
    ``reading``'s targets) is written after the lines ``before`` covers, which ``reading``
    read (``events.view.llm_pass``; its ``exact`` must hold): what ``rebuild`` of the whole
    log gives, without a pass over it."""
    summary = appended[-1]
    state = before.copy()
    state.model = reading.model
    state.encoding = reading.encoding
    state.window = context_window(reading.model, reading.context_window, ctx)
    state.current_turn_id = reading.current_turn_id
    state.max_turn = reading.max_turn
    state.last_ended_turn = reading.last_ended_turn
    state.prompt_estimate = reading.kept_estimate + stamped_tokens(summary, reading.encoding)
    state.min_candidate_turn = reading.kept_min_candidate_turn
    state.compacted_through = reading.compacted_through
    state.last_compaction = {"kind": "llm", "uuid": summary.get("uuid"), "timestamp": summary.get("timestamp")}
    state.events = before.events + len(appended)
    state.log_size = log_size
    return state


def decide(state: SessionState, ctx: ContextSettings, *, breaker_open: bool) -> Decision | None:
    """SPEC §5: "llm" over the compaction threshold (breaker closed), else "micro" when useful.

    With the breaker open and ``fallbackModel: extractive`` it is still "llm": the job then
    summarizes with the extractive summarizer and calls no LLM, so the session never overflows
    for lack of an LLM (``ContextSettings.fallback_past_breaker``).
    """
    estimate, window = state.prompt_estimate, state.window or ctx.default_context_window
    if estimate > ctx.compaction_limit(window) and (not breaker_open or ctx.fallback_past_breaker):
        return "llm"
    if estimate > ctx.micro_limit(window) and _has_old_candidate(state):
        return "micro"
    return None


def _has_old_candidate(state: SessionState) -> bool:
    return state.min_candidate_turn != 0 and state.min_candidate_turn < state.current_turn_id - 1
