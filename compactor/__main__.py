"""``python -m compactor`` and the ``compactor`` console script.

The entry point imports the command line inside itself, so a stop signal while the modules load
(the first half second of every command) ends the command as one later does: Ctrl-C exit code
130, SIGTERM or SIGHUP 128 + its number, no traceback, and ``compact`` prints its CompressResult
JSON line first (SPEC §7: always its last line).
"""

from __future__ import annotations

import atexit
import signal
import sys
from typing import Any

from compactor import write_or_drop

_EARLY_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # (SIGINT is Python's KeyboardInterrupt already)
_LATE_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_NOTHING_COMPACTED = '{"didCompress":false,"released":0,"promptEstimate":0}'


def main() -> None:
    """Console-script entry point."""
    received: list[int] = []
    atexit.register(_ignore_late_stops)  # (registered first: run last, after the other exit handlers)

    def stop(signum: int, _frame: Any) -> None:
        received.append(signum)
        raise KeyboardInterrupt

    # (until the command line is loaded: each command takes the signals over from its start; a
    # SIGHUP ignored at the start, ``nohup``, stays ignored)
    previous = {s: signal.signal(s, stop) for s in _EARLY_STOP_SIGNALS
                if signal.getsignal(s) is not signal.SIG_IGN}
    started = False
    try:
        from compactor.cli import main as run

        for s, handler in previous.items():
            signal.signal(s, handler)
        started = True
        run()
    except KeyboardInterrupt:  # (before a command took over the signals: most often while importing)
        if not started and _command() == "compact":
            write_or_drop(sys.stdout, _NOTHING_COMPACTED + "\n")
        raise SystemExit(128 + received[0] if received else 130) from None


def _ignore_late_stops() -> None:
    """The stop signals ignored from here to the process's end: the command is done, its exit code
    decided, and what is left is the interpreter's teardown, where Python has put every signal it
    handled back to its default action. A stop landing there (the supervisor's copy of a closed
    terminal's SIGHUP, a second SIGTERM a few ms after the first) killed a process that had stopped
    cleanly: exit 129 or 143 instead of 0, which a supervisor takes for a crash. (Run as the last
    exit handler: the threads are joined and the other handlers done, nothing is left to stop; the
    output flushed first, so that a reader who stopped reading does not hold it there unstoppable.)"""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # (a closed pipe, a closed or no stream: the teardown's to say)
            pass
    try:
        for signum in _LATE_STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
    except ValueError:  # (not the main thread: its signals are not this one's to set)
        pass


def _command() -> str | None:
    """The command named on the command line (its first word not an option)."""
    return next((arg for arg in sys.argv[1:] if not arg.startswith("-")), None)


if __name__ == "__main__":
    main()
