"""The offline summarizer (model name ``extractive``): a 10-section summary without an LLM.

Used when ``context.compactionModel`` or ``context.fallbackModel`` is
``extractive`` (the fallback when the breaker is open or the LLM failed).

Invariants:
- Deterministic: the same targets and previous summary give the same text.
- The output always passes ``worker.summarize.validate_summary_text``.
- Every user message appears verbatim under *All User Messages*, in order
  (after those carried over from the previous summary), each in a fenced code
  block longer than any backtick run it holds, so no line of it can close the
  block or pose as a section heading (headings inside fences do not count).
- *Files and Code Sections* lists the paths mentioned: file names with an
  extension, absolute / ``~/`` / ``./`` paths and well-known extensionless
  names (``Makefile``, ``Dockerfile``, ...), and every tool-call argument whose
  name says path, file or dir.
- The previous summary's list-like sections (files, errors, user messages,
  pending tasks, concepts) are carried forward and merged, so nothing is lost
  across incremental compactions; its *Primary Request* is kept.
- Long items are bounded (``MAX_*``) so the summary is always much shorter
  than what it replaces, except for the user messages, which are kept whole.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import orjson

from events.tokens import arguments_json
from worker.summarize import SECTION_TITLES, split_sections

EXTRACTIVE_MODEL = "extractive"
MAX_FILES = 60
MAX_ERROR_LINES = 30
MAX_LINE_CHARS = 300
MAX_CURRENT_WORK_CHARS = 4_000
MAX_DECISIONS = 15

_PATH = re.compile(
    r"(?<![\w/.<-])((?:~|\.{1,2})?/?(?:[\w.-]+/)+[\w.-]+\.[A-Za-z0-9]{1,8}|[\w-]+\.(?:py|js|ts|tsx|jsx|"
    r"go|rs|java|rb|c|h|cpp|hpp|cs|md|json|ya?ml|toml|ini|cfg|sh|sql|html|css|txt|lock)"
    r"|(?:~|\.{1,2})?/(?:[\w.-]+/)*[\w.-]*[\w-]/?"  # absolute, home or dot-relative, no extension needed
    r"|(?:Makefile|Dockerfile|Containerfile|Procfile|Gemfile|Rakefile|Jenkinsfile|Vagrantfile|README|LICENSE))"
    r"(?![\w/])"
)
_PATH_ARGUMENT = re.compile(r"path|file|dir", re.IGNORECASE)  # a tool-call argument naming a path
_ERROR = re.compile(r"(error|exception|traceback|failed|failure|fatal|panic|fault|denied|not found|abort)",
                    re.IGNORECASE)
_DECISION = re.compile(r"\b(because|decided|instead of|so that|rather than|chose|trade-?off)\b",
                       re.IGNORECASE)
_PENDING = re.compile(r"(^\s*[-*]\s*\[ \]|\bTODO\b|\bFIXME\b)")


def extractive_summary(events: Sequence[dict[str, Any]], previous_summary: str | None) -> str:
    """The summary text (the inner text of ``<summary>``) of ``events`` folded onto ``previous_summary``."""
    previous = split_sections(previous_summary) if previous_summary else {}
    users = [_str(e.get("content")) for e in events if e.get("type") == "user"]
    assistants = [e for e in events if e.get("type") == "assistant"]
    results = [e for e in events if e.get("type") == "tool_result"]
    bodies = {
        "Primary Request": _primary_request(previous, users),
        "Key Technical Concepts": _concepts(previous, assistants),
        "Files and Code Sections": _files(previous, events),
        "Errors and Fixes": _errors(previous, results),
        "Problem Solving": _problem_solving(events, assistants, results),
        "Decision Rationale": _decisions(previous, assistants),
        "All User Messages": _user_messages(previous, users),
        "Pending Tasks": _pending(previous, events),
        "Current Work": _current_work(assistants),
        "Optional Next Step": _next_step(users),
    }
    return "\n\n".join(f"### {title}\n{bodies[title] or 'None.'}" for title in SECTION_TITLES)


def _primary_request(previous: dict[str, str], users: list[str]) -> str:
    if previous.get("Primary Request") and previous["Primary Request"] != "None.":
        return previous["Primary Request"]
    return _verbatim(users[0]) if users else ""


def _concepts(previous: dict[str, str], assistants: list[dict[str, Any]]) -> str:
    tools: Counter[str] = Counter()
    for event in assistants:
        for call in event.get("toolCalls") or []:
            if isinstance(call, dict) and call.get("name"):
                tools[str(call["name"])] += 1
    lines = _carried(previous.get("Key Technical Concepts"))
    if tools:
        used = ", ".join(f"{name} ({count}x)" for name, count in sorted(tools.items()))
        lines.append(f"- tools used: {used}")
    return "\n".join(_unique(lines))


def _files(previous: dict[str, str], events: Sequence[dict[str, Any]]) -> str:
    found: list[str] = [line[2:] for line in _carried(previous.get("Files and Code Sections"))]
    for event in events:
        for text in _texts(event):
            found.extend(match.group(1) for match in _PATH.finditer(text))
        found.extend(_path_arguments(event))
    return "\n".join(f"- {path}" for path in _unique(found)[:MAX_FILES])


def _errors(previous: dict[str, str], results: list[dict[str, Any]]) -> str:
    lines = _carried(previous.get("Errors and Fixes"))
    for event in results:
        for line in _str(event.get("output")).splitlines():
            if _ERROR.search(line):
                lines.append(f"- [{event.get('toolName', '')}] {_clip(line.strip())}")
    return "\n".join(_unique(lines)[-MAX_ERROR_LINES:])


def _problem_solving(events: Sequence[dict[str, Any]], assistants: list[dict[str, Any]],
                     results: list[dict[str, Any]]) -> str:
    turns = [e["turnId"] for e in events if isinstance(e.get("turnId"), int)]
    if not turns:
        return ""
    calls = sum(len(e.get("toolCalls") or []) for e in assistants)
    return (f"- turns {min(turns)}-{max(turns)} summarized extractively (no LLM): "
            f"{len(assistants)} assistant messages, {calls} tool calls, {len(results)} tool results.")


def _decisions(previous: dict[str, str], assistants: list[dict[str, Any]]) -> str:
    lines = _carried(previous.get("Decision Rationale"))
    for event in assistants:
        for sentence in re.split(r"(?<=[.!?])\s+|\n", _str(event.get("content"))):
            if _DECISION.search(sentence):
                lines.append(f"- {_clip(sentence.strip())}")
    return "\n".join(_unique(lines)[-MAX_DECISIONS:])


def _user_messages(previous: dict[str, str], users: list[str]) -> str:
    carried = previous.get("All User Messages", "")
    carried = "" if carried == "None." else carried
    new = [f"- message:\n{_verbatim(text)}" for text in users]
    return "\n".join(part for part in [carried, *new] if part)


def _pending(previous: dict[str, str], events: Sequence[dict[str, Any]]) -> str:
    lines = _carried(previous.get("Pending Tasks"))
    for event in events:
        if event.get("type") in ("user", "assistant"):
            for line in _str(event.get("content")).splitlines():
                if _PENDING.search(line):
                    lines.append(f"- {_clip(line.strip().lstrip('-* ').strip())}")
    return "\n".join(_unique(lines))


def _current_work(assistants: list[dict[str, Any]]) -> str:
    for event in reversed(assistants):
        content = _str(event.get("content")).strip()
        calls = [f"-> {c.get('name', '')}({_clip(arguments_json(c.get('arguments', '')))})"
                 for c in event.get("toolCalls") or [] if isinstance(c, dict)]
        if content or calls:
            text = _quote(content[:MAX_CURRENT_WORK_CHARS]) if content else ""
            return "\n".join(part for part in [text, *calls] if part)
    return ""


def _next_step(users: list[str]) -> str:
    if not users:
        return ""
    return "Continue with the most recent user request:\n" + _quote(_clip(users[-1], 1_000))


def _texts(event: dict[str, Any]) -> Iterable[str]:
    yield _str(event.get("content"))
    yield _str(event.get("output"))
    for call in event.get("toolCalls") or []:
        if isinstance(call, dict):
            yield arguments_json(call.get("arguments", ""))


def _path_arguments(event: dict[str, Any]) -> Iterable[str]:
    """The string values of an assistant's tool-call arguments named like a path (``path``, ``file_path``, ...)."""
    for call in event.get("toolCalls") or []:
        arguments = call.get("arguments") if isinstance(call, dict) else None
        if isinstance(arguments, str):
            try:
                arguments = orjson.loads(arguments)
            except orjson.JSONDecodeError:
                continue
        if isinstance(arguments, dict):
            for name, value in arguments.items():
                if isinstance(name, str) and _PATH_ARGUMENT.search(name) and isinstance(value, str):
                    path = value.strip()
                    if path and "\n" not in path:
                        yield _clip(path)


def _carried(body: str | None) -> list[str]:
    """The ``- `` items of a previous section."""
    return [line for line in (body or "").splitlines() if line.startswith("- ")]


def _verbatim(text: str) -> str:
    """``text`` exactly, in a fenced code block longer than any backtick run in it (no line of
    ``text`` can close it, and a heading inside a fence is no section heading)."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}\n{text}\n{fence}"


def _quote(text: str) -> str:
    safe = text.replace("<summary>", "&lt;summary>").replace("</summary>", "&lt;/summary>")
    return "\n".join(f"> {line}" if line else ">" for line in safe.splitlines() or [""])


def _clip(text: str, limit: int = MAX_LINE_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""
