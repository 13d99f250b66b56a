"""The chaos suite's harness: the real stack as processes, a flaky LLM, and the invariant checks.

The promise under test is "nothing lost, nothing duplicated, never stuck":

- *nothing lost*: every entry published (and still held by Redis) is in its
  session's log, in stream order;
- *nothing duplicated*: no stream id appears twice in a log, no line is torn;
- *never stuck*: once the stack is quiet, no session holds a job claim whose
  job is gone or ended, and a session over the LLM threshold has a summary,
  a counted LLM failure (the next ``turn_end`` retries) or an open breaker.

Sizes scale with ``COMPACTOR_CHAOS_SCALE`` (default 1: the bounded form the
default test run uses; 5 gives the 1 000-session soak of the issue).
Processes are started as users start them: ``python -m compactor watch|work|api
--config FILE``, with the LLM stub reached through ``OPENAI_API_BASE``.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis
import yaml
from rq.job import Job

from compactor.keys import Keys
from compactor.llm_stub import STUB_MODEL, LLMStub, StubResponse
from compactor.queue import STALE_CLAIM_GRACE_S
from events.config import Settings, load_settings
from events.log import SessionLog
from events.view import build_view
from tests.support import wait_for
from worker.runner import JANITOR_INTERVAL_S

REPO = Path(__file__).parents[2]
SCALE = float(os.environ.get("COMPACTOR_CHAOS_SCALE", "1"))
CWD = "/home/dev/chaos"
LONG_OUTPUT_WORDS = 260  # about 300 tokens: a compactable tool output well over 120 chars


def scaled(n: int, minimum: int = 1) -> int:
    """``n`` times COMPACTOR_CHAOS_SCALE (at least ``minimum``)."""
    return max(minimum, int(n * SCALE))




# -- the LLM ------------------------------------------------------------------------------------


class FlakyStub(LLMStub):
    """The LLM stub with a random latency and a share of 500 errors (seeded, thread-safe)."""

    def __init__(self, *, error_rate: float = 0.05, latency_s: tuple[float, float] = (0.05, 0.4),
                 seed: int = 7) -> None:
        super().__init__()
        self.error_rate = error_rate
        self.latency_range = latency_s
        self._rng = random.Random(seed)
        self.errors = 0

    def _record(self, request: Any) -> StubResponse:
        scripted = super()._record(request)
        if scripted.status != self.status or scripted.delay_s != self.latency_s:
            return scripted  # a scripted answer
        with self._lock:
            failed = self._rng.random() < self.error_rate
            delay = self._rng.uniform(*self.latency_range)
            self.errors += failed
        return StubResponse(status=500 if failed else 200, delay_s=delay)


@pytest.fixture
def flaky_stub() -> Iterator[FlakyStub]:
    with FlakyStub() as stub:
        yield stub


# -- the stack as processes ---------------------------------------------------------------------


def chaos_config(path: Path, data_dir: Path, redis_url: str, **extra: Any) -> Path:
    """A codingcode.yaml for the processes: fast leases, the stub as compaction model."""
    config: dict[str, Any] = {
        "dataDir": str(data_dir),
        "redis": {"url": redis_url, "shards": 8},
        "watcher": {"leaseMs": 1000, "blockMs": 50, "claimIdleMs": 1000, "batchSize": 64},
        "context": {"compactionModel": STUB_MODEL, "llmTimeoutSeconds": 10},
        "worker": {"jobTimeoutSeconds": 60},
    }
    for section, values in extra.items():
        config[section] = {**config.get(section, {}), **values} if isinstance(values, dict) else values
    path.write_text(yaml.safe_dump(config))
    return path


@dataclass
class Stack:
    """``python -m compactor`` processes sharing one config; their output goes to files."""

    directory: Path
    config: Path
    env: dict[str, str]
    processes: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)

    @property
    def settings(self) -> Settings:
        return load_settings(self.config, {})

    def start(self, command: str, *args: str) -> subprocess.Popen[bytes]:
        """Start ``python -m compactor COMMAND --config FILE ARGS``; output in ``{command}-{n}.log``."""
        log_path = self.directory / f"{command}-{len(self.processes)}.log"
        with open(log_path, "wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "compactor", command, "--config", str(self.config), *args],
                stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=str(REPO),
                start_new_session=True)
        self.processes.append((command, process))
        return process

    def watcher(self) -> subprocess.Popen[bytes]:
        return self.start("watch")

    def workers(self, count: int) -> subprocess.Popen[bytes]:
        return self.start("work", "--count", str(count))

    def api(self, port: int) -> subprocess.Popen[bytes]:
        return self.start("api", "--port", str(port))

    def output(self) -> str:
        """Everything the processes printed so far."""
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.directory.glob("*.log")))

    def stop(self) -> None:
        for _, process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for _, process in self.processes:
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                kill_tree(process.pid)
                process.wait()


def kill_tree(pid: int) -> None:
    """SIGKILL a process and its children (a worker supervisor and its forks)."""
    try:
        parent = psutil.Process(pid)
        victims = parent.children(recursive=True) + [parent]
    except psutil.NoSuchProcess:
        return
    for victim in victims:
        try:
            victim.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


def worker_children(supervisor: subprocess.Popen[bytes]) -> list[psutil.Process]:
    """The forked worker processes of a ``compactor work --count N`` supervisor."""
    try:
        return [c for c in psutil.Process(supervisor.pid).children() if c.is_running()]
    except psutil.NoSuchProcess:
        return []


@pytest.fixture
def stack_env(redis_url: str) -> dict[str, str]:
    """The processes' environment: offline litellm; no inherited compactor overrides."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("COMPACTION_", "REDIS_URL", "CODINGCODE_", "OPENAI_"))}
    env.update(LITELLM_LOCAL_MODEL_COST_MAP="True", PYTHONUNBUFFERED="1",
               COMPACTION_LOG_LEVEL="INFO", OPENAI_API_KEY="sk-chaos")
    return env


@pytest.fixture
def make_stack(tmp_path: Path, stack_env: dict[str, str]) -> Iterator[Callable[..., Stack]]:
    """Build a Stack on ``redis_url`` (and the stub when given); stops every process at the end."""
    stacks: list[Stack] = []

    def build(redis_url: str, stub: LLMStub | None = None, data_dir: Path | None = None,
              env: dict[str, str] | None = None, **extra: Any) -> Stack:
        directory = tmp_path / f"stack{len(stacks)}"
        directory.mkdir()
        config = chaos_config(directory / "codingcode.yaml", data_dir or tmp_path / "data", redis_url, **extra)
        full_env = {**stack_env, **(env or {})}
        if stub is not None:
            full_env["OPENAI_API_BASE"] = stub.base_url
        stack = Stack(directory, config, full_env)
        stacks.append(stack)
        return stack

    yield build
    for stack in stacks:
        stack.stop()


# -- workload ----------------------------------------------------------------------------------


_WORDS = ("alpha", "bravo", "delta", "kernel", "socket", "parser", "buffer", "thread",
          "module", "tensor", "vector", "stream", "commit", "branch", "schema", "record")


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def agent_turn(rng: random.Random, sid: str, turn: int, window: int) -> list[dict[str, Any]]:
    """One turn of a simulated agent: user, assistant calling a compactable tool, its long output, turn_end."""
    call = f"c{turn}"
    return [
        {"type": "user", "turnId": turn, "content": f"{sid} turn {turn}: {words(rng, 12)}"},
        {"type": "assistant", "turnId": turn, "content": words(rng, 10),
         "toolCalls": [{"id": call, "name": "read_file", "arguments": {"path": f"src/{turn}.py"}}]},
        {"type": "tool_result", "turnId": turn, "toolCallId": call, "toolName": "read_file",
         "output": words(rng, LONG_OUTPUT_WORDS)},
        {"type": "turn_end", "turnId": turn, "model": STUB_MODEL, "contextWindow": window},
    ]


# -- invariants --------------------------------------------------------------------------------


def read_lines(settings: Settings, sid: str, cwd: str = CWD) -> list[dict[str, Any]]:
    """Every line of the session's log; fails on a torn or unparsable line."""
    log = SessionLog(settings.data_dir, cwd, sid)
    if not log.exists():
        return []
    raw = log.path.read_bytes()
    assert not raw or raw.endswith(b"\n"), f"{log.path}: torn last line {raw[-80:]!r}"
    return log.read()


def assert_exactly_once_in_order(settings: Settings, published: dict[str, list[str]],
                                 cwd: str = CWD, surviving: set[str] | None = None) -> None:
    """Each session's log holds its published stream ids exactly once, in publication order.

    With ``surviving`` (the ids Redis still held after losing data), ids Redis lost
    before they were applied may be missing; every surviving one must be there.
    """
    for sid, ids in published.items():
        logged = [line["streamId"] for line in read_lines(settings, sid, cwd) if "streamId" in line]
        assert len(logged) == len(set(logged)), f"{sid}: duplicated lines"
        if surviving is None:
            assert logged == ids, f"{sid}: {len(logged)} lines logged vs {len(ids)} published"
            continue
        expected = [i for i in ids if i in surviving or i in set(logged)]
        assert logged == expected, f"{sid}: log order/contents differ from the surviving stream"


def backlog(client: redis.Redis, settings: Settings) -> int:
    """Entries not yet delivered plus delivered-but-unacked ones, over all shards."""
    keys = Keys(settings.redis.prefix, settings.redis.shards)
    total = 0
    for stream in keys.all_streams():
        if not client.exists(stream):
            continue
        for group in client.xinfo_groups(stream):
            last = group["last-delivered-id"]
            total += int(group["pending"]) + len(client.xrange(stream, b"(" + last, "+"))
    return total


def claims(client: redis.Redis, settings: Settings) -> dict[str, str]:
    """Session id -> the job id its claim names."""
    prefix = f"{settings.redis.prefix}:job:"
    found: dict[str, str] = {}
    for key in client.scan_iter(match=prefix + "*", count=1000):
        value = client.get(key)
        if value:
            found[key.decode()[len(prefix):]] = value.decode()
    return found


def dangling_claims(client: redis.Redis, settings: Settings) -> dict[str, str]:
    """Claims whose job is missing or already ended: sessions that would be stuck."""
    out = {}
    for sid, job_id in claims(client, settings).items():
        status = client.hget(Job.key_for(job_id), "status")
        if status is None or status.decode() in ("finished", "failed", "stopped", "canceled"):
            out[sid] = job_id
    return out


def queue_busy(client: redis.Redis, settings: Settings) -> bool:
    """Whether any compaction job is queued, running or rate-limited."""
    queue = settings.redis.prefix
    if client.llen(f"rq:queue:{queue}"):
        return True
    for registry in ("wip", "scheduled", "deferred"):
        if client.zcard(f"rq:{registry}:{queue}"):
            return True
    live = set(claims(client, settings)) - set(dangling_claims(client, settings))
    return bool(live)  # a dangling claim is no work to wait for: assert_never_stuck reports it


def crossed_llm_threshold(settings: Settings, sid: str, cwd: str = CWD) -> int | None:
    """The index of the first ``turn_end`` of the log whose view was over compactionThreshold x
    window, or None."""
    events = read_lines(settings, sid, cwd)
    ctx = settings.context
    for i, event in enumerate(events):
        if event.get("type") == "turn_end":
            view = build_view(events[: i + 1], ctx)
            if view.prompt_estimate > ctx.compaction_threshold * event.get("contextWindow", 0):
                return i
    return None


def _compacted_below_after(settings: Settings, sid: str, crossing: int, cwd: str = CWD) -> bool:
    """Whether the first ``compact`` after the log's line ``crossing`` took the view back to the
    threshold or under, and no ``turn_end`` after it was over it again: the job pending when the
    session crossed (a micro job that ran late) answered it, and the coalesced LLM trigger,
    re-checked at that job's end, was rightly not due (turns may come meanwhile: the job waits in
    a busy queue). A compact that left the view over the threshold, or a later turn over it again,
    is no such case."""
    events = read_lines(settings, sid, cwd)
    ctx = settings.context
    at = next((i for i in range(crossing + 1, len(events)) if events[i].get("type") == "compact"), None)
    if at is None:
        return False
    window = events[crossing].get("contextWindow", 0)
    for i in range(at, len(events)):
        if i == at or events[i].get("type") == "turn_end":
            window = events[i].get("contextWindow", window)
            if build_view(events[: i + 1], ctx).prompt_estimate > ctx.compaction_threshold * window:
                return False
    return True


def over_llm_threshold_now(settings: Settings, sid: str, cwd: str = CWD) -> bool:
    """Whether the log's view is over compactionThreshold x the window of its last turn_end."""
    events = read_lines(settings, sid, cwd)
    windows = [e.get("contextWindow", 0) for e in events if e.get("type") == "turn_end"]
    estimate = build_view(events, settings.context).prompt_estimate
    return bool(windows) and estimate > settings.context.compaction_threshold * windows[-1]


def assert_never_stuck(client: redis.Redis, settings: Settings, sessions: list[str], cwd: str = CWD,
                       *, history: bool = True) -> None:
    """Quiet stack: no dangling claim, and every session that crossed 0.9·W (``history``) — or,
    after crashes, every session still over 0.9·W — has a summary, a counted LLM failure
    (retried at its next turn_end) or an open breaker.

    A session that crossed while a micro job was pending (on a loaded machine that job can run
    turns late) may be answered by that job alone: its end re-checks the coalesced LLM trigger
    against the log, and a view the micro step took back to 0.9·W or under is not due (DESIGN.md,
    "Forced jobs and the one-job rule"). Such a session passes when a ``compact`` follows the
    crossing and the view is no longer over.

    After a crash the weaker form applies: an LLM job applies micro compaction first, and a
    worker killed in the LLM call after that can leave the session legitimately below 0.9·W,
    where no job is due any more.

    A claim whose job never came (Redis died between the claim and the enqueue, or lost the
    enqueue) is freed by the worker janitor once ``STALE_CLAIM_GRACE_S`` old: that recovery is
    waited for (it re-checks the session, so the stack is then waited quiet again), and a
    claim it does not free in that time fails, by name.
    """
    if dangling_claims(client, settings):
        try:
            wait_for(lambda: not dangling_claims(client, settings), STALE_CLAIM_GRACE_S + 3 * JANITOR_INTERVAL_S,
                     "the janitor to free the claims whose job ended or never came", every_s=0.5)
        except AssertionError as e:
            raise AssertionError(f"{e}: {dangling_claims(client, settings)}") from None
        wait_quiet(client, settings, 120)
    assert dangling_claims(client, settings) == {}
    keys = Keys(settings.redis.prefix, settings.redis.shards)
    unsummarized = []
    for sid in sessions:
        if history:
            crossing = crossed_llm_threshold(settings, sid, cwd)
            due = crossing is not None and not _compacted_below_after(settings, sid, crossing, cwd)
        else:
            due = over_llm_threshold_now(settings, sid, cwd)
        if not due:
            continue
        has_summary = any(line["type"] == "summary" for line in read_lines(settings, sid, cwd))
        failures = int(client.get(keys.failures(sid)) or 0)
        if not has_summary and failures == 0:
            unsummarized.append(sid)
    assert unsummarized == [], (f"sessions over 0.9·W with no summary, no failure, no breaker: {unsummarized}; "
                                f"{[_what_redis_holds(client, settings, sid, cwd) for sid in unsummarized]}")


def _what_redis_holds(client: redis.Redis, settings: Settings, sid: str, cwd: str) -> dict[str, object]:
    """What a stuck session's failure message shows: its claim, coalesced trigger, stored state and
    last log lines (a run that failed once on CI named the session only)."""
    keys = Keys(settings.redis.prefix, settings.redis.shards)
    state = {k.decode(): v.decode(errors="replace")[:40] for k, v in client.hgetall(keys.session(sid)).items()}
    return {
        "session": sid,
        "claim": client.get(keys.job(sid)),
        "retrigger": client.get(keys.retrigger(sid)),
        "state": {k: state[k] for k in sorted(state) if k in ("prompt_estimate", "window", "log_size", "events")},
        "log_tail": [(line["type"], line.get("turnId")) for line in read_lines(settings, sid, cwd)[-4:]],
    }


def wait_quiet(client: redis.Redis, settings: Settings, timeout_s: float) -> None:
    """Until every entry is applied and no compaction job is pending (twice in a row)."""
    def quiet() -> bool:
        return backlog(client, settings) == 0 and not queue_busy(client, settings)

    try:
        wait_for(lambda: quiet() and (time.sleep(0.5) is None) and quiet(), timeout_s,
                 "the stack to drain its streams and its queue", every_s=0.5)
    except AssertionError as e:
        raise AssertionError(f"{e}: {busy_report(client, settings)}") from None


def busy_report(client: redis.Redis, settings: Settings) -> dict[str, Any]:
    """What keeps the stack from being quiet (for a failure message)."""
    queue = settings.redis.prefix
    jobs = {}
    for sid, job_id in claims(client, settings).items():
        jobs[sid] = (job_id, client.hget(Job.key_for(job_id), "status"))
    return {
        "backlog": backlog(client, settings),
        "queued": client.llen(f"rq:queue:{queue}"),
        **{name: client.zrange(f"rq:{name}:{queue}", 0, 5) for name in ("wip", "scheduled", "deferred")},
        "claims": dict(list(jobs.items())[:10]),
        "rate_limit_keys": [k for k in client.scan_iter(match="rq:rl:*", count=1000)][:10],
    }


class Publishing:
    """Simulated agents publishing turns from a background thread until told to stop."""

    def __init__(self, client: redis.Redis, settings: Settings, sessions: list[str], turns: int,
                 window: int, pace_s: float = 0.0, seed: int = 1) -> None:
        from producer.publisher import Publisher

        self.publisher = Publisher(client, settings)
        self.sessions, self.turns, self.window, self.pace_s = sessions, turns, window, pace_s
        self.published: dict[str, list[str]] = {sid: [] for sid in sessions}
        self.errors: list[BaseException] = []
        self._rng = random.Random(seed)
        self._thread = threading.Thread(target=self._run, name="agents", daemon=True)

    def __enter__(self) -> Publishing:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.join(300)

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "publishing did not finish"
        assert not self.errors, self.errors

    def one_more_turn(self) -> None:
        """Every session runs one more turn (its turn_end re-checks the thresholds)."""
        self.turns += 1
        for sid in self.sessions:
            self._publish_turn(sid, self.turns)

    def _run(self) -> None:
        try:
            for turn in range(1, self.turns + 1):
                order = list(self.sessions)
                self._rng.shuffle(order)  # the agents interleave
                for sid in order:
                    self._publish_turn(sid, turn)
                    if self.pace_s:
                        time.sleep(self.pace_s)
        except BaseException as e:  # noqa: BLE001 - reported by join()
            self.errors.append(e)

    def _publish_turn(self, sid: str, turn: int) -> None:
        events = agent_turn(self._rng, sid, turn, self.window)
        while True:
            try:
                self.published[sid] += self.publisher.publish(sid, CWD, events)
                return
            except (redis.ConnectionError, redis.TimeoutError):
                time.sleep(0.1)  # Redis is being restarted: the agent retries the whole turn
