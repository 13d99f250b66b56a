"""Benchmark: building the context view of a large log vs. just parsing it.

Writes a synthetic, stamped session log (20 MB, 10 000 events by default:
users, assistants with tool calls, 2 KB tool outputs, turn_ends, one compact
and one summary) into a temporary directory, then measures, best of N:

- ``baseline_s``: read the file and ``orjson.loads`` each line;
- ``view_s``: ``SessionLog.read`` + ``build_view``.

Runs alternate between the two, with the garbage collector paused during each
timed run, and the best of each is kept.

The target is ``ratio = view_s / baseline_s <= 3``.
"""

from __future__ import annotations

import gc
import logging
import random
import tempfile
import time
import uuid as uuidlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from events.config import ContextSettings
from events.log import SessionLog
from events.tokens import encoding_for_model, stamp
from events.view import build_view

logger = logging.getLogger(__name__)

FULL_EVENTS = 10_000
FULL_BYTES = 20 * 1024 * 1024
QUICK_EVENTS = 1_000
QUICK_BYTES = 2 * 1024 * 1024
TOOL_OUTPUT_CHARS = 2048
FULL_REPEATS = 7
QUICK_REPEATS = 3
MODEL = "gpt-4o"
CWD = "/bench/project"
SESSION_ID = "bench-view"
TOOLS = ("read_file", "execute_command", "search_code", "list_dir")
_WORDS = (
    "def return self import the value of a to in for if else class async await "
    "config token event log session turn output error test file line path cache"
).split()

Event = dict[str, Any]
Progress = Callable[[str], None]


def _text(rng: random.Random, chars: int) -> str:
    parts: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(_WORDS)
        sep = "\n" if rng.random() < 0.08 else " "
        parts.append(word + sep)
        size += len(word) + 1
    return "".join(parts)[:chars]


class _Generator:
    """Realistic turns until the target event count; text sized to hit the target bytes."""

    def __init__(self, events: int, total_bytes: int, seed: int = 7) -> None:
        self.rng = random.Random(seed)
        self.target_events = events
        per_event = total_bytes // events
        # Per turn: user, assistant(4 calls), 4 tool results, assistant, turn_end = 8 lines.
        self.text_chars = max(64, (per_event * 8 - 4 * (TOOL_OUTPUT_CHARS + 260) - 900) // 3)
        self.events: list[Event] = []
        self.pool = [_text(self.rng, TOOL_OUTPUT_CHARS) for _ in range(64)]

    def _add(self, event: Event) -> Event:
        event.setdefault("uuid", str(uuidlib.UUID(int=self.rng.getrandbits(128))))
        event.setdefault("timestamp", "2025-01-01T00:00:00.000Z")
        self.events.append(event)
        return event

    def turn(self, turn: int) -> None:
        rng = self.rng
        self._add({"type": "user", "turnId": turn, "content": _text(rng, self.text_chars)})
        calls = [
            {"id": f"call_{turn}_{i}", "name": rng.choice(TOOLS), "arguments": {"path": f"src/m{i}.py", "n": i}}
            for i in range(4)
        ]
        self._add({"type": "assistant", "turnId": turn, "content": _text(rng, self.text_chars // 2),
                   "toolCalls": calls, "usage": {"prompt": 1000, "completion": 100, "total": 1100}})
        for call in calls:
            output = rng.choice(self.pool) + f"\n# {turn}"
            self._add({"type": "tool_result", "turnId": turn, "toolCallId": call["id"],
                       "toolName": call["name"], "output": output})
        self._add({"type": "assistant", "turnId": turn, "content": _text(rng, self.text_chars), "toolCalls": []})
        self._add({"type": "turn_end", "turnId": turn, "model": MODEL, "contextWindow": 128_000})

    def build(self) -> list[Event]:
        self._add({"type": "session_meta", "sessionId": SESSION_ID, "cwd": CWD, "model": MODEL})
        turn = 0
        while len(self.events) < self.target_events - 2:
            turn += 1
            self.turn(turn)
            if turn == 300:
                self._add({"type": "compact", "startTurnId": 1, "endTurnId": 299})
            if turn == 600:
                replaced = [e["uuid"] for e in self.events
                            if e["type"] in ("user", "assistant", "tool_result") and e["turnId"] <= 200]
                self._add({"type": "summary", "replaces": replaced,
                           "summaryText": _text(self.rng, 4000), "lastSummarizedTurnId": 200})
        return self.events[: self.target_events]


def write_log(directory: Path, *, events: int, total_bytes: int) -> SessionLog:
    """Write the synthetic, stamped log and return it."""
    log = SessionLog(directory, CWD, SESSION_ID)
    encoding = encoding_for_model(MODEL)
    lines = _Generator(events, total_bytes).build()
    log.append([stamp(e, encoding) for e in lines])
    return log


def _timed(fn: Callable[[], object]) -> float:
    gc.collect()
    gc.disable()  # the same for both sides: a collection pass would land on whichever runs then
    try:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    finally:
        gc.enable()


def _best_interleaved(first: Callable[[], object], second: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Best time of each, alternating runs so a burst of machine load hits both alike."""
    best_first = best_second = float("inf")
    for _ in range(repeats):
        best_first = min(best_first, _timed(first))
        best_second = min(best_second, _timed(second))
    return best_first, best_second


def _baseline(path: Path) -> list[Any]:
    with open(path, "rb") as f:
        data = f.read()
    return [orjson.loads(line) for line in data.split(b"\n") if line]


def run(*, quick: bool = False, progress: Progress | None = None) -> dict[str, float]:
    """Measure view vs. parse time; returns ``{"view_s", "baseline_s", "ratio"}`` (and sizes)."""
    say = progress or (lambda message: None)
    events, total = (QUICK_EVENTS, QUICK_BYTES) if quick else (FULL_EVENTS, FULL_BYTES)
    repeats = QUICK_REPEATS if quick else FULL_REPEATS
    ctx = ContextSettings.model_validate({})
    with tempfile.TemporaryDirectory(prefix="compactor-bench-") as tmp:
        say(f"writing a {events}-event log")
        log = write_log(Path(tmp), events=events, total_bytes=total)
        size = log.size()
        say(f"measuring ({repeats} runs each, best kept)")
        baseline, view = _best_interleaved(lambda: _baseline(log.path), lambda: build_view(log.read(), ctx), repeats)
    result = {
        "view_s": round(view, 6),
        "baseline_s": round(baseline, 6),
        "ratio": round(view / baseline, 3),
        "events": events,  # (counts: whole numbers, as the other scenarios' are)
        "bytes": size,
    }
    logger.info("bench view: %s", result)
    return result
