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

import errno
import os
import select
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
# a write to stdout refused (``status --json > f`` on a full disk, ``> /dev/full``): said in one line, exit 1
# (a traceback of typer's and click's frames, before)
OUTPUT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EBADF})


def main() -> None:
    """Console-script entry point. Output to a closed pipe (``compactor context ... | head -1``)
    ends the command with ``EXIT_STDOUT_CLOSED``, silently, as a Unix tool that SIGPIPE stops
    (typer's own handling exits 1, which says Redis was unreachable or the session unknown)."""
    stdout = _kept(1)  # (a copy: rich puts /dev/null on fd 1 when a pipe breaks)
    try:
        try:
            app(prog_name="compactor")
        finally:
            if sys.stdout is not None:
                sys.stdout.flush()  # (what is left buffered fails here, not at exit: "Exception ignored", 120)
    except OSError as e:
        if e.errno not in OUTPUT_ERRNOS or e.filename is not None or not _in_output(e):
            raise  # (a log's read failing EIO is no output's: its traceback, as before)
        _say_unwritten(e)
        raise SystemExit(1) from None
    except SystemExit as e:
        # (on EPIPE, typer puts its PacifyFlushWrapper on sys.stdout and rich /dev/null on fd 1, then each
        # exits 1, whichever stream broke: stdout's own reader gone tells a closed stdout from a closed
        # stderr, after which a command's exit 1 is its own)
        broke = type(sys.stdout).__name__ == "PacifyFlushWrapper" or _identity(1) != _identity(stdout)
        if e.code == 1 and broke and _reader_gone(stdout):
            raise SystemExit(EXIT_STDOUT_CLOSED) from None
        raise
    finally:
        if stdout is not None:
            os.close(stdout)


def _in_output(error: OSError) -> bool:
    """Whether ``error`` was raised writing the output: in typer's or click's ``echo``, rich's
    console, or this module's last flush (a stream's write names no file, nor does a read's)."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = tb.tb_frame.f_code.co_filename if tb is not None else ""
    return where == __file__ or any(f"{os.sep}{package}{os.sep}" in where for package in ("typer", "click", "rich"))


def _say_unwritten(error: OSError) -> None:
    """The one line saying the output could not be written; the output is dropped (the error
    would come again at exit, when Python flushes it)."""
    try:
        sys.stderr.write(f"compactor: cannot write the output: {error.strerror or error}\n")
        sys.stderr.flush()
    except OSError:
        pass
    try:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115
    except OSError:
        pass


def _kept(fd: int) -> int | None:
    """A duplicate of ``fd``, None when it is not open."""
    try:
        return os.dup(fd)
    except OSError:
        return None


def _identity(fd: int | None) -> tuple[int, int] | None:
    """The device and inode ``fd`` is open on, None when it is not open."""
    try:
        found = os.fstat(fd) if fd is not None else None
    except OSError:
        return None
    return (found.st_dev, found.st_ino) if found is not None else None


def _reader_gone(fd: int | None) -> bool:
    """Whether ``fd`` is a pipe (or socket) whose reading end is closed (POLLERR)."""
    if fd is None:
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))
