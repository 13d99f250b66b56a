"""The context view: what the model sees of a session log (SPEC §4).

Works on the plain camelCase dicts ``SessionLog.read`` returns; nothing here
validates with pydantic or re-tokenizes a stamped line, so a view of a large
log costs one reverse and one forward pass.

Rules, in SPEC order:
1. A ``rollback`` hides the turn-scoped events *before it* with
   ``turnId >= throughTurnId`` (``turn_end`` included) and the ``compact`` /
   ``summary`` events before it that cover such a turn. Later events are
   unaffected. A rollback whose ``throughTurnId`` is not an integer (only a
   hand-edited log has one) hides nothing.
2. A ``summary`` not hidden by a rollback hides the events whose uuids it
   ``replaces``. A summary replaced by a later such summary is not shown, but
   what it replaced stays hidden: an incremental summary (SPEC §5) replaces
   only the new targets and the previous summary, whose text it folds in. When
   a rollback hides the later summary, the earlier one is shown again.
   ``replaces`` refers to events before the summary; uuids of later events are
   ignored.
3. A visible ``compact`` marks turns ``startTurnId..endTurnId``; there a
   ``tool_result`` of a compactable tool longer than ``microCompactMinChars``
   is shown elided (``elide``), always strictly shorter than the original.
4. Messages: visible summaries first (``system``/``compacted_history``), then
   user / assistant / tool messages in log order. An assistant message is kept
   only if each of its tool calls is answered by a visible tool result later in
   the log; a tool message only if its call is in a kept assistant message (the
   first answer wins; duplicates are dropped). Adjacent user messages, and
   adjacent assistant messages without tool calls, are merged with a blank line.
5. promptEstimate sums SPEC §4.5 over the visible summary / user / assistant /
   tool_result events before pairing and merging, with the output as shown.

``current_turn_id`` and the session model ignore summaries and only honour
rollbacks: a summarized turn has still happened.

Workers and the state need no chat messages: ``build_view(..., messages=False)``
skips pairing and merging, and ``extend_view`` derives the view after one
appended ``compact`` from the view before it (no second pass over the log);
both give exactly what a full ``build_view`` gives. An LLM job reads its log
with ``llm_pass``: the targets (SPEC §5) as they are once its micro step's
compact is appended, rendered, and what the state will be once its summary is
appended, in one reverse and one forward pass; elided targets carry
*estimated* token stamps (for sizing a prompt only; see there).
"""

from __future__ import annotations

import logging
import math
from bisect import bisect_left, bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from events.config import ContextSettings
from events.tokens import (
    MESSAGE_OVERHEAD_TOKENS,
    TOKEN_COUNT_FIELD,
    TOKEN_ENCODING_FIELD,
    arguments_json,
    count_shown_tokens,
    count_tokens,
    encoding_for_model,
    event_tokens,
    stamped_tokens,
)

logger = logging.getLogger(__name__)

Event = dict[str, Any]
Message = dict[str, Any]

SUMMARY_MESSAGE_NAME = "compacted_history"
MERGE_SEPARATOR = "\n\n"
_TURN_SCOPED = frozenset({"user", "assistant", "tool_result", "turn_end"})
_CONTEXT_KINDS = frozenset({"user", "assistant", "tool_result"})  # the kinds a summary replaces
_NO_ROLLBACK = float("inf")


def elision_marker(omitted: int) -> str:
    """The text that replaces ``omitted`` characters of an elided output."""
    return f"\n…[{omitted} characters elided]…\n"


def elide(output: str, keep_chars: int) -> str:
    """Head + marker + tail of ``output``, strictly shorter than it.

    Head and tail keep up to ``keep_chars`` characters each, fewer when needed.
    An output too short to hold even the bare marker is returned unchanged.
    """
    length = len(output)
    if length >= 2 * keep_chars + _ROOM:  # the usual case: both halves kept whole (the marker inlined)
        return f"{output[:keep_chars]}\n…[{length - 2 * keep_chars} characters elided]…\n{output[length - keep_chars:]}"
    keep = _kept(length, keep_chars)
    shown = output[:keep] + elision_marker(length - 2 * keep) + output[length - keep:]
    if len(shown) < length:
        return shown
    return output


def omitted_chars(output: str, shown: str, keep_chars: int) -> int:
    """How many characters of ``output`` its ``shown`` form (``elide``'s) leaves out, as its marker
    says; 0 when it is shown whole."""
    if shown == output:
        return 0
    length = len(output)
    return length - 2 * (keep_chars if length >= 2 * keep_chars + _ROOM else _kept(length, keep_chars))


def _kept(length: int, keep_chars: int) -> int:
    """The head (and tail) ``elide`` keeps of a ``length``-character output too short for
    ``keep_chars``: the most, up to ``keep_chars``, that leaves the result shorter than the output
    (SPEC §8: "less when needed to stay shorter"; 0 when even the bare marker does not fit)."""
    # the marker's number has at most as many digits as ``length``: start from that bound, then
    # take back what the count's fewer digits leave room for (a step or two)
    keep = max(0, min(keep_chars, (length - _MARKER_CHARS - len(str(length)) - 1) // 2))
    while keep < keep_chars and 2 * (keep + 1) + _MARKER_CHARS + len(str(length - 2 * (keep + 1))) < length:
        keep += 1
    return keep


_MARKER_CHARS = len(elision_marker(0)) - 1  # the marker's length but the number's digits
_ROOM = _MARKER_CHARS + 21  # a length at least 2 * keep + this leaves room for the marker (< 20 digits)
SHORTEST_ELIDABLE = next(n for n in range(1, 100) if len(elide("x" * n, 0)) < n)  # 27: shorter ones shown whole


def candidate_min_chars(ctx: ContextSettings) -> int:
    """A micro candidate's output is longer than this: ``microCompactMinChars``, but never one too
    short to elide (DESIGN: such an output is shown whole and is no candidate; below 27 a
    candidate that could not be elided made a job append a compact that changed nothing)."""
    return max(ctx.micro_compact_min_chars, SHORTEST_ELIDABLE - 1)


@dataclass(frozen=True, slots=True)
class ContextView:
    """The view of one log. ``visible`` holds the raw visible events in log order."""

    messages: list[Message]
    prompt_estimate: int
    current_turn_id: int
    model: str | None
    encoding: str
    summary: Event | None  # the latest visible summary
    visible: list[Event]
    last_ended_turn: int  # highest visible turn_end (0 none)
    max_turn: int  # highest visible turnId (0 none)
    context_window: int | None  # contextWindow of the latest visible turn_end
    candidates: list[Event]  # visible compactable long tool results not compacted, any turn
    compacted: tuple[tuple[int, int], ...]  # merged visible compact ranges, sorted
    # position in ``visible`` -> (the output as shown, the item's SPEC §4.5 tokens), per elided tool result
    elided: dict[int, tuple[str, int]] = field(default_factory=dict)

    @property
    def min_candidate_turn(self) -> int:
        """The smallest turn holding a micro-compaction candidate (0 when none)."""
        return min((turn_of(e) for e in self.candidates), default=0)


@dataclass(frozen=True, slots=True)
class LlmTargets:
    """What an LLM compaction summarizes (SPEC §5)."""

    previous_summary: Event | None
    events: list[Event]  # as shown: an elided tool_result is a copy whose output is the shown text
    end_turn: int
    start_after: int  # lastSummarizedTurnId of previous_summary, 0 without one
    # id() of each such copy -> the output it shows elided (the extractive summarizer reads errors in
    # it: the micro step elides long outputs long before a summary, their error lines too)
    full_outputs: dict[int, str] = field(default_factory=dict)
    # the visible summaries before ``previous_summary``, in log order (a producer's summary that did
    # not replace the one before it): the new summary folds them in and replaces them too, so the
    # context holds one summary again (each job replaced only the latest: both stayed for good)
    earlier_summaries: list[Event] = field(default_factory=list)

    @property
    def previous_summaries(self) -> list[Event]:
        """Every visible summary the new one replaces, in log order."""
        return [*self.earlier_summaries, self.previous_summary] if self.previous_summary is not None else []


@dataclass(slots=True)
class _Scan:
    """Result of the reverse pass: visibility and the facts that need it."""

    hidden: list[bool]
    model: str | None = None
    meta_model: str | None = None
    turn_end_seen: bool = False
    context_window: int | None = None
    last_ended_turn: int = 0
    max_turn: int = 0
    compacts: list[tuple[int, int]] = field(default_factory=list)
    summary: Event | None = None  # the latest visible summary (the first one kept in reverse)
    earlier: list[Event] = field(default_factory=list)  # the other visible summaries, latest first


def _int(value: Any) -> int:
    return value if type(value) is int else 0


def turn_of(event: Event) -> int:
    """The event's ``turnId``; 0 when it has none (or one that is not an integer)."""
    return _int(event.get("turnId"))


def _through(rollback: Event) -> float:
    """The turn a rollback undoes from; ``_NO_ROLLBACK`` (none) when its ``throughTurnId`` is not an
    integer (a hand-edited ``"2"`` or ``2.0``: read as 0, it hid every turn)."""
    value = rollback.get("throughTurnId")
    return value if type(value) is int else _NO_ROLLBACK


def _scan(events: list[Event]) -> _Scan:
    """One reverse pass: rollback and summary hiding, the model, the turn counters.

    The common case (a turn-scoped line) is inlined: this pass runs over every
    line of the log on each view.
    """
    hidden = [False] * len(events)
    scan = _Scan(hidden=hidden)
    through: float = _NO_ROLLBACK
    replaced: set[Any] = set()
    max_turn = 0
    for i in range(len(events) - 1, -1, -1):
        event = events[i]
        kind = event.get("type")
        if kind in _TURN_SCOPED:
            turn = event.get("turnId")
            if type(turn) is not int:
                turn = 0
            if turn >= through:
                hidden[i] = True
                continue
            if turn > max_turn:
                max_turn = turn
            if kind == "turn_end":
                _note_turn_end(scan, event, turn)
        elif kind == "rollback":
            through = min(through, _through(event))
            continue
        elif kind == "summary":
            if _int(event.get("lastSummarizedTurnId")) >= through:
                hidden[i] = True
                continue
            uuid = event.get("uuid")
            if type(uuid) is str and uuid in replaced:  # (a hand-edited line's uuid may be unhashable)
                hidden[i] = True  # superseded: not shown, but what it replaced stays hidden
            elif scan.summary is None:
                scan.summary = event
            else:
                scan.earlier.append(event)
            replaces = event.get("replaces")
            if isinstance(replaces, list):
                replaced.update(r for r in replaces if isinstance(r, str))
            continue
        elif kind == "compact":
            end = _int(event.get("endTurnId"))
            if end >= through or (replaced and type(uuid := event.get("uuid")) is str
                                  and uuid in replaced):  # a replaced one marks nothing
                hidden[i] = True
            else:
                scan.compacts.append((_int(event.get("startTurnId")), end))
            continue
        elif kind == "session_meta":
            if scan.meta_model is None and isinstance(event.get("model"), str) and event["model"]:
                scan.meta_model = event["model"]
            continue
        if replaced and type(uuid := event.get("uuid")) is str and uuid in replaced:
            hidden[i] = True
    scan.max_turn = max_turn
    if not scan.turn_end_seen:
        scan.model = scan.meta_model
    return scan


def undone_by_rollback(events: list[Event]) -> set[int]:
    """Indexes of the ``compact``/``summary`` lines a later rollback hides: ``_scan``'s rule 1
    (SPEC §4), for a caller that must tell them from lines a later summary replaced."""
    undone: set[int] = set()
    through: float = _NO_ROLLBACK
    for i in range(len(events) - 1, -1, -1):
        event = events[i]
        kind = event.get("type")
        if kind == "rollback":
            through = min(through, _through(event))
        elif kind == "compact" and _int(event.get("endTurnId")) >= through:
            undone.add(i)
        elif kind == "summary" and _int(event.get("lastSummarizedTurnId")) >= through:
            undone.add(i)
    return undone


def _note_turn_end(scan: _Scan, event: Event, turn: int) -> None:
    if turn > scan.last_ended_turn:
        scan.last_ended_turn = turn
    if not scan.turn_end_seen:  # the first seen in reverse is the latest
        scan.turn_end_seen = True
        model = event.get("model")
        scan.model = model if isinstance(model, str) and model else None
        window = event.get("contextWindow")
        scan.context_window = window if type(window) is int and window > 0 else None


def _merge_ranges(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(r for r in ranges if r[0] <= r[1]):
        if merged and start <= merged[-1][1] + 1:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return tuple(merged)


def _in_ranges(turn: int, starts: list[int], ranges: tuple[tuple[int, int], ...]) -> bool:
    index = bisect_right(starts, turn) - 1
    return index >= 0 and turn <= ranges[index][1]


def _current_turn(last_ended: int, max_turn: int) -> int:
    return max(last_ended + 1, max_turn)


class _Builder:
    """The forward pass: visible events, shown outputs, candidate messages, the estimate.

    With ``messages=False`` no chat messages are built (the state and the
    compaction targets need only the estimate, the candidates and the visible
    events); the estimate, candidates and shown outputs are the same either way.
    """

    def __init__(
        self, ctx: ContextSettings, encoding: str, compacted: tuple[tuple[int, int], ...], *, messages: bool = True,
        count: bool = True,
    ) -> None:
        self.ctx = ctx
        self.count = count
        self.encoding = encoding
        self.compacted = compacted
        self.starts = [start for start, _ in compacted]
        self.min_chars = candidate_min_chars(ctx)
        self.build_messages = messages
        self.compactable: dict[str, bool] = {}
        self.name_tokens: dict[str, int] = {}
        self.visible: list[Event] = []
        self.summaries: list[Event] = []
        self.messages: list[Message] = []
        self.call_ids: list[list[str] | None] = []  # per message: an assistant's call ids
        self.candidates: list[Event] = []
        self.elided: dict[int, tuple[str, int]] = {}
        self.estimate = 0

    def is_compactable(self, name: str) -> bool:
        known = self.compactable.get(name)
        if known is None:
            known = self.compactable[name] = self.ctx.is_compactable(name)
        return known

    def add_all(self, events: list[Event]) -> None:
        """Add the visible events in log order (the estimate-only path is inlined for speed)."""
        if self.build_messages:
            for event in events:
                self.add(event)
            return
        self.visible = events
        if not self.count:
            self._candidates_only(events)
            return
        encoding = self.encoding
        estimate = 0
        for position, event in enumerate(events):
            kind = event.get("type")
            if kind == "tool_result":
                estimate += self._tool_result_tokens(event, position)
            elif kind == "user" or kind == "assistant" or kind == "summary":
                count = event.get(TOKEN_COUNT_FIELD)
                if type(count) is int and event.get(TOKEN_ENCODING_FIELD) == encoding:
                    estimate += count
                else:
                    estimate += event_tokens(event, encoding)
                if kind == "summary":
                    self.summaries.append(event)
        self.estimate += estimate

    def _candidates_only(self, events: list[Event]) -> None:
        """The candidates and summaries, nothing counted (the caller knows the estimate)."""
        for event in events:
            kind = event.get("type")
            if kind == "tool_result":
                if self._long_compactable(event) is not None and self._a_candidate(event):
                    self.candidates.append(event)
            elif kind == "summary":
                self.summaries.append(event)

    def _long_compactable(self, event: Event) -> str | None:
        """A tool result's output when it is over ``microCompactMinChars`` and its tool compactable."""
        output = event.get("output")
        if isinstance(output, str) and len(output) > self.min_chars and self.is_compactable(
                str_or_empty(event.get("toolName"))):
            return output
        return None

    def _a_candidate(self, event: Event) -> bool:
        """Whether a long compactable tool result is a micro candidate: not compacted, and in a
        turn (a hand-edited ``turnId`` that is not an integer reads as turn 0, which no
        ``compact`` can cover: a candidate there would ask for a micro job after every turn,
        and its raw value crashed the comparisons that rank candidates by turn)."""
        return turn_of(event) > 0 and not self._compacted(event)

    def _compacted(self, event: Event) -> bool:
        """Whether a visible compact covers the event's turn."""
        return bool(self.compacted) and _in_ranges(turn_of(event), self.starts, self.compacted)

    def add(self, event: Event) -> None:
        self.visible.append(event)
        kind = event.get("type")
        if kind == "tool_result":
            self._tool_result(event)
        elif kind == "user":
            self.estimate += stamped_tokens(event, self.encoding)
            self._message({"role": "user", "content": str_or_empty(event.get("content"))}, None)
        elif kind == "assistant":
            self.estimate += stamped_tokens(event, self.encoding)
            self._assistant(event)
        elif kind == "summary":
            self.estimate += stamped_tokens(event, self.encoding)
            self.summaries.append(event)

    def _message(self, message: Message, call_ids: list[str] | None) -> None:
        self.messages.append(message)
        self.call_ids.append(call_ids)

    def _assistant(self, event: Event) -> None:
        message: Message = {"role": "assistant", "content": str_or_empty(event.get("content"))}
        calls = tool_calls(event)
        if not calls:  # (none an object: no ``tool_calls: []``, which a chat API refuses)
            self._message(message, None)
            return
        shown = [_tool_call(call) for call in calls]
        message["tool_calls"] = shown
        self._message(message, [call["id"] for call in shown])

    def _tool_result_tokens(self, event: Event, position: int) -> int:
        """The tool result's contribution as shown; records candidates and elided outputs."""
        output = self._long_compactable(event)
        if output is not None:
            if not self._compacted(event):
                if turn_of(event) > 0:  # (see ``_a_candidate``)
                    self.candidates.append(event)
            elif (shown := elide(output, self.ctx.micro_compact_keep_chars)) is not output:
                name = str_or_empty(event.get("toolName"))
                tokens = count_shown_tokens(shown, self.encoding) + self._name_tokens(name) + MESSAGE_OVERHEAD_TOKENS
                self.elided[position] = (shown, tokens)
                return tokens
        return stamped_tokens(event, self.encoding)

    def _tool_result(self, event: Event) -> None:
        position = len(self.visible) - 1
        self.estimate += self._tool_result_tokens(event, position)
        elided = self.elided.get(position)
        message = {"role": "tool", "tool_call_id": event.get("toolCallId"), "name": str_or_empty(event.get("toolName")),
                   "content": str_or_empty(event.get("output")) if elided is None else elided[0]}
        self._message(message, None)

    def _name_tokens(self, name: str) -> int:
        known = self.name_tokens.get(name)
        if known is None:
            known = self.name_tokens[name] = count_tokens(name, self.encoding)
        return known


def str_or_empty(value: Any) -> str:
    """``value`` when it is a string, else ``""`` (a field of an event as read from a log)."""
    return value if isinstance(value, str) else ""


def tool_calls(event: Event) -> list[dict[str, Any]]:
    """An assistant event's tool calls as read from a log: the objects of its ``toolCalls`` list
    (a hand-edited line's ``toolCalls: 7`` failed the view and every LLM job of the session, never
    counted as a failure; the estimate already counted only these)."""
    calls = event.get("toolCalls")
    if type(calls) is not list:
        return []
    return calls if all(type(call) is dict for call in calls) else [c for c in calls if isinstance(c, dict)]


def _tool_call(call: Event) -> Message:
    return {
        "id": call.get("id"),
        "type": "function",
        "function": {"name": str_or_empty(call.get("name")), "arguments": arguments_json(call.get("arguments", ""))},
    }


def _pair(messages: list[Message], call_ids: list[list[str] | None]) -> list[Message]:
    """Drop assistants with an unanswered call and tool messages that answer no kept call.

    A call's answer is the first tool message with its id *after* it, and before the next
    assistant calling that id, that no earlier kept call took (a call id may come back: a
    stray result logged ahead of its call, or an id reused by a later assistant, costs
    nothing else). (Without the bound, a call left unanswered (an interrupted turn) took the
    answer to the next call of its id, providers reusing ids: that call was dropped, and the
    answer followed a user message in the chat.)
    """
    answers: dict[str, list[int]] = {}  # call id -> positions of the tool messages with it
    callers: dict[Any, list[int]] = {}  # call id -> positions of the assistants calling it (each once)
    for position, message in enumerate(messages):
        if message["role"] == "tool" and type(answered := message["tool_call_id"]) is str:
            answers.setdefault(answered, []).append(position)  # (a hand-edited id that is no string answers nothing)
        elif (ids := call_ids[position]) is not None:
            for call in ids:
                if type(call) is str and ((at := callers.setdefault(call, [])) == [] or at[-1] != position):
                    at.append(position)
    first_free: dict[Any, int] = {}  # call id -> index in answers[id] of the first not taken nor passed
    taken: set[int] = set()
    kept: list[Message] = []
    for position, message in enumerate(messages):
        ids = call_ids[position]
        if ids is None:
            if message["role"] != "tool" or position in taken:  # an answer comes after its call: decided
                kept.append(message)
            continue
        chosen: dict[Any, int] = {}
        for call in ids:
            if type(call) is not str:
                break  # (hand-edited: no string id, so no answer)
            if call in chosen:
                continue
            found = answers.get(call, ())
            index = first_free.get(call, 0)
            while index < len(found) and found[index] < position:
                index += 1  # before this call, so before every later one too: never an answer
            first_free[call] = index
            if index == len(found):
                break
            if found[index] > _next_caller(callers[call], position):
                break  # (its first answer is the next call's)
            chosen[call] = index
        else:
            for call, index in chosen.items():
                taken.add(answers[call][index])
                first_free[call] = index + 1
            kept.append(message)
    return kept


def _next_caller(positions: list[int], position: int) -> int | float:
    """The position of the next assistant after ``position`` in ``positions`` (ascending), else infinity."""
    at = bisect_right(positions, position)
    return positions[at] if at < len(positions) else math.inf


def _mergeable(message: Message) -> bool:
    return message["role"] in ("user", "assistant") and "tool_calls" not in message


def _merge(messages: list[Message]) -> list[Message]:
    """Merge adjacent user messages and adjacent plain assistant messages (each run's contents
    joined once: added one at a time, 4 000 messages of 4 KB in one turn took 7 s a view)."""
    merged: list[Message] = []
    run: list[Message] = []
    for message in messages:
        if not (run and _mergeable(message) and message["role"] == run[0]["role"]):
            _close(run, merged)
            run = [message] if _mergeable(message) else []
            if not run:
                merged.append(message)
            continue
        run.append(message)
    _close(run, merged)
    return merged


def _close(run: list[Message], merged: list[Message]) -> None:
    """Append a run of mergeable messages of one role as one message (the first's, its content the
    run's joined)."""
    if len(run) == 1:
        merged.append(run[0])
    elif run:
        merged.append({**run[0], "content": MERGE_SEPARATOR.join(message["content"] for message in run)})


def _summary_message(summary: Event) -> Message:
    return {"role": "system", "name": SUMMARY_MESSAGE_NAME, "content": str_or_empty(summary.get("summaryText"))}


def build_view(
    events: list[Event], ctx: ContextSettings, *, messages: bool = True, estimate: int | None = None,
) -> ContextView:
    """The SPEC §4 view of a log's events (as read, camelCase dicts).

    ``messages=False`` skips building the chat messages (``.messages`` is then
    empty); everything else — the estimate, visibility, candidates, targets'
    inputs — is the same. The state and the compaction jobs use that.
    ``estimate`` (with ``messages=False``): the caller knows these events' exact
    estimate (a stored state derived from them): nothing is counted, and
    ``.elided`` stays empty (the micro job: ``extend_view`` adds what its compact elides).
    """
    if estimate is not None and messages:
        raise ValueError("build_view: estimate= is for a view without messages")
    scan = _scan(events)
    encoding = encoding_for_model(scan.model)
    compacted = _merge_ranges(scan.compacts)
    builder = _Builder(ctx, encoding, compacted, messages=messages, count=estimate is None)
    builder.add_all([event for event, hidden in zip(events, scan.hidden) if not hidden])
    chat: list[Message] = []
    if messages:
        chat = [_summary_message(s) for s in builder.summaries]
        chat += _merge(_pair(builder.messages, builder.call_ids))
    return ContextView(
        messages=chat,
        prompt_estimate=builder.estimate if estimate is None else estimate,
        current_turn_id=_current_turn(scan.last_ended_turn, scan.max_turn),
        model=scan.model,
        encoding=encoding,
        summary=builder.summaries[-1] if builder.summaries else None,
        visible=builder.visible,
        last_ended_turn=scan.last_ended_turn,
        max_turn=scan.max_turn,
        context_window=scan.context_window,
        candidates=builder.candidates,
        compacted=compacted,
        elided=builder.elided,
    )


def extend_view(view: ContextView, appended: list[Event], ctx: ContextSettings) -> ContextView | None:
    """The view (without messages) of the viewed events + ``appended``, from ``view``; None when
    that is not computed incrementally (then build the view of the whole log).

    Handled: one appended ``compact`` (the micro job's): the newly compacted candidates are
    shown elided. Being last in the log it is visible, and it changes neither the turn
    counters, the model nor the other events' visibility, so the result is exactly
    ``build_view(events + appended, ctx, messages=False)``. (An LLM job derives the state
    after its compact and summary from its ``llm_pass`` instead.)
    """
    if len(appended) == 1 and appended[0].get("type") == "compact":
        return _with_compact(view, appended[0], ctx)
    return None


def _with_compact(view: ContextView, event: Event, ctx: ContextSettings) -> ContextView:
    compacted = _merge_ranges([*view.compacted, (_int(event.get("startTurnId")), _int(event.get("endTurnId")))])
    starts = [start for start, _ in compacted]
    estimate = view.prompt_estimate
    elided = dict(view.elided)
    candidates: list[Event] = []
    newly = [c for c in view.candidates if _in_ranges(turn_of(c), starts, compacted)]
    if newly:
        positions = {id(e): i for i, e in enumerate(view.visible)}
        newly_ids = {id(c) for c in newly}
        candidates = [c for c in view.candidates if id(c) not in newly_ids]
        tokens_of = _ElidedTokens(view.encoding)
        for candidate in newly:
            output = candidate["output"]  # a candidate's output is a long str
            shown = elide(output, ctx.micro_compact_keep_chars)
            if shown is output:
                continue
            tokens = tokens_of(candidate, shown)
            estimate += tokens - stamped_tokens(candidate, view.encoding)
            elided[positions[id(candidate)]] = (shown, tokens)
    else:
        candidates = list(view.candidates)
    return replace(view, messages=[], prompt_estimate=estimate, visible=[*view.visible, event],
                   candidates=candidates, compacted=compacted, elided=elided)


class _ElidedTokens:
    """An elided tool result's SPEC §4.5 tokens: the shown output's + its tool name's + overhead."""

    def __init__(self, encoding: str) -> None:
        self.encoding = encoding
        self.names: dict[str, int] = {}

    def __call__(self, event: Event, shown: str) -> int:
        name = str_or_empty(event.get("toolName"))
        known = self.names.get(name)
        if known is None:
            known = self.names[name] = count_tokens(name, self.encoding)
        return count_shown_tokens(shown, self.encoding) + known + MESSAGE_OVERHEAD_TOKENS


def current_turn_id(events: list[Event]) -> int:
    """SPEC §3: the turn about to run (t + 1 after turn_end t, or a later turn in progress)."""
    scan = _scan(events)
    return _current_turn(scan.last_ended_turn, scan.max_turn)


class VisibleTurns:
    """``current_turn_id`` kept as events come, a rollback in O(what it hides): the visible turns
    (distinct, ascending) and those ended. Built from a log's events once, then told each event
    appended (its turns only grow, past the checks of turn order: an append each)."""

    def __init__(self, events: list[Event]) -> None:
        self.turns: list[int] = []
        self.ended: list[int] = []
        for event in events:
            self.add(event)

    def add(self, event: Event) -> None:
        """One more event of the log: a turn seen, or a rollback hiding the turns it undoes."""
        kind = event.get("type")
        if kind in _TURN_SCOPED:
            turn = event.get("turnId")
            if type(turn) is int and turn > 0:  # (``_scan`` reads any other as 0: it counts for nothing)
                _insert(self.turns, turn)
                if kind == "turn_end":
                    _insert(self.ended, turn)
        elif kind == "rollback" and (through := _through(event)) is not _NO_ROLLBACK:
            del self.turns[bisect_left(self.turns, through):]
            del self.ended[bisect_left(self.ended, through):]

    @property
    def current(self) -> int:
        return _current_turn(self.ended[-1] if self.ended else 0, self.turns[-1] if self.turns else 0)


def _insert(turns: list[int], turn: int) -> None:
    if not turns or turns[-1] < turn:
        turns.append(turn)
    elif turns[(at := bisect_left(turns, turn))] != turn:
        turns.insert(at, turn)


def session_model(events: list[Event]) -> str | None:
    """The model of the latest visible turn_end, else session_meta's model, else None."""
    return _scan(events).model


def micro_candidates(
    events: list[Event], ctx: ContextSettings, current_turn_id: int | None = None,
    *, view: ContextView | None = None,
) -> list[Event]:
    """Visible compactable tool results over the minimum, in turns < currentTurnId - 1, not compacted.

    ``view`` (a view of ``events``, with or without messages) saves building it again.
    """
    if view is None:
        view = build_view(events, ctx, messages=False)
    current = view.current_turn_id if current_turn_id is None else current_turn_id
    return [e for e in view.candidates if turn_of(e) < current - 1]


@dataclass(frozen=True, slots=True)
class LlmPass:
    """An LLM job's one pass over its log (``llm_pass``): the targets, each rendered, and the
    session's state once the micro step's compact (if any) and the summary are appended, but
    for the summary's own tokens (known once it is written: ``events.state.state_after_summary``).

    ``exact`` is False when another visible event carries a uuid the summary replaces (the
    log breaks SPEC §3's uniqueness): that event would be hidden too, so rebuild instead.
    """

    targets: LlmTargets
    compact_turns: tuple[int, int] | None  # the micro step's compact (start, end); None without
    blocks: list[str]  # ``render`` of each target as shown
    target_tokens: int  # the targets' stamps (estimated where elided) + ``block_tokens`` each + ``call_tokens``
    # per tool call (its line's frame, which no stamp counts)
    replaces: list[str]  # the targets' uuids, then the previous summary's
    encoding: str
    model: str | None
    context_window: int | None
    current_turn_id: int
    max_turn: int
    last_ended_turn: int
    kept_estimate: int  # SPEC §4.5 tokens of what stays visible, the new summary's excluded
    kept_min_candidate_turn: int  # 0 when no candidate stays
    compacted_through: int  # the highest turn a visible compact covers, the new one included
    exact: bool


def llm_pass(
    events: list[Event], ctx: ContextSettings, *, micro: bool, render: Callable[[Event], str],
    block_tokens: int = 0, call_tokens: int = 0,
) -> LlmPass:
    """An LLM job's reading of its log, in one reverse pass (``_scan``) and one forward
    pass: a job's cost beyond reading its log is mostly passes over it (the forward one
    is inlined, as ``_scan`` is).

    ``micro``: the micro step runs; its compact covers the turns of the candidates in
    turns before ``currentTurnId - 1``, every one of which is then shown elided. The
    targets are SPEC §5's, as the view shows them once that compact is appended
    (``build_view`` of the log + the compact), each elided one a copy carrying the
    output as shown and an *estimated* stamp (its stamp scaled by the shown / original
    length, plus the per-message overhead), also one a compact already covered: no
    target is tokenized (stamps only size the prompt). What stays visible once the
    compact and the summary are appended is counted exactly, as ``build_view`` would.
    ``block_tokens``, ``call_tokens``: what ``render`` adds to a target's stamp, per block
    and per tool call.
    """
    scan = _scan(events)
    hidden = scan.hidden
    encoding = encoding_for_model(scan.model)
    current = _current_turn(scan.last_ended_turn, scan.max_turn)
    end_turn = current - ctx.keep_recent_turns - 1
    previous = scan.summary
    start_after = _int(previous.get("lastSummarizedTurnId")) if previous else 0
    summarize = end_turn > start_after
    # (one without a uuid cannot be replaced: folded in, it stayed, and came back in every summary after; one
    # covering turns past ``end_turn`` (a producer's, before a later one of fewer turns) stays too: folded
    # into a summary of fewer turns, a rollback of those turns no longer hid its text, SPEC §4.1)
    earlier = [summary for summary in reversed(scan.earlier) if type(summary.get("uuid")) is str
               and _int(summary.get("lastSummarizedTurnId")) <= end_turn] if summarize else []
    earlier_ids = {id(summary) for summary in earlier}  # (a search of the list per summary: 16 000 took 3 s)
    outputs = _Outputs(ctx, _merge_ranges(scan.compacts), micro=micro, before_turn=current - 1)
    min_chars = candidate_min_chars(ctx)
    tokens_of = _ElidedTokens(encoding)
    targets: list[Event] = []
    full_outputs: dict[int, str] = {}
    blocks: list[str] = []
    replaces: list[str] = []
    others: list[Any] = []  # uuids of the events that stay visible and a summary could hide
    target_tokens = kept = kept_min = 0
    show = outputs.show
    count_field, encoding_field = TOKEN_COUNT_FIELD, TOKEN_ENCODING_FIELD
    # (the hot loop: locals bound, ``zip`` rather than indexing, the output read only for a tool result)
    for event, gone in zip(events, hidden):
        if gone:
            continue
        kind = event.get("type")
        if kind in _CONTEXT_KINDS:
            turn = event.get("turnId")
            if type(turn) is not int:
                turn = 0
            shown: str | None = None  # the output as shown once the compact is appended, when elided
            candidate = False  # still a micro candidate after the append
            if kind == "tool_result":
                output: Any = event.get("output")
                if isinstance(output, str) and len(output) > min_chars:
                    name = event.get("toolName")
                    shown, candidate = show(output, name if isinstance(name, str) else "", turn)
            count = event.get(count_field)
            stamped = count if type(count) is int and event.get(encoding_field) == encoding else -1
            uuid = event.get("uuid")
            if summarize and start_after < turn <= end_turn:
                if stamped < 0:
                    stamped = event_tokens(event, encoding)
                if shown is None:
                    target = event
                    target_tokens += stamped + block_tokens
                    if kind == "assistant" and type(calls := event.get("toolCalls")) is list:
                        target_tokens += call_tokens * len(calls)
                else:
                    estimate = -(-stamped * len(shown) // len(output)) + MESSAGE_OVERHEAD_TOKENS
                    target = {**event, "output": shown, TOKEN_COUNT_FIELD: estimate, TOKEN_ENCODING_FIELD: encoding}
                    full_outputs[id(target)] = output
                    target_tokens += estimate + block_tokens
                targets.append(target)
                blocks.append(render(target))
                if isinstance(uuid, str):
                    replaces.append(uuid)
                    continue  # hidden by the summary
            elif uuid is not None:
                others.append(uuid)
            if shown is not None:
                kept += tokens_of(event, shown)
            else:
                kept += stamped if stamped >= 0 else event_tokens(event, encoding)
            if candidate and (kept_min == 0 or turn < kept_min):
                kept_min = turn
        elif kind == "summary":
            uuid = event.get("uuid")
            if summarize and isinstance(uuid, str) and (event is previous or id(event) in earlier_ids):
                continue  # replaced by the new summary
            others.append(uuid)
            kept += stamped_tokens(event, encoding)
        elif kind != "rollback" and kind != "session_meta":  # never hidden by a summary
            others.append(event.get("uuid"))
    replaces.extend(summary["uuid"] for summary in (*earlier, previous)
                    if summary is not None and isinstance(summary.get("uuid"), str))
    compacted = outputs.compacted_after()
    replaced = set(replaces)
    return LlmPass(
        targets=LlmTargets(previous_summary=previous, events=targets, end_turn=end_turn, start_after=start_after,
                           full_outputs=full_outputs, earlier_summaries=earlier),
        compact_turns=outputs.compact_turns(),
        blocks=blocks,
        target_tokens=target_tokens,
        replaces=replaces if targets else [],
        encoding=encoding,
        model=scan.model,
        context_window=scan.context_window,
        current_turn_id=current,
        max_turn=scan.max_turn,
        last_ended_turn=scan.last_ended_turn,
        kept_estimate=kept,
        kept_min_candidate_turn=kept_min,
        compacted_through=compacted[-1][1] if compacted else 0,
        exact=replaced.isdisjoint(uuid for uuid in others if type(uuid) is str),
    )


class _Outputs:
    """``llm_pass``'s long tool outputs: each as shown once the micro step's compact is
    appended, and that compact's range (the turns of the candidates before ``before_turn``)."""

    __slots__ = ("ctx", "compacted", "starts", "micro", "before_turn", "keep_chars", "compactable", "low", "high")

    def __init__(
        self, ctx: ContextSettings, compacted: tuple[tuple[int, int], ...], *, micro: bool, before_turn: int,
    ) -> None:
        self.ctx = ctx
        self.compacted = compacted  # the ranges compacted before the micro step
        self.starts = [start for start, _ in compacted]
        self.micro = micro
        self.before_turn = before_turn
        self.keep_chars = ctx.micro_compact_keep_chars
        self.compactable: dict[str, bool] = {}
        self.low: int | None = None
        self.high = 0

    def show(self, output: str, name: str, turn: int) -> tuple[str | None, bool]:
        """For an output over ``microCompactMinChars``: the text shown when it is elided
        (else None), and whether it is still a micro candidate after the compact."""
        known = self.compactable.get(name)
        if known is None:
            known = self.compactable[name] = self.ctx.is_compactable(name)
        if not known:
            return None, False
        if not (self.compacted and _in_ranges(turn, self.starts, self.compacted)):
            if not self.micro or turn >= self.before_turn:
                return None, True
            if self.low is None or turn < self.low:
                self.low = turn
            if turn > self.high:
                self.high = turn
        shown = elide(output, self.keep_chars)
        return (None if shown is output else shown), False

    def compact_turns(self) -> tuple[int, int] | None:
        return None if self.low is None else (self.low, self.high)

    def compacted_after(self) -> tuple[tuple[int, int], ...]:
        """The merged compacted ranges once the micro step's compact is appended."""
        turns = self.compact_turns()
        return self.compacted if turns is None else _merge_ranges([*self.compacted, turns])
