"""The ``compactor`` command line: one typer app, one module per command group.

    processes.py  serve, watch, work, api     (the long-running processes)
    sessions.py   compact, context, status, dead-letters  (operator actions on sessions)
    health.py     health                      (container health checks)
    demo.py       demo                        (simulated agents on the whole stack)
    bench.py      bench                       (the benchmark scenarios)

Every command takes ``--config PATH``; options docker-compose needs also read
environment variables (REDIS_URL, COMPACTION_DATA_DIR, ...). Bad configuration
(an API address that cannot be listened on included) exits with code 2 and a
one-line message.

Command bodies import the heavy modules (FastAPI, RQ, litellm via the worker)
when they run, so ``--help`` and ``health --check`` (a container health check
every few seconds) start in about half a second.
"""

from __future__ import annotations

from collections.abc import Callable

import typer

from compactor import __version__
from compactor.cli import bench, demo, health, processes, sessions

app = typer.Typer(
    name="compactor",
    help="Context compaction service for LLM coding agents.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(shown: bool) -> None:
    if shown:
        typer.echo(f"compactor {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = typer.Option(False, "--version", "-V", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """Context compaction service for LLM coding agents."""


PANELS: dict[str, tuple[Callable[..., None], ...]] = {
    "Processes": (processes.serve, processes.watch, processes.work, processes.api),
    "Sessions": (sessions.compact, sessions.context, sessions.status, sessions.dead_letters),
    "Operations": (health.health, demo.demo, bench.bench),
}
for panel, commands in PANELS.items():
    for command in commands:
        app.command(rich_help_panel=panel, cls=sessions.CompactCommand if command is sessions.compact else None)(
            command)


def main() -> None:
    """Console-script entry point."""
    app(prog_name="compactor")
