"""The offline summarizer (model name ``extractive``): a 10-section summary without an LLM.

Used when ``context.compactionModel`` or ``context.fallbackModel`` is
``extractive`` (the fallback when the breaker is open or the LLM failed).

Invariants:
- Deterministic: the same targets and previous summary give the same text.
- The output always passes ``worker.summarize.validate_summary_text``.
- Every user message appears under *All User Messages*, in order (after those
  carried over from the previous summary), once (or is counted in the folded
  line, see Size), each in a fenced code block
  longer than any backtick run it holds, so no line of it can close the block
  or pose as a section heading (headings inside fences do not count). It is
  verbatim except in the one case below.
- Every other section is bounded (``Bounds``): lists keep at most so many
  items, quotes (the first user message as *Primary Request*, the last as
  *Optional Next Step*, the last assistant reply as *Current Work*) at most
  so many characters, a longer one its head and tail around a
  ``[… N characters omitted …]`` line. User messages are quoted whole only
  under *All User Messages*.
- Size: the summary is never more tokens (SPEC §4.5, in ``encoding``) than
  what it replaces (the targets as shown plus the previous summary), nor than
  ``limit_tokens`` (the compaction's limit on a summary, counted without the
  message overhead). When the
  usual bounds exceed that, the sections are rendered again with
  ``TIGHT_BOUNDS`` (``MINIMAL_BOUNDS`` when that is still larger and they are less); when even that exceeds it (what is replaced is almost all
  user messages), the longest user messages are cut to their head and tail,
  at least ``MIN_KEPT_CHARS`` of each kept, under a ``- message (elided: N of
  L characters omitted):`` item with the omitted count between the two parts.
  Only when that floor (the 10 headings, the tight sections, every message
  cut) is still larger, as for a transcript of a few short lines, is the
  summary larger than what it replaces. It is never larger than
  ``limit_tokens`` for that: past it, the sections are rendered with
  ``MINIMAL_BOUNDS`` and the fewest oldest user messages are folded into one
  ``- [N earlier user messages omitted ...]`` line, which a later summary folds
  on (the messages stay in the session's log).
- The previous summary's list-like sections (files, errors, user messages,
  pending tasks, concepts, decisions) are carried forward and merged under the
  same bounds, so nothing is lost across incremental compactions but what the
  bounds drop (an LLM's ``*``, ``+`` and numbered items and its prose lines are
  items too); each list keeps its latest items, an item that comes back at its
  latest place; its *Primary Request* is kept (quoted and elided when longer
  than the bound), and so is its *Current Work* (quoted) when the batch has
  no assistant message. Messages this module wrote are parsed back, so a rolling
  summary quotes each message once and can cut a carried one further (not
  one inside a fenced block of other text: that is the other text's quote).
  A previous summary in none of the 10 sections (a producer's free text) is
  carried whole as one message; so is any previous summary whose sections,
  carried, would make the output fail validation.
- Errors are read from the whole output of a target the micro step shows
  elided (``full_outputs``), not from what it shows (paths from what it shows:
  a long listing, whole, pushed the files edited out of the list).
"""

from __future__ import annotations

import functools
import math
import re
import unicodedata
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from events.config import EXTRACTIVE
from events.errors import SummaryInvalid
from events.tokens import (
    DEFAULT_ENCODING,
    MESSAGE_OVERHEAD_TOKENS,
    arguments_json,
    count_tokens,
    event_tokens,
    get_encoding,
)
from events.view import str_or_empty as _str
from events.view import tool_calls
from worker.summarize import (
    SECTION_TITLES,
    canonical_summary,
    fenced_line_starts,
    in_fenced_blocks,
    parts_holding,
    says_nothing,
    split_sections,
)

EXTRACTIVE_MODEL = EXTRACTIVE  # (named in events.config, which refuses a misspelling)
MAX_FILES = 60
MAX_ERROR_LINES = 30
MAX_LINE_CHARS = 300
MAX_PASTED_ERROR_CHARS = 2_000  # of a user's line, what is looked at for a pasted error (the rest: cost)
MAX_CURRENT_WORK_CHARS = 4_000
MAX_DECISIONS = 15
MAX_PENDING = 30
MAX_CONCEPTS = 15
MAX_REQUEST_CHARS = 1_000  # a user message quoted as Primary Request or Optional Next Step
MIN_KEPT_CHARS = 200  # a user message is never cut below this many characters (head + tail)


@dataclass(frozen=True, slots=True)
class Bounds:
    """How much each section but *All User Messages* keeps: items per list, characters per quote."""

    files: int = MAX_FILES
    error_lines: int = MAX_ERROR_LINES
    decisions: int = MAX_DECISIONS
    pending: int = MAX_PENDING
    concepts: int = MAX_CONCEPTS
    line_chars: int = MAX_LINE_CHARS
    request_chars: int = MAX_REQUEST_CHARS
    current_work_chars: int = MAX_CURRENT_WORK_CHARS


BOUNDS = Bounds()
TIGHT_BOUNDS = Bounds(files=20, error_lines=10, decisions=5, pending=10, concepts=5, line_chars=160,
                      request_chars=200, current_work_chars=600)
MINIMAL_BOUNDS = Bounds(files=5, error_lines=3, decisions=2, pending=3, concepts=3, line_chars=100,
                        request_chars=200, current_work_chars=300)

LAST_RESORT_LINE_CHARS = 60  # every line of a summary still over its limit is clipped to this (``_within_limit``)
# an item's text clipped by a bound (``- `` and its text of ``line_chars``) or by the last resort (the line)
_CLIPPED_LENGTHS = frozenset({MAX_LINE_CHARS, TIGHT_BOUNDS.line_chars, MINIMAL_BOUNDS.line_chars,
                              LAST_RESORT_LINE_CHARS - 2})
# a path segment's characters (SvelteKit's ``+page``), a scope's ``@`` (``node_modules/@types/node``) and a
# route's bracketed or parenthesized name (Next.js's ``app/[id]``, ``[[...slug]]``, ``(auth)``): without them
# ``app/[id]/page.tsx`` was listed as ``/page.tsx``, another path, and ``app/(auth)/login/page.tsx`` not at all.
# A path does not start with ``@`` (an agent's ``@src/app.py`` is ``src/app.py``), nor right after a ``]``, a ``)``
# (a segment bracketed otherwise is not taken for the root of the rest) or an ``@`` (each letter of
# ``@a/@a/...`` was a start, scanned to the run's end: quadratic), nor at a ``[`` or ``(`` right after
# one (each inner ``[`` of ``[[x]/[[x]/...`` was such a start); a markdown link's
# ``[src/app.py](src/app.py)`` is the path twice, without its brackets.
_SEGMENT = r"(?:[\w.+-]|(?<=[\w.+-])@(?=[\w.+-])|\[\[?[\w.+-]+\]\]?|\([\w.+-]+\))"  # (an ``@`` between
# a segment's characters too: pnpm's ``.pnpm/react@18.2.0/``, Go's ``bar@v1.2.3/``)
_DIRECTORY = rf"@?{_SEGMENT}+/"  # (a scope's ``@`` opens a segment only: anywhere in one, a run of ``@a@a``
# was scanned to its end from each of its letters)
_EXTENSIONS = (r"py|pyi|ipynb|js|mjs|cjs|ts|mts|cts|tsx|jsx|"
               r"go|rs|java|rb|c|h|cpp|cc|hpp|cs|md|mdx|rst|json|jsonc|ya?ml|toml|ini|cfg|conf|sh|bash|zsh|ps1|bat|sql|"
               r"html|css|scss|sass|less|txt|lock|vue|svelte|astro|kt|kts|swift|php|gradle|mod|sum|scala|ex|exs|dart|tf|"
               r"proto|xml|env|lua|zig|jl|pl|pm|hs|ml|mli|erl|clj|nim|cmake|graphql|gql|prisma|csv|tsv|log|patch|diff")
_DOTFILES = (r"env|gitignore|gitattributes|gitmodules|dockerignore|npmrc|nvmrc|yarnrc|prettierrc|prettierignore|"
             r"eslintrc|eslintignore|editorconfig|babelrc|bashrc|zshrc|profile|bash_profile|pylintrc|flake8|coveragerc|"
             r"python-version|node-version|tool-versions|pre-commit-config|golangci|clang-format|stylelintrc|"
             r"browserslistrc|htaccess|vimrc|tmux\.conf")
_NAMES = r"Makefile|Dockerfile|Containerfile|Procfile|Gemfile|Rakefile|Jenkinsfile|Vagrantfile|README|LICENSE"
_END = r"(?![\w/\\])"  # where a path ends
_EXTENSION_END = rf"\.[A-Za-z0-9]{{1,8}}{_END}"
# ``_PATH``'s alternatives, each with what any path it matches holds (patterns, all found in it): a stretch of
# text holding none of an alternative's is searched without it (``_plain_paths``: on a run of 4 MB of path
# characters, ``./a-b_c/...``, the alternatives that could not end there went over all of it, 70 s a summary)
_PATH_ALTERNATIVES = (
    # Windows: from a drive (C:\src\app), or relative with an extension (src\app\main.py); its
    # basename alone was listed
    (r"[A-Za-z]:\\(?:[\w.-]+\\)*[\w.-]*[\w-]\\?", (r":\\",)),
    (r"(?:\.{1,2}\\)?(?:[\w.-]+\\)+[\w.-]+\.[A-Za-z0-9]{1,8}", (r"\\", _EXTENSION_END)),
    # ... from a drive with forward slashes (C:/Users/me/app.py was listed as /Users/me/app.py: another path)
    (rf"[A-Za-z]:/(?:{_DIRECTORY})*{_SEGMENT}*[\w-]/?", (":/",)),
    (rf"(?:~|\.{{1,2}})?/?(?:{_DIRECTORY})+{_SEGMENT}+\.[A-Za-z0-9]{{1,8}}", ("/", _EXTENSION_END)),
    # a bare name, dotted ones too (``app.component.ts``, ``index.d.ts``; a framework's, ``Next.js``, is
    # dropped: ``_paths``)
    (rf"[\w-]+(?:\.[\w-]+)*\.(?:{_EXTENSIONS})", (rf"\.(?:{_EXTENSIONS}){_END}",)),
    # a known dotfile (``.env.local``, ``.gitignore``, ``.eslintrc.json``)
    (rf"\.(?:{_DOTFILES})(?:\.[\w-]+)*", (rf"\.(?:{_DOTFILES})",)),
    (rf"(?:~|\.{{1,2}})?/(?:{_DIRECTORY})*{_SEGMENT}*[\w-]/?", ("/",)),  # absolute, home or dot-relative, no
    # extension needed (``Dockerfile.dev`` was listed as ``Dockerfile``: another file)
    (rf"(?:{_NAMES})(?:\.[\w-]+)?", (_NAMES,)),
)
_PATH_NEEDS = tuple(tuple(re.compile(need) for need in needs) for _, needs in _PATH_ALTERNATIVES)


@functools.cache
def _path_pattern(kept: tuple[bool, ...]) -> re.Pattern[str]:
    """``_PATH`` with only the alternatives ``kept`` says (one flag per ``_PATH_ALTERNATIVES``)."""
    return re.compile(r"(?<![\w/.<\\+\])@-])(?!(?<=[\[(])[\[(])@?(?!@)("
                      + "|".join(alternative for (alternative, _), keep in zip(_PATH_ALTERNATIVES, kept) if keep)
                      + ")" + _END)


_ALL = (True,) * len(_PATH_ALTERNATIVES)
_PATH = _path_pattern(_ALL)

# names that look like a file's but are a library's (checked on a match: a lookahead cost every position)
_FRAMEWORKS = frozenset(f"{name.lower()}.js" for name in (
    "Node Next Nuxt Vue Express Three Chart Ember Backbone Alpine Solid Nest React Angular Svelte Socket Moment "
    "Anime Pixi Phaser Leaflet Video Day Reveal Deno Bun Preact Lit Ext Knockout Meteor Marionette Handlebars "
    "Mustache Raphael Paper Fabric Matter Cannon Babylon Tone Howler Chroma Popper Hammer Immutable Sails Koa "
    "Hapi Feathers Redux Mobx Gatsby Remix Astro Qwik D3 Discord P5 PDF Highlight TensorFlow Ethers Web3").split())
# ... and code a tool call wrote, a member of an object (``console.log``, ``res.json``, ``np.log``)
_RECEIVERS = frozenset("console process res req resp np window document this self import ctx r e err docs".split())
# (not ``app``, ``request``, ``json``, ``os``: the stems of files too; and a receiver's name before a source
# file's extension is a file: ``process.py``, ``docs.md``)
_SOURCE_EXTENSIONS = frozenset("py pyi ipynb js mjs cjs ts mts cts tsx jsx go rs java rb c h cpp cc hpp cs md mdx rst "
                               "kt kts swift php scala ex exs dart vue svelte astro lua zig jl pl pm hs ml erl clj "
                               "nim sh bash zsh ps1 sql html css scss sass less txt yml yaml toml ini cfg".split())


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
    """``_PATH``'s paths in ``text`` (no ``file://`` URL in it), libraries and members aside. Only the runs
    of non-blanks holding what a path holds (``_PATH_ALTERNATIVES``: a ``/``, ``\\``, ``.`` or a name) are
    searched, a stretch of ``_PATH_SPAN`` characters from each at a time, with only the alternatives the
    stretch allows: ``_PATH`` matches no blank, and its look-arounds read a blank as the text's start or
    end (each word was a start tried for every alternative, 0.3 s a megabyte at each rendering)."""
    hint = _PATH_OR_NAME_HINT if "file" in text or "README" in text or "LICENSE" in text else _PATH_HINT
    found: list[str] = []
    end = 0
    while (hinted := hint.search(text, end)) is not None:
        at = hinted.start()
        run = _RUN_START.search(text, max(end, at - _PATH_SPAN), at) or _RUN_START.search(text, end, at)
        assert run is not None  # (``end`` is the text's start or a blank)
        start = run.start()
        blank = _BLANK.search(text, max(hinted.end(), start + _PATH_SPAN))
        end = blank.start() if blank else len(text)
        kept = _ALL if end - start < _PATH_SPAN else tuple(  # (a short text: looked at whole)
            all(need.search(text, start, end) for need in needs) for needs in _PATH_NEEDS)
        if any(kept):  # (with none, the pattern would match nothing at all: an empty path)
            found += [path for match in _path_pattern(kept).finditer(text, start, end)
                      if not _library_or_member(path := match.group(1))]
    return found


_PATH_HINT = re.compile(r"[/\\.]")  # what every path but a bare name of ``_NAMES`` holds
_PATH_OR_NAME_HINT = re.compile(rf"[/\\.]|{_NAMES}")  # (each name holds "file", "README" or "LICENSE")
_RUN_START = re.compile(r"(?<!\S)\S*\Z")  # (with the position of a character of a run as the end: the run's start)
_BLANK = re.compile(r"\s")
_PATH_SPAN = 1_024  # (the least read from a run holding a hint: a search per hint, and per stretch the look
# for each alternative's needs, cost more than they saved in a dense listing)


_FILE_URL = re.compile(r"\bfile://(?:localhost)?(/[^\s\"'<>`\[\]{}|]+)")  # its path, up to a blank or a quote
_DRIVE_URL_PATH = re.compile(r"/[A-Za-z]:/")


def _library_or_member(path: str) -> bool:
    """Whether a bare name ``_PATH`` found is a library's (``Next.js``) or code's (``console.log``)."""
    if "/" in path or "\\" in path:
        return False
    lowered = path.lower()
    stem, _, extension = lowered.rpartition(".")
    return lowered in _FRAMEWORKS or (stem.split(".", 1)[0] in _RECEIVERS and extension not in _SOURCE_EXTENSIONS)


_PATH_ARGUMENT = re.compile(r"path|file|dir", re.IGNORECASE)  # a tool-call argument naming a path
# (and the failure lines of test runners and build tools that say none of those words: go test's
# ``--- FAIL:`` and ``FAIL``, jest's ``FAIL``, npm's ``npm ERR!``, pytest's ``E   ...``, an exit status)
# Whole words (``default`` held "fault", ``on_failure`` "failure": 9 lines of a 10-line config were
# errors), an exception's name, and the runners' markers; a line saying none failed is none
# (``42 passed, 0 errors``, ``No errors found.``) unless it counts some that did.
_ERROR = re.compile(r"(?i:\b(?:errors?|exception|traceback|failed|failures?|fatal|panicked|segmentation fault|"
                    r"(?:permission|access|is) denied|(?:file|command|module|\w+:) not found|abort trap|aborted|"
                    r"timed out|undefined reference|no such file or directory)\b)|^\s*panic:|^abort:|^Aborting\b"
                    r"|\bFAIL\b|\bERR!|^E {2,}\S|(?i:\bexit(?:ed)?(?: with)? (?:status|code):? [1-9])|^Killed$")
# A compiler's or a linter's diagnostic, ``path:line:column: message`` (go's ``./main.go:10:2: undefined:
# foo``, ruff's ``app.py:1:8: F401 ...``, gcc's ``a.c:3:5: error: ...``), not a warning or a note: none
# of go's and the linters' say "error". (A grep's hits have no column.)
_DIAGNOSTIC = re.compile(r"^\s*[^\s:]+\.\w+:\d+:\d+: (?!(?:warning|note|info|hint)\b)\S")
_CAPITAL_WORD = re.compile(r"\b[A-Z]\w*+")  # (an exception's name, ``KeyError``, ``UniqueError7``: checked in code,
# as ``\b[A-Z]\w*(?:Error|Exception)`` took one long word's every "Error" for a new start: 30 s on 200 kB)
# (``Errors: 0``, ``{"failures": []}``: every passing Maven test class prints ``Failures: 0, Errors: 0``)
_NONE_FAILED = re.compile(r"(?i)\b(?:0|no|zero) (?:errors?|failures?|failed)\b|\ball checks passed\b|"
                          r"\bwithout (?:any )?errors?\b|\b(?:errors?|failures?|failed)\"?\s*[:=]\s*(?:0|\[\])"
                          r"(?=\s*+(?:[,;}\])(]|\.?\s*+$|\.\s|(?<=\s)[A-Za-z]+\s*+[:=]\s*+\d))")  # (possessive: the blanks
# overlapped, and a run of 20 000 after "Failures: 0" took 4 s)
# (a count of none: the line ends, or a list of counts goes on; "Error: 0 is not a valid port number",
# "error: 0 files matched, aborting" are errors)
_SOME_FAILED = re.compile(r"(?i)\b[1-9]\d* (?:errors?|failures?|failed)\b|\b(?:errors?|failures?|failed)\"?\s*[:=]\s*[1-9]")
# In what a file-content tool returns (a file read, a search's hits, a page), only a line that is an
# error as a program prints it: code's ``except ValueError as error:`` (a grep's 40 hits) pushed
# the real failures out of the section. (A constant, ``FAILED = "failed"``, ``ERROR = 40``, is none.)
_ERROR_PRINTED = re.compile(r"^\s*(?:Traceback \(most recent call last\)|(?:[A-Za-z_][\w.]*)?(?:Error|Exception)(?::|$)"
                            r"|(?:FATAL|ERROR|CRITICAL|FAILED)\b(?!\s*=)|panic:|Segmentation fault|E {2,}\S|npm ERR!)")
# an error a user pasted: a traceback's first line, a named exception (``KeyError: 'id'``), a panic; not
# a line of prose starting with ERROR, FAILED or Exception: (``FAILED payments must be retried``)
_USER_PASTED_ERROR = re.compile(r"^\s*(?:Traceback \(most recent call last\)|(?!(?:Error|Exception)\b)[A-Za-z_][\w.]*"
                                r"(?:Error|Exception)(?::|$)|panic:|Segmentation fault|npm ERR!)")
# a compiler's diagnostic quoted in prose (``tsc says src/a.ts(3,5): error TS2322``; not a count, "Found 2
# errors in the docs")
_DIAGNOSTIC_SAID = re.compile(r"\berror\[E?\d+\]|\berror TS\d+|^\S+:\d+(?::\d+)?: error\b|^\s*\d+:\d+\s+error\s")
_FAILURE_SAID = re.compile(r"(?i)[ \t]*+(?:error\b|failed\b|file not found|no such file|permission denied|"
                           r"access denied|cannot\b|could not\b|unable to\b)")  # (a tool saying it failed)
_CONTENT_TOOLS = frozenset({"read_file", "search_code", "search_files", "web_search", "fetch_url", "write_file",
                            "edit_file", "read", "grep", "glob", "webfetch", "websearch", "write", "edit",
                            "multiedit", "notebookread", "view", "cat", "open_file", "str_replace_editor"})
# A command whose output is content (a file's, a search's hits, a history), not a run's: only an
# error as printed counts there (``git log``'s "Add retry on failure", ``grep``'s code lines)
_CONTENT_COMMAND = re.compile(r"(?:grep|egrep|fgrep|rg|ag|ack|cat|bat|less|more|head|tail|sed|awk|nl|wc|ls|find|fd|"
                              r"tree|git\s+(?:log|show|diff|grep|blame|status|commit|checkout|switch|pull|merge|push|"
                              r"add|stash|branch|fetch|rebase))\b")  # (git's own chatter: "[main 1a2b] Fix TypeError")
_COMMAND_PREFIX = re.compile(r"(?:\w+=\S*\s+)*(?:(?:sudo|env|command|exec|time|nice)\s+)*")  # (``GIT_PAGER=cat``)
# a command that prints nothing of a run's (``cd repo``, ``|| true``, ``; echo done``)
_NEUTRAL = re.compile(r"(?:true|false|:|echo|printf|exit|cd|pushd|popd|export|set|unset|alias|test|\[|\[\[|"
                      r"pwd|mkdir|touch|sleep|which|type|clear|cp|mv|rm|rmdir|ln|chmod|chown|chgrp)(?:\s|$)"  # (quiet
                      # file commands: ``cp a b && cat b`` is content; their own failures are ``_COMMAND_SAID``'s)
                      # (``source`` of a script runs it, but one setting up its shell does not: a venv's activate,
                      # nvm.sh, an env or rc file, named by its file name: ``source run_env_tests.sh`` runs tests)
                      r"|(?:source|\.)\s+[\"']?(?:\S*/)?(?:activate(?:\.\w+)?|nvm\.sh|\.?\w*env(?:\.\w+)?|\.?\w+rc)[\"']?(?:\s|$)")
_GIT_OPTIONS = re.compile(r"git\s+(?:(?:-C|-c|--git-dir|--work-tree)\s+\S+\s+|--no-pager\s+|-P\s+)+")
_COMMAND_ARGUMENT = ("command", "cmd", "script", "commandLine", "shell_command")
_SHELLS = frozenset({"sh", "bash", "zsh", "dash", "ksh"})
# a test runner's verbose success (``tests/error/test_x.py::test_ok PASSED``) is no error for the words it holds
_PASSED = re.compile(r"::[^\s:]*+(?:\s+\.\.\.)?\s+(?:PASSED|SKIPPED|XFAIL|XPASS|ok)\b|^\s*(?:=== (?:RUN|PAUSE|CONT)\s"
                     r"|--- (?:PASS|SKIP):|ok\s+\S+\s+(?:[\d.]+s|\(cached\))\s*$|PASS\s|(?:Compiling|Checking|Downloaded|Fresh)\s+\S+"
                     r"\s+v\d)|\s\.+\s+\[\s*\d+%\]$")  # (go's, cargo's ``Compiling failure v0.1.8``,
# cargo's ``test x::y ... ok``, jest's ``PASS``, pytest's ``file.py ....  [ 50%]``; possessive, and no ``:``
# in it: ``\S*`` ran to the end of a run of 50 000 ``::`` from each: 40 s)
_DECISION = re.compile(r"\b(because|decided|instead of|so that|rather than|chose|trade-?off)\b",
                       re.IGNORECASE)
# An open checkbox item, or a TODO / FIXME that says what (``TODO: x``, ``FIXME(bob): x``): prose that
# names them ("I removed every TODO and FIXME comment") is no task; in an assistant's message only at a
# line's start ("... so no TODO: markers remain." was a task), and none in inline code (`` `# TODO: x` ``).
_PENDING = re.compile(r"^[ \t]*+(?:[-*]|\d{1,3}[.)])[ \t]*+\[ \]"
                      r"|^[ \t]*+(?:(?:#|//|--|\*|-)[ \t]*+)?(?:TODO|FIXME)\b[ \t:-]++\S")  # (possessive: a line of
# 60 000 blanks took a roll 65 s, each blank a start for the optional marker's blanks)
_PENDING_SAID = re.compile(r"\b(?:TODO|FIXME)(?:\(\w*\))?:")  # (a user's "... and TODO: update the docs")
_INLINE_CODE = re.compile(r"`[^`\n]*`")
# a checkbox ticked: the same task's open item is done (``- [x] x``, ``1. [X] ~~x~~ ✅``)
_DONE = re.compile(r"^\s*(?:[-*]|\d{1,3}[.)])\s*\[[xX]\]\s*(.+)")
_DONE_MARKS = ("✅", "✔️", "✔", "✓", "☑️", "☑", "(done)", "(fixed)", "(completed)")  # at a ticked task's end
_DONE_MARKS_REVERSED = re.compile("(?: *(?:" + "|".join(re.escape(mark[::-1]) for mark in _DONE_MARKS) + "))+")


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
    read = _read(events, outputs)
    try:
        return _summary(events, previous_summary, previous, carried, encoding, limit_tokens, read)
    except SummaryInvalid:  # a previous summary this module did not write split where it should not be
        return _summary(events, previous_summary, {}, [_Message(previous_summary or "")], encoding, limit_tokens,
                        read)


def _summary(events: Sequence[dict[str, Any]], previous_summary: str | None, previous: dict[str, str],
             carried: list[str | _Message], encoding: str, limit_tokens: int | None, read: _Read) -> str:
    """``extractive_summary`` with the previous summary's sections (``previous``) and user
    messages (``carried``), and the events (``read``), read already."""
    users = [_str(e.get("content")) for e in events if e.get("type") == "user"]
    messages = carried + [_Message(text) for text in users]
    counter = _Counter(encoding)
    text = _render(_sections(events, previous, users, BOUNDS, read), messages)
    if limit_tokens is not None and _fewest_tokens(text, encoding) > limit_tokens:  # (over the cap: not
        tokens, cap = None, limit_tokens + MESSAGE_OVERHEAD_TOKENS  # counted, a message of 4 MB took seconds)
    else:
        tokens = counter(text) + MESSAGE_OVERHEAD_TOKENS
        cap = tokens if limit_tokens is None else min(tokens, limit_tokens + MESSAGE_OVERHEAD_TOKENS)
    replaced = _replaced_tokens(events, previous_summary, encoding, enough=cap)
    if tokens is not None and tokens <= replaced:
        return text
    # (all counted when under ``cap``: the count stops early only at it)
    budget = replaced - MESSAGE_OVERHEAD_TOKENS
    text = _fit(_sections(events, previous, users, TIGHT_BOUNDS, read), messages, budget, counter)
    if not _within(text, budget, counter):  # (an LLM summary's lists, carried: larger than what it replaced)
        minimal = _fit(_sections(events, previous, users, MINIMAL_BOUNDS, read), messages, budget, counter)
        if counter(minimal) < counter(text):
            text = minimal
    if limit_tokens is None or _within(text, limit_tokens, counter):
        return text
    return _within_limit(_sections(events, previous, users, MINIMAL_BOUNDS, read), messages, limit_tokens,
                         counter)


def _sections(events: Sequence[dict[str, Any]], previous: dict[str, str], users: list[str],
              bounds: Bounds, read: _Read) -> dict[str, str]:
    """The body of every section but *All User Messages* (``read``: what they take from the events
    whatever the bounds)."""
    assistants = [e for e in events if e.get("type") == "assistant"]
    results = [e for e in events if e.get("type") == "tool_result"]
    return {
        "Primary Request": _primary_request(previous, users, bounds),
        "Key Technical Concepts": _concepts(previous, assistants, bounds),
        "Files and Code Sections": _files(previous, read, bounds),
        "Errors and Fixes": _errors(previous, read, bounds),
        "Problem Solving": _problem_solving(previous, events, assistants, results, bounds),
        "Decision Rationale": _decisions(previous, read, bounds),
        "Pending Tasks": _pending(previous, read, bounds),
        "Current Work": _current_work(previous, assistants, bounds),
        "Optional Next Step": _next_step(previous, users, bounds),
    }


@dataclass(frozen=True, slots=True)
class _Read:
    """What the sections take from the events whatever the bounds, read once: the sections are
    rendered at up to four bounds, and each rendering read every message again (a transcript of
    three 4 MB messages took a minute)."""

    paths: list[str]  # the paths named, in order (``_files``)
    listed: set[int]  # the positions in ``paths`` of those only a tool's output showed
    errors: list[tuple[str | None, str]]  # (the tool's name, on one line, None for the user's; the error line,
    # stripped): each at its last place (the sections keep the latest of each)
    decisions: list[str]  # the sentences giving a reason, on one line, each at its last place
    tasks: list[tuple[bool, str]]  # in order, a task ticked (True, its ``_task``) or an item added (False, its text)


def _read(events: Sequence[dict[str, Any]], outputs: Mapping[int, str]) -> _Read:
    """The events read for the sections (``outputs``: the whole outputs of the events shown elided,
    by ``id()``)."""
    paths, listed = _read_paths(events)
    return _Read(paths, listed, _read_errors(events, outputs), _read_decisions(events), _read_tasks(events))


class _Counter:
    """``count_tokens`` in one encoding for one summary, the last texts' counts kept: a summary counts
    the same rendering, or the same message, more than once (0.2 s each time for a 1 MB path listed
    whole)."""

    def __init__(self, encoding: str) -> None:
        self.encoding = encoding
        self._counted: list[tuple[str, int]] = []

    def __call__(self, text: str) -> int:
        count = next((count for counted, count in self._counted if counted == text), None)
        if count is None:
            count = count_tokens(text, self.encoding)
            self._counted = [(text, count), *self._counted[:5]]
        return count


def _within(text: str, limit: int, counter: _Counter) -> bool:
    """Whether ``text`` is at most ``limit`` tokens (not counted when it cannot be: ``_fewest_tokens``)."""
    return _fewest_tokens(text, counter.encoding) <= limit and counter(text) <= limit


def _fewest_tokens(text: str, encoding: str) -> int:
    """The fewest tokens ``text`` can count (``count_tokens``): every token of ``encoding`` is at most
    so many bytes, and every character at least one (a lone surrogate, replaced, three)."""
    return -(-len(text) // _longest_token(encoding))


@functools.cache
def _longest_token(encoding: str) -> int:
    """The most bytes a token of ``encoding`` stands for (128 in cl100k_base and o200k_base)."""
    return max(map(len, get_encoding(encoding).token_byte_values()))


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
    shown), or ``enough`` when that is less, counted only until it reaches ``enough``: a short summary
    of a long transcript tokenizes little of it (nor any of a text long enough to reach it alone)."""
    total = 0
    if previous_summary:
        if _fewest_tokens(previous_summary, encoding) + MESSAGE_OVERHEAD_TOKENS >= enough:
            return enough
        total = count_tokens(previous_summary, encoding) + MESSAGE_OVERHEAD_TOKENS
    for event in events:
        if total >= enough:
            break
        # (``event_tokens``: its text's tokens, the message's overhead, and for some more)
        field = _COUNTED_TEXT.get(_str(event.get("type")))
        if field and total + _fewest_tokens(_str(event.get(field)), encoding) + MESSAGE_OVERHEAD_TOKENS >= enough:
            return enough
        total += event_tokens(event, encoding)
    return min(total, enough)


_COUNTED_TEXT = {"user": "content", "assistant": "content", "tool_result": "output", "summary": "summaryText"}


def _fit(sections: dict[str, str], messages: list[str | _Message], budget: int, counter: _Counter) -> str:
    """The summary with the longest user messages cut, round by round, until it fits ``budget``
    tokens or no message can be cut further (each round cuts at least one: it terminates)."""
    while True:
        text = _render(sections, messages)
        if all(m.kept <= MIN_KEPT_CHARS for m in messages if isinstance(m, _Message)):  # (none left to cut: it
            return text  # fits or not, this is it; a count of a 4 MB path listed whole took seconds)
        over = counter(text) - budget
        if over <= 0:
            return text
        quoted = "\n".join(m.head + m.tail for m in messages if isinstance(m, _Message))
        chars_per_token = len(quoted) / max(counter(quoted), 1)
        cap = _cap([m.kept for m in messages if isinstance(m, _Message)], math.ceil(over * chars_per_token))
        cut = [m.cut(cap) if isinstance(m, _Message) else m for m in messages]
        if cut == messages:
            return text
        messages = cut


def _within_limit(sections: dict[str, str], messages: list[str | _Message], limit: int, counter: _Counter) -> str:
    """The summary at most ``limit`` tokens when even every message cut to its floor is more: the
    sections at ``MINIMAL_BOUNDS``, each message at its floor, and the fewest oldest messages
    folded into one line that counts them (``_folded``; they stay in the session's log).

    (A rolling summary carried every user message at least ``MIN_KEPT_CHARS``: in a 4 000-token
    window it passed its 1 000-token limit after ~17 turns and reached 6 300 tokens by turn 40,
    the session over its window after every compaction.)
    """
    messages = [m.cut(MIN_KEPT_CHARS) if isinstance(m, _Message) else m for m in messages]

    def fits(sections: dict[str, str], dropped: int) -> bool:
        return _within(_render(sections, _folded(messages, dropped)), limit, counter)

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


_FENCE = re.compile(r"[ \t]*(`{3,}|~{3,})")  # a line that opens or closes a fenced block
_EMPTIED_FIRST = ("Key Technical Concepts", "Decision Rationale", "Problem Solving", "Errors and Fixes",
                  "Files and Code Sections", "Pending Tasks", "Current Work", "Optional Next Step",
                  "Primary Request")


_FOLDED = re.compile(r"- \[(?P<count>[\d,]+) earlier user messages? omitted to keep this summary within its "
                     r"limit: they are in the session's log\]")


def _folded(messages: list[str | _Message], dropped: int) -> list[str | _Message]:
    """``messages`` with the first ``dropped`` replaced by one line counting them (a folded line
    among them counts what it counted; other text, an LLM summary's, counts as one)."""
    if dropped == 0:
        return messages
    count = 0
    for item in messages[:dropped]:
        match = _FOLDED.fullmatch(item) if isinstance(item, str) else None
        count += int(match.group("count").replace(",", "")) if match else 1
    line = (f"- [{count:,} earlier user message{'' if count == 1 else 's'} omitted to keep this summary "
            f"within its limit: they are in the session's log]")
    return [line, *messages[dropped:]]


def _cap(sizes: list[int], need: int) -> int:
    """The largest per-message size (at least ``MIN_KEPT_CHARS``) that cuts ``need`` characters
    from messages of ``sizes``; ``MIN_KEPT_CHARS`` when even that cuts less."""
    def cut_at(cap: int) -> int:
        return sum(size - cap for size in sizes if size > cap)

    low, high = MIN_KEPT_CHARS, max(sizes, default=0)
    if high <= low or cut_at(low) < need:
        return low
    while high - low > 1:  # cut_at(low) >= need > cut_at(high)
        middle = (low + high) // 2
        low, high = (middle, high) if cut_at(middle) >= need else (low, middle)
    return low


@dataclass(frozen=True, slots=True)
class _Message:
    """A user message under *All User Messages*: whole (``tail`` empty), or its head and tail
    with the middle of its ``length`` characters omitted."""

    head: str
    tail: str = ""
    length: int = -1

    def __post_init__(self) -> None:
        if self.length < self.kept:
            object.__setattr__(self, "length", self.kept)

    @property
    def kept(self) -> int:
        return len(self.head) + len(self.tail)

    def render(self) -> str:
        omitted = self.length - self.kept
        if not omitted:
            return f"- message:\n{_verbatim(self.head + self.tail)}"
        return (f"- message (elided: {omitted:,} of {self.length:,} characters omitted):\n{_verbatim(self.head)}\n"
                f"[… {omitted:,} characters omitted …]\n{_verbatim(self.tail)}")

    def cut(self, keep: int) -> _Message:
        """This message with at most ``keep`` characters kept, half from its head, half from its tail."""
        if keep >= self.kept:
            return self
        if self.length == self.kept:
            text = self.head + self.tail
            return _Message(text[:keep - keep // 2], text[len(text) - keep // 2:], self.length)
        tail = min(max(keep // 2, keep - len(self.head)), len(self.tail))
        return _Message(self.head[:keep - tail], self.tail[len(self.tail) - tail:], self.length)


_WHOLE_ITEM = r"- message:\n(?P<fence>`{3,})\n(?P<text>.*?)\n(?P=fence)$"
_ELIDED_ITEM = (r"- message \(elided: [\d,]+ of (?P<length>[\d,]+) characters omitted\):\n"
                r"(?P<head_fence>`{3,})\n(?P<head>.*?)\n(?P=head_fence)\n\[… [\d,]+ characters omitted …\]\n"
                r"(?P<tail_fence>`{3,})\n(?P<tail>.*?)\n(?P=tail_fence)$")
_MESSAGE_ITEM = re.compile(rf"^(?:{_WHOLE_ITEM}|{_ELIDED_ITEM})", re.MULTILINE | re.DOTALL)


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


_ITEM_START = re.compile(r"(?:[-*+]|\d{1,3}[.)])\s")  # a list item's first line


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


def _primary_request(previous: dict[str, str], users: list[str], bounds: Bounds) -> str:
    carried = previous.get("Primary Request", "None.")
    if not says_nothing(carried):  # (exactly "None." it was: an indented or "- None" one was carried)
        if len(carried) <= bounds.request_chars:
            return carried
        return _quote(_elide(_unquoted(carried), bounds.request_chars))
    return _quote(_elide(users[0], bounds.request_chars)) if users else ""


def _concepts(previous: dict[str, str], assistants: list[dict[str, Any]], bounds: Bounds) -> str:
    tools: Counter[str] = Counter()
    lines = []
    for line in _carried(previous.get("Key Technical Concepts"), bounds.line_chars, whole=_TOOLS_USED):
        items = line[len(_TOOLS_USED):].split(", ")
        if items and (_MORE_TOOLS.fullmatch(items[-1]) or items[-1].endswith("...")):
            items = items[:-1]  # (an old ``+K more``, counting nothing, or a tail a tighter bound clipped)
        counts = [_TOOL_COUNT.fullmatch(item) for item in items]
        if line.startswith(_TOOLS_USED) and all(counts):  # ours: a rolling summary adds the counts up
            for counted in counts:  # (none left: its one entry clipped by the last resort; dropped, not kept
                assert counted is not None  # beside a new line counting again from 1)
                tools[counted.group(1)] += int(counted.group(2))
        else:  # (an LLM's own "- tools used: ..." line is carried, clipped as its other items are)
            lines.append(_clipped_item(line, bounds.line_chars))
    for event in assistants:
        for call in tool_calls(event):
            if call.get("name"):
                tools[_one_line(str(call["name"]))] += 1
    if tools:
        lines.append(_TOOLS_USED + _tools_used(_unclipped(tools), bounds.line_chars))
    return "\n".join(_latest(lines, bounds.concepts))


def _unclipped(tools: Counter[str]) -> Counter[str]:
    """``tools`` with a name an earlier roll clipped (``mcp__atlassian_confl...``) counted with the
    whole name it starts (a second tool otherwise, in every roll after)."""
    merged: Counter[str] = Counter()
    whole = [name for name in tools if not name.endswith("...") and name != _OTHER_TOOLS]
    for name, count in tools.items():
        head = name[:-3] if name.endswith("...") else None
        starting = [w for w in whole if w.startswith(head)] if head else []
        merged[starting[0] if len(starting) == 1 else name] += count  # (two: whose it was, unknown)
    return merged


def _tools_used(tools: Counter[str], room: int) -> str:
    """``name (Nx), ...``, the most used first, whole entries within ``room`` characters and the
    rest counted together as ``other tools (Nx)``: clipped mid-entry, the line no longer read as
    counts, and a ``+K more`` lost their counts at the next roll (the line then said it was all)."""
    others = tools.get(_OTHER_TOOLS, 0)
    ranked = sorted(((name, count) for name, count in tools.items() if name != _OTHER_TOOLS),
                    key=lambda item: (-item[1], item[0]))
    entries = [f"{_clip(name, room // 2)} ({count}x)" for name, count in ranked]
    rest, length, kept = others + sum(count for _, count in ranked), -2, 0
    for entry, (_, count) in zip(entries, ranked):
        after = rest - count  # (the calls still to name once this entry is in)
        if length + 2 + len(entry) + (len(f", {_OTHER_TOOLS} ({after}x)") if after else 0) > room:
            break
        rest, length, kept = after, length + 2 + len(entry), kept + 1
    return ", ".join([*entries[:kept], *([f"{_OTHER_TOOLS} ({rest}x)"] if rest else [])])


_TOOLS_USED = "- tools used: "
_OTHER_TOOLS = "other tools"  # the calls of the tools a line had no room to name
_TOOL_COUNT = re.compile(r"(.+) \((\d+)x\)")
_MORE_TOOLS = re.compile(r"\+\d+ more")


def _files(previous: dict[str, str], read: _Read, bounds: Bounds) -> str:
    found: list[str] = []
    ours = any(_SUMMARIZED.match(line) for line in _carried(previous.get("Problem Solving")))
    for line in _carried(previous.get("Files and Code Sections")):
        if ours:  # this module's items are paths as found (an argument's may hold spaces, start with _)
            found.append(line[2:])
            continue
        item = _unwrapped(line[2:].strip())  # another's (an LLM's) may say more around them
        found.extend([item] if _PATH.fullmatch(item) or not any(c.isspace() for c in item) else _paths(item))
    listed = {len(found) + index for index in read.listed}  # positions in ``found`` of paths only a tool's
    found.extend(read.paths)  # output showed
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


def _read_paths(events: Sequence[dict[str, Any]]) -> tuple[list[str], set[int]]:
    """The paths the events name, in order, and the positions of those only a tool's output showed
    (``_Read``); a text named again is read once."""
    found: list[str] = []
    listed: set[int] = set()
    known: dict[str, list[str]] = {}
    for event in events:
        for text in _texts(event):
            found.extend(known[text] if text in known else known.setdefault(text, _paths(text)))
        start = len(found)  # (as shown: a long listing, whole, pushed the edited files out)
        output = _str(event.get("output"))
        found.extend(known[output] if output in known else known.setdefault(output, _paths(output)))
        listed.update(range(start, len(found)))
        found.extend(_path_arguments(event))
    return found, listed


def _unwrapped(item: str) -> str:
    """``item`` without the markdown around it (`` `x` ``, ``**x**``, ``*x*``, ``__x__``): pairs only,
    so a name's own underscores stay (``__init__.py``, ``_config.yml``)."""
    while True:
        wrapper = next((w for w in ("**", "__", "`", "*") if len(item) > 2 * len(w)
                        and item.startswith(w) and item.endswith(w)), None)
        if wrapper is None:
            return item
        item = item[len(wrapper):-len(wrapper)].strip()


def _errors(previous: dict[str, str], read: _Read, bounds: Bounds) -> str:
    # (an item is ``[tool] `` and a line, each clipped to ``line_chars``: clipped to that whole, an error
    # that came again was listed twice, carried clipped and new whole)
    carried = _carried(previous.get("Errors and Fixes"), 2 * bounds.line_chars + 3)
    lines = [f"- [{'user' if name is None else _clip(name, bounds.line_chars)}] {_clip(line, bounds.line_chars)}"
             for name, line in read.errors]
    return "\n".join(_latest_errors(carried, lines, bounds.error_lines))


def _read_errors(events: Sequence[dict[str, Any]], outputs: Mapping[int, str]) -> list[tuple[str | None, str]]:
    """The error lines of the events (``_Read.errors``): the user's pasted ones, the tool results'."""
    errors: list[tuple[str | None, str]] = []
    shown = _content_results(events)
    for event in events:
        if event.get("type") == "user":  # an error the user pasted or quoted (SPEC §1: "with user feedback")
            errors.extend((None, line.strip()) for line in _error_lines(
                _str(event.get("content")), lambda line, _: _pasted_error(line[:MAX_PASTED_ERROR_CHARS])))
            continue
        if event.get("type") != "tool_result":
            continue
        content = _str(event.get("toolName", "")).lower() in _CONTENT_TOOLS
        command = not content and id(event) in shown
        name = _one_line(_str(event.get("toolName", "")))
        errors.extend((name, line.strip()) for line in _error_lines(
            outputs.get(id(event)) or _str(event.get("output")), functools.partial(_output_error, content, command)))
    return list(dict.fromkeys(reversed(errors)))[::-1]  # (only an item's last place counts: ``_latest_errors``)


def _output_error(content: bool, command: bool, line: str, count: int) -> bool:
    """Whether ``line`` of a tool's output of ``count`` lines reports an error (``content``: a content
    tool's output; ``command``: a command's showing content, ``_content_results``)."""
    # (a content tool's own failure is a short output: "Error: old_string not found", "File not found";
    # a content command's, its own line: "cat: x: No such file or directory", "fatal: not a git ...",
    # and a compiler's, run before it: ``npm run build && ls dist/``)
    return bool(_is_error(line, content or command) or (content and count <= 3 and _FAILURE_SAID.match(line))
                or (command and ((_COMMAND_SAID.match(line) and _is_error(line)) or _compiler_said(line)
                                 or _GIT_FAILED.match(line.strip()))))


def _error_lines(text: str, says: Callable[[str, int], bool]) -> list[str]:
    """The lines of ``text`` that ``says`` is an error (given the line and the count of lines), in order:
    only the distinct lines holding a word of ``_ERROR_HINT`` are looked at (a call per line of a
    million blank ones, or of the same one, took seconds)."""
    if not _holds(text, _ERROR_WORDS, _DIAGNOSTIC_PLACE):
        return []
    lines = text.splitlines()
    distinct = list(dict.fromkeys(lines))
    errors = {distinct[index] for index in parts_holding(distinct, _ERROR_HINT, _lowered)
              if says(distinct[index], len(lines))}
    return [line for line in lines if line in errors] if errors else []


# What every line ``_read_errors`` takes holds, lowercased (``_lowered``): a word of ``_ERROR``, ``_ERROR_PRINTED``,
# ``_USER_PASTED_ERROR``, ``_FAILURE_SAID``, ``_GIT_FAILED`` or ``_COMPILER`` (each "error"), an ``E   `` or an
# exception's name (``_CAPITAL_WORD``: "error", "exception"), or a diagnostic's place (``_DIAGNOSTIC``)
_ERROR_WORDS = ("error", "exception", "traceback", "fail", "fatal", "panic", "segmentation fault", "denied", "not found",
                "abort", "timed out", "undefined reference", "no such file", "exit", "err!", "killed", "critical",
                "cannot", "could not", "unable to", "conflict (", "rejected]", "e  ")
_DIAGNOSTIC_PLACE = re.compile(r":\d+:\d+: ")
_ERROR_HINT = re.compile("|".join(map(re.escape, _ERROR_WORDS)) + "|" + _DIAGNOSTIC_PLACE.pattern)
# what ``(?i)`` matches to an ASCII letter that ``str.lower`` does not lower to it (İ, ı, ſ; İ is two characters)
_UNFOLDED = re.compile("[\u0130\u0131\u017f]")


def _lowered(text: str) -> str | None:
    """``text`` lowercased, each character one (so a lowercase word found in it is there in any case, as
    ``(?i)`` reads it: such a search is 10 times faster), or None when it cannot be (``_UNFOLDED``)."""
    return None if _UNFOLDED.search(text) else text.lower()


def _holds(text: str, words: tuple[str, ...], place: re.Pattern[str] | None = None) -> bool:
    """Whether ``text`` may hold one of ``words`` (lowercase) in any case (``_lowered``), or a match of ``place``
    (one a search for one of them at each character took 0.5 s on 4 MB)."""
    lowered = _lowered(text)
    return lowered is None or any(word in lowered for word in words) or bool(place and place.search(lowered))


def _pasted_error(line: str) -> bool:
    return bool(_USER_PASTED_ERROR.match(line) or _DIAGNOSTIC.match(line) or _DIAGNOSTIC_SAID.search(line))


def _content_results(events: Sequence[dict[str, Any]]) -> set[int]:
    """``id()`` of the tool results that answer a call running a command showing content (``grep``,
    ``cat``, ``git log``): each answers the latest call with its id before it (providers restart
    their ids, ``call_0``, each turn: a later ``git log``'s id made an earlier pytest run content)."""
    showing: dict[str, bool] = {}
    found = set()
    for event in events:
        kind = event.get("type")
        if kind == "assistant":
            for call in tool_calls(event):
                if isinstance(call.get("id"), str):
                    command = _command_of(_arguments(call.get("arguments")))
                    showing[call["id"]] = command is not None and _shows_content(command)
        elif kind == "tool_result" and showing.get(_str(event.get("toolCallId"))):
            found.add(id(event))
    return found


def _command_of(arguments: Any) -> str | None:
    """The shell command a tool call's arguments run: a string argument named like one, or an
    argv list (Codex's ``["bash", "-lc", "rg -n x src"]``: the script)."""
    if not isinstance(arguments, dict):
        return None
    for name in _COMMAND_ARGUMENT:
        value = arguments.get(name)
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value and all(isinstance(part, str) for part in value):
            if value[0].rsplit("/", 1)[-1] in _SHELLS:  # (``["bash", "-e", "-c", script]``, ``-lc``, ``-xc``)
                for index, part in enumerate(value[1:], 1):
                    if not part.startswith("-"):
                        break
                    if not part.startswith("--") and "c" in part[1:] and index + 1 < len(value):
                        return str(value[index + 1])
            return " ".join(value)
    return None


def _shows_content(command: str) -> bool:
    """Whether a shell ``command`` prints content only: each command of it whose output counts
    (``_NEUTRAL`` ones aside) is a reader or a search, its pipeline's first (``cd repo && git log``;
    not ``pytest | tail``, whose output is the run's). A run anywhere in it makes it a run's:
    ``go test ./... && git commit -am wip`` read as content (its last command git's) dropped the
    test failures it printed."""
    shown = False
    for part in re.split(r"&&|\|\||;|\n", command):
        head = part.split("|", 1)[0].strip().lstrip("({ \t").rstrip(")} \t")  # (``(cd sub && cat f)``)
        prefix = _COMMAND_PREFIX.match(head)
        head = head[prefix.end():] if prefix else head
        if not head or _NEUTRAL.match(head):
            continue
        if _CONTENT_COMMAND.match(_GIT_OPTIONS.sub("git ", head, count=1)) is None:
            return False
        shown = True
    return shown


# git's own failures in its chatter (a merge's or a push's): content-command rules would drop them
_GIT_FAILED = re.compile(r"CONFLICT \(|Automatic merge failed|! \[(?:remote )?rejected\]|error: could not apply")
_COMMAND_SAID = re.compile(r"(?:grep|egrep|fgrep|rg|ag|ack|cat|bat|head|tail|sed|awk|ls|find|fd|tree|git|fatal|"
                           r"cp|mv|rm|rmdir|ln|chmod|chown|chgrp|mkdir|touch|bash|sh|zsh|"
                           r"error): ")  # the command's own message, not what it shows


def _is_error(line: str, content: bool = False) -> bool:
    """Whether an output's ``line`` reports an error (``content``: a line of what a tool returning a
    file's or a page's content returned: only a line printed as an error counts)."""
    if content:
        return _ERROR_PRINTED.match(line) is not None
    if _DIAGNOSTIC.match(line):
        return True
    if _PASSED.search(line):
        return False
    said = _ERROR.search(line) is not None or any(
        word.group().rstrip("0123456789").endswith(("Error", "Exception")) for word in _CAPITAL_WORD.finditer(line))
    return said and (_NONE_FAILED.search(line) is None or _SOME_FAILED.search(line) is not None)


# a line that is a failure whatever else there is (kept first when the section has no room for all)
_STRONG = re.compile(r"\bFAIL(?:ED)?\b|\berror\[E?\d+\]|(?i:^\s*(?:fatal )?error:)|\bERR!|^\s*panic:|^E {2,}\S"
                     r"|(?i:\bexit(?:ed)?(?: with)? (?:status|code):? [1-9])|\berror TS\d+|^\S+:\d+(?::\d+)?: error\b"
                     r"|^\s*\d+:\d+\s+error\s")  # (tsc's, mypy's, eslint's too)
# a compiler's or a type checker's error (counted in a command's output whatever ran after it)
_COMPILER = re.compile(r"\berror\[E?\d+\]|\berror TS\d+|^\S+:\d+(?::\d+)?: error\b|^\s*\d+:\d+\s+error\s"
                       r"|\bFound [1-9]\d* errors?\b")
_ERROR_ITEM = re.compile(r"- (?:\[[^\]\n]*\] )?")  # an item's ``- [tool] `` before the line it quotes


def _compiler_said(line: str) -> bool:
    return _DIAGNOSTIC.match(line) is not None or _COMPILER.search(line) is not None


def _latest_errors(carried: list[str], new: list[str], count: int) -> list[str]:
    """The last ``count`` distinct items of ``carried`` then ``new`` (``_latest``), when there are more,
    those kept first: this batch's failures a runner or a program printed (``FAILED ...``, a
    traceback's ``ValueError: ...``, ``error[E0308]``, tsc's ``error TS2322``), then the carried
    ones, then this batch's lines that only say a word like "error", then the carried such lines:
    a ``git log`` or a build's chatter of 30 such lines pushed a test run's failure out, and 30
    stale failures carried a new type error out."""
    distinct = list(dict.fromkeys(reversed(carried + new)))  # the newest first
    if len(distinct) <= count:
        return distinct[::-1]
    fresh = set(new)
    ranked = sorted(range(len(distinct)), key=lambda i: (not _strong(distinct[i]), distinct[i] not in fresh, i))
    kept = {distinct[i] for i in ranked[:count]}
    return [item for item in reversed(distinct) if item in kept]


def _strong(item: str) -> bool:
    prefix = _ERROR_ITEM.match(item)
    text = item[prefix.end():] if prefix else item
    return (_ERROR_PRINTED.match(text) is not None or _DIAGNOSTIC.match(text) is not None
            or _STRONG.search(text) is not None)


def _problem_solving(previous: dict[str, str], events: Sequence[dict[str, Any]],
                     assistants: list[dict[str, Any]], results: list[dict[str, Any]], bounds: Bounds) -> str:
    """The previous summary's items (an LLM's included), then the range of turns summarized
    extractively so far (a rolling summary widens its own line) with this batch's counts."""
    lines, first = [], None
    for line in _carried(previous.get("Problem Solving"), bounds.line_chars):
        summarized = _SUMMARIZED.match(line)
        if summarized:
            first = int(summarized.group(1)) if first is None else min(first, int(summarized.group(1)))
        else:
            lines.append(line)
    turns = [e["turnId"] for e in events if isinstance(e.get("turnId"), int)]
    if turns:
        calls = sum(len(tool_calls(e)) for e in assistants)
        start = min(turns) if first is None else min(first, min(turns))
        lines.append(f"- turns {start}-{max(turns)} summarized extractively (no LLM); turns {min(turns)}-"
                     f"{max(turns)}: {len(assistants)} assistant messages, {calls} tool calls, "
                     f"{len(results)} tool results.")
    return "\n".join(_latest(lines, bounds.decisions))


_SUMMARIZED = re.compile(r"- turns (\d+)-\d+ summarized extractively \(no LLM\)")


def _decisions(previous: dict[str, str], read: _Read, bounds: Bounds) -> str:
    lines = _carried(previous.get("Decision Rationale"), bounds.line_chars)
    lines.extend(f"- {_clip(sentence, bounds.line_chars)}" for sentence in read.decisions)
    return "\n".join(_latest(lines, bounds.decisions))


def _read_decisions(events: Sequence[dict[str, Any]]) -> list[str]:
    """The sentences of the assistant's messages that give a reason, on one line (``\\r###`` ended its
    line), each at its last place (only that counts: ``_latest``); only the sentences holding a word
    of ``_DECISION`` are looked at."""
    found: list[str] = []
    for event in events:
        content = _str(event.get("content")) if event.get("type") == "assistant" else ""
        if _holds(content, _DECISION_WORDS):
            sentences = re.split(r"(?<=[.!?])\s+|\n", content)
            found.extend(_one_line(sentences[index])
                         for index in parts_holding(sentences, _DECISION_HINT, _lowered)
                         if _DECISION.search(sentences[index]))
    return list(dict.fromkeys(reversed(found)))[::-1]


_DECISION_WORDS = ("because", "decided", "instead of", "so that", "rather than", "chose", "trade")  # (``_DECISION``'s,
_DECISION_HINT = re.compile("|".join(_DECISION_WORDS))  # lowercased: ``_holds``)


def _pending(previous: dict[str, str], read: _Read, bounds: Bounds) -> str:
    """Open checkbox items and TODO / FIXME lines of the messages (not in their fenced code: a code
    block's ``# TODO`` is the code's), less those ticked later (``[x]``), carried ones included."""
    tasks = _OpenTasks(_carried(previous.get("Pending Tasks"), bounds.line_chars))
    for ticked, text in read.tasks:
        if ticked:
            tasks.tick(text)
        else:
            tasks.add(f"- {_clip(text, bounds.line_chars)}")
    return "\n".join(list(tasks.items)[-bounds.pending:] if bounds.pending else [])


def _read_tasks(events: Sequence[dict[str, Any]]) -> list[tuple[bool, str]]:
    """The tasks the messages tick and the items they add, in order (``_Read.tasks``)."""
    found: list[tuple[bool, str]] = []
    listed_before: set[str] = set()  # the tasks of the last todo list seen in this batch
    for event in events:
        if event.get("type") not in ("user", "assistant"):
            continue
        content = _str(event.get("content"))
        hint = _USER_TASK_HINT if event.get("type") == "user" else _TASK_HINT
        if hint.search(content):  # (only a line holding one can be a task: a look at each line of a
            lines = content.splitlines()  # million took seconds)
            holding = parts_holding(lines, hint)
            # (fences as the summary's own reading finds them: a toggle at any line starting ```, one of
            # inline code (```npm install```) or indented 4 spaces, hid every task after it)
            fenced = in_fenced_blocks(lines) if holding else []
            for line in (lines[index] for index in holding if not fenced[index]):
                done = _DONE.match(line)
                if done:  # (it was listed open, and stayed "pending" for good)
                    found.append((True, _task(done.group(1))))
                elif _PENDING.search(line) or (event.get("type") == "user"
                                               and _PENDING_SAID.search(_INLINE_CODE.sub("", line))):
                    found.append((False, line.strip().lstrip("-* ").strip()))
        for todos, whole in _todo_lists(event):  # (an agent's todo list tool, Claude Code's ``TodoWrite``)
            listed = {_task(todo["content"]) for todo in todos}
            if whole:  # (a list sent whole: an item it no longer holds was dropped, and stayed pending for good;
                found.extend((True, task) for task in listed_before if task not in listed)  # ``merge: true``,
                listed_before = listed  # Cursor's update of some items, leaves the others as they are)
            else:
                listed_before |= listed
            for todo in todos:
                if todo["status"] in _TODO_CLOSED:
                    found.append((True, _task(todo["content"])))
                else:
                    found.append((False, "[ ] " + _one_line(todo["content"])))
    return found


# what a line ``_DONE``, ``_PENDING`` or (a user's, with its inline code removed) ``_PENDING_SAID`` matches holds
_TASK_HINT = re.compile(r"\[[ xX]\]|TODO|FIXME")
_USER_TASK_HINT = re.compile(r"\[[ xX]\]|TODO|FIXME|`")


_TODO_CLOSED = frozenset({"completed", "cancelled", "canceled"})  # a todo item's statuses that leave it done


def _todo_lists(event: dict[str, Any]) -> Iterable[tuple[list[dict[str, str]], bool]]:
    """The item lists of an assistant's todo-list calls (``{"todos": [{"content", "status"}, ...]}``),
    one per call, and whether it is the whole list as it is now (not ``"merge": true``)."""
    for call in tool_calls(event):
        arguments = _arguments(call.get("arguments"))
        if not isinstance(arguments, dict) or not isinstance(todos := arguments.get("todos"), list):
            continue
        yield ([{"content": todo["content"], "status": str(todo.get("status", "pending"))} for todo in todos
                if isinstance(todo, dict) and isinstance(todo.get("content"), str) and todo["content"].strip()],
               arguments.get("merge") is not True)


class _OpenTasks:
    """The pending items in the order of their last mention, ticked ones removed: each item's task
    looked up, not compared with every item at each tick (a checklist restated 20 times, each more
    ticked, took seconds; 5 000 items and their ticks, minutes)."""

    def __init__(self, items: list[str]) -> None:
        self.items: dict[str, None] = {}
        self._by_task: dict[str, set[str]] = {}
        # an item clipped (``_clip``ped when long, to any bound's ``line_chars`` in this roll or an earlier
        # one) -> its task's head, which a ticked task starts with
        self._clipped: dict[str, str] = {}
        for item in items:
            self.add(item)

    def add(self, item: str) -> None:
        self.items.pop(item, None)
        self.items[item] = None  # (at its last mention)
        listed = item[2:]
        if len(listed) in _CLIPPED_LENGTHS and listed.endswith("..."):
            self._clipped[item] = _task(_OPEN_ITEM.sub("", listed, count=1))[:-3].rstrip()
        else:
            self._by_task.setdefault(_task(_OPEN_ITEM.sub("", listed, count=1)), set()).add(item)

    def tick(self, task: str) -> None:
        for item in self._by_task.pop(task, ()):
            self.items.pop(item, None)
        for item in [item for item, head in self._clipped.items() if head and task.startswith(head)]:
            del self._clipped[item]
            self.items.pop(item, None)


def _task(text: str) -> str:
    """A checkbox item's task, as compared with another's (case, spacing, a strike-through and a
    trailing "done" mark aside: ``[x] ~~Write tests~~ ✅`` ticks ``[ ] Write tests``)."""
    text = " ".join(text.replace("~~", "").replace("**", "").replace("__", "").replace("`", "").split()).lower()
    # (the marks matched at the start of the text reversed, in one linear match: a regex anchored at the
    # end tried each blank of a long run, 64 s; a slice per mark copied the text each time, 22 s on a
    # million marks; a loop over the marks' ends, 1.5 s)
    marks = _DONE_MARKS_REVERSED.match(text[::-1])
    return text[:len(text) - marks.end()].rstrip(" ") if marks else text


_OPEN_ITEM = re.compile(r"^(?:\d{1,3}[.)][ \t]*)?\[ \][ \t]*")  # what a listed item's task follows


def _current_work(previous: dict[str, str], assistants: list[dict[str, Any]], bounds: Bounds) -> str:
    """The last assistant message (and its tool calls), quoted; without one in the batch, the
    previous summary's (the transcript's last is there: it was erased, ``None.``)."""
    for event in reversed(assistants):
        content = _str(event.get("content")).strip()
        calls = [f"-> {_clip(_one_line(_str(c.get('name', ''))), bounds.line_chars)}"
                 f"({_clip(_one_line(arguments_json(c.get('arguments', ''))), bounds.line_chars)})"
                 for c in tool_calls(event)]
        if len(calls) > bounds.pending:
            calls = [*calls[:bounds.pending], f"-> ... and {len(calls) - bounds.pending} more tool calls"]
        if content or calls:
            text = _quote(_elide(content, bounds.current_work_chars)) if content else ""
            return "\n".join(part for part in [text, *calls] if part)
    carried = previous.get("Current Work", "None.")
    if says_nothing(carried):
        return ""
    # (quoted: another summary's, carried as it is, held a ``### Optional Next Step`` line that took
    # that section's place)
    return _quote(_elide(_unquoted(carried), bounds.current_work_chars))


def _next_step(previous: dict[str, str], users: list[str], bounds: Bounds) -> str:
    """The most recent user request, quoted; without one in the batch, the previous summary's step
    (a batch of tool calls alone, mid-turn, erased it: ``None.``)."""
    if not users:
        carried = previous.get("Optional Next Step", "None.")
        return "" if says_nothing(carried) else carried
    return "Continue with the most recent user request:\n" + _quote(_elide(users[-1], bounds.request_chars))


def _texts(event: dict[str, Any]) -> Iterable[str]:
    """An event's message text and its tool calls' arguments' strings (its output is read apart):
    as decoded, not as JSON (a ``\\n`` in a written file's code made ``sys\\nsys.path`` a Windows path)."""
    yield _str(event.get("content"))
    for call in tool_calls(event):
        yield from _strings(_arguments(call.get("arguments")))


def _arguments(arguments: Any) -> Any:
    """A tool call's arguments decoded (a JSON text as sent: its value; not JSON: the text)."""
    if isinstance(arguments, str):
        try:
            return orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return arguments
    return arguments


def _strings(value: Any) -> Iterable[str]:
    """The strings in a decoded JSON value, depth first (keys aside)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
        elif isinstance(item, list):
            stack.extend(reversed(item))


def _path_arguments(event: dict[str, Any]) -> Iterable[str]:
    """The string values of an assistant's tool-call arguments named like a path (``path``, ``file_path``, ...)
    on one line (any line break: a ``\\r### Optional Next Step`` in one wrote a heading of its own)."""
    for call in tool_calls(event):
        arguments = _arguments(call.get("arguments"))
        if isinstance(arguments, dict):
            for name, value in arguments.items():
                if isinstance(name, str) and _PATH_ARGUMENT.search(name) and isinstance(value, str):
                    path = value.strip()
                    if path and len(path.splitlines()) == 1:
                        yield _clip(path)


def _carried(body: str | None, line_chars: int = MAX_LINE_CHARS, whole: str | None = None) -> list[str]:
    """The items of a previous section as ``- `` lines: this module's (``- ``), and an LLM's
    bullets (``* ``, ``+ ``, ``1. ``, nested ones too) and prose lines (only ``- `` lines were
    carried: an LLM summary's numbered or ``*`` lists, and its prose, were lost when the
    extractive fallback took over); fence lines and ``None.`` are no items. Each item's text is
    clipped to ``line_chars``, ``- `` ones too (kept as they were, an LLM's long ``- `` bullets
    went past every bound, and the last resort clipped every line of the summary to 60 characters),
    but for lines starting with ``whole`` (this module's, sized to the bound when written)."""
    lines = []
    for line in (body or "").splitlines():
        if line.startswith("- "):
            lines.append(line if whole is not None and line.startswith(whole) else _clipped_item(line, line_chars))
            continue
        text = line.strip()
        if not text or text in ("None.", "None") or _FENCE.match(text):
            continue
        bullet = _BULLET.match(text)
        lines.append(f"- {_clip(bullet.group(1) if bullet else text, line_chars)}")
    return lines


def _clipped_item(line: str, line_chars: int) -> str:
    """A ``- `` item with its text clipped to ``line_chars`` (as it is when it fits)."""
    return line if len(line) - 2 <= line_chars else f"- {_clip(line[2:], line_chars)}"


_BULLET = re.compile(r"(?:[-*+]|\d{1,3}[.)])\s+(.*)")


def _latest(items: list[str], count: int) -> list[str]:
    """The last ``count`` distinct items, each at its last mention, in order: an item that came
    back (the same error in the newest turn) was kept at its first place and dropped first."""
    return list(dict.fromkeys(reversed(items)))[:count][::-1]


def _verbatim(text: str) -> str:
    """``text`` exactly, in a fenced code block longer than any backtick run in it (no line of
    ``text`` can close it, and a heading inside a fence is no section heading)."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}\n{text}\n{fence}"


def _elide(text: str, limit: int) -> str:
    """``text`` when at most ``limit`` characters, else its head and tail around a line saying how
    many characters were omitted, ``limit`` characters in all (so eliding it again changes nothing)."""
    if len(text) <= limit:
        return text
    keep = max(limit - len(f"\n[… {len(text):,} characters omitted …]\n"), 0)
    return f"{text[:keep - keep // 2]}\n[… {len(text) - keep:,} characters omitted …]\n{text[len(text) - keep // 2:]}"


def _unquoted(text: str) -> str:
    """``text`` without the ``> `` marks ``_quote`` adds, when every line has one."""
    lines = text.splitlines()
    if not all(line.startswith("> ") or line == ">" for line in lines):
        return text
    return "\n".join(line[2:] for line in lines)


def _quote(text: str) -> str:
    """``text`` as a markdown quote, as sent (its tags too, as in All User Messages: this summary
    is parsed from no reply; half escaped, the same message read two ways in one summary)."""
    return "\n".join(f"> {line}" if line else ">" for line in text.splitlines() or [""])


def _one_line(text: str) -> str:
    """``text`` on one line (any run of whitespace, line breaks included, one space): a tool name
    or arguments holding ``\n### Optional Next Step`` wrote a section heading of their own."""
    return " ".join(text.split())


def _clip(text: str, limit: int = MAX_LINE_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
