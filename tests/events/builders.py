"""Small constructors for log events as plain camelCase dicts (as read from a log)."""

from __future__ import annotations

import itertools
from typing import Any

Event = dict[str, Any]
_ids = itertools.count(1)


def _uuid(prefix: str) -> str:
    return f"{prefix}-{next(_ids)}"


def user(turn: int, content: str = "hi", **extra: Any) -> Event:
    return {"type": "user", "uuid": _uuid("u"), "turnId": turn, "content": content, **extra}


def assistant(turn: int, content: str = "ok", calls: list[Event] | None = None, **extra: Any) -> Event:
    return {"type": "assistant", "uuid": _uuid("a"), "turnId": turn, "content": content,
            "toolCalls": calls or [], **extra}


def call(call_id: str, name: str = "read_file", arguments: Any = None) -> Event:
    return {"id": call_id, "name": name, "arguments": {"path": "x.py"} if arguments is None else arguments}


def result(turn: int, call_id: str, output: str = "out", name: str = "read_file", **extra: Any) -> Event:
    return {"type": "tool_result", "uuid": _uuid("r"), "turnId": turn, "toolCallId": call_id,
            "toolName": name, "output": output, **extra}


def turn_end(turn: int, model: str = "gpt-4", **extra: Any) -> Event:
    return {"type": "turn_end", "uuid": _uuid("e"), "turnId": turn, "model": model, **extra}


def rollback(through: int) -> Event:
    return {"type": "rollback", "uuid": _uuid("rb"), "throughTurnId": through, "reason": "test"}


def compact(start: int, end: int) -> Event:
    return {"type": "compact", "uuid": _uuid("c"), "startTurnId": start, "endTurnId": end}


def summary(replaces: list[str], text: str, last: int) -> Event:
    return {"type": "summary", "uuid": _uuid("s"), "replaces": replaces, "summaryText": text,
            "lastSummarizedTurnId": last}


def meta(model: str | None = None) -> Event:
    event: Event = {"type": "session_meta", "uuid": _uuid("m"), "sessionId": "s1", "cwd": "/w"}
    if model:
        event["model"] = model
    return event


def simple_turn(turn: int, text: str = "hi", output: str = "out", tool: str = "read_file") -> list[Event]:
    """user, assistant with one call, its result, a final assistant, turn_end."""
    cid = f"c{turn}-{next(_ids)}"
    return [
        user(turn, text),
        assistant(turn, "", [call(cid, tool)]),
        result(turn, cid, output, tool),
        assistant(turn, f"done {turn}"),
        turn_end(turn),
    ]
