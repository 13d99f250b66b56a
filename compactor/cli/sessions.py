"""Operator commands about sessions: ``compact``, ``context``, ``status`` and ``dead-letters``.

``context`` reads the log only (no Redis needed); ``compact`` and ``status``
talk to Redis. ``compact`` always ends its stdout with the ``CompressResult``
JSON line; ``--json`` elsewhere prints only JSON on stdout.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.cells import cell_len
from rich.console import Console
from rich.measure import Measurement
from rich.panel import Panel
from rich.rule import Rule
from rich.table import Table
from rich.text import Text
from typer.core import TyperCommand

from compactor.cli.common import (
    ConfigOpt,
    DataDirOpt,
    JsonOpt,
    RedisUrlOpt,
    UsageError,
    connect,
    err_console,
    fail,
    interrupted_by_signals,
    load,
    outside_the_stack,
    print_json,
    readable_data_dir,
    user_errors,
)
from events.config import DAY_S, Settings
from events.errors import CompactorError, SessionNotFound
from events.models import validate_cwd, validate_session_id
from producer.api_models import SessionBody

logger = logging.getLogger(__name__)

BAR_WIDTH = 24  # characters of the context bar in a terminal of WIDE_COLUMNS or more
NARROW_BAR_WIDTH = 12
WIDE_COLUMNS = 120
SESSION_WIDTH = 8  # the session column's width at least (a longer id folds); other columns are left out first
HELD_LABEL = " held back"  # after the id of a session a watcher holds back (its log cannot be written)
STATUS_COLUMNS = ("turn", "context", "tokens", "failures", "job", "last compaction")
NARROW_DROP_ORDER = ("last compaction", "context", "job", "turn", "tokens", "failures")  # to keep the session's
UNCROPPED_COLUMNS = 10_000  # the table's width when stdout is no terminal: as wide as its content
CONTENT_PREVIEW_CHARS = 600
FULL_PANEL_CHARS = 100_000  # a message longer (``context --full``) is printed under a rule, not in a panel
# RQ's statuses as an operator reads them: a job not yet running is "queued", whether RQ calls it
# queued, created (a forced job waiting behind the session's pending job), deferred or scheduled.
WAIT_WORDS = {"created": "queued", "deferred": "queued", "scheduled": "queued", "started": "running"}

SessionArg = Annotated[str, typer.Argument(help="Session id.", show_default=False)]
CwdOpt = Annotated[str, typer.Option("--cwd", help="Absolute working directory of the session.",
                                     show_default=False)]


def compact(
    session: SessionArg,
    cwd: CwdOpt,
    json_out: Annotated[bool, typer.Option(
        "--json", help="Print only the CompressResult JSON on stdout (the summary line goes to stderr).")
    ] = False,
    config: ConfigOpt = None,
    redis_url: RedisUrlOpt = None,
    data_dir: DataDirOpt = None,
    timeout: Annotated[float | None, typer.Option(
        "--timeout", min=0.1, max=DAY_S,  # as api.jobWaitSeconds (inf had been taken: "waiting (up to infs)")
        help="Seconds to wait for the job (default api.jobWaitSeconds).")
    ] = None,
) -> None:
    """Force an LLM compaction now and print its CompressResult JSON (last line).

    Needs running workers (`compactor serve` or `compactor work`).
    """
    settings: Settings | None = None
    client: Any = None
    job_id: str | None = None
    elsewhere: int | None = None  # the estimate of a session bound to another cwd than --cwd
    try:
        with interrupted_by_signals():  # (stopped while it waits: the JSON line too, then 130 or 128+N)
            # (the imports in the block: RQ's and the API's took up to 0.8 s, and a Ctrl-C or SIGTERM
            # then ended the command with no JSON line)
            outside_the_stack()  # (before compactor.queue imports compactor.metrics)
            import redis

            from compactor.keys import Keys
            from compactor.queue import enqueue_forced_compaction
            from producer.api_jobs import error_message, wait_for_job

            settings = readable_data_dir(load(config, redis_url=redis_url, data_dir=data_dir), data_dir, config)
            with user_errors():
                sid, cwd = validate_session_id(session), validate_cwd(cwd)
                refusal, elsewhere = _log_refusal(settings, sid, cwd)
                if refusal is not None:
                    raise refusal
                client = connect(settings)
                wait_s = timeout or settings.api.job_wait_seconds
                job_id = enqueue_forced_compaction(client, settings, sid, cwd)
                err_console.print(f"compaction job {job_id} queued; waiting (up to {wait_s:g}s)")
                try:
                    job = wait_for_job(client, job_id, Keys(settings.redis.prefix, settings.redis.shards).queue,
                                       wait_s)
                except (redis.ConnectionError, redis.TimeoutError) as e:  # (still down at the deadline)
                    raise CompactorError(f"Redis unreachable: {e}; compaction job {job_id} was queued and may "
                                         f"still run: see GET /api/jobs/{job_id}") from e
    except (typer.Exit, KeyboardInterrupt, Exception) as stopped:
        # SPEC §7: the CompressResult JSON is always the last line, when no job could run too (a bad
        # session id, no such session, Redis unreachable, a bad config: the reason is on stderr), and
        # when the command is stopped (Ctrl-C, SIGTERM: a `timeout` around it) before its job ended;
        # and after an error no one foresaw (its traceback follows on stderr)
        signalled = isinstance(stopped, KeyboardInterrupt) or (isinstance(stopped, typer.Exit)
                                                               and stopped.exit_code > 128)  # (SIGTERM: 143)
        if signalled and job_id is not None:  # (it said nothing: a second ``compact`` joined the same job unsaid)
            err_console.print(f"stopped waiting: compaction job {job_id} was queued and runs on; see GET "
                              f"/api/jobs/{job_id}", markup=False, soft_wrap=True)
        print_json(_nothing_compacted(client, settings, session, cwd, elsewhere))
        raise
    if job.status == "finished" and job.result is not None:
        result = job.result
        if job.llm_error is not None:
            failed = job.llm_error
            err_console.print(f"the LLM call failed ({failed.kind}: {shown(failed.error)}); "
                              f"summarized by the fallback {failed.fallback}", style="yellow", markup=False,
                              soft_wrap=True)
        typer.echo(f"released {result.released} tokens; promptEstimate now "
                   f"{result.prompt_estimate}" if result.did_compress else "nothing to compact", err=json_out)
        print_json(result.model_dump(by_alias=True))
        return
    # SPEC §7: the CompressResult JSON is always the last line: the micro step a failed LLM job
    # applied (it stays in the log), else none compacted (yet), the estimate now
    if job.micro_step is not None:
        step = job.micro_step
        typer.echo(f"its micro step was applied: released {step.released} tokens; promptEstimate now "
                   f"{step.prompt_estimate}", err=True)
        print_json(step.model_dump(by_alias=True))
    else:
        print_json(_nothing_compacted(client, settings, sid, cwd))
    job_id = job.job_id  # (a job abandoned mid-run: the one queued in its place, followed)
    if job.error is not None:
        fail(f"compaction job {job_id} {job.status}: {shown(error_message(job.error))}")  # (a provider's text)
    fail(f"compaction job {job_id} still {WAIT_WORDS.get(job.status, job.status)} after {wait_s:g}s; "
         f"see GET /api/jobs/{job_id}")


class CompactCommand(TyperCommand):
    """``compact``'s command: its arguments refused before it runs (a missing ``--cwd``, an empty
    ``--config``, ``--timeout 0``) end stdout with the nothing-compacted JSON line too (SPEC §7:
    always its last line; a script's ``| tail -1 | jq`` read the usage error's nothing)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except typer.Exit as e:
            if e.exit_code:  # (an option's own check; 0: --help)
                print_json(_nothing_compacted(None, None, "", ""))
            raise
        except UsageError:
            print_json(_nothing_compacted(None, None, "", ""))
            raise


def _nothing_compacted(client: Any, settings: Settings | None, session_id: str, cwd: str,
                       estimate: int | None = None) -> dict[str, Any]:
    """``{didCompress: false, released: 0, promptEstimate}``: ``estimate`` when known (a session
    bound to another cwd: its own), else the estimate as stored, else (Redis has no state of the
    session, or does not answer) as the log gives it, else 0 (no settings, no valid session, no log,
    or one that cannot be read: the reason of the failure is said on stderr)."""
    from events.models import CompressResult

    if estimate is None:
        estimate = _estimate_now(client, settings, session_id, cwd)
    return CompressResult(did_compress=False, released=0, prompt_estimate=estimate).model_dump(by_alias=True)


def _estimate_now(client: Any, settings: Settings | None, session_id: str, cwd: str) -> int:
    from compactor.store import SessionStore
    from producer.api_sessions import context_body

    if settings is None:
        return 0
    try:  # (the failure's own line, after this one, is what matters)
        state = SessionStore(client, settings).load(session_id) if client is not None else None
    except Exception:
        state = None
    if state is not None:
        return state.prompt_estimate
    try:
        return context_body(settings, session_id, cwd).prompt_estimate
    except Exception:
        return 0


def _log_refusal(settings: Settings, session_id: str, cwd: str) -> tuple[CompactorError | None, int | None]:
    """None when the session has a log under ``cwd``, else what to raise: SessionNotFound, or, for a
    session Redis holds under another cwd, the refusal naming that cwd, as the API does (exit 2: ``no
    session`` hid the mistake), with that session's stored estimate (the JSON line's: the log under
    ``--cwd`` is not the session's, and counted nothing)."""
    import redis

    from compactor.serve import client_redis_url
    from compactor.store import SessionStore, bound_elsewhere
    from events.errors import InvalidConfig
    from events.log import SessionLog
    from producer.api_sessions import bound_state

    if SessionLog(settings.data_dir, cwd, session_id).found():
        return None, None
    missing = SessionNotFound(f"no session {session_id} under cwd {cwd} (data dir {settings.data_dir})")
    try:  # (no Redis to ask, or it does not answer: no session, the log is known to be missing)
        client = redis.Redis.from_url(client_redis_url(settings), socket_timeout=5, socket_connect_timeout=2)
    except InvalidConfig:
        return missing, None
    try:
        state = bound_state(SessionStore(client, settings), session_id, cwd)
    finally:
        client.close()
    if state is None:
        return missing, None
    return bound_elsewhere(session_id, state.cwd, cwd), state.prompt_estimate


def context(
    session: SessionArg,
    cwd: CwdOpt,
    json_out: JsonOpt = False,
    full: Annotated[bool, typer.Option("--full", help="Show whole message contents.")] = False,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Show the context the model would see (SPEC §4), computed from the log alone."""
    outside_the_stack()  # (before producer.api_sessions imports compactor.metrics)
    from producer.api_sessions import context_body

    settings = readable_data_dir(load(config, data_dir=data_dir, redis=False), data_dir, config)
    with user_errors():
        body = context_body(settings, session, cwd)
    if json_out:
        print_json(body.model_dump(by_alias=True, exclude_unset=True))
        return
    console = _console()
    console.print(f"[bold]{session}[/]  promptEstimate [bold]{body.prompt_estimate}[/]  "
                  f"currentTurnId [bold]{body.current_turn_id}[/]  "
                  f"messages {len(body.messages)}")
    for message in body.messages:
        _print_message(console, message, full)


# C0 controls but the line break and the tab, DEL, C1: shown as escapes, never sent to the terminal
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def shown(text: str) -> str:
    """``text`` with its control characters written as escapes (``\x1b``): a session's text is an
    agent's (a tool's output, a fetched page), and its escape sequences went to the operator's
    terminal as they were: one set the window's title and cleared the screen."""
    return _CONTROLS.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def one_line(text: str) -> str:
    """``shown``, line breaks and tabs escaped too: a table cell's text (a producer's session id with a
    line break in it, refused and lettered, broke the dead letters' table into two rows)."""
    return shown(text).replace("\t", "\\t").replace("\n", "\\n")


_COLORS = {"system": "magenta", "user": "green", "assistant": "cyan", "tool": "yellow"}


def _print_message(console: Console, message: dict[str, Any], full: bool) -> None:
    """One message in a panel; a long one (``--full``) under a rule of its title instead, as it is
    (in a panel rich laid out each of its lines: 1 million lines of an output took about a minute)."""
    role = str(message.get("role", "?"))
    title = shown(role + (f" ({message['name']})" if message.get("name") else ""))
    lines = [str(message.get("content") or "")]
    for call in message.get("tool_calls") or []:
        fn = call.get("function", {})
        lines.append(f"→ {fn.get('name')}({fn.get('arguments')})  [{call.get('id')}]")
    text = shown("\n".join(line for line in lines if line))
    if not full and len(text) > CONTENT_PREVIEW_CHARS:
        text = text[:CONTENT_PREVIEW_CHARS] + f" … (+{len(text) - CONTENT_PREVIEW_CHARS} chars)"
    color = _COLORS.get(role, "white")
    if len(text) > FULL_PANEL_CHARS:
        console.print(Rule(Text(title), align="left", style=color))
        console.file.write(text + "\n")  # (no markup read, no wrapping: its control characters escaped)
        return
    # (the title a Text too: a tool name is the agent's, and rich read ``tool[/]`` as markup and raised)
    console.print(Panel(Text(text), title=Text(title), title_align="left", border_style=color))


def status(
    json_out: JsonOpt = False,
    limit: Annotated[int, typer.Option("--limit", min=1, max=1_000_000, help="Most recent sessions shown.")] = 50,
    config: ConfigOpt = None,
    redis_url: RedisUrlOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Sessions by last activity: context fill against both thresholds, breaker, jobs."""
    from compactor.held import held_sessions
    from compactor.keys import Keys
    from compactor.store import known_sessions

    outside_the_stack()
    settings = readable_data_dir(load(config, redis_url=redis_url, data_dir=data_dir), data_dir, config)
    client = connect(settings)
    keys = Keys(settings.redis.prefix, settings.redis.shards)
    with user_errors():
        bodies = session_bodies(client, settings, limit)
        total = known_sessions(client, keys)
        held = held_sessions(client, keys)
    if json_out:
        print_json([b.model_dump(by_alias=True) for b in bodies])
        return
    if not bodies and not held:
        said = _no_sessions(settings.data_dir, total, min(total, limit), keys.data_dir)
        err_console.print(said, soft_wrap=True, markup=False)  # (a path: as it is)
        return
    console = _table_console()
    if bodies:
        console.print(status_table(bodies, console.width, total=total, limit=limit))
    listed = {b.session_id for b in bodies}
    now = datetime.now(UTC)
    for sid, h in sorted(held.items(), key=lambda item: item[1].since):
        if sid not in listed:  # (its log cannot be read, or it is not among the rows: named here)
            since = _age(now - datetime.fromtimestamp(h.since, UTC))
            # (escaped: the error quotes a path of an agent's cwd, whose control characters went to the terminal)
            console.print(Text(f"held back, not in the table: {one_line(sid)} since {since}: {one_line(h.error)}",
                               style="red"))


LOGS_COUNTED = 10_000  # log files counted at most when Redis knows no session


def _no_sessions(data_dir: Path, known: int, looked_at: int, recorded_key: str) -> str:
    """What ``status`` says when it has no row: "no sessions yet" only when Redis knows none and
    the data dir holds no log either (after Redis was emptied or replaced, it said so over hundreds
    of logs; on the wrong data dir, over all the sessions Redis knows)."""
    from compactor.datadir import ID_FILE
    from compactor.store import STATE_IDLE_TTL_S
    from events.log import LOG_SUFFIX

    if known:
        which = "none" if looked_at == known else f"none of the {looked_at} most recent"
        return (f"Redis knows {known} session(s), {which} with a log in {data_dir}: is it the data dir they "
                f"were written to? (compare {data_dir / ID_FILE} with {recorded_key})")

    found = 0
    with contextlib.suppress(OSError):
        for _ in data_dir.glob(f"*/sessions/*{LOG_SUFFIX}"):
            found += 1
            if found >= LOGS_COUNTED:
                break
    if not found:
        return "no sessions yet"
    count = f"{found}{'+' if found >= LOGS_COUNTED else ''} session log{'s' if found > 1 else ''}"
    return (f"no session known to Redis, but {data_dir} holds {count}: each is listed again at its "
            f"session's next event or compaction (idle for {STATE_IDLE_TTL_S // 86_400} days, their state "
            f"forgotten? or was Redis emptied or replaced?)")


def dead_letters(
    session: Annotated[str | None, typer.Option("--session", help="Only this session's letters.",
                                                show_default=False)] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, max=1_000, help="Newest letters shown.")] = 20,
    json_out: JsonOpt = False,
    config: ConfigOpt = None,
    redis_url: RedisUrlOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Entries the watcher refused (the stream {redis.prefix}:dead), newest first: when, session, reason, entry id."""
    outside_the_stack()  # (before producer.api_sessions imports compactor.metrics)
    from producer.api_sessions import dead_letters_body

    settings = load(config, redis_url=redis_url, data_dir=data_dir)
    client = connect(settings)
    with user_errors():
        body = dead_letters_body(client, settings, session, limit)
    if json_out:
        print_json(body.model_dump(by_alias=True))
        return
    if not body.letters:
        whose = f" of session {one_line(session)}" if session else ""
        looked = "" if body.complete else f" in the newest {body.scanned} of {body.total}"
        # (no markup: a malformed id, what the filter is for, is text: ``agent[/]1`` was a traceback,
        # ``[bold]s-43`` read "no dead letters of session s-43")
        err_console.print(f"no dead letters{whose}{looked}", markup=False, soft_wrap=True)
        return
    now = datetime.now(UTC)
    # (of a session: "1 of 3" read as 1 of that session's 3, where 3 counted every session's letters)
    title = (f"{len(body.letters)} dead letter(s) of session {one_line(session)} ({body.total} in all)" if session
             else f"{len(body.letters)} of {body.total} dead letter(s)")
    table = Table(title=Text(f"compactor: {title}, newest first"),
                  box=box.SIMPLE_HEAD, caption=None if body.complete else
                  f"looked through the newest {body.scanned} letters only")
    for header in ("written", "session", "reason", "entry"):
        table.add_column(header, overflow="fold")
    for letter in body.letters:
        written = datetime.fromtimestamp(letter.written_at, UTC)
        table.add_row(f"{_age(now - written)} ago", Text(one_line(letter.session or "-")),
                      Text(one_line(letter.reason)), Text(one_line(f"{letter.stream or '?'} {letter.entry_id or '?'}")))
    _table_console().print(table)


MIN_COLUMNS = 40  # the narrowest width printed at (``COLUMNS=0``: rich printed nothing, and the exit was 0)


def _console() -> Console:
    """A console for stdout, at least ``MIN_COLUMNS`` wide."""
    console = Console()
    return console if console.width >= MIN_COLUMNS else Console(width=MIN_COLUMNS)


def _table_console() -> Console:
    """A console for stdout: a terminal's width (or ``$COLUMNS``) to fit; else, piped or
    redirected, as wide as the table, which is then never cropped (rich would take 80)."""
    console = _console()
    columns = os.environ.get("COLUMNS", "")
    if console.is_terminal or (columns.isascii() and columns.isdigit()):
        return console
    return Console(width=UNCROPPED_COLUMNS)


def session_bodies(client: Any, settings: Settings, limit: int) -> list[SessionBody]:
    """The status of the ``limit`` most recently active sessions (stored state)."""
    from producer.api_sessions import recent_session_bodies

    # (stored nowhere: its settings may not be the stack's, a status run without -c rewrote every state)
    return [body for body, _ in recent_session_bodies(client, settings, limit, stores_rebuilt=False)]


def fill_bar(estimate: int, micro: int, llm: int, window: int, width: int = BAR_WIDTH) -> Text:
    """A bar of ``estimate / window`` with the two thresholds marked and coloured."""
    bar = Text()
    for i in range(width):
        lo, hi = window * i / width, window * (i + 1) / width
        marker = lo <= micro < hi or lo <= llm < hi
        filled = estimate > lo
        style = "red" if lo >= llm else "yellow" if lo >= micro else "green"
        bar.append("┃" if marker else ("█" if filled else "░"), style=style if filled else "dim")
    return bar


def status_table(bodies: list[SessionBody], width: int = 200, now: datetime | None = None,
                 total: int | None = None, limit: int | None = None) -> Table:
    """One row per session, fitted to a terminal ``width`` columns wide: the bar narrows
    under ``WIDE_COLUMNS`` and no header or value is broken over two lines (at 80 columns
    only a session id over ~8 characters folds). Where even that leaves the session column
    under ``SESSION_WIDTH``, whole columns are left out (``NARROW_DROP_ORDER``; the caption
    names them), never the session's. The title says "N of M" when ``total`` sessions are
    more than the rows because of the ``limit``; fewer rows than the limit leave out only
    sessions whose log is gone (``recent_session_bodies``), and the title says so."""
    now = now or datetime.now(UTC)
    title = f"{len(bodies)} session(s)"
    if total and total > len(bodies):
        cut = limit is None or len(bodies) >= limit
        title = f"{len(bodies)} of {total} sessions" if cut else f"{title} ({total - len(bodies)} more without a log)"
    longest = max((cell_len(b.session_id) + (len(HELD_LABEL) if b.held_back else 0) for b in bodies), default=0)
    hidden: list[str] = []
    table = _status_table(bodies, width, now, title, hidden)
    for header in NARROW_DROP_ORDER:
        if _session_room(table, width, longest) >= SESSION_WIDTH:  # (rich keeps a column's min_width)
            break
        hidden.append(header)
        table = _status_table(bodies, width, now, title, hidden)
    return table


def _session_room(table: Table, width: int, longest: int) -> int:
    """Characters left for the session column in ``width`` once every other column has its own."""
    console = Console(width=UNCROPPED_COLUMNS, file=io.StringIO())
    natural = Measurement.get(console, console.options, table).maximum
    return width - natural + max(longest, cell_len("session"), SESSION_WIDTH)


def _status_table(bodies: list[SessionBody], width: int, now: datetime, title: str,
                  hidden: list[str]) -> Table:
    bar_width = BAR_WIDTH if width >= WIDE_COLUMNS else NARROW_BAR_WIDTH
    notes = [] if "context" in hidden else ["┃ micro and LLM thresholds"]
    notes.append("open: LLM breaker open")
    if any(b.held_back for b in bodies):
        notes.append("held back: its log cannot be written or read, its events wait (compactor status --json: why)")
    if hidden:
        notes.append(f"hidden to fit: {', '.join(hidden)} (--json has all)")
    caption = " · ".join(notes)
    table = Table(title=f"compactor: {title}", box=box.SIMPLE_HEAD, expand=False, caption=caption)
    table.add_column("session", overflow="fold", min_width=SESSION_WIDTH)
    for header in STATUS_COLUMNS:
        if header not in hidden:
            table.add_column(header, no_wrap=True, justify="right" if header in ("turn", "tokens") else "left")
    for b in bodies:
        fill = fill_bar(b.prompt_estimate, b.micro_threshold, b.compaction_threshold,
                        b.context_window, bar_width)
        breaker = " [red]open[/]" if b.breaker_open else ""
        pending = (b.pending_job.status or "pending") if b.pending_job else ""
        cells: dict[str, Text | str] = {
            "turn": str(b.current_turn_id), "context": fill, "tokens": f"{b.prompt_estimate}/{b.context_window}",
            "failures": f"{b.failures}{breaker}", "job": pending, "last compaction": _describe(b.last_compaction, now)}
        session = Text(b.session_id)
        if b.held_back:
            session.append(HELD_LABEL, style="bold red")
        table.add_row(session, *(cell for header, cell in cells.items() if header not in hidden))
    return table


def _describe(last: dict[str, Any] | None, now: datetime) -> str:
    """``micro 42s ago``: the last compaction's kind and age (its timestamp when unreadable)."""
    if not last:
        return ""
    kind, stamp = last.get("kind") or "", last.get("timestamp")
    try:
        when = datetime.fromisoformat(str(stamp).replace("Z", "+00:00"))
    except ValueError:
        return " ".join(str(part) for part in (kind, stamp) if part)
    return f"{kind} {_age(now - when)} ago".strip()


def _age(delta: timedelta) -> str:
    seconds = max(int(delta.total_seconds()), 0)
    for unit, size in (("d", 86_400), ("h", 3_600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"
