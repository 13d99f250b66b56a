"""``python -m compactor`` and the ``compactor`` console script.

The entry point imports the command line inside itself, so a stop signal while the modules load
(the first half second of every command) ends the command as one later does: Ctrl-C exit code
130, SIGTERM or SIGHUP 128 + its number, no traceback, and ``compact`` prints its CompressResult
JSON line first (SPEC §7: always its last line).
"""

from __future__ import annotations

import signal
import sys
from typing import Any

from compactor import write_or_drop

_EARLY_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # (SIGINT is Python's KeyboardInterrupt already)
_NOTHING_COMPACTED = '{"didCompress":false,"released":0,"promptEstimate":0}'


def main() -> None:
    """Console-script entry point."""
    received: list[int] = []

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


def _command() -> str | None:
    """The command named on the command line (its first word not an option)."""
    return next((arg for arg in sys.argv[1:] if not arg.startswith("-")), None)


if __name__ == "__main__":
    main()
