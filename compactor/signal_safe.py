"""An event a signal handler may set: ``SignalSafeEvent``.

A Python signal handler runs in the main thread between two of its bytecodes, so it may run while
that very thread holds the lock of the event the handler sets: inside its own ``wait`` (the
watcher's loop sleeps in one), or inside a first handler's ``set`` when two stop signals come a
moment apart (a closed terminal's SIGHUP reaches every process of the group, and ``compactor work``
or ``serve`` passes it on as a SIGTERM). ``threading.Event`` guards its flag with a plain lock, and
the handler's ``set`` then waited for its own thread for good: the process neither went on nor
stopped (a worker hung with its job finished, until SIGKILLed).
"""

from __future__ import annotations

import threading


class SignalSafeEvent(threading.Event):
    """``threading.Event`` on a reentrant lock: a handler interrupting its holder takes it over,
    sets the flag and wakes the waiters (``Condition.notify`` tolerates a waiter released twice,
    CPython gh-92530). A handler landing in a ``wait`` between its look at the flag and its sleep
    does not cut that sleep short: give such waits a timeout (every one here has one)."""

    def __init__(self) -> None:
        super().__init__()
        self._cond = threading.Condition(threading.RLock())
