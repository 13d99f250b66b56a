"""Checks beyond one event's schema (``events.models``), shared by every way events come in.

- ``check_json``: no value the log cannot hold as it was sent (a non-finite
  number, an integer past 64 bits, a lone surrogate): a JSON decoder may hand
  them over, and the log's encoder would change or refuse them.
- ``check_batch``: the uuid / turn order of a batch, as ``compactor.store``
  refuses it, seen from the batch alone (so a refusal is certain; what the
  batch cannot see, the store still checks).
- ``check_covered_turns``: a summary / compact covers turns that are over (the
  store's rule; ``check_past_turns`` applies it to a batch on a known session).
- ``unique_keys`` / ``json_float``: ``json.loads`` hooks that keep what a decoder
  passes over silently for ``check_json`` to refuse: a key given twice in one JSON
  object (JSON allows it, and a decoder keeps the last value), a nonzero number a
  double holds only as 0 (``1e-400``); ``json_problem`` reads a text with them
  (the watcher's slow path, where orjson also made an integer past 64 bits a float).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from events.errors import InvalidEvent
from events.models import MAX_JSON_INT, MIN_JSON_INT, TURN_SCOPED_TYPES, escaped, json_path, text_problem


class DuplicateKey(ValueError):
    """Raised by ``unique_keys``: ``key`` appears twice in one object."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object of a JSON text (``json.loads``'s ``object_pairs_hook``): JSON lets a key repeat,
    and the last value silently won (``{"cwd": "/a", "cwd": "/b"}``); DuplicateKey instead."""
    value = dict(pairs)
    if len(value) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKey(key)
            seen.add(key)
    return value


class Underflow:
    """A number the JSON text wrote as nonzero that a double holds only as 0 (``json_float``)."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def json_float(text: str) -> float | Underflow:
    """``json.loads``'s ``parse_float``: the double, or an ``Underflow`` for ``check_json`` to name
    (``1e-400`` read as 0.0 silently, as orjson reads it)."""
    value = float(text)
    if value == 0.0 and any(c in "123456789" for c in text.partition("e")[0].partition("E")[0]):
        return Underflow(text)
    return value


def json_problem(text: str | bytes, where: str) -> str | None:
    """What a strict reading of the JSON ``text`` (at ``where``) refuses, as an error message:
    a key given twice in one object, an integer past 64 bits, a nonzero number a double holds only
    as 0, a lone surrogate; None when there is none, or when ``text`` is not JSON (for the
    caller's decoder to refuse)."""
    try:
        value = json.loads(text, object_pairs_hook=unique_keys, parse_float=json_float)
    except DuplicateKey as e:
        return f"{where}: the key {e.key!r} appears twice in one object (one of its values would be dropped)"
    except (ValueError, RecursionError):
        return None
    try:
        check_json(value, (where,))
    except InvalidEvent as e:
        return str(e)
    return None


def check_json(value: object, where: Sequence[str | int] = ()) -> None:
    """Raise InvalidEvent naming the first value in ``value`` the log cannot hold as it was sent.

    A JSON decoder may hand over what JSON cannot hold (Python's reads ``NaN``, ``Infinity``
    and ``1e999``, and lone surrogate escapes such as ``"\\ud800"``); the log's encoder would
    write a non-finite number as ``null`` and refuse the rest with no field named. Iterative:
    any depth the decoder read.
    """
    if _plainly_holdable(value):
        return
    # (each value's place as a link to its container's: a path tuple per value held the depth
    # times the items, 2 GB for a 2 MB list of numbers nested 200 deep)
    stack: list[tuple[object, _Place]] = [(value, None)]
    while stack:
        item, place = stack.pop()
        problem = _value_problem(item)
        if problem is not None:
            raise InvalidEvent(escaped(json_path((*where, *_path(place)))) or "body", problem)
        if isinstance(item, dict):
            stack.extend((v, (place, k)) for k, v in reversed(item.items()))
        elif isinstance(item, (list, tuple)):
            stack.extend((v, (place, i)) for i, v in reversed(list(enumerate(item))))


_Place = tuple[Any, str | int] | None  # (the container's place, the key or index in it); None: the top


def _path(place: _Place) -> list[str | int]:
    """The keys and indexes from the top down to ``place``."""
    parts: list[str | int] = []
    while place is not None:
        place, key = place
        parts.append(key)
    return parts[::-1]


def _plainly_holdable(value: object) -> bool:
    """``check_json``'s fast pass (no paths kept): True when nothing in ``value`` needs a look
    (False sends it to the pass that finds and names the problem; so does any other type)."""
    stack: list[Any] = [value]
    pop, extend = stack.pop, stack.extend
    while stack:
        item = pop()
        kind = type(item)
        if kind is str:
            if not item.isascii() and text_problem(item) is not None:
                return False
        elif kind is dict:
            extend(item.values())
            if not all(type(k) is str and (k.isascii() or text_problem(k) is None) for k in item):
                return False
        elif kind is list:
            extend(item)
        elif kind is float:
            if not math.isfinite(item):
                return False
        elif kind is int:
            if not MIN_JSON_INT <= item <= MAX_JSON_INT:
                return False
        elif item is not None and kind is not bool:  # (an Underflow too)
            return False
    return True


def _value_problem(value: object) -> str | None:
    if isinstance(value, str):
        return text_problem(value)
    if isinstance(value, float) and not math.isfinite(value):
        return ("is not a finite number (NaN, Infinity, or past a double's range like 1e999): "
                "not valid JSON, and the log cannot hold it")
    if isinstance(value, int) and not isinstance(value, bool) and not MIN_JSON_INT <= value <= MAX_JSON_INT:
        return "is an integer outside the 64-bit range (-2^63 .. 2^64-1) the log can store"
    if isinstance(value, Underflow):
        return f"is the number {value.text}, too small for a double: it would be stored as 0"
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):  # (a Python caller's: decoded JSON has none)
                return f"has a key {key!r} that is not a string"
            if (problem := text_problem(key)) is not None:
                return f"has a key {escaped(key)!r} that {problem}"
    if not isinstance(value, _JSON_VALUES):  # a Python caller's datetime, Decimal, bytes, set, ...:
        # the log's encoder refused some with no field named, and wrote others as strings silently
        return (f"is a Python {type(value).__name__}, not a JSON value (text, a number, true/false, null, "
                "a list or an object): convert it first")
    return None


_JSON_VALUES = (str, int, float, type(None), dict, list, tuple, Underflow)  # (bool is an int)


def check_batch(events: Sequence[Mapping[str, Any]], *, new_session: bool = False) -> None:
    """Raise InvalidEvent (located at the event's index) for an event the log would refuse after
    the ones before it in ``events`` (each valid alone, as written): a ``uuid`` seen before
    (SPEC §3: unique within the session) or a turn-scoped event whose ``turnId`` is below the
    ``currentTurnId`` the events before it reached (a ``rollback`` hides the turns it undoes
    from it, SPEC §4). Events before the batch are not known here: the current turn of the
    log is never below this one, so what is refused here the log refuses too. With
    ``new_session`` (nothing before the batch), also a summary or compact past the turns
    before it (``check_covered_turns``)."""
    seen: dict[str, int] = {}
    # the visible turn-scoped events' turnIds, ascending (a turn below the current one is refused),
    # and the (currentTurnId, index that set it) after each: a rollback pops those it undoes and
    # takes the current turn left on top (copying and recounting the list at each, 20 000
    # rollbacks in one request held an API thread 19 s)
    turns: list[int] = []
    reached: list[tuple[int, int]] = []
    current, reached_at = 1, -1
    for index, event in enumerate(events):
        if new_session and event.get("type") in COVERING:
            check_covered_turns(current, event, index)
        uuid = event.get("uuid")
        if isinstance(uuid, str):
            if uuid in seen:
                raise InvalidEvent("uuid", f"{uuid!r} duplicates events[{seen[uuid]}]", index)
            seen[uuid] = index
        kind, turn = event.get("type"), event.get("turnId")
        if kind == "rollback" and isinstance(through := event.get("throughTurnId"), int):
            while turns and turns[-1] >= through:
                turns.pop()
                reached.pop()
            current, reached_at = reached[-1] if reached else (1, -1)
        elif kind in TURN_SCOPED_TYPES and isinstance(turn, int):
            if turn < current:
                raise InvalidEvent(
                    "turnId", f"goes backwards: {turn} < currentTurnId {current}, reached at events[{reached_at}]",
                    index)
            if (now := max(current, turn + 1 if kind == "turn_end" else turn)) > current:
                current, reached_at = now, index
            turns.append(turn)
            reached.append((current, reached_at))


COVERING = {"summary": "lastSummarizedTurnId", "compact": "endTurnId"}  # the last turn each event covers


def check_covered_turns(current: int, event: Mapping[str, Any], index: int | None = None) -> None:
    """A summary or compact covers turns that are over: raise InvalidEvent for one that covers
    ``current``, the session's currentTurnId before it (SPEC §3: a rollback lowers it), or a
    turn after it. A producer's ``lastSummarizedTurnId: 1000000`` left every later turn out of
    the LLM's targets for good (SPEC §5: the targets are the turns after it); a compact ahead of
    its turns elided their outputs as they came; and one of the turn still running did both to
    that turn's later events (its read_file result shown cut in the middle; its events after
    the summary never summarized, the session over its window for good)."""
    field = COVERING.get(event.get("type"))  # type: ignore[arg-type]
    covered = event.get(field) if field else None
    if field and isinstance(covered, int) and covered >= current:
        raise InvalidEvent(field, f"is past the session's turns: {covered} > {current - 1}, the last turn that is "
                                  f"over (currentTurnId {current}: a {event['type']} covers turns that are over, "
                                  f"not one still running)", index)


def check_past_turns(events: Sequence[Mapping[str, Any]], current_before: int) -> None:
    """``check_covered_turns`` for each summary/compact of ``events`` appended to a session whose
    currentTurnId is ``current_before`` (a rollback among them ends the check: what it hides is
    the store's to see)."""
    current = current_before
    for index, event in enumerate(events):
        kind, turn = event.get("type"), event.get("turnId")
        if kind == "rollback":
            return
        if kind in TURN_SCOPED_TYPES and isinstance(turn, int):
            current = max(current, turn + 1 if kind == "turn_end" else turn)
        else:
            check_covered_turns(current, event, index)


