"""compactor: the process-level glue (CLI, Redis keys, the embedded server, job queue names).

``events`` is the domain; ``producer`` puts work in; ``worker`` runs the jobs. The
modules here are the small shared vocabulary between producer and worker.
"""

import os
import signal
from typing import TextIO

__version__ = "0.1.0"

# The stop signals this process was started with ignored, read at the package's first import (before
# any handler is set): SIGHUP under ``nohup``, SIGINT for a background job of a shell without job
# control (``compactor serve &`` in a script: the terminal's Ctrl-C, meant for the script's foreground
# command, reaches the whole process group). Each stays ignored (``ignored_at_start``).
_IGNORED_AT_START = frozenset(s for s in (signal.SIGINT, signal.SIGHUP) if signal.getsignal(s) is signal.SIG_IGN)


def ignored_at_start(signum: int) -> bool:
    """Whether ``signum`` was ignored when the process started: then no process of the service takes
    it as a stop (each did once its handlers were set, a moment after its start: a Ctrl-C meant for a
    script stopped its background ``compactor``, or not, by when it came), as the shell meant."""
    return signum in _IGNORED_AT_START


def write_or_drop(stream: TextIO, text: str) -> None:
    """``text`` written to ``stream`` and flushed; when its reader is gone (EPIPE), dropped, and
    ``stream``'s file pointed at /dev/null, so neither a later write nor the flush at exit fails
    ("Exception ignored ... BrokenPipeError", a traceback, exit 1 or 120) (Python's recipe)."""
    try:
        stream.write(text)
        stream.flush()
    except BrokenPipeError:
        to_devnull(stream.fileno())


def to_devnull(fd: int) -> None:
    """Point ``fd`` at /dev/null (its reader gone: later writes, and the flush at exit, succeed)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)
