"""The Prometheus metrics the watcher, the workers and the API update (one list, one place).

Process-side metrics (counters and histograms) are defined here once and
updated with one-liners where things happen:

    compactor_events_ingested_total{type}            watcher: lines appended to session logs
    compactor_entries_dead_lettered_total{reason}    watcher: entries dead-lettered (reason kind)
    compactor_jobs_enqueued_total{kind,forced}       anyone enqueueing: a job went to RQ
    compactor_jobs_coalesced_total{kind}             a trigger folded into the pending job
    compactor_jobs_succeeded_total{kind,outcome}     worker: compressed | nothing_to_do
    compactor_jobs_failed_total{kind,outcome}        worker: llm_transient | llm_permanent |
                                                     summary_invalid | session_not_found |
                                                     error | abandoned
    compactor_job_seconds{kind}                      worker: job duration (histogram)
    compactor_llm_call_seconds{outcome}              worker: one litellm call (histogram)
    compactor_tokens_released_total{kind}            worker: estimate before - after, when > 0
    compactor_breaker_opens_total                    worker: a failure counter reached maxFailures

Gauges that describe shared state (stream lag, open breakers, sessions) are
computed by the API from Redis at scrape time (``producer.api_metrics``), so
they are right whichever process changed the state.

Invariants:
- Label values come from small fixed sets (event types, job kinds, outcomes,
  ``REASON_KINDS``); never a session id, job id or free text.
- Multi-process: when ``PROMETHEUS_MULTIPROC_DIR`` is set *before*
  prometheus_client is imported (``compactor serve`` sets it for all its
  children), every process writes its values to files there and the API
  aggregates them with ``MultiProcessCollector``. Unset, each process exposes
  its own values (``REGISTRY``).
- The shared directory is created when missing; at a stack's start the files of
  processes of this host that are gone are removed, unless a process of this host still
  writes there (``prepare_multiprocess_dir``).
- A process's files are named by host name and pid (``counter_{host}-{pid}.db``),
  not by pid alone: the containers of a docker compose stack share the directory
  and each runs its process as pid 1, and two processes writing one file lose
  each other's counts.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import socket
import tempfile
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, values
from prometheus_client.mmap_dict import _INITIAL_MMAP_SIZE, MmapedDict

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
EVENT_TYPES = frozenset({"session_meta", "user", "assistant", "tool_result", "turn_end",
                         "rollback", "compact", "summary"})
REASON_KINDS = ("malformed", "too_large", "invalid_event", "identity", "wrong_shard", "cwd_conflict",
                "turn_order", "duplicate_uuid", "out_of_order", "deleted_unread")
JOB_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
LLM_SECONDS_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300)

HOST = socket.gethostname()


def process_identifier() -> str:
    """This process in the shared directory's file names; a forked child gets its own."""
    return f"{HOST}-{os.getpid()}"


def _usable_multiprocess_dir() -> bool:
    """Whether ``PROMETHEUS_MULTIPROC_DIR`` is set and usable (created when missing: a missing one
    made every command die with a traceback at its first metric). One that cannot be created is
    dropped from the environment with a warning: this process and its children count alone."""
    directory = os.environ.get(MULTIPROC_ENV)
    if not directory:
        return False
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        logging.getLogger(__name__).warning("%s=%s cannot be used (%s): metrics are per process", MULTIPROC_ENV,
                                            directory, e.strerror or e)
        del os.environ[MULTIPROC_ENV]
        values.ValueClass = values.MutexValue  # (prometheus_client chose the multi-process one at import)
        return False
    return True


class AllocatedDict(MmapedDict):
    """prometheus_client's file of one process's values, its blocks allocated before they are
    written through the mapping: the file is sparse, and on a full disk the first write to a
    page with no block behind it killed the process (SIGBUS; the API at its first new route,
    then every child restarted, and serve gave up). With no room at the start, the values go to
    an unlinked file in ``/dev/shm`` (not in a scrape, one warning); a file that cannot grow
    (the API's HTTP histogram outgrows its first 64 KB past ~20 routes) raises ``OSError``
    (ENOSPC) where the series is first set, a Python error. On a file system without fallocate
    (ext2, NFSv3, some FUSE mounts) glibc writes each block instead (not through an O_APPEND
    descriptor: EBADF); a libc that does not (musl) leaves the file sparse, as it was."""

    def __init__(self, filename: str, read_mode: bool = False) -> None:
        fallback = None
        if not read_mode:
            try:
                _allocate(filename, _INITIAL_MMAP_SIZE)
            except OSError as e:
                filename = fallback = _unshared(filename, e)
        super().__init__(filename, read_mode)  # type: ignore[no-untyped-call]
        self._unlinked = fallback is not None
        if fallback is not None:
            os.unlink(fallback)  # (mapped: it lives as long as the process)

    def _init_value(self, key: str) -> None:
        encoded = len(key.encode("utf-8"))
        needed, capacity = self._used + 4 + encoded + (8 - (encoded + 4) % 8) + 16, self._capacity
        while needed > capacity:
            capacity *= 2
        if capacity != self._capacity and not self._unlinked:  # (through a descriptor of its own: glibc's
            _allocate(self._f.name, capacity)  # emulation of fallocate, where the file system has none, refuses
            # prometheus's O_APPEND one; the memory file's name is gone: opened, it made another)
        super()._init_value(key)  # type: ignore[no-untyped-call]


def _allocate(filename: str, size: int) -> None:
    """``filename`` (created when missing) with its first ``size`` bytes (its whole length, when
    longer: one left sparse by an earlier version) allocated on disk; ``OSError`` when there is no
    room (ENOSPC, EDQUOT), left sparse where it cannot be allocated (EOPNOTSUPP from a libc with
    no fallback)."""
    fd = os.open(filename, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        os.posix_fallocate(fd, 0, max(size, os.fstat(fd).st_size))
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise
    finally:
        os.close(fd)


def _unshared(filename: str, error: OSError) -> str:
    """A file in memory (``/dev/shm``) for a process's values when ``filename`` has no room; raises
    ``error`` when there is none there either."""
    with contextlib.suppress(OSError):
        if os.stat(filename).st_size == 0:
            os.unlink(filename)  # (created, empty: a scrape reading it failed)
    try:
        fd, path = tempfile.mkstemp(prefix="compactor-metrics-", dir="/dev/shm")
        os.close(fd)
        _allocate(path, _INITIAL_MMAP_SIZE)
    except OSError:
        raise error from None
    logging.getLogger(__name__).warning("no room for %s (%s): this process's metrics are not in a scrape",
                                        filename, error.strerror or error)
    return path


if _usable_multiprocess_dir():  # before any metric (here or in the API) has a value
    values.MmapedDict = AllocatedDict  # type: ignore[attr-defined]  # (the name MultiProcessValue opens files with)
    values.ValueClass = values.MultiProcessValue(  # type: ignore[no-untyped-call]
        process_identifier)

# No ``*_created`` series (prometheus_client's default, outside the multiprocess mode): they are
# not in OPERATIONS.md's table, and a scrape of a lone API showed them beside the documented ones.
disable_created_metrics()  # type: ignore[no-untyped-call]  # (process-wide: the API's own counters too)

REGISTRY = CollectorRegistry()

EVENTS_INGESTED = Counter(
    "compactor_events_ingested", "Events appended to session logs by the watcher",
    ["type"], registry=REGISTRY)
DEAD_LETTERED = Counter(
    "compactor_entries_dead_lettered", "Stream entries dead-lettered, by reason kind",
    ["reason"], registry=REGISTRY)
JOBS_ENQUEUED = Counter(
    "compactor_jobs_enqueued", "Compaction jobs put on the RQ queue",
    ["kind", "forced"], registry=REGISTRY)
JOBS_COALESCED = Counter(
    "compactor_jobs_coalesced", "Triggers folded into the session's pending job",
    ["kind"], registry=REGISTRY)
JOBS_SUCCEEDED = Counter(
    "compactor_jobs_succeeded", "Compaction jobs that ended with a result",
    ["kind", "outcome"], registry=REGISTRY)
JOBS_FAILED = Counter(
    "compactor_jobs_failed", "Compaction jobs that raised or were abandoned",
    ["kind", "outcome"], registry=REGISTRY)
JOB_SECONDS = Histogram(
    "compactor_job_seconds", "Duration of compaction jobs", ["kind"],
    buckets=JOB_SECONDS_BUCKETS, registry=REGISTRY)
LLM_CALL_SECONDS = Histogram(
    "compactor_llm_call_seconds", "Duration of one LLM summarization call", ["outcome"],
    buckets=LLM_SECONDS_BUCKETS, registry=REGISTRY)
TOKENS_RELEASED = Counter(
    "compactor_tokens_released", "Prompt tokens released by compactions (positive releases only)",
    ["kind"], registry=REGISTRY)
BREAKER_OPENS = Counter(
    "compactor_breaker_opens", "Times a session's LLM failure counter reached maxFailures",
    registry=REGISTRY)


JOB_KINDS = ("micro", "llm")
SUCCEEDED_OUTCOMES = ("compressed", "nothing_to_do")
LLM_CALL_OUTCOMES = ("ok", "error")
FAILED_OUTCOMES = ("llm_transient", "llm_permanent", "summary_invalid", "session_not_found", "error", "abandoned")


def init_series() -> None:
    """Give every series of the counters' fixed label sets a value (0) before its first count. A
    labelled series only appeared at its first increment, and Prometheus takes a series that
    first shows at 1 for no increase: the first job failure or dead letter of each kind after a
    start never fired the alerts OPERATIONS suggests (``rate(compactor_jobs_failed_total[10m]) >
    0``). Called by the service's processes (watcher, workers, API), not at import: a producer
    importing the publisher left a metrics file of zeros in a shared directory per run."""
    for kind in (*sorted(EVENT_TYPES), "other"):
        _ingested(kind)
    for reason in REASON_KINDS:
        DEAD_LETTERED.labels(reason)
    for kind in JOB_KINDS:
        for forced in ("true", "false"):
            JOBS_ENQUEUED.labels(kind, forced)
        JOBS_COALESCED.labels(kind)
        TOKENS_RELEASED.labels(kind)
        for outcome in SUCCEEDED_OUTCOMES:
            JOBS_SUCCEEDED.labels(kind, outcome)
        for outcome in FAILED_OUTCOMES:
            JOBS_FAILED.labels(kind, outcome)
        JOB_SECONDS.labels(kind)  # (the histograms too: a dashboard of them said "no data", not 0)
    JOBS_COALESCED.labels("forced")
    for outcome in LLM_CALL_OUTCOMES:
        LLM_CALL_SECONDS.labels(outcome)


def multiprocess_dir() -> str | None:
    """The shared metrics directory when multi-process mode is on."""
    return os.environ.get(MULTIPROC_ENV) or None


def prepare_multiprocess_dir(directory: Path) -> Path:
    """Create ``directory`` and, when no process of this host still writes there, remove the
    metric files that processes of this host no longer running left. Other hosts' files stay (the
    containers of a compose stack, whose processes cannot be seen from here); so does everything
    while a process of this host writes there (another stack sharing the directory: its counters
    had stopped at zero, written to files no longer there, and its dead processes' counts are part
    of its totals: removed, its counters went backwards)."""
    directory.mkdir(parents=True, exist_ok=True)
    ours: list[tuple[Path, int | None]] = []
    for path in directory.glob("*.db"):  # ``{kind}_{host}-{pid}.db``, the kind with ``_`` in it at times
        prefix, _, pid = path.stem.rpartition("-")
        if not pid.isdigit():
            ours.append((path, None))  # not named by ``process_identifier``
        elif prefix.endswith(f"_{HOST}") and prefix[:-len(HOST) - 1] in _FILE_KINDS:  # (not host my_vm's for vm)
            ours.append((path, int(pid)))
    if not any(pid is not None and pid != os.getpid() and _writes(pid, path) for path, pid in ours):
        for path, _ in ours:
            path.unlink(missing_ok=True)
    return directory


_FILE_KINDS = frozenset({"counter", "histogram", "summary", *(f"gauge_{mode}" for mode in Gauge._MULTIPROC_MODES)})


def _writes(pid: int, path: Path) -> bool:
    """Whether process ``pid`` may be the one writing ``path``: it runs and started before the file
    was last written (a pid reused since, after a reboot or days of respawns, by any process at
    all, had kept every dead one's file for good)."""
    import psutil

    try:
        started = float(psutil.Process(pid).create_time())
        return started <= path.stat().st_mtime + PID_START_SLACK_S
    except psutil.NoSuchProcess:
        return False
    except (psutil.Error, OSError):  # (someone else's process, unreadable: taken for a writer)
        return True


PID_START_SLACK_S = 1.0  # a process's start time (from boot, in ticks) against a file's mtime


def reason_kind(reason: str) -> str:
    """A dead-letter reason (free text) as one of ``REASON_KINDS``, by the fixed words each reason
    starts (or, for a duplicate uuid, ends) with: the rest may quote the producer's data (a uuid
    holding "goes backwards" was counted as ``turn_order``)."""
    text = reason.lower()
    if text.startswith(("turnid: goes backwards", "lastsummarizedturnid: is past the session's turns",
                        "endturnid: is past the session's turns")):
        return "turn_order"
    if text.startswith("streamid: ") and text.endswith("out of order, not written"):
        return "out_of_order"
    if text.startswith("uuid: ") and text.endswith("duplicates an event already in this session"):
        return "duplicate_uuid"
    if _BOUND_ELSEWHERE.match(text):
        return "cwd_conflict"
    if _TOO_LARGE.match(text):
        return "too_large"
    if text.startswith("entries deleted from the stream before the watchers read them"):
        return "deleted_unread"
    if text.startswith("session: belongs to shard"):  # ``producer.watcher.entries.misrouted``
        return "wrong_shard"
    if text.startswith(("sessionid:", "cwd:")):  # a bad one, or one differing from the entry's
        return "identity"
    if text.startswith(("missing field", "field 'session' given", "field 'cwd' given", "field 'event' given",
                        "invalid utf-8", "invalid json", "entry has no fields",
                        "event: must be a json object", "event: the key ")):
        return "malformed"
    return "invalid_event"


# (a session id has no space; the second: a log elsewhere with no session_meta to say which cwd)
_BOUND_ELSEWHERE = re.compile(r"cwd: session [a-z0-9_-]+ is (?:bound to cwd |logged under another cwd \()")
_TOO_LARGE = re.compile(r"event is \d+ bytes, more than limits\.maxeventbytes ")


def count_ingested(events: Iterable[dict[str, Any]]) -> None:
    """Count appended log lines by type (unknown types as ``other``); one ``inc`` per type."""
    counts: dict[str, int] = {}
    for event in events:
        kind = event.get("type")
        label = kind if kind in EVENT_TYPES else "other"
        counts[label] = counts.get(label, 0) + 1
    for label, count in counts.items():
        _ingested(label).inc(count)


@lru_cache(maxsize=None)
def _ingested(label: str) -> Any:
    """The ``EVENTS_INGESTED`` child of a label (``labels()`` looks it up under a lock each time);
    labels are the few event types and ``other``."""
    return EVENTS_INGESTED.labels(label)


def count_dead_letters(reasons: Iterable[str]) -> None:
    """Count entries dead-lettered (after the ack that wrote them succeeded)."""
    for reason in reasons:
        DEAD_LETTERED.labels(reason_kind(reason)).inc()


def observe_job(kind: str, outcome: str, seconds: float, released: int | None) -> None:
    """Record one finished job: success or failure by outcome, duration, tokens released."""
    succeeded = outcome in SUCCEEDED_OUTCOMES
    (JOBS_SUCCEEDED if succeeded else JOBS_FAILED).labels(kind, outcome).inc()
    JOB_SECONDS.labels(kind).observe(seconds)
    if released is not None and released > 0:
        TOKENS_RELEASED.labels(kind).inc(released)
