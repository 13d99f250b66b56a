"""``SignalSafeEvent``: set by a signal handler that interrupts its own thread holding the event's lock.

Each case runs in a process of its own (a deadlock there is a timeout here, not a hung suite), and
a profile hook sends the signal at the exact instant: while the main thread is inside the event's
lock. (``threading.Event`` deadlocks in both: its lock is not reentrant.)"""

from __future__ import annotations

import subprocess
import sys
import textwrap

PROLOGUE = """
import os, signal, sys, time
from compactor.signal_safe import SignalSafeEvent
event = SignalSafeEvent()
sent = []

def send_once_in(function, signum):
    def hook(frame, what, arg):
        if what == "call" and frame.f_code.co_qualname == function and not sent:
            sent.append(signum)
            os.kill(os.getpid(), signum)
    return hook
"""


def _run(body: str) -> str:
    code = PROLOGUE + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          timeout=20).stdout


def test_a_second_stop_signal_during_the_first_handlers_set_sets_it_and_returns() -> None:
    """A closed terminal's SIGHUP, then the supervisor's SIGTERM a moment later, landing while the
    first handler's ``set`` held the lock (a worker hung there, its job done, never stopping)."""
    out = _run("""
        handled = []
        def second(signum, frame):
            event.set()
            handled.append("second")
        def first(signum, frame):
            sys.setprofile(send_once_in("Condition.notify_all", signal.SIGTERM))
            event.set()
            sys.setprofile(None)
            handled.append("first")
        signal.signal(signal.SIGTERM, second)
        signal.signal(signal.SIGHUP, first)
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(0.1)
        print(event.is_set(), len(sent), sorted(handled))
    """)
    assert out.split("\n")[0] == "True 1 ['first', 'second']"


def test_a_stop_signal_while_the_main_thread_waits_on_the_event_sets_it_and_ends_the_wait() -> None:
    """The watcher's loop sleeps in its stop event's ``wait`` (a standby watcher, no shard held):
    a signal landing while that wait held the lock stopped nothing, for good."""
    out = _run("""
        signal.signal(signal.SIGTERM, lambda signum, frame: event.set())
        sys.setprofile(send_once_in("Condition.wait", signal.SIGTERM))  # (Event.wait holds the lock)
        started = time.monotonic()
        event.wait(2.0)
        sys.setprofile(None)
        while not event.is_set() and time.monotonic() - started < 10:
            event.wait(0.1)
        print(event.is_set(), len(sent), time.monotonic() - started < 5)
    """)
    assert out.split("\n")[0] == "True 1 True"
