"""The process-level context the RQ job functions read (no module-level settings elsewhere).

RQ calls ``worker.jobs.*`` with ids and primitives only; what a job needs
besides (settings, a Redis client, the ``Compactor`` with its summarizer) is
installed once per worker process by ``worker.runner.CompactionWorker`` (or by
a test) with ``install``, and read with ``current``. A job running in a
process without a context fails loudly instead of guessing a configuration.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from redis import Redis

from events.config import Settings
from worker.compaction import Compactor
from worker.summarize import LiteLLMSummarizer, Summarizer


@dataclass
class JanitorPlace:
    """Where in the index of stale claims this process's next janitor pass begins: past the
    score and session id of the last one its pass before looked at (None: at the oldest)."""

    after: tuple[float, str] | None = None


@dataclass(frozen=True)
class WorkerContext:
    """Everything a job needs besides its arguments."""

    settings: Settings
    redis: Redis  # decode_responses=False: shared with RQ
    compactor: Compactor
    janitor: JanitorPlace = field(default_factory=JanitorPlace)

    @classmethod
    def build(
        cls,
        settings: Settings,
        client: Redis,
        summarizer: Callable[[], Summarizer] | None = None,
    ) -> WorkerContext:
        """The context for ``settings``; the summarizer defaults to litellm (loaded on first use)."""
        factory = summarizer or (lambda: LiteLLMSummarizer(settings.context.llm_timeout_seconds))
        return cls(settings, client, Compactor(client, settings, factory))


_current: WorkerContext | None = None


def install(context: WorkerContext) -> WorkerContext:
    """Make ``context`` the one the job functions of this process use."""
    global _current
    _current = context
    return context


def clear() -> None:
    """Forget the installed context (tests)."""
    global _current
    _current = None


def current() -> WorkerContext:
    """The installed context; RuntimeError when the process has none."""
    if _current is None:
        raise RuntimeError("no worker context: run jobs with worker.runner.CompactionWorker "
                           "or call worker.context.install() first")
    return _current
