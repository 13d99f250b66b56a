"""``compactor bench``: run the benchmark scenarios (``compactor.bench.*``) and report.

Each scenario module exposes ``run(*, quick=False, progress=None) -> dict``;
``progress`` receives one-line messages. Results print as a table, or as JSON
with ``--json``: one scenario prints its result object as is (for example
``{"view_s", "baseline_s", "ratio", ...}``), ``all`` prints ``{scenario: result}``.
"""

from __future__ import annotations

import importlib
import logging
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from compactor.cli.common import (
    JsonOpt,
    config_path_option,
    err_console,
    interrupted_by_signals,
    load,
    print_json,
    user_errors,
)

logger = logging.getLogger(__name__)


class Scenario(str, Enum):
    view = "view"
    ingest = "ingest"
    jobs = "jobs"
    all = "all"


SCENARIOS = (Scenario.view, Scenario.ingest, Scenario.jobs)


def run_scenario(name: str, *, quick: bool, progress: Any = None) -> dict[str, Any]:
    """Import ``compactor.bench.{name}`` and run it."""
    module = importlib.import_module(f"compactor.bench.{name}")
    result: dict[str, Any] = module.run(quick=quick, progress=progress)
    return result


def bench(
    scenario: Annotated[Scenario, typer.Argument(help="Which benchmark to run.")] = Scenario.all,
    json_out: JsonOpt = False,
    quick: Annotated[bool, typer.Option(
        "--quick", help="Small sizes: seconds to half a minute each (jobs starts workers and a 1 s LLM stub).")] = False,
    config: Annotated[Path | None, typer.Option(
        "--config", "-c", envvar="CODINGCODE_CONFIG", show_envvar=True, parser=config_path_option,
        help="codingcode.yaml to check, as every command does; the benchmarks run on settings of their "
             "own (their own Redis, data dir and LLM stub).")] = None,
) -> None:
    """Benchmark the context view, event ingestion and compaction jobs."""
    # a bad config file fails here with exit 2, like every command; the Redis URL and the data dir, which
    # the benchmarks never use, are not (REDIS_URL=http://x or a dataDir too long for a socket refused them)
    load(config, redis_url="", data_dir=Path("/"), redis=False)
    names = [s.value for s in (SCENARIOS if scenario is Scenario.all else (scenario,))]
    with interrupted_by_signals(), user_errors():  # (its Redis, watcher and temp dirs stopped and removed;
        results = _run_with_progress(names, quick)  # no Redis server, a TMPDIR too long: one line, no traceback)
    if json_out:
        print_json(results if scenario is Scenario.all else results[scenario.value])
        return
    Console().print(results_table(results))


def _run_with_progress(names: list[str], quick: bool) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    columns = (SpinnerColumn(), TextColumn("[bold]{task.fields[name]:8}"), BarColumn(),
               TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=err_console, transient=False) as progress:
        tasks = {n: progress.add_task("waiting", total=1, name=n, start=False) for n in names}
        for name in names:
            task = tasks[name]
            progress.start_task(task)  # (its elapsed time counts from here, not from when it was listed)

            def say(message: str, task: Any = task) -> None:
                progress.update(task, description=str(message)[:80])

            say("running")
            results[name] = run_scenario(name, quick=quick, progress=say)
            progress.update(task, completed=1, description="done")
    return results


def results_table(results: dict[str, dict[str, Any]]) -> Table:
    table = Table(title="compactor bench")
    for column in ("scenario", "metric", "value"):
        table.add_column(column)
    for name, result in results.items():
        for i, (metric, value) in enumerate(result.items()):
            shown = f"{value:.4g}" if isinstance(value, float) else str(value)
            table.add_row(name if i == 0 else "", metric, shown)
        table.add_section()
    return table
