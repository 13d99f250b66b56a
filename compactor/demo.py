"""``compactor demo``: the whole stack driven by simulated agents, in under a minute.

What runs: the embedded Redis in a fresh temporary data dir (unless Redis is
configured, in which case the demo uses its own key prefix and cleans it up),
the watcher and the workers as child processes (``compactor.serve``), and one
thread per simulated agent publishing realistic turns through the Publisher:
a user request, an assistant with tool calls (compactable ones with large
outputs and a non-compactable one), the tool results, an answer, and a
``turn_end`` with a small context window so both thresholds are crossed.

Invariants: the demo never touches the operator's real data dir (a temp dir
unless ``--data-dir`` is given); compaction uses the offline ``extractive``
summarizer unless a compaction model is configured; the summary's numbers are
read back from the logs and the RQ registries, not from the agents' intentions.
"""

from __future__ import annotations

import logging
import os
import random
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from rq import Queue, Worker
from rq.defaults import RQ_KEY_PREFIX
from rq.job import Job
from rq.rate_limit import RateLimitRegistry

from compactor.keys import Keys
from compactor.queue import compaction_queue, parse_job_id
from compactor.serve import ChildFailed, Output, running_stack, stack_specs, temporary_demo_dir
from compactor.store import SessionStore
from compactor.urls import redacted
from events.config import EXTRACTIVE as EXTRACTIVE_MODEL
from events.config import EMBEDDED_SOCKET, MAX_SOCKET_PATH_BYTES, Settings
from events.errors import CompactorError, InvalidConfig
from events.log import SessionLog
from events.view import build_view
from producer.publisher import Publisher

logger = logging.getLogger(__name__)

DEFAULT_SESSIONS = 20
DEFAULT_TURNS = 12
DEFAULT_CONTEXT_WINDOW = 8_000  # tokens: small, so both thresholds are crossed in a few turns
DEFAULT_WORKERS = 2
SETTLE_TIMEOUT_S = 30.0  # after the agents finish, wait for the last jobs while they progress within this
SETTLE_CAP_S = 300.0  # ... and this long at most in all
TURN_PAUSE_S = (0.05, 0.25)  # an agent "thinks" this long between turns
AGENT_MODEL = "demo-agent"  # unknown to tiktoken: cl100k_base, works offline
DEMO_CWD_ROOT = "/home/demo/projects"

_WORDS = ["the", "config", "loader", "reads", "values", "from", "the", "yaml", "file", "and", "merges", "environment", "overrides", "before", "validating", "every", "section", "with", "pydantic", "so", "that", "a", "typo", "fails", "early", "while", "the", "watcher", "applies", "each", "event", "to", "the", "session", "log", "exactly", "once", "under", "the", "lock", "and", "the", "worker", "summarizes", "old", "turns"]
_REQUESTS = (
    "Why does the config loader ignore REDIS_URL when the file sets redis.url?",
    "Add a retry with backoff around the HTTP client in fetch_prices.",
    "The test_parse_dates test fails on Windows paths; can you fix it?",
    "Refactor the session store so writes share one pipeline.",
    "Find where we compute the token estimate and add caching.",
    "Rename the `cfg` variables in the CLI module to `settings`.",
)
_FILES = ("src/config.py", "src/http_client.py", "tests/test_dates.py", "src/store.py",
          "src/tokens.py", "src/cli.py", "README.md")


@dataclass
class DemoOptions:
    sessions: int = DEFAULT_SESSIONS
    turns: int = DEFAULT_TURNS
    context_window: int = DEFAULT_CONTEXT_WINDOW
    workers: int = DEFAULT_WORKERS
    seed: int = 7
    data_dir: Path | None = None  # None: a fresh temp dir, removed at the end


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(count))


def _code(rng: random.Random, path: str, lines: int) -> str:
    out = [f"# {path}"]
    for n in range(lines):
        name = rng.choice(("load", "merge", "validate", "apply", "fold", "emit"))
        out.append(f"def {name}_{n}(value):\n    return {name}(value)  # {_words(rng, 4)}")
    return "\n".join(out)


def _test_run(rng: random.Random, tests: int) -> str:
    lines = [f"tests/test_{rng.choice(('config', 'dates', 'store'))}.py::test_{i} "
             f"{'PASSED' if rng.random() < 0.9 else 'FAILED'}" for i in range(tests)]
    return "\n".join(lines) + f"\n{tests} tests ran in {rng.uniform(0.5, 9):.2f}s"


@dataclass
class Agent:
    """One simulated coding-agent session publishing its turns."""

    session_id: str
    cwd: str
    rng: random.Random
    published: int = 0
    turns_done: int = 0

    def meta(self) -> dict[str, Any]:
        return {"type": "session_meta", "sessionId": self.session_id, "cwd": self.cwd,
                "model": AGENT_MODEL}

    def turn(self, turn_id: int, window: int) -> list[list[dict[str, Any]]]:
        """One turn as the batches an agent would push: ask+calls, results, answer+end."""
        rng = self.rng
        path = rng.choice(_FILES)
        calls = [
            ("read_file", {"path": path}, _code(rng, path, rng.randint(20, 40))),
            ("execute_command", {"command": "pytest -q"}, _test_run(rng, rng.randint(25, 50))),
            ("list_dir", {"path": "src"}, "\n".join(f"src/{_words(rng, 1)}_{i}.py"
                                                     for i in range(rng.randint(40, 80)))),
        ]
        if rng.random() < 0.5:
            calls.append(("search_code", {"query": "estimate"},
                          "\n".join(f"{rng.choice(_FILES)}:{rng.randint(1, 400)}: {_words(rng, 8)}"
                                    for _ in range(rng.randint(15, 30)))))
        ids = [f"call_{turn_id}_{i}" for i in range(len(calls))]
        ask = [{"type": "user", "turnId": turn_id,
                "content": f"{rng.choice(_REQUESTS)} {_words(rng, rng.randint(10, 40))}"},
               {"type": "assistant", "turnId": turn_id, "content": f"Let me look. {_words(rng, 20)}",
                "toolCalls": [{"id": i, "name": n, "arguments": a}
                              for i, (n, a, _) in zip(ids, calls)]}]
        results = [{"type": "tool_result", "turnId": turn_id, "toolCallId": i, "toolName": n,
                    "output": o} for i, (n, _, o) in zip(ids, calls)]
        answer = [{"type": "assistant", "turnId": turn_id,
                   "content": f"Done: {_words(rng, rng.randint(60, 160))}"},
                  {"type": "turn_end", "turnId": turn_id, "model": AGENT_MODEL,
                   "contextWindow": window}]
        return [ask, results, answer]

    def run(self, publish: Callable[[str, str, list[dict[str, Any]]], Any], turns: int,
            window: int, stop: threading.Event) -> None:
        publish(self.session_id, self.cwd, [self.meta()])
        self.published += 1
        for turn_id in range(1, turns + 1):
            for batch in self.turn(turn_id, window):
                if stop.is_set():
                    return
                publish(self.session_id, self.cwd, batch)
                self.published += len(batch)
            self.turns_done = turn_id
            stop.wait(self.rng.uniform(*TURN_PAUSE_S))


class DemoFailed(CompactorError):
    """A process of the demo's stack kept dying."""


@dataclass
class JobStats:
    """Finished/failed compaction jobs of this run's sessions (their ids start ``session_prefix``)
    in the demo's queue, read from RQ's registries (which keep a run's jobs for a day, failed ones
    for a week: a second run on the same --data-dir counted the first run's too)."""

    session_prefix: str = ""
    finished: dict[str, int] = field(default_factory=lambda: {"micro": 0, "llm": 0})
    failed: int = 0
    released: int = 0
    seen: set[str] = field(default_factory=set)

    def ours(self, job_id: str) -> bool:
        parsed = parse_job_id(job_id)
        return parsed is not None and parsed[2].startswith(self.session_prefix)

    def refresh(self, client: redis.Redis, settings: Settings) -> None:
        queue = compaction_queue(client, settings)
        new = [j for j in queue.finished_job_registry.get_job_ids() if j not in self.seen and self.ours(j)]
        for job in Job.fetch_many(new, connection=client):
            if job is None:
                continue
            self.seen.add(job.id)
            parsed = parse_job_id(job.id)
            if parsed:
                self.finished[parsed[1]] = self.finished.get(parsed[1], 0) + 1
            value = job.return_value() or {}
            self.released += int(value.get("released", 0)) if isinstance(value, dict) else 0
        self.failed = sum(1 for j in queue.failed_job_registry.get_job_ids() if self.ours(j))

    def first_error(self, client: redis.Redis, settings: Settings) -> str | None:
        """The last line of the error of this run's first failed job (None: none failed)."""
        queue = compaction_queue(client, settings)
        failed = sorted(j for j in queue.failed_job_registry.get_job_ids() if self.ours(j))
        for job in Job.fetch_many(failed[:1], connection=client):
            result = job.latest_result() if job is not None else None
            text = (result.exc_string if result is not None else None) or (job.exc_info if job else None) or ""
            lines = [line for line in text.splitlines() if line.strip()]
            return f"{failed[0]}: {lines[-1].strip() if lines else 'no error recorded'}"
        return None

    def pending(self, client: redis.Redis, settings: Settings) -> int:
        queue = compaction_queue(client, settings)
        counts = (queue.count, queue.started_job_registry.count, queue.deferred_job_registry.count)
        return sum(int(c) for c in counts)


def demo_settings(settings: Settings, data_dir: Path) -> Settings:
    """The demo's settings: its data dir, the extractive summarizer unless a model is set,
    and its own key prefix when it shares a configured Redis."""
    ctx = settings.context
    if not ctx.compaction_model:
        ctx = ctx.model_copy(update={"compaction_model": EXTRACTIVE_MODEL})
    redis_settings = settings.redis
    if redis_settings.url:
        redis_settings = redis_settings.model_copy(
            update={"prefix": f"{redis_settings.prefix}-demo{os.getpid()}"})
    return settings.model_copy(update={"context": ctx, "data_dir": data_dir,
                                       "redis": redis_settings})


@contextmanager
def _data_dir(options: DemoOptions, *, embedded: bool) -> Iterator[Path]:
    if options.data_dir is not None:
        yield options.data_dir
        return
    path, mark = temporary_demo_dir()  # (a killed demo's: swept by the next serve or demo)
    socket = path / EMBEDDED_SOCKET
    if embedded and len(os.fsencode(socket)) > MAX_SOCKET_PATH_BYTES:  # (as a dataDir that long is refused)
        os.close(mark)
        shutil.rmtree(path, ignore_errors=True)
        raise InvalidConfig("TMPDIR", f"too long for the embedded Redis: its socket {socket} would be "
                            f"{len(os.fsencode(socket))} bytes, and a unix socket's path takes at most "
                            f"{MAX_SOCKET_PATH_BYTES} (set a shorter TMPDIR, or pass --data-dir)")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        os.close(mark)


def _agents(options: DemoOptions) -> list[Agent]:
    """The simulated agents: their talk follows ``seed``; their session ids are new on every
    run, so a second run on the same ``--data-dir`` (its Redis kept there) starts new sessions
    instead of reporting the first run's, which the same ids found already settled."""
    rng = random.Random(options.seed)
    rng.getrandbits(24)  # (what the session tag used to take: the talk stays what it was)
    tag = secrets.token_hex(3)
    return [Agent(f"demo-{tag}-{n:02d}", f"{DEMO_CWD_ROOT}/app-{n % 5}",
                  random.Random(rng.getrandbits(32))) for n in range(options.sessions)]


def _session_tag(agents: list[Agent]) -> str:
    """The run's part of its session ids (``demo-{tag}``): what names its jobs and keys."""
    return agents[0].session_id.rsplit("-", 1)[0]


Snapshot = Callable[[dict[str, Any]], None]


def run_demo(settings: Settings, options: DemoOptions, *, on_tick: Snapshot | None = None,
             output: Output = None) -> dict[str, Any]:
    """Run the demo; the summary dict (see ``summary``). ``on_tick`` gets live numbers."""
    with _data_dir(options, embedded=not settings.redis.url) as data_dir:
        demo = demo_settings(settings, data_dir)
        specs = stack_specs(workers=options.workers, api=False)
        agents = _agents(options)
        try:
            with running_stack(demo, specs, output=output) as stack:
                client = redis.Redis.from_url(stack.redis_url)
                try:
                    client.ping()  # a configured Redis that does not answer: one error, before any agent starts
                    return _drive(client, demo, agents, options, on_tick, stack.supervisor.check)
                except ChildFailed as e:  # (serve's words: "worker-1 exited 5 times within 60s ...")
                    raise DemoFailed(f"demo stopped: {e}") from None
                finally:
                    client.close()
        finally:  # once the workers have stopped: a job still running wrote its keys after a cleanup before
            if settings.redis.url:
                _cleanup(settings.redis.url, demo.redis.prefix, _session_tag(agents))


def _drive(client: redis.Redis, settings: Settings, agents: list[Agent], options: DemoOptions,
           on_tick: Snapshot | None, keep_up: Callable[[], None]) -> dict[str, Any]:
    """Run the agents until done and the jobs settle; ``keep_up`` (the stack's ``Supervisor.check``)
    restarts a child that died meanwhile, as ``serve`` does (a watcher killed mid-run left the
    demo waiting 30 s, then reporting all zeros, exit 0)."""
    publisher = Publisher(client, settings)
    stop, stats, started = threading.Event(), JobStats(_session_tag(agents) + "-"), time.monotonic()
    errors: list[Exception] = []

    def run(agent: Agent) -> None:  # an agent's error stops them all and is raised here, not dumped
        try:
            agent.run(publisher.publish, options.turns, options.context_window, stop)
        except Exception as e:
            errors.append(e)
            stop.set()

    threads = [threading.Thread(target=run, args=(a,), name=a.session_id, daemon=True) for a in agents]
    for t in threads:
        t.start()
    try:
        _wait(lambda: not any(t.is_alive() for t in threads), client, settings, agents, stats,
              started, on_tick, timeout_s=None, keep_up=keep_up)
        if errors:
            raise errors[0]
        _wait(lambda: _settled(client, settings, agents, stats, options.turns), client, settings,
              agents, stats, started, on_tick, timeout_s=SETTLE_TIMEOUT_S, keep_up=keep_up,
              progress=lambda: _progress(client, settings, agents, stats), ready=lambda: _ready(client, settings))
    finally:
        stop.set()
    if not any(turns for turns in _progress(client, settings, agents, stats)[0]):  # (zeros, exit 0, before)
        raise DemoFailed(f"demo stopped: no event was applied within {SETTLE_CAP_S:.0f}s "
                         f"({_not_ready(client, settings) or 'the watcher applied nothing'})")
    result = summary(client, settings, agents, stats, time.monotonic() - started)
    if on_tick:
        on_tick(result)
    return result


def _wait(done: Callable[[], bool], client: redis.Redis, settings: Settings, agents: list[Agent],
          stats: JobStats, started: float, on_tick: Snapshot | None,
          timeout_s: float | None, keep_up: Callable[[], None],
          progress: Callable[[], object] | None = None, ready: Callable[[], bool] | None = None) -> None:
    """Until ``done``; with ``timeout_s``, until nothing moved for that long (``progress`` tells
    what moved) once the stack is ``ready``, ``SETTLE_CAP_S`` at most. A fixed 30 s ended a demo
    whose watcher a slow machine took longer to restart than that: all turns published, none
    compacted, zeros reported; and the wait for a move ran out while a loaded machine still
    imported the watcher's modules (58 s from its start to its first lease)."""
    waited = time.monotonic()
    deadline = waited + timeout_s if timeout_s else None
    seen = progress() if progress else None
    while not done():
        keep_up()
        now = time.monotonic()
        if progress is not None and timeout_s and ((moved := progress()) != seen or (ready and not ready())):
            seen, deadline = moved, min(now + timeout_s, waited + SETTLE_CAP_S)
        if deadline is not None and now > deadline:
            logger.warning("demo: jobs still pending after %.0fs; summarizing anyway", now - waited)
            return
        stats.refresh(client, settings)
        if on_tick:
            on_tick(live_numbers(agents, stats, time.monotonic() - started))
        time.sleep(0.25)


def _ready(client: redis.Redis, settings: Settings) -> bool:
    return not _not_ready(client, settings)


def _not_ready(client: redis.Redis, settings: Settings) -> str:
    """What the stack still lacks to make progress ("" when nothing): a watcher holding a shard
    lease, a worker registered on the queue."""
    keys = Keys(settings.redis.prefix, settings.redis.shards)
    if not any(client.exists(keys.lease(n)) for n in range(keys.shards)):
        return "no watcher holds a shard lease yet"
    if not Worker.count(connection=client, queue=compaction_queue(client, settings)):
        return "no worker has started yet"
    return ""


def _progress(client: redis.Redis, settings: Settings, agents: list[Agent], stats: JobStats) -> tuple[Any, ...]:
    """What changes while the stack works: the turns in the sessions' states, the jobs ended."""
    store = SessionStore(client, settings)
    states = [store.load(agent.session_id) for agent in agents]
    return (tuple(state.last_ended_turn if state else 0 for state in states), dict(stats.finished), stats.failed)


def _settled(client: redis.Redis, settings: Settings, agents: list[Agent], stats: JobStats,
             turns: int) -> bool:
    """Every turn is in the logs and no compaction job is queued or running."""
    store = SessionStore(client, settings)
    for agent in agents:
        state = store.load(agent.session_id)
        if state is None or state.last_ended_turn < agent.turns_done:
            return False
    keys = Keys(settings.redis.prefix, settings.redis.shards)
    claims = sum(client.exists(keys.job(a.session_id)) for a in agents)
    return claims == 0 and stats.pending(client, settings) == 0


def live_numbers(agents: list[Agent], stats: JobStats, elapsed: float) -> dict[str, Any]:
    events = sum(a.published for a in agents)
    return {"sessions": len(agents), "elapsed": elapsed, "events": events,
            "eventsPerSecond": events / elapsed if elapsed else 0.0,
            "turns": sum(a.turns_done for a in agents),
            "jobs": dict(stats.finished), "failedJobs": stats.failed,
            "tokensReleased": stats.released}


def _session_row(settings: Settings, agent: Agent) -> dict[str, Any]:
    log = SessionLog(settings.data_dir, agent.cwd, agent.session_id)
    events = log.read() if log.exists() else []
    raw = [e for e in events if e.get("type") not in ("compact", "summary")]
    return {
        "sessionId": agent.session_id, "turns": agent.turns_done,
        "estimateBefore": build_view(raw, settings.context).prompt_estimate,
        "estimateAfter": build_view(events, settings.context).prompt_estimate,
        "micro": sum(1 for e in events if e.get("type") == "compact"),
        "llm": sum(1 for e in events if e.get("type") == "summary"),
    }


def summary(client: redis.Redis, settings: Settings, agents: list[Agent], stats: JobStats,
            elapsed: float) -> dict[str, Any]:
    """What the demo did, read back from the logs and RQ: per session and in total."""
    stats.refresh(client, settings)
    rows = [_session_row(settings, a) for a in agents]
    numbers = live_numbers(agents, stats, elapsed)
    numbers["compactions"] = {"micro": sum(r["micro"] for r in rows),
                              "llm": sum(r["llm"] for r in rows)}
    numbers["compactionModel"] = settings.context.compaction_model
    numbers["firstJobError"] = stats.first_error(client, settings) if stats.failed else None
    numbers["perSession"] = rows
    return numbers


def _cleanup(url: str, prefix: str, session_tag: str) -> None:
    """Remove the demo's keys from a shared Redis: its own prefix, its RQ queue,
    registries and rate limits, and its jobs (their ids end with the session id).
    A Redis that does not answer is logged, not raised (the demo's own error, if any, stands)."""
    rq = RQ_KEY_PREFIX  # (``RQ_KEY_PREFIX`` in the environment: RQ's keys under it left behind)
    patterns = (f"{prefix}:*", f"{prefix}-*", f"{rq}:*:{prefix}", f"{rq}:*:{prefix}:*",
                f"{rq}:*-{session_tag}-*")
    client = redis.Redis.from_url(url)
    try:
        for pattern in patterns:
            for key in client.scan_iter(match=pattern, count=1000):
                client.delete(key)
        client.srem(Queue.redis_queues_keys, f"{Queue.redis_queue_namespace_prefix}{prefix}")
        # RQ's index of rate limits names them without a key of their own: only a worker's
        # maintenance pruned them, and every demo on a shared Redis left its sessions' there
        limits = RateLimitRegistry.rl_keys_key
        members = list(client.sscan_iter(limits, match=f"{prefix}:*", count=1000))
        if members:
            client.srem(limits, *members)
    except redis.RedisError as e:
        logger.warning("demo: could not delete its keys (prefix %s) from %s: %s", prefix, redacted(url), e)
    finally:
        client.close()
