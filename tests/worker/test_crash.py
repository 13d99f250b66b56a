"""Worker processes for real: `worker.runner.main` in subprocesses, SIGKILL mid-job."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import redis
from rq.job import Job, JobStatus

from compactor.embedded import EmbeddedRedis
from compactor.keys import Keys
from compactor.queue import enqueue_compaction, pending_job_id
from events.config import Settings, load_settings
from compactor.llm_stub import STUB_MODEL, LLMStub
from tests.support import wait_for
from tests.worker.conftest import CWD, log_lines, write_session
from worker import context as worker_context

RECOVERY_LIMIT_S = 60.0
# A worker's start (Python, the imports, litellm's warm-up and the encodings, RQ's registration)
# before its first job: over 60 s on a 2-core VM at a load of 20 (the preload alone took 52 s).
START_S = 120.0

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _config(tmp_path: Path, settings: Settings) -> Path:
    path = tmp_path / "codingcode.yaml"
    path.write_text(json.dumps({
        "dataDir": str(settings.data_dir),
        "context": {"compactionModel": STUB_MODEL, "llmTimeoutSeconds": 120},
    }))
    return path


def _start_worker(config: Path, env: dict[str, str], count: int = 1, burst: bool = False,
                  nohup: bool = False) -> subprocess.Popen[bytes]:
    """``nohup``: started with SIGHUP ignored, as ``nohup`` starts a command; else with SIGHUP's
    default, whatever this test run inherited (run under ``nohup`` itself, a worker meant to stop
    at a hang-up ignored it)."""
    code = (
        "import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stderr)\n"
        "from events.config import load_settings\nfrom worker.runner import main\n"
        f"main(load_settings({str(config)!r}), count={count}, burst={burst})\n"
    )
    return subprocess.Popen([sys.executable, "-c", code], env=env, cwd=str(Path(__file__).parents[2]),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN if nohup else signal.SIG_DFL))


@contextlib.contextmanager
def _own_redis(tmp_path: Path, env_for_subprocess: dict[str, str],
               ) -> Iterator[tuple[redis.Redis, dict[str, str], Path, Settings]]:
    """A Redis of the test's own (one it may make refuse writes): a client, the environment and
    a config file naming it, and the settings they give."""
    with tempfile.TemporaryDirectory(prefix="refusal-") as directory, EmbeddedRedis(Path(directory)) as server:
        env = {**env_for_subprocess, "REDIS_URL": server.url}
        config = tmp_path / "compactor.yaml"
        config.write_text(json.dumps({"dataDir": str(tmp_path / "data"),
                                      "context": {"compactionModel": STUB_MODEL, "llmTimeoutSeconds": 60}}))
        yield redis.Redis.from_url(server.url), env, config, load_settings(config, env)


def _wait_job(r: redis.Redis, job_id: str, timeout_s: float) -> Job:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = Job.fetch(job_id, connection=r)
        if job.get_status() in (JobStatus.FINISHED, JobStatus.FAILED):
            return job
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} still {Job.fetch(job_id, connection=r).get_status()} after {timeout_s}s")


def _stop(process: subprocess.Popen[bytes]) -> str:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.stderr.read().decode(errors="replace")[-4000:] if process.stderr else ""


def test_killed_worker_leaves_no_stuck_session_and_no_duplicate_summary(
    r: redis.Redis, settings: Settings, stub: LLMStub, env_for_subprocess: dict[str, str], tmp_path: Path,
) -> None:
    config = _config(tmp_path, settings)
    wsettings = load_settings(config, env_for_subprocess)
    write_session(r, wsettings, "s1", 3)
    stub.latency_s = 90  # the LLM call is in flight when the worker dies
    first = _start_worker(config, env_for_subprocess)
    second: subprocess.Popen[bytes] | None = None
    try:
        stuck = enqueue_compaction(r, wsettings, "s1", CWD, "llm")
        assert stuck is not None
        stub.wait_for_requests(1, timeout_s=START_S)
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        killed_at = time.monotonic()
        stub.latency_s = 0
        second = _start_worker(config, env_for_subprocess)
        forced = enqueue_compaction(r, wsettings, "s1", CWD, "llm", forced=True)
        assert forced is not None
        done = _wait_job(r, forced, RECOVERY_LIMIT_S)
        assert time.monotonic() - killed_at < RECOVERY_LIMIT_S
        assert done.get_status() == JobStatus.FINISHED, done.latest_result()
        assert done.return_value()["didCompress"] is True
        assert Job.fetch(stuck, connection=r).get_status() == JobStatus.FAILED  # abandoned, not lost silently
        assert pending_job_id(r, wsettings, "s1") is None
        again = enqueue_compaction(r, wsettings, "s1", CWD, "llm")  # automatic jobs flow again
        assert again is not None
        assert _wait_job(r, again, 30).get_status() == JobStatus.FINISHED
    finally:
        first.kill()
        output = _stop(second) if second else ""
    lines = log_lines(wsettings, "s1")
    assert all(line.endswith(b"\n") for line in lines), output
    events = [json.loads(line) for line in lines]
    assert sum(e["type"] == "summary" for e in events) == 1, output


def test_a_forced_job_whose_worker_died_mid_call_is_queued_again_once_and_waits_follow_it(
    r: redis.Redis, settings: Settings, stub: LLMStub, env_for_subprocess: dict[str, str], tmp_path: Path,
) -> None:
    """A forced compaction accepted (a 202, or a wait cut short by a stopping API) whose worker died
    during the LLM call (a serve stopped: its children get 15 s, the call up to 120) was failed as
    abandoned and never ran again; the session, under its thresholds, got no compaction. The
    janitor queues a forced job in its place, once, and a wait on the first follows it."""
    from compactor.queue import enqueue_forced_compaction
    from producer.api_jobs import wait_for_job

    config = _config(tmp_path, settings)
    wsettings = load_settings(config, env_for_subprocess)
    write_session(r, wsettings, "s1", 3)
    stub.latency_s = 90
    first = _start_worker(config, env_for_subprocess)
    second: subprocess.Popen[bytes] | None = None
    try:
        forced = enqueue_forced_compaction(r, wsettings, "s1", CWD)
        stub.wait_for_requests(1, timeout_s=START_S)
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        stub.latency_s = 0
        second = _start_worker(config, env_for_subprocess)
        body = wait_for_job(r, forced, Keys(wsettings.redis.prefix, wsettings.redis.shards).queue, RECOVERY_LIMIT_S)
        assert body.status == "finished" and body.job_id != forced, body
        assert body.result is not None and body.result.did_compress
        old = Job.fetch(forced, connection=r)
        assert old.get_status() == JobStatus.FAILED and old.meta["requeuedAs"] == body.job_id
        assert Job.fetch(body.job_id, connection=r).meta["requeuedFrom"] == forced
    finally:
        first.kill()
        output = _stop(second) if second else ""
    events = [json.loads(line) for line in log_lines(wsettings, "s1")]
    assert sum(e["type"] == "summary" for e in events) == 1, output


def test_a_worker_killed_between_taking_a_job_and_starting_it_leaves_no_stuck_session(
    r: redis.Redis, settings: Settings, stub: LLMStub, env_for_subprocess: dict[str, str], tmp_path: Path,
) -> None:
    """The job sits in RQ's intermediate queue, still "queued", heartbeaten by nobody; RQ fails it
    only after a minute. The janitor fails it sooner, so the session is compactable within 60 s."""
    config = _config(tmp_path, settings)
    wsettings = load_settings(config, env_for_subprocess)
    write_session(r, wsettings, "s1", 3)
    stranded = enqueue_compaction(r, wsettings, "s1", CWD, "micro")
    assert stranded is not None
    dies = ("import os\nfrom events.config import load_settings\nfrom worker.runner import CompactionWorker, main\n"
            "CompactionWorker.prepare_execution = lambda self, job: os._exit(9)\n"
            f"main(load_settings({str(config)!r}), count=1)\n")
    first = subprocess.Popen([sys.executable, "-c", dies], env=env_for_subprocess,
                             cwd=str(Path(__file__).parents[2]), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    second: subprocess.Popen[bytes] | None = None
    try:
        deadline = time.monotonic() + 60
        while Job.fetch(stranded, connection=r).get_status() != JobStatus.QUEUED or \
                not r.lrange(f"rq:queue:{wsettings.redis.prefix}:intermediate", 0, -1):
            assert time.monotonic() < deadline, "the dying worker never took the job"
            time.sleep(0.1)
        first.kill()  # its supervisor would start a child that dies the same way
        first.wait()
        killed_at = time.monotonic()
        second = _start_worker(config, env_for_subprocess)
        while pending_job_id(r, wsettings, "s1") == stranded:
            assert time.monotonic() - killed_at < RECOVERY_LIMIT_S, "the session is still claimed by the stranded job"
            time.sleep(0.5)
        assert Job.fetch(stranded, connection=r).get_status() == JobStatus.FAILED
        again = enqueue_compaction(r, wsettings, "s1", CWD, "micro") or pending_job_id(r, wsettings, "s1")
        assert again is not None and again != stranded
        assert _wait_job(r, again, RECOVERY_LIMIT_S - (time.monotonic() - killed_at)).get_status() == JobStatus.FINISHED
    finally:
        first.kill()
        _stop(second) if second else None


def test_main_runs_several_worker_processes_until_the_queue_is_empty(
    r: redis.Redis, settings: Settings, stub: LLMStub, env_for_subprocess: dict[str, str], tmp_path: Path,
) -> None:
    config = _config(tmp_path, settings)
    wsettings = load_settings(config, env_for_subprocess)
    stub.latency_s = 1.0
    sessions = [f"s{i}" for i in range(4)]
    for sid in sessions:
        write_session(r, wsettings, sid, 3)
    jobs = [enqueue_compaction(r, wsettings, sid, CWD, "llm") for sid in sessions]
    process = _start_worker(config, env_for_subprocess, count=2, burst=True)
    try:
        assert process.wait(timeout=90) == 0
    finally:
        output = _stop(process)
    fetched = [Job.fetch(job_id, connection=r) for job_id in jobs if job_id is not None]
    assert len(fetched) == 4
    for job in fetched:
        assert job.get_status() == JobStatus.FINISHED, output
    assert len({job.worker_name for job in fetched}) == 2, output
    assert len(stub.requests) == 4
    # The jobs ran side by side: the time some job was running is less than their summed
    # durations (one after the other, ~4 s of 1 s calls, it would be their sum). Timed from RQ's
    # own stamps, not the wall clock around the processes, whose start is slow on a loaded machine.
    spans = sorted((job.started_at, job.ended_at) for job in fetched)
    assert all(start and end for start, end in spans), spans
    busy, reach = 0.0, spans[0][0]
    for start, end in spans:
        busy += max(0.0, (end - max(start, reach)).total_seconds())
        reach = max(reach, end)
    summed = sum((end - start).total_seconds() for start, end in spans)
    assert busy < summed - 0.5, f"2 workers should overlap the 1 s calls (busy {busy:.2f}s of {summed:.2f}s)"


@pytest.mark.parametrize(("count", "nohup"), [(1, False), (2, False), (2, True)])
def test_a_closed_terminal_lets_the_workers_finish_their_jobs_and_exit(
    r: redis.Redis, settings: Settings, stub: LLMStub, env_for_subprocess: dict[str, str], tmp_path: Path,
    count: int, nohup: bool,
) -> None:
    """SIGHUP (the terminal closed: every process of its group gets it) killed ``compactor work``
    outright, its jobs cut mid-run; now it is a warm stop, as SIGTERM is. Under ``nohup`` (SIGHUP
    ignored from the start) it is no stop at all: the workers go on, and SIGTERM stops them."""
    config = _config(tmp_path, settings)
    wsettings = load_settings(config, env_for_subprocess)
    stub.latency_s = 1.5
    sessions = [f"s{i}" for i in range(count)]
    for sid in sessions:
        write_session(r, wsettings, sid, 3)
    jobs = [enqueue_compaction(r, wsettings, sid, CWD, "llm") for sid in sessions]
    process = _start_worker(config, env_for_subprocess, count=count, nohup=nohup)
    try:
        wait_for(lambda: len(stub.requests) == count or process.poll() is not None, START_S,
                 "the jobs' LLM calls")
        if count > 1:  # the supervisor forks its workers with no thread but its own (litellm's warm-up left
            # threads running, one importing modules: a fork then left a child's LLM call blocked for good)
            assert psutil.Process(process.pid).num_threads() == 1
        group = [process.pid, *(child.pid for child in psutil.Process(process.pid).children())]
        for pid in group:  # (as a terminal's hang-up reaches its whole process group)
            os.kill(pid, signal.SIGHUP)
        if nohup:
            time.sleep(2.5)  # (past the jobs' 1.5 s calls: the workers wait for more)
            assert process.poll() is None and all(psutil.pid_exists(pid) for pid in group)
            process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        output = _stop(process)
    for job_id in jobs:
        assert job_id is not None and Job.fetch(job_id, connection=r).get_status() == JobStatus.FINISHED, output


def test_one_ctrl_c_passed_on_late_by_the_supervisor_is_still_a_warm_stop(
    r: redis.Redis, settings: Settings, stub: LLMStub, env_for_subprocess: dict[str, str], tmp_path: Path,
) -> None:
    """A Ctrl-C reaches every process of the terminal's group: the workers (a warm stop) and
    their supervisor, which passed it on as a SIGINT; on a loaded VM that copy came a second or
    more after the terminal's, and RQ took it for a second Ctrl-C: the jobs in hand were cut,
    failed. The supervisor passes its first stop on as a SIGTERM; a second Ctrl-C is still a cold stop."""
    config = _config(tmp_path, settings)
    wsettings = load_settings(config, env_for_subprocess)
    stub.latency_s = 4
    sessions = ["s0", "s1"]
    for sid in sessions:
        write_session(r, wsettings, sid, 3)
    jobs = [enqueue_compaction(r, wsettings, sid, CWD, "llm") for sid in sessions]
    process = _start_worker(config, env_for_subprocess, count=2)
    try:
        wait_for(lambda: len(stub.requests) == 2 or process.poll() is not None, START_S, "the jobs' LLM calls")
        for child in psutil.Process(process.pid).children():
            os.kill(child.pid, signal.SIGINT)  # (the terminal's)
        time.sleep(1.5)
        process.send_signal(signal.SIGINT)  # (the supervisor's, late)
        assert process.wait(timeout=30) == 0
    finally:
        output = _stop(process)
    for job_id in jobs:
        assert job_id is not None and Job.fetch(job_id, connection=r).get_status() == JobStatus.FINISHED, output
    assert "cold shut down" not in output, output


@pytest.mark.slow
def test_a_stop_while_a_dead_worker_is_being_replaced_stops_the_supervisor(
    r: redis.Redis, settings: Settings, stub: LLMStub, env_for_subprocess: dict[str, str], tmp_path: Path,
) -> None:
    """A child died, and SIGTERM came during the second before its replacement: the signal went to
    the children alive then, the replacement was started after it and never got one, and
    ``compactor work`` ran on (``docker stop`` then SIGKILLs it mid-job)."""
    process = _start_worker(_config(tmp_path, settings), env_for_subprocess, count=2)
    try:
        wait_for(lambda: len(r.keys("rq:worker:*")) >= 2 or process.poll() is not None, START_S,
                 "the workers to start")
        victim = psutil.Process(process.pid).children()[0]
        victim.kill()
        victim.wait(10)
        time.sleep(0.3)  # (the supervisor notices within 0.2 s, then waits 1 s before replacing it)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
    finally:
        output = _stop(process)
    assert "worker process died" in output, output


def test_a_worker_process_freezes_its_heap_after_the_heavy_imports(
    settings: Settings, stub: LLMStub, env_for_subprocess: dict[str, str], tmp_path: Path,
) -> None:
    """``main`` freezes the heap once litellm and the encodings are loaded (and before any
    fork): a full collection between jobs then scans the jobs' objects, not litellm's."""
    config = _config(tmp_path, settings)
    code = (
        "import gc\nfrom events.config import load_settings\nfrom worker.runner import main\n"
        f"main(load_settings({str(config)!r}), count=1, burst=True)\n"
        "import sys\nprint(gc.get_freeze_count(), len(gc.get_objects()), 'litellm' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env_for_subprocess, cwd=str(Path(__file__).parents[2]),
                         capture_output=True, text=True, check=True, timeout=120).stdout.split()
    frozen, tracked, litellm = int(out[0]), int(out[1]), out[2]
    assert litellm == "True"
    assert frozen > 100_000 and tracked < frozen // 5


def test_the_keeper_logs_one_line_not_a_traceback_while_redis_is_unreachable(
    r: redis.Redis, wsettings: Settings, caplog: pytest.LogCaptureFixture,
) -> None:
    """In a Redis outage RQ's loop retries (one line every few seconds); the keeper's janitor and
    heartbeat each logged a ~50-line chained traceback every 5 s per worker meanwhile. Now the
    outage is one line when it starts (and one a minute while it lasts)."""
    from worker.context import WorkerContext
    from worker.runner import CompactionWorker

    worker = CompactionWorker.for_settings(r, wsettings)  # (RQ names it in Redis as it starts)
    gone = redis.Redis.from_url("redis://127.0.0.1:1", socket_connect_timeout=0.5)  # nothing listens there
    worker_context.install(WorkerContext.build(wsettings, gone))  # Redis goes away under the running worker
    try:
        with caplog.at_level(logging.WARNING):
            worker._keeper._janitor()
            worker._keeper._janitor()  # the next try, 5 s later: nothing more to say
    finally:
        worker_context.clear()
    [record] = caplog.records
    assert record.levelno == logging.WARNING and record.exc_info is None
    assert "Redis does not serve" in record.getMessage() and "(the janitor)" in record.getMessage()
    assert worker.redis_wait.waiting
    worker.heartbeat()  # Redis (``r``) serves the worker's own writes
    assert not worker.redis_wait.waiting


def test_a_worker_rides_out_a_redis_that_refuses_writes_and_takes_jobs_again(
    stub: LLMStub, env_for_subprocess: dict[str, str], tmp_path: Path,
) -> None:
    """A full disk under Redis: it answers MISCONF to every write until there is room (here
    NOREPLICAS, a refusal of the same kind that a test can turn on and off). RQ's loop ended on
    the first refused write of its own (the end of the job in flight, a heartbeat): the worker
    took no job again, even once Redis served. Now it waits and takes the next job; the job
    whose end could not be recorded left no torn line and at most one summary."""
    with _own_redis(tmp_path, env_for_subprocess) as (client, env, config, wsettings):
        for session in ("s1", "s2"):
            write_session(client, wsettings, session, 3)
        stub.latency_s = 3
        worker = _start_worker(config, env)
        output = ""
        try:
            first = enqueue_compaction(client, wsettings, "s1", CWD, "llm", forced=True)
            assert first is not None
            stub.wait_for_requests(1, timeout_s=START_S)  # the LLM call is in flight
            client.config_set("min-replicas-to-write", 1)
            try:
                with pytest.raises(redis.ResponseError, match="NOREPLICAS"):
                    client.set("probe", 1)
                time.sleep(stub.latency_s + 3)  # the job's writes and RQ's record of its end are refused
                assert worker.poll() is None
            finally:
                client.config_set("min-replicas-to-write", 0)
            stub.latency_s = 0
            second = enqueue_compaction(client, wsettings, "s2", CWD, "llm", forced=True)
            assert second is not None
            assert _wait_job(client, second, 30).get_status() == JobStatus.FINISHED
            assert worker.poll() is None
        finally:
            output = _stop(worker)
        assert "Redis does not serve worker=" in output and "again after" in output, output
        assert "found an unhandled exception" not in output, output
        # (the refused job's session is recovered by the janitor, as a killed worker's: tested above)
        lines = log_lines(wsettings, "s1")
        assert all(line.endswith(b"\n") for line in lines)
        assert sum(json.loads(line)["type"] == "summary" for line in lines) <= 1
        assert sum(json.loads(line)["type"] == "summary" for line in log_lines(wsettings, "s2")) == 1


def test_a_stop_while_redis_refuses_writes_still_lets_the_job_in_hand_finish(
    stub: LLMStub, env_for_subprocess: dict[str, str], tmp_path: Path,
) -> None:
    """RQ records the stop's date from the signal handler; refused, its error was raised inside
    the job in hand, which was cut mid-call (left to the janitor, its LLM call wasted) though
    Redis served again a moment later. Now the job finishes its call and its writes, then the
    worker stops."""
    with _own_redis(tmp_path, env_for_subprocess) as (client, env, config, wsettings):
        write_session(client, wsettings, "s1", 3)
        stub.latency_s = 6  # (the refusal below lasts 1 s of it)
        worker = _start_worker(config, env)
        try:
            job_id = enqueue_compaction(client, wsettings, "s1", CWD, "llm", forced=True)
            assert job_id is not None
            stub.wait_for_requests(1, timeout_s=START_S)  # the LLM call is in flight
            client.config_set("min-replicas-to-write", 1)
            try:
                worker.send_signal(signal.SIGTERM)
                time.sleep(1.0)
            finally:
                client.config_set("min-replicas-to-write", 0)
            assert worker.wait(timeout=30) == 0
        finally:
            output = _stop(worker)
        assert Job.fetch(job_id, connection=client).get_status() == JobStatus.FINISHED, output
        assert [json.loads(line)["type"] for line in log_lines(wsettings, "s1")].count("summary") == 1, output


def _refusals(client: redis.Redis) -> int:
    """Writes Redis refused for want of replicas (``min-replicas-to-write``) so far."""
    return int(client.info("errorstats").get("errorstat_NOREPLICAS", {}).get("count", 0))


def test_a_worker_started_while_redis_refuses_writes_waits_and_then_takes_jobs(
    stub: LLMStub, env_for_subprocess: dict[str, str], tmp_path: Path,
) -> None:
    """RQ registers a worker before its loop, outside anything that waits: a worker started (or
    replaced by its supervisor) while Redis refused writes died at once, and each replacement
    did too, until the supervisor gave up on all of them."""
    with tempfile.TemporaryDirectory(prefix="refusal-") as directory, EmbeddedRedis(Path(directory)) as server:
        client = redis.Redis.from_url(server.url)
        env = {**env_for_subprocess, "REDIS_URL": server.url}
        config = tmp_path / "compactor.yaml"
        config.write_text(json.dumps({"dataDir": str(tmp_path / "data"), "context": {"compactionModel": STUB_MODEL}}))
        wsettings = load_settings(config, env)
        write_session(client, wsettings, "s1", 3)
        job = enqueue_compaction(client, wsettings, "s1", CWD, "llm", forced=True)
        assert job is not None
        client.config_set("min-replicas-to-write", 1)
        worker = _start_worker(config, env, count=2)
        try:
            try:  # preload, then the workers' registration is refused, again and again (a slow preload
                # on a loaded machine took longer than a fixed 8 s: the refusal had not begun)
                deadline = time.monotonic() + 90
                while _refusals(client) < 4 and time.monotonic() < deadline and worker.poll() is None:
                    time.sleep(0.2)
                assert _refusals(client) >= 4 and worker.poll() is None
            finally:
                client.config_set("min-replicas-to-write", 0)
            assert _wait_job(client, job, 30).get_status() == JobStatus.FINISHED
            assert worker.poll() is None
            # both registered: the one refused is served again (its next try can be 8 s off; the other,
            # its preload slowed past the refusal on a loaded machine, took the job meanwhile)
            from rq import Worker
            deadline = time.monotonic() + 60
            while Worker.count(connection=client) < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
        finally:
            output = _stop(worker)
        assert "Redis does not serve worker=" in output and "again after" in output, output
        assert "worker process died" not in output and "Traceback" not in output, output


def test_a_ctrl_c_ignored_at_the_start_stays_ignored_once_a_warm_stop_began(
    r: redis.Redis, wsettings: Settings, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """RQ points SIGINT at its cold stop when a warm one begins (a SIGTERM: ``kill``, serve, the
    supervisor passing one on): a worker started with SIGINT ignored (a script's background job)
    then had the job in hand cut by the terminal's Ctrl-C, meant for the script's foreground
    command. It stays ignored through the stop."""
    import compactor
    from rq.worker import WorkerStatus

    from worker.compaction import STOPPING
    from worker.runner import CompactionWorker

    monkeypatch.setattr(compactor, "_IGNORED_AT_START", frozenset({signal.SIGINT}))
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        worker = CompactionWorker.for_settings(r, wsettings)
        worker._install_signal_handlers()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        worker.set_state(WorkerStatus.BUSY)  # (a job in hand)
        worker.request_stop(signal.SIGTERM, None)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == worker.request_force_stop  # (RQ's own, as before)
    finally:  # (the process's: the tests after this one in it run jobs, which a set STOPPING cuts short)
        STOPPING.clear()
        for s, handler in previous.items():
            signal.signal(s, handler)


def test_a_worker_loop_ended_by_an_error_ends_its_process_so_it_is_replaced(
    r: redis.Redis, wsettings: Settings, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """RQ's loop logs an unexpected error and returns: the worker process then exited 0, which
    its supervisor takes for a worker done on purpose (one worker fewer until a restart)."""
    from worker.runner import CompactionWorker, WorkerLoopEnded

    worker = CompactionWorker.for_settings(r, wsettings)

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug in the loop")

    monkeypatch.setattr(worker, "dequeue_job_and_maintain_ttl", broken)
    with pytest.raises(WorkerLoopEnded, match="ended on an error"):
        worker.work()


def test_a_dropped_connection_outside_rqs_own_retry_is_waited_out_not_fatal(
    r: redis.Redis, wsettings: Settings, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """RQ's dequeue records the worker as idle before its own retry loop: a connection dropped
    there (Redis restarting as a job ended) ended the worker's loop."""
    from rq import SimpleWorker

    from worker import runner
    from worker.runner import CompactionWorker

    worker = CompactionWorker.for_settings(r, wsettings)
    gone = redis.Redis.from_url("redis://127.0.0.1:1", socket_connect_timeout=0.5)
    monkeypatch.setattr(worker, "connection", gone)
    worker.set_state("idle")  # raised ConnectionError
    assert worker.redis_wait.waiting
    tries: list[int] = []

    def dequeue(self: SimpleWorker, timeout: int | None, max_idle_time: int | None = None) -> None:
        tries.append(1)
        if len(tries) == 1:
            raise redis.ConnectionError("Connection closed by server.")

    monkeypatch.setattr(SimpleWorker, "dequeue_job_and_maintain_ttl", dequeue)
    monkeypatch.setattr(runner.time, "sleep", lambda seconds: None)
    assert worker.dequeue_job_and_maintain_ttl(1) is None and len(tries) == 2
    monkeypatch.setattr(SimpleWorker, "dequeue_job_and_maintain_ttl", lambda *a, **k: (_ for _ in ()).throw(
        redis.AuthenticationError("WRONGPASS invalid username-password pair")))
    with pytest.raises(redis.AuthenticationError):  # a refused password needs an operator: not waited out
        worker.dequeue_job_and_maintain_ttl(1)


def test_a_worker_whose_command_channel_failed_or_ended_subscribes_again(
    r: redis.Redis, wsettings: Settings, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """RQ subscribes to a worker's command channel once, right after registering it: when Redis
    went away in between, or the channel's thread ended on an error (any but a dropped
    connection, a malformed message included), the worker ignored `rq`'s stop-job and shutdown
    commands until it was restarted. The keeper now subscribes again; a malformed message is
    logged and ignored."""
    from redis.client import PubSub
    from rq.command import send_command

    from worker.runner import CompactionWorker

    worker = CompactionWorker.for_settings(r, wsettings)
    received: list[bytes] = []
    real_handler = worker.handle_payload

    def handle(message: dict[str, object]) -> None:  # (what RQ subscribes with)
        received.append(message["data"])  # type: ignore[arg-type]
        real_handler(message)

    monkeypatch.setattr(worker, "handle_payload", handle)
    real_subscribe = PubSub.subscribe
    refusals = [redis.ConnectionError("Connection refused.")]

    def subscribe(self: PubSub, *args: object, **kwargs: object) -> object:
        if refusals:
            raise refusals.pop()
        return real_subscribe(self, *args, **kwargs)

    def heard(command: str) -> bool:
        send_command(r, worker.name, command)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if any(command.encode() in data for data in received):
                return True
            time.sleep(0.05)
        return False

    monkeypatch.setattr(PubSub, "subscribe", subscribe)
    worker.register_birth()
    try:
        worker.subscribe()  # Redis went away between the registration and this
        assert not worker.listening() and worker.redis_wait.waiting
        worker._keeper._listen()  # the keeper's next beat
        assert worker.listening() and heard("stop-job")

        r.publish(worker.pubsub_channel_name, "not a command")  # RQ's thread ended on it
        assert heard("kill-horse") and worker.listening()

        assert worker.pubsub is not None and worker.pubsub_thread is not None
        thread = worker.pubsub_thread
        monkeypatch.setattr(worker.pubsub, "get_message", lambda **_: (_ for _ in ()).throw(
            redis.ResponseError("an error RQ's thread does not wait out")))
        r.publish(worker.pubsub_channel_name, "wake up")  # (the thread waits up to 60 s for a message)
        thread.join(timeout=5)
        assert not thread.is_alive() and not worker.listening()
        worker._keeper._listen()
        assert worker.listening() and heard("stop-job")
    finally:
        worker.teardown()


def test_a_worker_whose_registration_redis_lost_registers_again(r: redis.Redis, wsettings: Settings) -> None:
    """After Redis lost its data (a restart without persistence, FLUSHALL) the worker went on taking
    jobs, and its heartbeat recreated its key, but it was in no worker set again: `compactor health
    --workers` (the compose healthcheck) said no worker, for good."""
    from rq import Worker

    from compactor.queue import compaction_queue
    from worker.runner import CompactionWorker

    queue = compaction_queue(r, wsettings)
    worker = CompactionWorker.for_settings(r, wsettings)
    worker.register_birth()
    try:
        assert [w.name for w in Worker.all(queue=queue)] == [worker.name]
        worker._keeper._keep_registered()  # registered: nothing to do
        r.flushall()
        worker.heartbeat()
        assert Worker.all(queue=queue) == []
        worker._keeper._keep_registered()  # (each beat, idle or busy)
        [again] = Worker.all(queue=queue)
        assert again.name == worker.name and again.birth_date is not None
        assert r.ttl(worker.key) > 0
    finally:
        worker.teardown()


def test_the_keepers_subscription_waits_for_rqs_own_in_flight(
    r: redis.Redis, wsettings: Settings, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A keeper beat landing while RQ's SUBSCRIBE was in flight (a slow Redis at start) subscribed
    a second time: two listener threads read one connection, and one outlived the worker."""
    import threading

    from redis.client import PubSub

    from worker.runner import CompactionWorker

    worker = CompactionWorker.for_settings(r, wsettings)
    real_subscribe = PubSub.subscribe
    slow = [1.0]

    def subscribe(self: PubSub, *args: object, **kwargs: object) -> object:
        if slow:
            time.sleep(slow.pop())
        return real_subscribe(self, *args, **kwargs)

    before = {t for t in threading.enumerate() if type(t).__name__ == "PubSubWorkerThread"}

    def listeners() -> list[threading.Thread]:  # this worker's (an earlier test's may still be ending)
        return [t for t in threading.enumerate()
                if type(t).__name__ == "PubSubWorkerThread" and t.is_alive() and t not in before]

    monkeypatch.setattr(PubSub, "subscribe", subscribe)
    worker.register_birth()
    rq_own = threading.Thread(target=worker.subscribe)  # RQ's, in the worker's loop
    rq_own.start()
    try:
        time.sleep(0.2)
        worker._keeper._listen()  # the keeper's beat, in the middle of it
        rq_own.join(timeout=10)
        assert worker.listening() and len(listeners()) == 1
    finally:
        worker.teardown()
    deadline = time.monotonic() + 5
    while listeners() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert listeners() == []


def test_a_burst_worker_stops_at_once_and_leaves_no_listener(r: redis.Redis, wsettings: Settings) -> None:
    """redis-py 8's ``PubSubWorkerThread.stop()`` waits for the listener to end, which it did only
    once the UNSUBSCRIBE sent after it woke it, or RQ's 60 s later: every worker's stop (and every
    burst run) took a minute."""
    import threading

    from tests.worker.conftest import run_burst

    before = {t for t in threading.enumerate() if type(t).__name__ == "PubSubWorkerThread"}
    started = time.monotonic()
    run_burst(r, wsettings)
    assert time.monotonic() - started < 10
    assert not [t for t in threading.enumerate()
                if type(t).__name__ == "PubSubWorkerThread" and t.is_alive() and t not in before]


def test_a_redis_restart_as_a_job_ends_neither_fails_the_job_nor_loses_its_answer(
    stub: LLMStub, settings: Settings, tmp_path: Path,
) -> None:
    """Redis restarting (its data kept) while a forced job's LLM call ran: the job appended its
    summary, then the send of its last writes raised under the log's lock, the job failed and
    was not recorded, and its replacement answered the forced request ``didCompress: false``.
    Now the job succeeds with what it appended, and frees its claim once Redis is back."""
    from compactor.llm_stub import valid_summary_reply
    from tests.worker.conftest import make_settings, run_burst

    with tempfile.TemporaryDirectory(prefix="restart-") as directory:
        servers = [EmbeddedRedis(Path(directory), persist=True).start()]
        try:
            own = make_settings(settings.model_copy(update={"redis": settings.redis.model_copy(
                update={"url": servers[0].url})}), compaction_model=STUB_MODEL)
            client = redis.Redis.from_url(servers[0].url)
            write_session(client, own, "s1", 3)
            client.set(Keys().failures("s1"), 3, ex=86_400)  # (the breaker open: a success closes it, SPEC §5)

            def restart() -> None:
                servers.append(EmbeddedRedis(Path(directory), persist=True).start())

            def reply(body: dict[str, object]) -> str:  # (the call in flight: Redis goes, back 2 s later)
                servers[0].stop()
                threading.Timer(2.0, restart).start()
                return valid_summary_reply(body)

            stub.reply, stub.latency_s = reply, 0.3
            job_id = enqueue_compaction(client, own, "s1", CWD, "llm", forced=True)
            assert job_id is not None
            run_burst(client, own)
            wait_for(lambda: len(servers) == 2, 30, "the restart")
            job = _wait_job(client, job_id, 30)
            assert job.get_status() == JobStatus.FINISHED, job.latest_result().exc_string  # type: ignore[union-attr]
            assert job.return_value()["didCompress"] is True  # type: ignore[index]
            assert pending_job_id(client, own, "s1") is None  # the claim freed
            assert client.exists(Keys().failures("s1")) == 0  # (its reset went with the last writes, lost)
            lines = log_lines(own, "s1")
            assert sum(json.loads(line)["type"] == "summary" for line in lines) == 1
        finally:
            for server in servers:
                server.stop()
