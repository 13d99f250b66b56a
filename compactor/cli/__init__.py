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

import os
import sys
from collections.abc import Callable

import typer
from typer.core import TyperCommand

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
COMMAND_CLASSES: dict[Callable[..., None], type[TyperCommand]] = {
    sessions.compact: sessions.CompactCommand, health.health: health.HealthCommand}
for panel, commands in PANELS.items():
    for command in commands:
        app.command(rich_help_panel=panel, cls=COMMAND_CLASSES.get(command))(command)


EXIT_STDOUT_CLOSED = 141  # 128 + SIGPIPE: what a shell reports for a command a closed pipe stopped


def main() -> None:
    """Console-script entry point. Output to a closed pipe (``compactor context ... | head -1``)
    ends the command with ``EXIT_STDOUT_CLOSED``, silently, as a Unix tool that SIGPIPE stops
    (typer's own handling exits 1, which says Redis was unreachable or the session unknown)."""
    stdout = _file_identity(1)
    try:
        app(prog_name="compactor")
    except SystemExit as e:
        # (on EPIPE, typer puts its PacifyFlushWrapper on stdout, rich dup2s /dev/null onto fd 1
        # (its help, its tables), then each exits 1)
        if e.code == 1 and (type(sys.stdout).__name__ == "PacifyFlushWrapper" or _file_identity(1) != stdout):
            raise SystemExit(EXIT_STDOUT_CLOSED) from None
        raise


def _file_identity(fd: int) -> tuple[int, int] | None:
    """The device and inode ``fd`` is open on, None when it is not open."""
    try:
        found = os.fstat(fd)
    except OSError:
        return None
    return found.st_dev, found.st_ino
