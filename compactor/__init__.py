"""compactor: the process-level glue (CLI, Redis keys, the embedded server, job queue names).

``events`` is the domain; ``producer`` puts work in; ``worker`` runs the jobs. The
modules here are the small shared vocabulary between producer and worker.
"""

import os
from typing import TextIO

__version__ = "0.1.0"


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
