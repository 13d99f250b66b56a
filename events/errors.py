"""One error hierarchy for the whole service.

    CompactorError
    ├── InvalidInput            bad data from outside: permanent, never retried
    │   ├── InvalidEvent        an event, a session id or a cwd (names the field)
    │   └── InvalidConfig       codingcode.yaml or an environment override
    ├── SessionNotFound         no log file for (cwd, sessionId)
    ├── LogCorrupted            a complete line of a log does not parse
    ├── LogWriteFailed          the disk refused an append (full, read-only); nothing torn is left
    ├── LogLocked               another process held the log's lock past a bounded wait
    ├── SummaryInvalid          the LLM reply has no valid 10-section <summary>
    └── LLMUnavailable          the LLM call failed; ``transient`` says whether to retry

Library errors are wrapped with ``raise ... from e`` so the cause stays visible.
"""

from __future__ import annotations


class CompactorError(Exception):
    """Root of every error this service raises on purpose."""


class InvalidInput(CompactorError):
    """Input from outside the service is wrong; retrying cannot help."""

    def __init__(self, field: str, reason: str, index: int | None = None) -> None:
        self.field = field
        self.reason = reason
        self.index = index
        where = f"events[{index}].{field}" if index is not None else field
        super().__init__(f"{where}: {reason}")

    def at(self, index: int) -> InvalidInput:
        """The same error, located at position ``index`` of a batch."""
        return type(self)(self.field, self.reason, index)


class InvalidEvent(InvalidInput):
    """An event, session id or cwd failed validation."""


class InvalidConfig(InvalidInput):
    """The configuration file or an environment override is wrong."""


class SessionNotFound(CompactorError):
    """The session has no log file."""


class LogCorrupted(CompactorError):
    """A complete (newline-terminated) line of a session log is not a valid event."""


class LogWriteFailed(CompactorError):
    """Appending to a session log failed; the log was left as it was before."""


class LogLocked(CompactorError):
    """Another process held a session log's lock longer than the caller would wait (a paused or
    stuck writer): nothing was read or written; try again later."""


class JobAbandoned(CompactorError):
    """A job that went on after the worker janitor declared it abandoned (its worker stopped
    heartbeating: paused, frozen) and handed its session on: it writes nothing more."""


class JobLost(CompactorError):
    """A job waited for is no longer in Redis (a restart without persistence, FLUSHDB, a restore
    of an older snapshot): it may have run all the same."""


class SummaryInvalid(CompactorError):
    """The model's reply has no ``<summary>`` block with the 10 section headings in order.
    ``layout``: refused for where its blocks are (none, or ambiguous), not for what its block
    says (``worker.summarize.extract_summary`` reads such a reply again past a reasoning block)."""

    def __init__(self, message: str, *, layout: bool = False) -> None:
        super().__init__(message)
        self.layout = layout


class LLMUnavailable(CompactorError):
    """The LLM call failed. ``transient`` errors (rate limit, 5xx, timeout) may succeed later.
    ``job_timed_out``: the job's own timeout (RQ's) ran out during the call: nothing more is called."""

    def __init__(self, message: str, *, transient: bool, job_timed_out: bool = False) -> None:
        self.transient = transient
        self.job_timed_out = job_timed_out
        super().__init__(message)
