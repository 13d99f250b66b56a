"""The worker process: N non-forking RQ workers on the compaction queue.

``main(settings, count=N)`` checks that Redis answers (a ``redis.ConnectionError``
or ``TimeoutError`` before anything starts, not N children dying at their first
call), preloads the heavy imports (litellm, the tiktoken encodings) once, then
runs one ``CompactionWorker`` per process: in this process when N is 1, else in N forked
children that it supervises (a child that dies is replaced, unless one has died
``MAX_RESPAWNS`` times within ``RESPAWN_WINDOW_S``: then all stop and
``WorkersFailed`` says why; a stop signal is passed on, the first as a SIGTERM, a
later Ctrl-C as itself, and the children waited for). A
child whose supervisor was killed stops by itself, as ``serve``'s children do
(``compactor.serve.exit_with_parent``): SIGTERM within a second, so it finishes
its job, and SIGKILL 15 s later, abandoning it to the janitor below.

``CompactionWorker`` is an RQ ``SimpleWorker`` (jobs run in the worker's main
thread: ~3 ms of RQ overhead per job against ~10 ms for a fork per job). Job
timeouts are still enforced: ``perform_job`` wraps each job in RQ's
``UnixSignalDeathPenalty`` (SIGALRM), which works because the job runs in the
main thread. It installs the process-level ``worker.context`` the job
functions read, and runs a *keeper* thread that

- heartbeats the running job every ``HEARTBEAT_INTERVAL_S`` with an execution
  TTL of ``EXECUTION_TTL_S`` (SimpleWorker's default TTL is the job timeout +
  60 s, i.e. 11 minutes before a killed job is noticed; with the keeper a
  SIGKILLed worker's job expires ~20 s after the kill), and, idle, the worker
  itself as often (RQ's loop does only every ``WORKER_TTL_S - 15`` s): a running
  worker's ``last_heartbeat`` is never much older, and ``compactor health
  --workers`` counts a worker as live by it; and
- every ``JANITOR_INTERVAL_S`` runs the janitor (in one process at a time,
  under a Redis lock): RQ's ``StartedJobRegistry.cleanup`` moves jobs whose
  execution expired to failed (``AbandonedJobError``) and frees their
  rate-limit slot, which releases the session's next job; the session's
  pending-job claim is freed and a coalesced trigger re-checked
  (``worker.jobs.finish``); stale rate-limit slots of the queue's sessions are
  freed. So a session is compactable again within ~25-30 s of a SIGKILL.
  A job its worker took from the queue but died before starting (RQ's
  intermediate queue; RQ itself fails it only after a minute) is failed once
  seen there by two janitor runs ``STRANDED_AFTER_S`` apart, and its claim is
  then freed as stale: the session is compactable again within ~40 s.

A Redis that refuses writes (``MISCONF`` on a full disk) or drops a connection
never ends the worker's loop: it waits (``worker.redis_wait``), and a job whose
start or end could not be recorded is left to the janitor. A loop that ends on
any other error raises ``WorkerLoopEnded`` (the process exits 1 and is replaced).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections import deque
from datetime import UTC, datetime
from collections.abc import Iterator, Sequence
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any

import redis
import rq.executions
import rq.intermediate_queue
import rq.worker.base
import rq.worker.worker_classes
import rq.registry
from rq import Queue, SimpleWorker, worker_registration
from rq.command import parse_payload
from rq.executions import Execution
from rq.intermediate_queue import IntermediateQueue
from rq.job import Job, JobStatus
from rq.job_lifecycle import call_exception_handlers, format_exc_info
from rq.rate_limit import RateLimitRegistry, release_slot
from rq.registry import StartedJobRegistry
from rq.timeouts import JobTimeoutException, TimerDeathPenalty
from rq.utils import as_text
from rq.worker import WorkerStatus

from compactor import ignored_at_start, metrics
from compactor.heap import freeze_heap
from compactor.keys import Keys
from compactor.queue import (
    JANITOR_BATCH,
    STALE_CLAIM_GRACE_S,
    STRANDED_WORDS,
    claim_is_stale,
    compaction_queue,
    parse_job_id,
    pending_job_id,
    queue_unqueued_claim,
    redis_now,
    redis_time_s,
    sessions_to_look_at,
    sync_clock,
)
from compactor.redis_errors import is_transient
from compactor.serve import exit_with_parent, stop_signals_handled
from events.config import Settings
from events.errors import CompactorError
from events.models import escaped
from events.tokens import get_encoding
from worker import context as worker_context
from worker.compaction import STOPPING
from worker.context import WorkerContext
from worker.jobs import finish, replace_abandoned
from worker.redis_wait import RedisWait
from worker.summarize import warm_up_litellm

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 5  # how often the keeper heartbeats a running job
EXECUTION_TTL_S = 20  # a job not heartbeaten for this long is abandoned (its worker died)
JANITOR_INTERVAL_S = 5  # how often a worker process tries to run the janitor
# How long the janitor's re-check of a session waits for its log's lock: the janitor runs in the
# thread that heartbeats the worker's own job, and a paused process holding the lock (the very one
# whose job it recovered) held it there for good (its worker's own jobs then declared abandoned).
JANITOR_LOCK_WAIT_S = 0.5
# A janitor pass stops after this long, under its lock's life (JANITOR_INTERVAL_S - 0.5 s): one of
# 200 sessions each waiting out its lock outlived the lock, and every worker ran a pass at once over
# the same sessions, their keeper threads (their jobs' heartbeats) held up ~100 s.
JANITOR_PASS_S = 3.0
WORKER_TTL_S = 60  # RQ worker key TTL; the blocking dequeue returns every WORKER_TTL_S - 15 s
RQ_MAINTENANCE_INTERVAL_S = 60  # RQ's own registry maintenance (finished/failed/... cleanup)
RESPAWN_DELAY_S = 1.0  # before replacing a worker child that died
MAX_RESPAWNS = 5  # deaths of one worker child within RESPAWN_WINDOW_S that stop them all
RESPAWN_WINDOW_S = 60.0
REDIS_CHECK_TIMEOUT_S = 5.0
STRANDED_AFTER_S = 10  # a job dequeued but not started this long: its worker died in between
UNSUPPORTED_COMMANDS = frozenset({"stop-job", "stop-execution", "kill-horse"})  # (RQ's, for a forking worker)
SUCCESS_TRIES = 4  # tries at recording a job's success while Redis drops the connection (1 + 2 + 4 s apart)
PRELOAD_ENCODINGS = ("cl100k_base", "o200k_base")


class _Keeper:
    """The worker's background thread: job heartbeats and the janitor."""

    def __init__(self, worker: CompactionWorker) -> None:
        self.worker = worker
        self._lock = threading.Lock()
        self._job: tuple[Job, Execution] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="compaction-keeper", daemon=True)
        self._next_janitor = 0.0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # (started)
            self._thread.join(timeout=5)

    def running(self, job: Job, execution: Execution) -> None:
        with self._lock:
            self._job = (job, execution)

    def idle(self) -> None:
        with self._lock:
            self._job = None

    def _loop(self) -> None:
        while not self._stop.wait(HEARTBEAT_INTERVAL_S):
            self._sync_clock()
            self._beat()
            if not self._stop.is_set():  # (not once the worker ends: it unsubscribes and unregisters)
                self._listen()
                self._keep_registered()
            if time.monotonic() >= self._next_janitor:
                self._next_janitor = time.monotonic() + JANITOR_INTERVAL_S
                self._janitor()

    def _sync_clock(self) -> None:
        """Keep the offset to Redis's clock that RQ's scores are taken in (``_on_redis_clock``)
        measured (one ``TIME`` a minute)."""
        try:
            sync_clock(self.worker.connection)
        except Exception as e:
            self._failed("measuring the clock against Redis's", e)

    def _beat(self) -> None:
        with self._lock:
            if self._job is None:
                self._beat_idle()
                return
            try:
                self.worker.maintain_heartbeats(*self._job)
            except Exception as e:
                self._failed("the job's heartbeat", e)

    def _beat_idle(self) -> None:
        """The worker's own heartbeat (``last_heartbeat``, read by ``compactor health --workers``);
        RQ's loop gives one only every ``WORKER_TTL_S - 15`` s while it waits for a job.
        (``CompactionWorker.heartbeat`` reports a Redis that does not serve it.)"""
        if not self.worker.registered:  # (a heartbeat creates the key its registration checks for)
            return
        try:
            self.worker.heartbeat()
        except Exception as e:
            self._failed("the worker's idle heartbeat", e)

    def _listen(self) -> None:
        """Subscribe again when the command channel is not listened to (``CompactionWorker.listening``)."""
        try:
            self.worker.subscribe_again()
        except Exception as e:
            self._failed("subscribing to the command channel", e)

    def _keep_registered(self) -> None:
        """Register again when Redis lost the registration (``CompactionWorker.keep_registered``),
        idle or busy."""
        if not self.worker.registered:
            return
        try:
            self.worker.keep_registered()
        except Exception as e:
            self._failed("the worker's registration check", e)

    def _janitor(self) -> None:
        try:
            run_janitor(worker_context.current(), self.worker)
        except Exception as e:
            self._failed("the janitor", e)

    def _failed(self, what: str, error: Exception) -> None:
        """A Redis outage or refusal: a line now and then (``RedisWait``), not ~50 of traceback per try."""
        if is_transient(error):
            self.worker.redis_wait.failed(what, error)
        else:
            logger.exception("%s failed worker=%s", what, self.worker.name)


class CompactionWorker(SimpleWorker):
    """A non-forking RQ worker for the compaction queue (see the module docstring)."""

    def __init__(
        self,
        queues: Sequence[Queue],
        *,
        connection: redis.Redis,
        settings: Settings,
        context: WorkerContext | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("worker_ttl", WORKER_TTL_S)
        kwargs.setdefault("maintenance_interval", RQ_MAINTENANCE_INTERVAL_S)
        kwargs.setdefault("job_monitoring_interval", HEARTBEAT_INTERVAL_S)
        super().__init__(list(queues), connection=connection, **kwargs)
        self.settings = settings
        worker_context.install(context or WorkerContext.build(settings, connection))
        self.redis_wait = RedisWait(self.name)
        with contextlib.suppress(redis.RedisError):  # (its first scores in Redis's time; else the keeper's)
            sync_clock(connection)
        self.registered = False  # set once RQ's registration (``register_birth``) went through
        # The janitor's first run, once registered: RQ counts a stranded job's failure in the
        # worker's key, and one created before ``register_birth`` found it: the worker died at start.
        self._janitor_ran = False
        self.subscribe_tried = False  # set once RQ's loop tried to subscribe to the command channel
        self._subscribing = threading.Lock()  # RQ's subscription and the keeper's again, one at a time
        self._keeper = _Keeper(self)

    @classmethod
    def for_settings(cls, connection: redis.Redis, settings: Settings, **kwargs: Any) -> CompactionWorker:
        """A worker on the compaction queue of ``settings``."""
        return cls([compaction_queue(connection, settings)], connection=connection, settings=settings, **kwargs)

    def _install_signal_handlers(self) -> None:
        """RQ's (SIGINT, SIGTERM: a warm shutdown: the job in hand finishes), and SIGHUP the same
        (a closed terminal killed ``compactor work`` outright, its job cut mid-run; a second
        signal within a second, the terminal's and its supervisor's, is one for RQ)."""
        super()._install_signal_handlers()  # type: ignore[no-untyped-call]
        if ignored_at_start(signal.SIGINT):  # (a script's background job: stays ignored; RQ took it over)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        if not ignored_at_start(signal.SIGHUP):  # (nohup: stays ignored)
            signal.signal(signal.SIGHUP, self.request_stop)

    def request_stop(self, signum: int, frame: Any) -> None:
        """RQ's warm shutdown; the job in hand is told too (``worker.compaction.STOPPING``): it
        makes no LLM call past the one it is in. A SIGHUP once the stop is under way is the same
        stop (RQ points SIGINT and SIGTERM elsewhere after the first, not SIGHUP): a closed
        terminal's hang-up after ``serve``'s SIGTERM ran RQ's handler again, which raised
        ``StopRequested`` wherever the stopping worker was, in its teardown too: cut half-way,
        a traceback, exit 1."""
        STOPPING.set()
        if self._shutdown_requested_date is not None:
            return
        try:
            super().request_stop(signum, frame)  # type: ignore[no-untyped-call]
        finally:  # (RQ pointed SIGINT at its cold stop, then raised StopRequested when idle: a script's
            if ignored_at_start(signal.SIGINT):  # Ctrl-C, meant for its foreground command, cut the job in hand)
                signal.signal(signal.SIGINT, signal.SIG_IGN)

    def set_shutdown_requested_date(self) -> None:
        """RQ's record of when the stop was asked for (``rq info`` shows it), skipped while Redis
        does not serve. RQ writes it from the stop signal's handler, so Redis's error was raised
        wherever the main thread was: in the job in hand, whose LLM call was cut at once (the
        job left to the janitor, run again from the start) by a warm stop during an outage."""
        with self._unless_down("recording the stop request"):
            super().set_shutdown_requested_date()  # type: ignore[no-untyped-call]

    def request_force_stop(self, signum: int, frame: Any) -> None:
        """RQ's cold shutdown (the job in hand cut, failed) on a second Ctrl-C only: a SIGTERM once
        the warm stop began is the same stop (the supervisor passes a hang-up or a Ctrl-C on as
        SIGTERM; ``serve``, ``docker stop`` and systemd send one to every process), which RQ took
        for a cold stop when it came a second or more after the first signal (a loaded VM)."""
        if signum == signal.SIGINT:
            super().request_force_stop(signum, frame)

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        """The execution TTL: short, since the keeper heartbeats running jobs."""
        return EXECUTION_TTL_S

    def execute_job(self, job: Job, queue: Queue) -> None:
        """Run the job in this thread while the keeper heartbeats it. When Redis does not let
        its start or end be recorded, the job is left to the janitor, as a killed worker's is."""
        try:
            execution = self.prepare_execution(job)
            self._keeper.running(job, execution)
            try:
                self.perform_job(job, queue, execution)
            finally:
                self._keeper.idle()
        except redis.RedisError as error:
            if not is_transient(error):
                raise
            self.redis_wait.failed(f"recording job {job.id}", error)
            logger.warning("job %s not recorded as started or ended worker=%s: %s; the janitor recovers it",
                           job.id, self.name, error, extra={"job_id": job.id})
        self.set_state(WorkerStatus.IDLE)

    # -- riding out a Redis that does not serve (``worker.redis_wait``) ------------------------

    def dequeue_job_and_maintain_ttl(self, timeout: int | None, max_idle_time: int | None = None) -> Any:
        """RQ's dequeue (which waits out a dropped connection in its own loop), waiting out
        refusals too, and a dropped connection before that loop."""
        while True:
            try:
                return super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)
            except redis.RedisError as error:
                if not is_transient(error):
                    raise
                self._wait("waiting for a job", error)

    def register_birth(self) -> None:
        """RQ's registration of the worker, tried until Redis takes it (a worker started, or
        replaced, while Redis refuses writes waits instead of dying at once, over and over)."""
        retry = False
        while True:
            try:
                if retry:  # a refused try may have left this worker's key (its name is its own)
                    self.connection.delete(self.key)
                super().register_birth()  # type: ignore[no-untyped-call]  # (untyped in RQ 3)
                self.registered = True
                break
            except redis.RedisError as error:
                if not is_transient(error):
                    raise
                self._wait("registering the worker", error)
                retry = True
        if not self._janitor_ran:  # recover what a dead predecessor left, before the first job
            self._janitor_ran = True
            try:
                run_janitor(worker_context.current(), self)
            except redis.RedisError as error:
                if not is_transient(error):
                    raise
                self.redis_wait.failed("the janitor", error)

    def keep_registered(self) -> None:
        """Register again when Redis lost the worker's registration: its data lost (a restart
        without persistence, a ``FLUSHALL``) or the worker's key expired during an outage (RQ's
        maintenance then drops it from the worker sets). A heartbeat recreates the key, but not
        its fields or the sets, so ``Worker.all`` (``compactor health --workers``, the compose
        healthcheck) no longer saw a worker that went on taking jobs."""
        with self.connection.pipeline(transaction=False) as pipe:
            pipe.sismember(self.redis_workers_keys, self.key)
            pipe.hexists(self.key, "birth")
            listed, born = pipe.execute()
        if listed and born:
            return
        with self.connection.pipeline() as pipe:
            pipe.hset(self.key, mapping=self.serialize())
            worker_registration.register(self, pipe)
            pipe.expire(self.key, self.worker_ttl + 60)
            pipe.execute()
        logger.warning("worker %s: Redis had lost its registration (data lost, or its key expired during an "
                       "outage); registered again", self.name)

    def subscribe(self) -> None:
        """RQ's command channel (``rq`` stop-job commands), left out while Redis is unreachable;
        the keeper subscribes again (``listening``, ``subscribe_again``)."""
        with self._subscribing:
            try:
                with self._unless_down("subscribing to the command channel"):
                    super().subscribe()  # type: ignore[no-untyped-call]  # (untyped in RQ 3)
            finally:
                self.subscribe_tried = True

    def unsubscribe(self) -> None:
        """RQ's, with the listener told to stop first: RQ stops it after sending UNSUBSCRIBE, and a
        listener that read the reply in between waited for the next message again (up to RQ's 60 s),
        outliving the worker. Told first, the reply wakes it and it ends. (Told without waiting:
        redis-py 8's ``stop()`` waits for the thread to end, which, before the UNSUBSCRIBE that
        wakes it is sent, took RQ's 60 s: every worker's stop, and every burst run, lasted a minute.)"""
        thread = self.pubsub_thread
        if thread is not None:
            try:
                thread.stop(timeout=0)  # (redis-py 8: the flag cleared, no wait)
            except TypeError:  # (redis-py 5-7: stop() takes no timeout, and never waited)
                thread.stop()
        super().unsubscribe()  # type: ignore[no-untyped-call]  # (untyped in RQ 3)

    def handle_payload(self, message: dict[str, Any]) -> None:
        """RQ's handling of a command, but a malformed one is logged and ignored: RQ's error
        ended the channel's thread (the worker was deaf to commands until the keeper noticed).
        ``stop-job``, ``stop-execution`` and ``kill-horse`` stop nothing in a worker that runs its
        jobs in its own process (no work horse): said so, a WARNING (stop-job was silent, and
        kill-horse said "Worker is not working" in the middle of a job)."""
        try:
            payload = parse_payload(message)
            command = payload.get("command")
            if command in UNSUPPORTED_COMMANDS:
                running = self.get_current_job_id()
                logger.warning("worker %s: rq's %s command%s stops nothing here (the worker runs its jobs in its own "
                               "process, no work horse): %s; a SIGTERM stops the worker after its LLM call in hand",
                               self.name, command, f" for job {payload['job_id']}" if payload.get("job_id") else "",
                               f"job {running} runs to its end" if running else "no job runs")
                return
            super().handle_payload(message)  # type: ignore[no-untyped-call]  # (untyped in RQ 3)
        except Exception:
            logger.warning("worker %s: ignored a malformed command %r", self.name, message.get("data"), exc_info=True)

    def _pubsub_exception_handler(self, exc: BaseException, pubsub: Any, pubsub_thread: Any) -> None:
        """The command channel's thread on an error: a Redis that does not serve is waited out
        (RQ waits out a dropped connection only); any other error ends the thread with one log
        line instead of a traceback, and the keeper subscribes again."""
        if not isinstance(exc, Exception):
            raise exc
        if is_transient(exc):
            self.redis_wait.failed("listening to the command channel", exc)
            time.sleep(2.0)
            return
        logger.error("worker %s: the command channel's listener ended on %s: %s; subscribing again",
                     self.name, type(exc).__name__, exc)
        pubsub_thread.stop()

    def listening(self) -> bool:
        """Whether the command channel is listened to, or need not be yet: False when RQ's
        subscription failed (Redis went away between the registration and it: the worker then
        ignored stop-job commands until it was restarted) or its thread ended (RQ's thread
        waits out a dropped connection, and ends on any other error)."""
        if not self.subscribe_tried:  # (RQ subscribes once registered; not before)
            return True
        thread = self.pubsub_thread
        return thread is not None and thread.is_alive()

    def subscribe_again(self) -> None:
        """Unless ``listening``: subscribe anew, the earlier subscription (if any) closed; raises
        what Redis does. (Serialized with RQ's own ``subscribe``: the keeper's beat could land
        while RQ's SUBSCRIBE was in flight, and two threads then read one connection.)"""
        with self._subscribing:
            if self.listening():
                return
            if self.pubsub is not None:
                with contextlib.suppress(Exception):
                    self.pubsub.close()
            self.pubsub, self.pubsub_thread = None, None
            super().subscribe()  # type: ignore[no-untyped-call]  # (untyped in RQ 3)
        logger.info("worker %s: subscribed to its command channel again", self.name)

    def set_state(self, state: str, pipeline: Any | None = None) -> None:
        """RQ's record of the worker's state, skipped (and reported) while Redis does not serve."""
        if pipeline is not None:  # (queued: the pipeline's owner handles its errors)
            super().set_state(state, pipeline)
            return
        with self._unless_down("recording the worker's state"):
            super().set_state(state)

    def heartbeat(self, timeout: int | None = None, pipeline: Any | None = None) -> None:
        """RQ's heartbeat, skipped (and reported) while Redis does not serve."""
        if pipeline is not None:
            super().heartbeat(timeout, pipeline)
            return
        with self._unless_down("the worker's heartbeat"):
            super().heartbeat(timeout)
            self.redis_wait.served()

    def run_maintenance_tasks(self) -> None:
        """RQ's registry maintenance, put off (and reported) while Redis does not serve."""
        with self._unless_down("registry maintenance"):
            super().run_maintenance_tasks()  # type: ignore[no-untyped-call]  # (untyped in RQ 3)

    def check_for_suspension(self, burst: bool) -> None:
        """RQ's ``rq suspend`` check, skipped while Redis does not serve (the dequeue waits)."""
        with self._unless_down("the suspension check"):
            super().check_for_suspension(burst)

    @contextlib.contextmanager
    def _unless_down(self, what: str) -> Iterator[None]:
        """Run the block; a Redis that does not serve it (``is_transient``) is reported and the
        block skipped, any other error raised."""
        try:
            yield
        except redis.RedisError as error:
            if not is_transient(error):
                raise
            self.redis_wait.failed(what, error)

    def _wait(self, what: str, error: redis.RedisError) -> None:
        self.redis_wait.failed(what, error)
        time.sleep(self.redis_wait.next_wait())

    def handle_job_success(self, job: Job, queue: Queue, started_job_registry: StartedJobRegistry,
                           execution: Execution) -> None:
        """RQ's record of a job's success, tried again while Redis drops the connection or times
        out (up to ``SUCCESS_TRIES`` times, ~7 s in all): RQ's own ``except`` recorded the job
        ``failed`` instead, a forced request answered 502 with its summary in the log (one dropped
        connection in 500 jobs under a kill storm). Once the record landed (an error after it:
        the release of the session's rate-limit slot), only that release is tried again; the
        janitor frees a slot left behind (``_clean_rate_limits``)."""
        for attempt in range(SUCCESS_TRIES):
            try:
                if attempt and as_text(self.connection.hget(job.key, "status") or b"") == JobStatus.FINISHED:
                    release_slot(job)
                else:
                    super().handle_job_success(job, queue, started_job_registry, execution)
                if attempt:
                    self.redis_wait.served()
                return
            except redis.RedisError as error:
                if not is_transient(error) or attempt == SUCCESS_TRIES - 1:
                    raise
                self.redis_wait.failed(f"recording job {job.id}'s success", error)
                time.sleep(self.redis_wait.next_wait())

    def handle_job_failure(self, job: Job, queue: Queue, started_job_registry: Any = None, exc_string: str = "",
                           execution: Execution | None = None) -> None:
        """RQ's, with the job's error as valid text: a lone surrogate in it (quoted from a reply or a
        provider's error) made RQ's store of the result raise, and the worker quit, the job left
        ``started`` until declared abandoned (its real error lost). A forced job RQ found stranded
        (taken from the queue by a worker that died before starting it) is replaced first, as one
        abandoned while it ran is by its failure callback (``worker.jobs.replace_if_abandoned``)."""
        if exc_string.startswith(STRANDED_WORDS):
            replace_abandoned(job, "its worker died before it started")
        super().handle_job_failure(job, queue, started_job_registry, escaped(exc_string), execution)

    def handle_exception(self, job: Job, *exc_info: Any) -> None:
        """RQ's handling of a failed job, but a failure the job classified and logged already
        (a ``CompactorError``: an LLM failure, an invalid summary, a missing session) is one
        ERROR line, not its chained traceback (~100 lines per failed LLM call, litellm's and
        httpx's causes included). The job's result keeps the traceback (``exc_string``); DEBUG
        logs it too. Anything else keeps RQ's full traceback."""
        error = exc_info[1] if len(exc_info) > 1 else None
        if not isinstance(error, CompactorError):
            super().handle_exception(job, *exc_info)
            return
        self.log.error("Worker %s: job %s failed: %s: %s", self.name, job.id, type(error).__name__, error,
                       extra={"queue": job.origin, "job_id": job.id})
        self.log.debug("Worker %s: job %s traceback:\n%s", self.name, job.id, format_exc_info(exc_info))
        call_exception_handlers(self._exc_handlers, job, *exc_info)

    def work(self, *args: Any, **kwargs: Any) -> bool:
        """RQ's work loop, with the keeper thread running alongside.

        Raises ``WorkerLoopEnded`` when the loop ended on an error while it was to run until
        stopped (RQ logs the error and returns): the process is then replaced, not left idle.
        """
        self._keeper.start()
        try:
            worked = bool(super().work(*args, **kwargs))  # (its registration runs the janitor)
        finally:
            self._keeper.stop()
        burst = kwargs.get("burst", args[0] if args else False)
        asked_to_end = burst or kwargs.get("max_jobs") is not None or kwargs.get("max_idle_time") is not None
        if not (asked_to_end or self._stop_requested or self._shutdown_requested_date is not None):
            raise WorkerLoopEnded(f"worker {self.name}: RQ's work loop ended on an error (logged above)")
        return worked

    def teardown(self) -> None:
        """Stop the keeper before RQ deletes the worker's key, so no late heartbeat recreates it.
        A worker that ends while Redis does not serve leaves its key to expire."""
        self._keeper.stop()
        try:
            super().teardown()  # type: ignore[no-untyped-call]  # (untyped in RQ 3)
        except redis.RedisError as error:
            if not is_transient(error):
                raise
            logger.warning("worker %s ended without recording it: %s (its key expires within %d s)",
                           self.name, error, WORKER_TTL_S)
            with contextlib.suppress(redis.RedisError):
                self.unsubscribe()  # (RQ's teardown does it after recording the end)


class WorkerLoopEnded(RuntimeError):
    """RQ's work loop ended on an error while the worker was to run until stopped."""


def run_janitor(context: WorkerContext, worker: CompactionWorker | None = None) -> list[str]:
    """Fail abandoned jobs, free their sessions and stale rate-limit slots; the job ids recovered.

    Safe to run from any process at any time; a Redis lock keeps concurrent
    runs from doing the work twice.
    """
    client, settings = context.redis, context.settings
    keys = Keys(settings.redis.prefix, settings.redis.shards)
    lock_key = keys.janitor
    if not client.set(lock_key, os.getpid(), nx=True, px=JANITOR_INTERVAL_S * 1000 - 500):
        return []
    deadline = time.monotonic() + JANITOR_PASS_S  # (what is left goes to the next pass)
    queue = compaction_queue(client, settings)
    # (its failure callbacks, a forced job's replacement, under a timer: this is the keeper's thread,
    # where RQ's default alarm signal cannot be set, and the callback failed unrun)
    registry = StartedJobRegistry(queue=queue, death_penalty_class=_CallbackTimer)
    expired = registry.get_expired_job_ids()
    if expired:
        registry.cleanup()
    if worker is not None and worker.registered:  # (RQ counts the failure in the worker's key: created
        # before its registration, ``register_birth`` found it and the worker died at its start)
        _fail_stranded(worker, queue)
    _clean_rate_limits(client, keys.prefix)
    recovered = []
    for job_id in expired:
        parsed = parse_job_id(job_id)
        if parsed is None:
            continue
        metrics.JOBS_FAILED.labels(parsed[1], "abandoned").inc()
        logger.warning("abandoned job recovered session=%s job=%s", parsed[2], job_id,
                       extra={"session_id": parsed[2], "job_id": job_id, "kind": parsed[1],
                              "outcome": "abandoned"})
        recovered.append(job_id)
        _replace_without_callback(context, job_id)  # (two round trips: past the deadline too, or never)
        if time.monotonic() < deadline:  # (past it: failed above, its claim a stale one for a later pass)
            finish(context, parsed[2], job_id, abandoned=True, lock_wait_s=JANITOR_LOCK_WAIT_S)
    recovered += _free_stale_claims(context, deadline)
    return recovered


class _CallbackTimedOut(JobTimeoutException):
    """A failure callback run by the janitor past its timeout."""


class _CallbackTimer(TimerDeathPenalty):
    """RQ's timer penalty (the janitor's thread cannot set RQ's alarm signal) on an exception class
    of its own: RQ's sets its message on the class it is given, ``JobTimeoutException``, for the
    whole process, and every later job timeout of the worker read "(30 seconds)", the callback's."""

    def __init__(self, timeout: Any, exception: Any = None, **kwargs: Any) -> None:
        super().__init__(timeout, _CallbackTimedOut, **kwargs)  # type: ignore[no-untyped-call]


def _replace_without_callback(context: WorkerContext, job_id: str) -> None:
    """``replace_abandoned`` for a forced job queued before forced jobs had their failure callback
    (by the release before this one: an upgrade's restart abandons such jobs), which RQ's cleanup
    just failed as abandoned."""
    try:
        job = Job.fetch(job_id, connection=context.redis)
        if job.failure_callback is None and job.get_status(refresh=False) == JobStatus.FAILED:
            replace_abandoned(job, "its worker died while it ran")
    except (redis.ConnectionError, redis.TimeoutError):
        raise
    except Exception:
        logger.exception("abandoned forced job %s not queued again", job_id)


class _StrandedJobs(IntermediateQueue):
    """RQ's intermediate queue with a shorter wait: a job a worker took from the queue and died
    before starting is failed by RQ's own ``cleanup`` once first seen ``STRANDED_AFTER_S`` ago
    (RQ waits a minute; its claim is then freed as stale, and a session must be compactable
    again within 60 s of a kill)."""

    def should_be_cleaned_up(self, job_id: str) -> bool:
        first_seen = self.get_first_seen(job_id)
        return first_seen is not None and redis_time_s() - first_seen.timestamp() > STRANDED_AFTER_S


def _on_redis_clock() -> None:
    """Have RQ score its registries of started jobs and executions (a job's expiry: its
    heartbeat's time plus its TTL) and a taken job's first sighting in Redis's time, as this
    service's claims, leases and job ids are (``compactor.queue.sync_clock``). RQ used the clock
    of the host writing a score and of the host reading it: a worker host 30 s behind another had
    its running jobs failed as abandoned by the other's cleanup (a forced compaction answered as
    failed, then succeeding), and one 10 minutes ahead had a killed job recovered 10 minutes late."""
    rq.registry.current_timestamp = lambda: int(redis_time_s())  # type: ignore[attr-defined]
    rq.executions.current_timestamp = lambda: int(redis_time_s())  # type: ignore[attr-defined]
    rq.intermediate_queue.now = lambda: datetime.fromtimestamp(redis_time_s(), UTC)  # type: ignore[attr-defined]
    # ... and a worker's own times: its last_heartbeat, which ``compactor health --workers`` ages
    # against Redis's TIME (a worker host 30 s behind was never live), and a job's start and end
    rq.worker.base.now = rq.intermediate_queue.now  # type: ignore[attr-defined]
    rq.worker.worker_classes.now = rq.intermediate_queue.now  # type: ignore[attr-defined]


_on_redis_clock()


def _fail_stranded(worker: SimpleWorker, queue: Queue) -> None:
    _StrandedJobs(queue.key, queue.connection).cleanup(worker, queue)


def _free_stale_claims(context: WorkerContext, deadline: float | None = None) -> list[str]:
    """Claims whose job never came or ended unnoticed, and triggers left unsettled: handle them,
    up to ``deadline`` (``time.monotonic()``). Each pass goes on from where this process's last
    one stopped, past the sessions it looked at (a live job's claim, one that failed, one freed):
    the 200 oldest were looked at again at each pass, and 200 live claims of a queue's backlog, or
    failing sessions, hid every stale claim behind them. The place is a score and a session id,
    not a rank: sessions settled meanwhile before it moved every later one back, and a rank
    skipped as many until a pass wrapped around (``WorkerContext.janitor``)."""
    client, settings = context.redis, context.settings
    freed: list[str] = []
    now = redis_now(client)  # (the claims' clock: a worker's own may be off)
    sessions = sessions_to_look_at(client, settings, STALE_CLAIM_GRACE_S, now, after=context.janitor.after)
    looked = 0
    for session_id, score in sessions:
        if deadline is not None and time.monotonic() >= deadline:
            break
        _look_at(context, session_id, now, freed)  # (Redis gone: raised, the place kept)
        looked += 1
        context.janitor.after = (score, session_id)
    if looked == len(sessions) < JANITOR_BATCH:  # (all the index had past the place: the next pass
        context.janitor.after = None  # begins at its oldest again)
    return freed


def _look_at(context: WorkerContext, session_id: str, now: float, freed: list[str]) -> None:
    """Free the session's claim if stale, or re-check its unsettled trigger; what it frees goes
    into ``freed``."""
    client, settings = context.redis, context.settings
    try:
        claim = pending_job_id(client, settings, session_id)
        if claim is not None and not claim_is_stale(client, claim, now):
            if queue_unqueued_claim(client, settings, session_id, claim, now):
                logger.warning("forced job queued session=%s job=%s: claimed, its enqueue interrupted",
                               session_id, claim, extra={"session_id": session_id, "job_id": claim,
                                                         "outcome": "unqueued_claim"})
                freed.append(claim)
            return  # a live job still owns the session
    except (redis.ConnectionError, redis.TimeoutError):
        raise  # (Redis gone: every session's would fail; the pass ends, the next one tries again)
    except Exception:  # (one session's: the oldest first, it ended every pass before the others, for good)
        logger.exception("janitor skipped session=%s", session_id, extra={"session_id": session_id})
        return
    if claim is None:
        logger.warning("unsettled trigger re-checked session=%s", session_id,
                       extra={"session_id": session_id, "outcome": "unsettled_trigger"})
    else:
        logger.warning("stale claim freed session=%s job=%s", session_id, claim,
                       extra={"session_id": session_id, "job_id": claim, "outcome": "stale_claim"})
    finish(context, session_id, claim or "", abandoned=True, lock_wait_s=JANITOR_LOCK_WAIT_S)
    freed.append(claim or session_id)


def _clean_rate_limits(client: redis.Redis, prefix: str) -> None:
    """Free leaked slots of this service's per-session rate limits."""
    for registry in RateLimitRegistry.all(client):
        if registry.key.startswith(f"{prefix}:") and registry.get_allowed_job_count():
            registry.cleanup()


# -- the process -------------------------------------------------------------------------


def preload() -> None:
    """The heavy imports, once per process, before any job: litellm (warmed up: it leaves no thread
    running, so ``work --count N`` forks its workers from a process of one thread) and the encodings."""
    started = time.monotonic()
    warm_up_litellm()
    for name in PRELOAD_ENCODINGS:
        get_encoding(name)
    import worker.jobs  # noqa: F401 - RQ resolves the job functions by name; have them ready

    logger.info("worker preload done in %.1f s", time.monotonic() - started)


def run_worker(settings: Settings, *, burst: bool = False) -> bool:
    """One CompactionWorker in this process (must be the main thread); whether it ran any job."""
    client = redis.Redis.from_url(settings.redis.url)
    try:
        worker = CompactionWorker.for_settings(client, settings)
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        return worker.work(burst=burst, logging_level=level)
    finally:
        client.close()


def main(settings: Settings, *, count: int | None = None, burst: bool = False) -> None:
    """Run ``count`` (default ``worker.count``) workers until stopped (or the queue is empty with ``burst``).

    Raises ``redis.ConnectionError`` (or ``TimeoutError``) when Redis does not answer at start,
    ``WorkersFailed`` when a worker process keeps dying."""
    if not settings.redis.url:
        raise ValueError("worker.runner.main needs settings.redis.url (start the embedded Redis first)")
    count = count or settings.worker.count
    _ping(settings.redis.url)
    metrics.init_series()
    stopped: list[int] = []

    def stop(signum: int, frame: Any) -> None:
        stopped.append(signum)
        raise _StoppedBeforeAnyJob

    try:
        with stop_signals_handled(stop):  # (the preload takes seconds: a stop signal killed the
            preload()  # process, 143 not the clean stop's 0, with nothing to clean up)
    except _StoppedBeforeAnyJob:
        pass
    if stopped:  # (raised, or swallowed by a bare ``except`` in an import: recorded either way)
        logger.info("stopped during the preload, before any job")
        return
    freeze_heap()  # before forking too: the children share the frozen pages untouched by collections
    if count == 1:
        run_worker(settings, burst=burst)
        return
    _Supervisor(settings, count, burst).run()


class _StoppedBeforeAnyJob(BaseException):
    """A stop signal during the preload (not an ``Exception``: litellm's imports and its warm-up
    catch those, and the stop was lost, the worker taking jobs)."""


def _ping(url: str) -> None:
    client = redis.Redis.from_url(url, socket_timeout=REDIS_CHECK_TIMEOUT_S,
                                  socket_connect_timeout=REDIS_CHECK_TIMEOUT_S)
    try:
        client.ping()
    finally:
        client.close()


class WorkersFailed(RuntimeError):
    """A worker process kept dying; the others were stopped."""


class _Supervisor:
    """Keeps ``count`` forked worker processes running; passes stop signals on."""

    def __init__(self, settings: Settings, count: int, burst: bool) -> None:
        self.settings = settings
        self.count = count
        self.burst = burst
        self.stopping = False
        self.children: list[BaseProcess] = []
        self.deaths: dict[str, deque[float]] = {}  # by process name: one per slot
        self._mp = multiprocessing.get_context("fork")

    def run(self) -> None:
        stops = [s for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP) if not ignored_at_start(s)]  # (nohup)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in stops}
        try:
            self.children = [self._spawn(i) for i in range(self.count)]
            while self.children:
                self._reap()
                time.sleep(0.2)
        except WorkersFailed:
            self._stop_all()
            raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _spawn(self, index: int) -> BaseProcess:
        process = self._mp.Process(target=_orphan_safe_child, args=(self.settings, self.burst, os.getpid()),
                                   name=f"compaction-worker-{index}")
        process.start()
        logger.info("worker process started pid=%s", process.pid)
        return process

    def _reap(self) -> None:
        for i, child in enumerate(list(self.children)):
            if child.is_alive():
                continue
            child.join()
            if self.stopping or self.burst or child.exitcode == 0:
                self.children.remove(child)
                continue
            self._count_death(child)
            logger.warning("worker process died pid=%s exitcode=%s: replacing it", child.pid, child.exitcode)
            time.sleep(RESPAWN_DELAY_S)
            if self.stopping:  # (a stop signal meanwhile went to the children alive then: a child started
                self.children.remove(child)  # now got none, and the supervisor waited on it for good)
                continue
            self.children[self.children.index(child)] = self._spawn(i)

    def _count_death(self, child: BaseProcess) -> None:
        deaths, now = self.deaths.setdefault(child.name, deque()), time.monotonic()
        deaths.append(now)
        while now - deaths[0] > RESPAWN_WINDOW_S:
            deaths.popleft()
        if len(deaths) >= MAX_RESPAWNS:
            raise WorkersFailed(f"worker process exited {len(deaths)} times within {RESPAWN_WINDOW_S:.0f}s "
                                f"(last exit code {child.exitcode}); giving up")

    def _stop_all(self) -> None:
        self.stopping = True
        for child in self.children:
            if child.is_alive():
                child.terminate()
        for child in self.children:
            child.join(10)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """Pass the stop on: the first as a SIGTERM (a warm stop), a later Ctrl-C as itself (a
        cold one). A Ctrl-C reaches the children from the terminal too, and the copy passed on
        as a SIGINT, coming a second or more later on a loaded VM, was a second Ctrl-C to them:
        one Ctrl-C cut the jobs in hand."""
        forwarded = signal.SIGINT if signum == signal.SIGINT and self.stopping else signal.SIGTERM
        self.stopping = True
        for child in self.children:
            if child.is_alive() and child.pid is not None:
                try:
                    os.kill(child.pid, forwarded)
                except ProcessLookupError:
                    pass


def _orphan_safe_child(settings: Settings, burst: bool, parent_pid: int) -> None:
    """A forked worker process that stops by itself when its supervisor is gone (killed)."""
    exit_with_parent(parent_pid)
    _child(settings, burst)


def _child(settings: Settings, burst: bool) -> None:
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # (the worker installs its own)
        if not ignored_at_start(signum):  # (one ignored at the start, nohup's SIGHUP, stays ignored)
            signal.signal(signum, signal.SIG_DFL)
    run_worker(settings, burst=burst)
