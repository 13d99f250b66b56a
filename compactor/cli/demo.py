"""``compactor demo``: simulated agents on the whole stack, with a live view and a summary table."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import IO, TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from compactor.cli.common import (
    ConfigOpt,
    JsonOpt,
    data_dir_path,
    err_console,
    fail,
    interrupted_by_signals,
    load,
    outside_the_stack,
    print_json,
    usable_dir,
    user_errors,
)

if TYPE_CHECKING:
    from compactor.demo import DemoOptions
    from events.config import Settings

logger = logging.getLogger(__name__)


def demo(
    sessions: Annotated[int, typer.Option("--sessions", "-s", min=1, max=500,
                                          help="Concurrent simulated sessions.")] = 20,
    turns: Annotated[int, typer.Option("--turns", "-t", min=1, max=200,
                                       help="Turns per session.")] = 12,
    window: Annotated[int, typer.Option("--context-window", min=1000, max=10_000_000,
                                        help="contextWindow the agents report (tokens).")] = 8000,
    workers: Annotated[int, typer.Option("--workers", "-w", min=1, max=16,
                                         help="Worker processes.")] = 2,
    data_dir: Annotated[Path | None, typer.Option(
        "--data-dir", parser=data_dir_path,
        help="Keep the logs here (default: a temp dir removed afterwards).")] = None,
    json_out: JsonOpt = False,
    config: ConfigOpt = None,
    redis_url: Annotated[str | None, typer.Option(
        "--redis-url", envvar="REDIS_URL", show_envvar=True,
        help="A Redis to share (the demo uses its own key prefix there, and deletes its keys after); "
             "empty: its own embedded server, in its temporary dir.")] = None,
) -> None:
    """Run simulated agents against watcher + workers and show the compactions live.

    Uses a temporary data dir, removed afterwards, unless --data-dir is given
    (never dataDir or COMPACTION_DATA_DIR); an embedded Redis unless redis.url
    is set (then its own key prefix there, deleted afterwards); the offline
    `extractive` summarizer unless context.compactionModel is set.
    """
    outside_the_stack()  # (its numbers, and its processes', were added to the stack's /metrics)
    from compactor.demo import DemoOptions

    if data_dir is not None:  # read as dataDir is: ~ expanded, made absolute, a NUL refused
        settings = load(config, redis_url=redis_url, data_dir=data_dir)
        data_dir = settings.data_dir
        usable_dir(data_dir, "--data-dir")
    else:  # (the service's dataDir is never used here: one the service could not use refused the demo;
        # "/" stands in for it, as short as a path gets, until the demo's own temp dir replaces it)
        settings = load(config, redis_url=redis_url, data_dir=Path("/"))
    options = DemoOptions(sessions=sessions, turns=turns, context_window=window,
                          workers=workers, data_dir=data_dir)
    with interrupted_by_signals(), tempfile.TemporaryFile() as child_output, user_errors():
        try:
            result = _run(settings, options, json_out, child_output)
        except KeyboardInterrupt:  # (it exited 130 saying nothing, when not on a terminal)
            err_console.print("compactor demo: interrupted; its processes are stopped and its temporary "
                              "files removed", markup=False)
            raise
    if json_out:
        print_json(result)
    else:
        Console().print(summary_table(result))
    if result.get("failedJobs"):  # (it exited 0 with every LLM job failed, saying nothing of why)
        fail(f"{result['failedJobs']} compaction job(s) failed; the first, {result.get('firstJobError')}")


def _run(settings: Settings, options: DemoOptions, json_out: bool, child_output: IO[bytes]) -> dict[str, Any]:
    """The demo, its live numbers on a terminal, else once at the end (a file or a pipe, CI:
    rich's Live leaves the line open there, and the table's title joined it); none with --json."""
    from compactor.demo import run_demo

    if json_out:
        return run_demo(settings, options, output=child_output)
    if err_console.is_terminal:
        with Live(live_view({}), console=err_console, refresh_per_second=4) as live:
            return run_demo(settings, options, output=child_output, on_tick=lambda n: live.update(live_view(n)))
    last: dict[str, Any] = {}
    said: list[bool] = []

    def ticked(numbers: dict[str, Any]) -> None:
        if not said:  # its first numbers: the stack is up (a pipe or a file: nothing was said until the end,
            # 25 s to 2 minutes; said before the start, a start that failed said two lines)
            said.append(True)
            err_console.print(f"compactor demo: {options.sessions} simulated sessions of {options.turns} turns, "
                              f"{options.workers} workers; the numbers when it ends (about a minute)", markup=False)
        last.update(numbers)

    result = run_demo(settings, options, output=child_output, on_tick=ticked)
    err_console.print(live_view(last))
    return result


def live_view(numbers: dict[str, Any]) -> Group:
    jobs = numbers.get("jobs", {})
    table = Table.grid(padding=(0, 2))
    table.add_row("sessions", str(numbers.get("sessions", "…")),
                  "elapsed", f"{numbers.get('elapsed', 0.0):.1f}s")
    table.add_row("events", str(numbers.get("events", 0)),
                  "events/s", f"{numbers.get('eventsPerSecond', 0.0):.0f}")
    table.add_row("micro jobs", str(jobs.get("micro", 0)), "LLM jobs", str(jobs.get("llm", 0)))
    table.add_row("failed jobs", str(numbers.get("failedJobs", 0)),
                  "tokens released", str(numbers.get("tokensReleased", 0)))
    return Group("[bold]compactor demo[/] (simulated agents → watcher → workers)", table)


def summary_table(result: dict[str, Any]) -> Table:
    comp = result.get("compactions", {})
    table = Table(title=(f"{result['sessions']} sessions, {result['events']} events in "
                         f"{result['elapsed']:.1f}s; in the logs: {comp.get('micro', 0)} compact events "
                         f"(micro jobs, and LLM jobs' micro step), {comp.get('llm', 0)} summaries "
                         f"({result.get('compactionModel')}); "
                         f"{result['tokensReleased']} tokens released"))
    for column in ("session", "turns", "estimate uncompacted", "estimate now", "compacts", "summaries"):
        table.add_column(column, justify="left" if column == "session" else "right")
    for row in result.get("perSession", []):
        table.add_row(row["sessionId"], str(row["turns"]), str(row["estimateBefore"]),
                      str(row["estimateAfter"]), str(row["micro"]), str(row["llm"]))
    return table
