"""worker.extractive at scale: the summaries of big messages, the same as before, in a fraction of the time.

The functions that were rewritten for speed are checked against their code as it was (the reference
copies below, verbatim, run with the module's other helpers), on seeded random texts and transcripts.
"""

from __future__ import annotations

import random
import re
import string
import sys
import time
from typing import Any

import worker.extractive as extractive
import worker.summarize as summarize
from events.tokens import DEFAULT_ENCODING, count_tokens
from worker.extractive import BOUNDS, MINIMAL_BOUNDS, TIGHT_BOUNDS, extractive_summary
from worker.summarize import SECTION_TITLES, split_sections

# The code before the rewrite, verbatim: worker/summarize.py's fence and heading reading (the functions
# calling ``_inside_fences`` too, so the whole reference reads as it did) ...
OLD_SUMMARIZE = r'''
def _headings(text: str) -> list[tuple[int, str | None]]:
    """Per line of ``text``: its index and the section title it is a heading of (None: a body
    line). A line inside a fenced code block (markdown ``` or ~~~) is never a heading."""
    lines = text.split("\n")  # (not ``splitlines``: see ``split_sections``)
    inside, _ = _inside_fences(lines)  # (a fence's opening line is no heading either: ``_heading_title``)
    return [(index, None if fenced else _heading_title(line)) for index, (line, fenced) in enumerate(zip(lines, inside))]


def fenced_line_starts(text: str) -> set[int]:
    """The offsets in ``text`` of the lines that start inside a fenced code block (the rules of
    ``_headings``): one pass, whatever the number of lines asked about."""
    lines = text.split("\n")
    inside, _ = _inside_fences(lines)
    starts, offset = set(), 0
    for line, fenced in zip(lines, inside):
        if fenced:
            starts.add(offset)
        offset += len(line) + 1
    return starts


def in_fenced_blocks(lines: list[str]) -> list[bool]:
    """Per line, whether it belongs to a fenced code block: its opening line, its content or its
    closing line (the rules of ``_headings``: a backtick line holding another backtick,
    `` ```npm install``` ``, is inline code, and one indented 4 spaces is no fence)."""
    inside, _ = _inside_fences(lines)
    return [fenced or _FENCE.match(line) is not None for line, fenced in zip(lines, inside)]


def _inside_fences(lines: list[str]) -> tuple[list[bool], str]:
    """Per line, whether it is inside a fenced code block (its closing line too; the rules of
    ``_headings``), and the fence left open after the last ("" when none)."""
    inside: list[bool] = []
    fence = ""
    for line in lines:
        inside.append(bool(fence))
        if fence:
            if _closes(line, fence):
                fence = ""
        elif opening := _FENCE.match(line):
            fence = opening.group(1)
    return inside, fence


def _section_lines(text: str, headings: list[tuple[int, str | None]]) -> list[int] | None:
    """The line of each section's heading, in ``SECTION_TITLES`` order, or None when the 10 are
    not there in order. A heading line whose title is not the next section's is body text: the
    summary quotes the user's messages, and one holding ``## Current Work`` inside *All User
    Messages* made a valid reply invalid for good (the message stays in every later job's
    targets). The headings at the level the model wrote most of them are tried first: a quoted
    ``## Pending Tasks`` among ``###`` headings is text, not section 8's heading.
    When a title is there more than once (a quote), the headings chosen leave the others, the
    quotes, in as few sections as they can (the text before the first counting as one); of
    equals, the later ones (``_quotes_together``). A quote is one block in one section: chosen
    as the first of each title, a user's ``### Pending Tasks`` ... ``### Optional Next Step``
    quoted under *All User Messages* became sections 8-10, the model's own text in the last;
    as the last of each, a pasted summary there became sections 1-7, the model's own text
    before them."""
    lines = text.split("\n")
    titled = [(index, title, _level(lines[index])) for index, title in headings if title is not None]
    levels = [level for _, _, level in titled]
    first: dict[int, int] = {}
    for index, _, level in titled:
        first.setdefault(level, index)
    # (on a tie, the level met first: the model's first heading comes before any quote in its sections; the
    # lower level won, and a pasted template of ``##`` headings as many as the model's took their place)
    usual = max(set(levels), key=lambda level: (levels.count(level), -first[level])) if levels else 0
    for candidates in ([h for h in titled if h[2] == usual], titled):
        before = [0] * (len(lines) + 1)  # before[i]: the candidate heading lines among lines[:i]
        for index, _, _ in candidates:
            before[index + 1] = 1
        for i in range(len(lines)):
            before[i + 1] += before[i]
        chosen = _quotes_together([[index for index, title, _ in candidates if title == want]
                                   for want in SECTION_TITLES], before)
        if chosen is not None:
            return chosen
    return None


def canonical_summary(text: str) -> str:
    """``text`` in the form a summary is stored in (``_canonical_headings``); SummaryInvalid
    unless it has the 10 section headings in order (``validate_summary_text``)."""
    return _canonical(text)[0]


def _canonical(text: str) -> tuple[str, list[int]]:
    """``canonical_summary``, and the line of each section's heading in ``text``."""
    headings = _headings(text)
    sections = _sections_or_invalid(text, headings)
    return _canonical_headings(text, sections, headings), sections


def _canonical_headings(text: str, sections: list[int], headings: list[tuple[int, str | None]]) -> str:
    """``text`` with each section's heading line (``sections``: ``_section_lines``) written
    ``### Title`` (``headings``: the text's ``_headings``): a summary is stored with the headings
    the prompt asked for, however the model wrote them. A heading line in a body that names a section (a quoted ``## Current
    Work``, outside a fenced block) is escaped, ``\\## Current Work``: the sections found at
    the model's level, once all at ``###``, could not be told from such a quote at that level,
    and every later reader split the summary at the quote (the rest of the section lost).
    So is any other ``###`` heading outside a fenced block (``### Notes`` after the last
    section): the summary has the 10 sections SPEC §1 fixes, not an 11th the agent reads as
    one of them; other levels stay (a model's sub-headings)."""
    lines = text.split("\n")
    changed = False
    chosen = set(sections)
    fenced = _inside_fences(lines)[0] if "#" in text else [False] * len(lines)
    for (index, title), line, inside in zip(headings, lines, fenced):
        if index not in chosen and (title is not None or (_OTHER_HEADING.match(line) and not inside)):
            at = line.index("#")
            lines[index], changed = f"{line[:at]}\\{line[at:]}", True
    for index, title in zip(sections, SECTION_TITLES):
        if lines[index] != f"### {title}":
            lines[index], changed = f"### {title}", True
    return "\n".join(lines) if changed else text


def validate_summary_text(text: str) -> list[int]:
    """The line of each section's heading (``_section_lines``); raise SummaryInvalid unless
    ``text`` has the 10 section headings in order (a heading line that is not the next section's
    is body text; headings inside fenced code blocks do not count)."""
    return _sections_or_invalid(text, _headings(text))


def _sections_or_invalid(text: str, headings: list[tuple[int, str | None]]) -> list[int]:
    """``validate_summary_text`` given the text's ``_headings``."""
    sections = _section_lines(text, headings)
    if sections is not None:
        return sections
    order = _first_headings(headings)
    missing = [title for title in SECTION_TITLES if title not in order]
    if missing:
        raise SummaryInvalid(f"summary lacks section headings: {', '.join(missing)}")
    wrong = next(i for i, (got, want) in enumerate(zip(order, SECTION_TITLES)) if got != want)
    raise SummaryInvalid(f"summary sections out of order: {order[wrong]!r} where {SECTION_TITLES[wrong]!r} "
                         "belongs (the 10 sections go in the order the prompt lists)")


def split_sections(text: str) -> dict[str, str]:
    """The body of each section of ``text`` by title, in the sections' order (SPEC §1); a heading
    repeated later, or inside a fenced code block, is part of the body it is in. Only ``\n``
    ends a line (a heading line's trailing ``\r`` is ignored): ``splitlines`` also split on
    ``\r``, ``\u2028`` and the like, and dropped them from the user messages a body quotes.
    The sections of a valid summary are ``_section_lines``'s; of another text, each title's first
    heading's."""
    lines = text.split("\n")
    headings = _headings(text)
    sections = _section_lines(text, headings)
    if sections is not None:
        return _bodies(text, sections, lines)
    bodies: dict[str, list[str]] = {}
    current: str | None = None
    for index, title in headings:
        if title is not None and title not in bodies:
            current = title
            bodies[current] = []
        elif current is not None:
            bodies[current].append(lines[index])
    return {title: _body(bodies[title]) for title in SECTION_TITLES if title in bodies}
'''

# ... and worker/extractive.py's (the functions calling the rewritten ones too: the whole summary as it was).
OLD_EXTRACTIVE = r'''
def extractive_summary(events: Sequence[dict[str, Any]], previous_summary: str | None,
                       encoding: str = DEFAULT_ENCODING, *, limit_tokens: int | None = None,
                       full_outputs: Mapping[int, str] | None = None) -> str:
    """The summary text (the inner text of ``<summary>``) of ``events`` folded onto ``previous_summary``,
    no more tokens in ``encoding`` than they are, nor than ``limit_tokens`` (see the module's
    invariants for the floor). ``full_outputs``: ``id()`` of an event shown elided -> its whole
    output, which errors are read from (``LlmTargets.full_outputs``)."""
    outputs = full_outputs or {}
    previous = split_sections(previous_summary) if previous_summary else {}
    # a previous summary in no section (a producer's free text) is carried whole, as one item
    carried: list[str | _Message] = _carried_messages(previous.get("All User Messages")) \
        if previous or not previous_summary else [_Message(previous_summary)]
    try:
        return _summary(events, previous_summary, previous, carried, encoding, limit_tokens, outputs)
    except SummaryInvalid:  # a previous summary this module did not write split where it should not be
        return _summary(events, previous_summary, {}, [_Message(previous_summary or "")], encoding, limit_tokens,
                        outputs)


def _summary(events: Sequence[dict[str, Any]], previous_summary: str | None, previous: dict[str, str],
             carried: list[str | _Message], encoding: str, limit_tokens: int | None,
             outputs: Mapping[int, str]) -> str:
    """``extractive_summary`` with the previous summary's sections (``previous``) and user
    messages (``carried``) read already."""
    users = [_str(e.get("content")) for e in events if e.get("type") == "user"]
    messages = carried + [_Message(text) for text in users]
    text = _render(_sections(events, previous, users, BOUNDS, outputs), messages)
    tokens = count_tokens(text, encoding) + MESSAGE_OVERHEAD_TOKENS
    cap = tokens if limit_tokens is None else min(tokens, limit_tokens + MESSAGE_OVERHEAD_TOKENS)
    replaced = _replaced_tokens(events, previous_summary, encoding, enough=cap)
    if tokens <= min(replaced, cap):
        return text
    # (all counted when under ``cap``: the count stops early only at it)
    budget = min(replaced, cap) - MESSAGE_OVERHEAD_TOKENS
    text = _fit(_sections(events, previous, users, TIGHT_BOUNDS, outputs), messages, budget, encoding)
    if count_tokens(text, encoding) > budget:  # (an LLM summary's lists, carried: larger than what it replaced)
        minimal = _fit(_sections(events, previous, users, MINIMAL_BOUNDS, outputs), messages, budget, encoding)
        if count_tokens(minimal, encoding) < count_tokens(text, encoding):
            text = minimal
    if limit_tokens is None or count_tokens(text, encoding) <= limit_tokens:
        return text
    return _within_limit(_sections(events, previous, users, MINIMAL_BOUNDS, outputs), messages, limit_tokens,
                         encoding)


def _sections(events: Sequence[dict[str, Any]], previous: dict[str, str], users: list[str],
              bounds: Bounds, outputs: Mapping[int, str]) -> dict[str, str]:
    """The body of every section but *All User Messages* (``outputs``: the whole outputs of the
    events shown elided, by ``id()``)."""
    assistants = [e for e in events if e.get("type") == "assistant"]
    results = [e for e in events if e.get("type") == "tool_result"]
    return {
        "Primary Request": _primary_request(previous, users, bounds),
        "Key Technical Concepts": _concepts(previous, assistants, bounds),
        "Files and Code Sections": _files(previous, events, bounds, outputs),
        "Errors and Fixes": _errors(previous, events, results, bounds, outputs),
        "Problem Solving": _problem_solving(previous, events, assistants, results, bounds),
        "Decision Rationale": _decisions(previous, assistants, bounds),
        "Pending Tasks": _pending(previous, events, bounds),
        "Current Work": _current_work(previous, assistants, bounds),
        "Optional Next Step": _next_step(previous, users, bounds),
    }


def _render(sections: dict[str, str], messages: list[str | _Message]) -> str:
    """The summary in the form it is stored in (``canonical_summary``: a heading line another
    summary's text quotes, carried, escaped), so what is counted against a budget is what is
    stored (escaped after the fit, 310 ``### a`` lines of a producer's summary carried raw took a
    summary fitted to its 1 000-token limit to 1 307). SummaryInvalid for a previous summary
    this module did not write that splits where it should not."""
    bodies = {**sections, "All User Messages": "\n".join(
        part if isinstance(part, str) else part.render() for part in messages)}
    return canonical_summary("\n\n".join(f"### {title}\n{bodies[title] or 'None.'}" for title in SECTION_TITLES))


def _replaced_tokens(events: Sequence[dict[str, Any]], previous_summary: str | None, encoding: str,
                     enough: int) -> int:
    """What the summary replaces, in SPEC §4.5 tokens (the previous summary and the events as
    shown), counted only until it reaches ``enough``: a short summary of a long transcript
    tokenizes little of it."""
    total = count_tokens(previous_summary, encoding) + MESSAGE_OVERHEAD_TOKENS if previous_summary else 0
    for event in events:
        if total >= enough:
            break
        total += event_tokens(event, encoding)
    return total


def _fit(sections: dict[str, str], messages: list[str | _Message], budget: int, encoding: str) -> str:
    """The summary with the longest user messages cut, round by round, until it fits ``budget``
    tokens or no message can be cut further (each round cuts at least one: it terminates)."""
    while True:
        text = _render(sections, messages)
        over = count_tokens(text, encoding) - budget
        if over <= 0:
            return text
        quoted = "\n".join(m.head + m.tail for m in messages if isinstance(m, _Message))
        chars_per_token = len(quoted) / max(count_tokens(quoted, encoding), 1)
        cap = _cap([m.kept for m in messages if isinstance(m, _Message)], math.ceil(over * chars_per_token))
        cut = [m.cut(cap) if isinstance(m, _Message) else m for m in messages]
        if cut == messages:
            return text
        messages = cut


def _within_limit(sections: dict[str, str], messages: list[str | _Message], limit: int, encoding: str) -> str:
    """The summary at most ``limit`` tokens when even every message cut to its floor is more: the
    sections at ``MINIMAL_BOUNDS``, each message at its floor, and the fewest oldest messages
    folded into one line that counts them (``_folded``; they stay in the session's log).

    (A rolling summary carried every user message at least ``MIN_KEPT_CHARS``: in a 4 000-token
    window it passed its 1 000-token limit after ~17 turns and reached 6 300 tokens by turn 40,
    the session over its window after every compaction.)
    """
    messages = [m.cut(MIN_KEPT_CHARS) if isinstance(m, _Message) else m for m in messages]

    def fits(sections: dict[str, str], dropped: int) -> bool:
        return count_tokens(_render(sections, _folded(messages, dropped)), encoding) <= limit

    def fewest_folded(sections: dict[str, str]) -> int | None:
        """The fewest oldest messages folded for ``sections`` to fit, None when even all do not."""
        if fits(sections, 0):
            return 0
        if not fits(sections, len(messages)):
            return None
        low, high = 0, len(messages)  # in (low, high]
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (low, middle) if fits(sections, middle) else (middle, high)
        return high

    dropped = fewest_folded(sections)
    if dropped is not None:
        return _render(sections, _folded(messages, dropped))
    # (a previous summary's long lines, carried): every line cut but fence lines, which keep the
    # sections' structure; then the least useful sections emptied, one by one, until it fits, with
    # the fewest messages folded then (all were folded, the newest too, with room to spare)
    sections = {title: "\n".join(line if _FENCE.match(line) else _clip(line, LAST_RESORT_LINE_CHARS)
                                 for line in body.split("\n"))
                for title, body in sections.items()}
    for title in (None, *_EMPTIED_FIRST):
        if title is not None:
            sections = {**sections, title: ""}
        dropped = fewest_folded(sections)
        if dropped is not None:
            return _render(sections, _folded(messages, dropped))
    return _render(sections, _folded(messages, len(messages)))


def _paths(text: str) -> list[str]:
    """The paths ``text`` names, in order (a ``file://`` URL's path too, decoded: it was dropped,
    or its basename listed; ``file:///C:/x`` is ``C:/x``)."""
    if "file://" not in text:
        return _plain_paths(text)
    found: list[str] = []
    start = 0
    for url in _FILE_URL.finditer(text):
        found += _plain_paths(text[start:url.start()])
        start = url.end()
        encoded = re.split(r"[?#]", url.group(1), maxsplit=1)[0].rstrip(".,;:!?")  # (a query, an anchor, a
        excess, end = encoded.count(")") - encoded.count("("), len(encoded)  # sentence's end, the bracket
        while excess > 0 and end and encoded[end - 1] == ")":  # closing a link around it: no part of it;
            end, excess = end - 1, excess - 1  # (x86) is. Counted once: each ")" cut off, the whole
            while end and encoded[end - 1] in ".,;:!?":  # counted again, 128 000 of them took 8 s)
                end -= 1
        encoded = encoded[:end]
        path = urllib.parse.unquote(encoded)
        if path.splitlines() != [path] or any(unicodedata.category(c) in ("Cc", "Zl", "Zp") for c in path):  # (a
            path = encoded  # %0A, %E2%80%A8: lines of its own in the section, or cut at it in the next summary)
        path = path[1:] if _DRIVE_URL_PATH.match(path) else path
        if path.strip("/."):
            found.append(path)
    return found + _plain_paths(text[start:])


def _plain_paths(text: str) -> list[str]:
    return [path for match in _PATH.finditer(text) if not _library_or_member(path := match.group(1))]


def _files(previous: dict[str, str], events: Sequence[dict[str, Any]], bounds: Bounds,
           outputs: Mapping[int, str]) -> str:
    found: list[str] = []
    ours = any(_SUMMARIZED.match(line) for line in _carried(previous.get("Problem Solving")))
    for line in _carried(previous.get("Files and Code Sections")):
        if ours:  # this module's items are paths as found (an argument's may hold spaces, start with _)
            found.append(line[2:])
            continue
        item = _unwrapped(line[2:].strip())  # another's (an LLM's) may say more around them
        found.extend([item] if _PATH.fullmatch(item) or not any(c.isspace() for c in item) else _paths(item))
    listed: set[int] = set()  # positions in ``found`` of paths only a tool's output showed
    for event in events:
        for text in _texts(event):
            found.extend(_paths(text))
        start = len(found)  # (as shown: a long listing, whole, pushed the edited files out)
        found.extend(_paths(_str(event.get("output"))))
        listed.update(range(start, len(found)))
        found.extend(_path_arguments(event))
    # the most recently named, each at its last mention: the first ones kept froze the list (a
    # rolling summary still listed turn 1's files after a hundred turns on other ones); those an
    # output alone listed take the places the others leave (a `find` of 80 paths after an edit
    # pushed the edited file out)
    last = {path: index for index, path in enumerate(found)}
    said = {path for index, path in enumerate(found) if index not in listed}  # (once is enough: an edited
    # file a later listing showed again stays an edited one)
    named = sorted((index for path, index in last.items() if path in said), reverse=True)[:bounds.files]
    rest = sorted((index for path, index in last.items() if path not in said), reverse=True)[:bounds.files - len(named)]
    return "\n".join(f"- {found[index]}" for index in sorted(named + rest))


def _errors(previous: dict[str, str], events: Sequence[dict[str, Any]], results: list[dict[str, Any]],
            bounds: Bounds, outputs: Mapping[int, str]) -> str:
    # (an item is ``[tool] `` and a line, each clipped to ``line_chars``: clipped to that whole, an error
    # that came again was listed twice, carried clipped and new whole)
    carried = _carried(previous.get("Errors and Fixes"), 2 * bounds.line_chars + 3)
    lines: list[str] = []
    shown = _content_results(events)
    wanted = {id(event) for event in results}
    for event in events:
        if event.get("type") == "user":  # an error the user pasted or quoted (SPEC §1: "with user feedback")
            lines.extend(f"- [user] {_clip(line.strip(), bounds.line_chars)}" for line in _str(event.get("content"))
                         .splitlines() if _pasted_error(line[:MAX_PASTED_ERROR_CHARS]))
            continue
        if id(event) not in wanted:
            continue
        content = _str(event.get("toolName", "")).lower() in _CONTENT_TOOLS
        command = not content and id(event) in shown
        lines_out = (outputs.get(id(event)) or _str(event.get("output"))).splitlines()
        for index, line in enumerate(lines_out):
            # (a content tool's own failure is a short output: "Error: old_string not found", "File not found";
            # a content command's, its own line: "cat: x: No such file or directory", "fatal: not a git ...",
            # and a compiler's, run before it: ``npm run build && ls dist/``)
            if (_is_error(line, content or command) or (content and len(lines_out) <= 3 and _FAILURE_SAID.match(line))
                    or (command and ((_COMMAND_SAID.match(line) and _is_error(line)) or _compiler_said(line)
                                     or _GIT_FAILED.match(line.strip())))):
                name = _clip(_one_line(_str(event.get("toolName", ""))), bounds.line_chars)
                lines.append(f"- [{name}] {_clip(line.strip(), bounds.line_chars)}")
    return "\n".join(_latest_errors(carried, lines, bounds.error_lines))


def _decisions(previous: dict[str, str], assistants: list[dict[str, Any]], bounds: Bounds) -> str:
    lines = _carried(previous.get("Decision Rationale"), bounds.line_chars)
    for event in assistants:
        for sentence in re.split(r"(?<=[.!?])\s+|\n", _str(event.get("content"))):
            if _DECISION.search(sentence):
                lines.append(f"- {_clip(_one_line(sentence), bounds.line_chars)}")  # (``\r###`` ended its line)
    return "\n".join(_latest(lines, bounds.decisions))


def _pending(previous: dict[str, str], events: Sequence[dict[str, Any]], bounds: Bounds) -> str:
    """Open checkbox items and TODO / FIXME lines of the messages (not in their fenced code: a code
    block's ``# TODO`` is the code's), less those ticked later (``[x]``), carried ones included."""
    tasks = _OpenTasks(_carried(previous.get("Pending Tasks"), bounds.line_chars))
    listed_before: set[str] = set()  # the tasks of the last todo list seen in this batch
    for event in events:
        if event.get("type") not in ("user", "assistant"):
            continue
        lines = _str(event.get("content")).splitlines()
        # (fences as the summary's own reading finds them: a toggle at any line starting ```, one of
        # inline code (```npm install```) or indented 4 spaces, hid every task after it)
        for line, fenced in zip(lines, in_fenced_blocks(lines)):
            if fenced:
                continue
            done = _DONE.match(line)
            if done:  # (it was listed open, and stayed "pending" for good)
                tasks.tick(_task(done.group(1)))
            elif _PENDING.search(line) or (event.get("type") == "user"
                                           and _PENDING_SAID.search(_INLINE_CODE.sub("", line))):
                tasks.add(f"- {_clip(line.strip().lstrip('-* ').strip(), bounds.line_chars)}")
        for todos, whole in _todo_lists(event):  # (an agent's todo list tool, Claude Code's ``TodoWrite``)
            listed = {_task(todo["content"]) for todo in todos}
            if whole:  # (a list sent whole: an item it no longer holds was dropped, and stayed pending for good;
                for task in [task for task in listed_before if task not in listed]:  # ``merge: true``, Cursor's
                    tasks.tick(task)  # update of some items, leaves the others as they are)
                listed_before = listed
            else:
                listed_before |= listed
            for todo in todos:
                if todo["status"] in _TODO_CLOSED:
                    tasks.tick(_task(todo["content"]))
                else:
                    tasks.add(f"- {_clip('[ ] ' + _one_line(todo['content']), bounds.line_chars)}")
    return "\n".join(list(tasks.items)[-bounds.pending:] if bounds.pending else [])


def _carried_messages(body: str | None) -> list[str | _Message]:
    """A previous *All User Messages* body as items: the messages this module wrote (whole or
    cut) parsed back, any other text (an LLM's) as it is."""
    body = "" if body is None or says_nothing(body) else body
    parts: list[str | _Message] = []
    end = 0
    fenced = fenced_line_starts(body)
    for match in _MESSAGE_ITEM.finditer(body):
        if match.start() in fenced:
            continue  # a look-alike inside the other text's fenced block: part of that text
        if match.group("length") is None:
            item = _Message(match.group("text"))
        else:
            item = _Message(match.group("head"), match.group("tail"), int(match.group("length").replace(",", "")))
        if item.render() == match.group(0):  # exactly as written here (an LLM's look-alike stays text)
            parts.extend([*_foreign_items(body[end:match.start()]), item])
            end = match.end()
    parts.extend(_foreign_items(body[end:]))
    return [part for part in parts if part]


def _foreign_items(text: str) -> list[str]:
    """Text another summarizer wrote (an LLM's) as items, one per list item at the start of a line
    (not in a fenced block): whole, its 40 messages were one item, folded as "1 earlier user
    message omitted" and dropped all at once though most would have fit."""
    fenced = fenced_line_starts(text)
    items, start, offset = [], 0, 0
    for line in text.split("\n"):
        if offset > start and offset not in fenced and _ITEM_START.match(line):
            items.append(text[start:offset].strip("\n"))
            start = offset
        offset += len(line) + 1
    items.append(text[start:].strip("\n"))
    return [item for item in items if item]
'''


def _reference(source: str, module: Any, **names: Any) -> dict[str, Any]:
    """The functions of ``source`` run with ``module``'s other globals (and ``names``)."""
    namespace = {**vars(module), **names}
    exec(compile("from __future__ import annotations\n" + source, f"<reference {module.__name__}>", "exec"), namespace)
    return namespace


OLD_S = _reference(OLD_SUMMARIZE, summarize)
OLD = _reference(OLD_EXTRACTIVE, extractive, **{name: OLD_S[name] for name in (
    "canonical_summary", "fenced_line_starts", "in_fenced_blocks", "split_sections")})

PIECES = [
    "word", "fix", "the", "Error:", "error", "ERROR", "FAILED", "FAIL", "failed", "0 errors", "Failures: 0", "2 errors",
    "exit code 1", "exited with status 2", "Killed", "panic:", "abort:", "Aborting", "Traceback (most recent call last):",
    "KeyError: 'id'", "ValueError", "UniqueError7", "npm ERR!", "E   assert 1", "src/a.py", "src/app/main.py",
    "C:\\x\\y.txt", "C:\\src\\app", "src\\app\\main.py", "..\\a\\b.cs", "C:/Users/me/app.py", "./a", "../b/c", "~/b",
    "~/.bashrc", "/usr/bin/env", "/", "//", "\\", ".", "..", "...", "file:///x", "file:///C:/x/y.py", "(file:///x))",
    "file:///a%20b/c%0Ad", "@scope/pkg", "@types/node", "node_modules/@types/node/index.d.ts", ".pnpm/react@18.2.0/x",
    "bar@v1.2.3/", "[id]", "app/[id]/page.tsx", "[[...slug]]", "(auth)", "app/(auth)/login/page.tsx", "+page.svelte",
    "Next.js", "console.log", "res.json", "process.py", "docs.md", "index.d.ts", ".env.local", ".gitignore",
    ".eslintrc.json", ".tmux.conf", "Makefile", "Dockerfile.dev", "README", "README.md", "LICENSE", "Gemfile.lock",
    "a.b.c", "a-b_c", "./a-b_c/", "x.py:3:5: error: bad", "./main.go:10:2: undefined: foo", "app.py:1:8: F401 unused",
    "a.c:3:5: warning: x", "src/a.ts(3,5): error TS2322", "error[E0308]", "3:5  error  no", "tests/t.py::test_ok PASSED",
    "=== RUN TestX", "--- FAIL: TestX", "ok  pkg 0.1s", "Compiling failure v0.1.8", "PASS src/x.test.js",
    "- [ ] write tests", "- [x] write tests", "1. [ ] deploy", "* [X] ~~deploy~~ ✅", "TODO: update docs", "# TODO fix",
    "FIXME(bob): x", "TO`x`DO: y", "`TODO: x`", "because", "Decided", "instead of", "rather than", "trade-off", "chose",
    "```", "```python", "````", "~~~", "```npm install```", "    ```", "### ", "### Pending Tasks", "## Current Work",
    "### All User Messages", "#### 1. Primary Request", "# heading", "> quote", "- None", "None.", "- message:",
    "CONFLICT (content)", "Automatic merge failed", "! [rejected]", "error: could not apply", "fatal: not a git repo",
    "cat: x: No such file or directory", "Permission denied", "command not found", "timed out", "Segmentation fault",
    "No errors found.", "all checks passed", "ERROR = 40", "except ValueError as error:", "Exception:", "a.b.Error:",
    "CRITICAL: disk full", "undefined reference to f", "abort trap", "cannot open x", "could not read", "unable to go",
    "CONFLICT (content): x", " ! [rejected] main", "Found 2 errors", "Cannot", "COULD NOT",
    "ErRoR", "EXİT 1", "faıled", "becauſe", "é", "名前", "файл.py", "ß/ẞ", "İ", "ǅ", "٣", "\u0301", "\U0001f600", "✔",
    "0", "42", "1.2.3", "-", "+", "@", "[", "]", "(", ")", "<", ">", "`", "*", "_", "~", ":", "::", "=", "'", "|", ";", "#",
]
# a tool's own failure, a content command's, git's (read so only in such an output: ``_output_error``)
FAILURES = ["CONFLICT (content): x", " ! [rejected] main", "Automatic merge failed", "error: could not apply 1a",
            "unable to go", "Cannot open", "could not read", "UNABLE TO x", "file not found", "No such file", "Failed",
            "Permission denied", "x.py:3:5: error: bad", "Found 2 errors", "fatal: not a git repo", "mv: x: denied",
            "cat: x: No such file or directory", "1:2  error  x", "error TS2322: x", "error[E0308]: y", "ok"]
BLANKS = [" ", " ", " ", "\n", "\n", "", "\t", "  ", "\r\n", "\r", "\u2028", "\u2029", "\u00a0", "\u3000", "\x0b",
          "\x0c", "\x1c", "\x1d", "\x1e", "\x1f", "\x85", "\u2000", "\u200b", "\ufeff", "\u202f", "\n\n", "\n   \n"]
CHARACTERS = "aZ09_./\\-+@[]()~:`#* \n\t\r\x0b\x0c\x1c\x1f\u2028\u00a0\u3000éΩ名٣\u0301İıſ"


def _text(rng: random.Random, size: int | None = None) -> str:
    """Words, paths, errors, tasks, fences and headings between blanks of all kinds, or raw characters;
    now and then a run of one piece long enough to be read apart (``extractive._PATH_SPAN``)."""
    size = rng.choice([0, 1, 2, 3, 5, 8, 12, 20, 40, 80]) if size is None else size
    if rng.random() < 0.1:
        return "".join(rng.choice(CHARACTERS) for _ in range(size * 3))
    parts = []
    for _ in range(size):
        piece = rng.choice(PIECES) + (rng.choice(PIECES) if rng.random() < 0.15 else "")
        parts += [piece * (rng.randint(2, 400) if rng.random() < 0.03 else 1),
                  rng.choice(BLANKS) if rng.random() < 0.85 else rng.choice(CHARACTERS)]
    text = "".join(parts)
    if rng.random() < 0.1:
        text = rng.choice(["\n", " ", "\t", "\n \n", "\u2028"]) * rng.randint(1, 30) + text
    return text


def _arguments(rng: random.Random) -> Any:
    kind = rng.random()
    if kind < 0.3:
        return {"command": _text(rng, rng.randint(1, 6))}
    if kind < 0.45:
        return {"path": _text(rng, 1), "content": _text(rng)}
    if kind < 0.55:
        return {"todos": [{"content": _text(rng, rng.randint(0, 3)),
                           "status": rng.choice(["pending", "completed", "in_progress", "cancelled"])}
                          for _ in range(rng.randint(0, 4))], "merge": rng.random() < 0.3}
    if kind < 0.65:
        return {"cmd": ["bash", "-lc", _text(rng, 3)]}
    return _text(rng, 4) if kind < 0.8 else {"file_path": _text(rng, 1), "nested": [_text(rng, 2), {"x": _text(rng)}]}


def _events(rng: random.Random) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    turn = rng.randint(1, 5)
    for _ in range(rng.randint(0, 7)):
        kind = rng.choice(["user", "assistant", "assistant", "tool_result", "tool_result", "call"])
        turn += rng.random() < 0.3
        if kind == "call":  # (a command and its output: one showing content reads only some lines as errors)
            command = rng.choice(["git merge main", "git push", "cat a.txt", "grep -rn x src", "pytest -x", "ls && make"])
            events += [{"type": "assistant", "turnId": turn, "content": "", "toolCalls": [
                           {"id": "k", "name": "bash", "arguments": {"command": command}}]},
                       {"type": "tool_result", "turnId": turn, "toolCallId": "k",
                        "toolName": rng.choice(["bash", "read_file", "edit"]),
                        "output": "\n".join(rng.choice(FAILURES) if rng.random() < 0.5 else _text(rng, rng.randint(1, 4))
                                            for _ in range(rng.randint(1, 4)))}]
        elif kind == "user":
            events.append({"type": "user", "turnId": turn, "content": _text(rng)})
        elif kind == "assistant":
            calls = [{"id": f"c{rng.randint(0, 3)}", "name": rng.choice(["bash", "read_file", "edit", "TodoWrite", "grep"]),
                      "arguments": _arguments(rng)} for _ in range(rng.randint(0, 2))]
            events.append({"type": "assistant", "turnId": turn, "content": _text(rng), **({"toolCalls": calls} if calls else {})})
        else:
            events.append({"type": "tool_result", "turnId": turn, "toolCallId": f"c{rng.randint(0, 3)}",
                           "toolName": rng.choice(["bash", "read_file", "grep", "run", "edit", "user"]), "output": _text(rng)})
    return events


def _transcript(rng: random.Random, summaries: list[str]) -> tuple[list[dict[str, Any]], dict[int, str], str | None]:
    """Random events, the whole outputs of some of their tool results (shown elided), a previous summary."""
    events = _events(rng)
    outputs = {id(event): _text(rng) for event in events if event["type"] == "tool_result" and rng.random() < 0.2}
    return events, outputs, _previous(rng, summaries)


def _previous(rng: random.Random, summaries: list[str]) -> str | None:
    """None, a summary written before (this module's), an LLM's (its headings as models write them) or free text."""
    kind = rng.random()
    if kind < 0.4:
        return None
    if kind < 0.65 and summaries:
        return rng.choice(summaries[-20:])
    if kind < 0.9:
        return "\n\n".join(rng.choice(["### ", "## ", "### 1. ", "### **"]) + f"{title}\n{_text(rng)}"
                           for title in SECTION_TITLES if rng.random() < 0.95)
    return _text(rng)


def _summary_like(rng: random.Random) -> str:
    """A text with the 10 headings (as models write them), their bodies holding quoted headings and fences
    (some left open), or lines of any kind."""
    def body() -> str:
        lines = []
        for _ in range(rng.randint(0, 8)):
            kind = rng.random()
            if kind < 0.55:
                lines.append(rng.choice(["text", "- item", "> q", "", " ", "a ## b", "x```y", "\\### a", "# z", "##"]))
            elif kind < 0.65:
                lines.append(rng.choice(["### ", "## ", "#### ", "### 1. ", "  ### "]) + rng.choice([*SECTION_TITLES, "Notes"]))
            elif kind < 0.9:
                fence = rng.choice(["```", "````", "~~~", "```python", "```npm install```"])
                lines.append(rng.choice(["", " ", "   ", "    "]) + fence)
                lines += [rng.choice(["text", "### " + rng.choice(SECTION_TITLES), "```", "~~~", "    ```", "## x"])
                          for _ in range(rng.randint(0, 4))]
                if rng.random() < 0.9:
                    lines.append(fence[:3] * rng.randint(1, 2) + rng.choice(["", "`", " ", "\r"]))
            else:
                lines.append(_text(rng, 2))
        return "\n".join(lines)

    if rng.random() < 0.3:
        return "\n".join(_text(rng, 3) for _ in range(rng.randint(0, 30)))
    return "\n\n".join(f"{rng.choice(['### ', '## ', '### ', '#### '])}{title}\n{body()}"
                       for title in SECTION_TITLES if rng.random() < 0.98)


def _outcome(function: Any, *arguments: Any) -> tuple[str, Any]:
    try:
        return "returned", function(*arguments)
    except Exception as error:  # (SummaryInvalid, with its message)
        return type(error).__name__, str(error)


def test_paths_are_found_as_before_in_random_texts_and_long_runs() -> None:
    rng = random.Random(1)
    pathy = ["./", "a", "-", "b_c", "/", ".", "x.py", "\\", ":", "C:", "@", "[id]", "(x)", "+", "~", "..", "README",
             "Makefile", ".env", "é", "1", "[[", "]]", "(", ")", ".js", "Next.js", "console.log", "tmux.conf", "file"]
    for _ in range(2_500):
        kind = rng.random()
        if kind < 0.5:
            text = _text(rng)
        elif kind < 0.8:
            text = "".join(rng.choice(pathy) for _ in range(rng.randint(1, 600)))
            text = text.replace(rng.choice(pathy), rng.choice(BLANKS)) if rng.random() < 0.5 else text
        else:  # (a run past ``_PATH_SPAN``: read with only the alternatives it allows)
            unit = "".join(rng.choice(pathy) for _ in range(rng.randint(1, 6)))
            text = unit * rng.randint(100, 800) + rng.choice(["", " ", "x.py", ".md", "/a", "\n"]) + unit * rng.randint(0, 300)
        text = rng.choice(["", " ", "word ", "\n"]) * rng.randint(0, 200) + text
        assert extractive._plain_paths(text) == OLD["_plain_paths"](text), text
        assert extractive._paths(text) == OLD["_paths"](text), text
    assert extractive._PATH.pattern == OLD["_PATH"].pattern  # (rebuilt from its alternatives, the same)


def test_each_section_read_once_is_as_before_at_every_bound() -> None:
    rng = random.Random(2)
    summaries: list[str] = []
    for _ in range(400):
        events, outputs, previous_summary = _transcript(rng, summaries)
        previous = split_sections(previous_summary) if previous_summary else {}
        read = extractive._read(events, outputs)
        assistants = [e for e in events if e.get("type") == "assistant"]
        results = [e for e in events if e.get("type") == "tool_result"]
        for bounds in (BOUNDS, TIGHT_BOUNDS, MINIMAL_BOUNDS):
            assert extractive._files(previous, read, bounds) == OLD["_files"](previous, events, bounds, outputs)
            assert extractive._errors(previous, read, bounds) == OLD["_errors"](previous, events, results, bounds, outputs)
            assert extractive._decisions(previous, read, bounds) == OLD["_decisions"](previous, assistants, bounds)
            assert extractive._pending(previous, read, bounds) == OLD["_pending"](previous, events, bounds)
        for enough in (1, 50, 300, 10**9):
            replaced = OLD["_replaced_tokens"](events, previous_summary, DEFAULT_ENCODING, enough)
            assert extractive._replaced_tokens(events, previous_summary, DEFAULT_ENCODING, enough) == min(replaced, enough)
        summaries.append(extractive_summary(events, previous_summary))


def test_summaries_are_as_before() -> None:
    rng = random.Random(3)
    summaries: list[str] = []
    for _ in range(500):
        events, outputs, previous_summary = _transcript(rng, summaries)
        limit = rng.choice([None, None, 20_000, 2_000, 600, 200])
        summary = extractive_summary(events, previous_summary, limit_tokens=limit, full_outputs=outputs)
        assert summary == OLD["extractive_summary"](events, previous_summary, limit_tokens=limit, full_outputs=outputs)
        summaries.append(summary)
    for text in ("\n" * 20_000, " \n" * 5_000, "word " * 20_000, "/" * 20_000, "Error: x\n" * 2_000, "a." * 10_000,
                 "./a-b_c/" * 2_000, "\u2028" * 5_000, "```\n" * 1_000, "### a\n" * 1_000, "- [ ] x\n" * 500,
                 "\x1c\x1d\x1e\x1f\x0b\x0c\n" * 1_000, "src/a.py " * 3_000, "\n" * 3_000 + "Traceback (most recent call last):"):
        events = [{"type": "user", "turnId": 1, "content": text}, {"type": "assistant", "turnId": 1, "content": text},
                  {"type": "tool_result", "turnId": 1, "toolCallId": "c", "toolName": "bash", "output": text}]
        for limit in (None, 20_000, 1_000):
            assert extractive_summary(events, None, limit_tokens=limit) == \
                OLD["extractive_summary"](events, None, limit_tokens=limit), (text[:20], limit)


def test_fences_headings_and_the_stored_form_are_read_as_before() -> None:
    rng = random.Random(4)
    for _ in range(3_000):
        text = _summary_like(rng)
        for name in ("canonical_summary", "validate_summary_text", "split_sections", "fenced_line_starts", "_headings"):
            assert _outcome(getattr(summarize, name), text) == _outcome(OLD_S[name], text), (name, text)
        for lines in (text.split("\n"), text.splitlines(), [*text.splitlines(), "a\nb", "```"]):
            assert summarize.in_fenced_blocks(lines) == OLD_S["in_fenced_blocks"](lines)
            assert summarize._inside_fences(lines) == OLD_S["_inside_fences"](lines)


def test_the_fewest_tokens_of_a_text_are_never_more_than_it_counts() -> None:
    rng = random.Random(5)
    texts = [_text(rng) for _ in range(300)] + [
        unit * count for unit in ("/", "\n", " ", "a", "é", "名", "\U0001f600", "\ud800", "\ud83d\ude00", "=", "-", "\t")
        for count in (1, 127, 128, 129, 1_000, 20_000)]
    for text in texts:
        assert extractive._fewest_tokens(text, DEFAULT_ENCODING) <= count_tokens(text, DEFAULT_ENCODING), repr(text[:20])


def test_what_the_shortcuts_take_for_granted_holds_for_every_character() -> None:
    """A path holds no blank (so each run of non-blanks is read apart); lowercased, each character is
    one, no other a line break (so positions line up) and what ``(?i)`` takes for an ASCII letter is
    that letter, but for the characters ``_UNFOLDED`` finds."""
    characters = [chr(code) for code in range(sys.maxunicode + 1)]
    blank = re.compile(r"\s")
    path = re.compile(r"[\w.\-/\\:~@\[\]()+]")  # (every character ``_PATH`` consumes)
    assert not [c for c in characters if blank.match(c) and path.match(c)]
    assert [c for c in characters if len(c.lower()) != 1] == ["\u0130"]
    assert [c for c in characters if "\n" in c.lower()] == ["\n"]
    unfolded = [c for c in characters if extractive._UNFOLDED.match(c)]
    assert unfolded == ["\u0130", "\u0131", "\u017f"]
    letters = re.compile("(?i)[a-z]")
    for c in (c for c in characters if letters.fullmatch(c)):
        assert c in unfolded or [x for x in string.ascii_lowercase if re.fullmatch(f"(?i){x}", c)] == [c.lower()]
    others = re.compile("(?i)[ !(\\]:]")  # (the hints' other characters, and digits: their own lowercase)
    assert [c for c in characters if others.fullmatch(c)] == [" ", "!", "(", ":", "]"]
    assert not [c for c in characters if re.match(r"\d", c) and c.lower() != c]


def _seconds(run: Any, times: int = 2) -> float:
    """The shortest of ``times`` runs (a noisy machine only ever adds)."""
    best = float("inf")
    for _ in range(times):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def test_a_million_blank_lines_cost_a_few_tokenizations_of_them() -> None:
    """Three messages of 1 MB of line breaks: each line was looked at by every section at every
    bound, and by the stored form's reading, 80 to 100 times the time tiktoken takes to count
    them (15-20 s); now about 8 times (the counts the fitting needs, most of it)."""
    text = "\n" * 1_000_000
    events = [{"type": "user", "turnId": 1, "content": text}, {"type": "assistant", "turnId": 1, "content": text},
              {"type": "tool_result", "turnId": 1, "toolCallId": "c", "toolName": "bash", "output": text}]
    counting = _seconds(lambda: count_tokens(text + "x", DEFAULT_ENCODING), 3)  # (a new text each time: the
    summarizing = _seconds(lambda: extractive_summary(events, None, limit_tokens=20_000))  # last one is cached)
    assert summarizing < 25 * counting, (summarizing, counting)
