"""Benchmark: compaction jobs end to end (workers, RQ, litellm over HTTP, the log).

Starts an embedded Redis and a local OpenAI-compatible stub in a temporary
directory, then measures:

- ``jobs_per_s`` vs ``ideal_jobs_per_s``: ``W`` worker processes
  (``worker.runner.main``) run forced LLM jobs of distinct sessions while the
  stub answers each call after ``LLM_LATENCY_S``; ideal is ``W / LLM_LATENCY_S``,
  measured from the first job's start to the last job's end. Target
  ``ratio >= 0.9``.
- ``overhead_ms_p50``: one LLM job on a ~100 000-token session, in-process,
  with an instant in-process summarizer (the LLM call excluded), vs
  ``overhead_baseline_ms`` (also reported as ``parse_ms_p50``), the median time
  to read and parse that log; target ``overhead_ratio`` (job / baseline) ``<= 2``.
  Every line carries a uuid, as the watcher writes them (a summary replaces
  events by uuid).
- ``micro_overhead_ms_p50`` (no target): one micro job on that session once a
  micro job compacted its old turns and two more turns came (the steady
  state: the job elides the new candidates while its view shows the ~100
  earlier ones elided), in a worker that never saw the session;
  ``micro_overhead_ratio`` against the parse of that log (``micro_parse_ms_p50``).
- ``worker_rss_growth_pct``: RSS of an in-process worker after 1 000 jobs
  (litellm to the stub, no latency) vs after a warm-up; target < 10 %.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import redis
from rq.job import Job

from compactor.embedded import EmbeddedRedis
from compactor.heap import freeze_heap
from compactor.llm_stub import LLMStub
from compactor.queue import enqueue_compaction
from compactor.serve import child_env, our_python
from compactor.store import SessionStore
from events.config import Settings
from events.log import SessionLog
from worker.summarize import SECTION_TITLES

Progress = Callable[[str], None]

LLM_LATENCY_S = 1.0
MODEL = "openai/bench-model"
CWD = "/bench/project"
SUMMARY = "<analysis>ok</analysis>\n<summary>\n" + "\n".join(
    f"### {title}\nbench {title.lower()}" for title in SECTION_TITLES) + "\n</summary>"
BIG_SESSION_TOKENS = 100_000
OVERHEAD_RUNS = (5, 15)  # quick, full
THROUGHPUT = ((2, 8), (4, 40))  # (workers, jobs): quick, full
RSS_JOBS = ((100, 300), (100, 1_000))  # (warm-up, measured): quick, full


def run(*, quick: bool = False, progress: Progress | None = None) -> dict[str, Any]:
    """Run the three measurements; a flat dict of numbers."""
    say = progress or (lambda message: None)
    level = 0 if quick else 1
    with tempfile.TemporaryDirectory(prefix="compactor-bench-jobs-") as tmp, LLMStub(lambda _body: SUMMARY) as stub:
        root = Path(tmp)
        server = EmbeddedRedis(root / "redis", persist=False).start()
        previous_env = _point_litellm_at(stub.base_url)
        try:
            settings = Settings.model_validate({
                "dataDir": str(root / "data"), "redis": {"url": server.url},
                "context": {"compactionModel": MODEL, "llmTimeoutSeconds": 30},
            })
            client = redis.Redis.from_url(server.url)
            result: dict[str, Any] = {}
            say("overhead of one job on a 100k-token session")
            result.update(_overhead(client, settings, OVERHEAD_RUNS[level]))
            say("overhead of one micro job on a micro-compacted 100k-token session")
            result.update(_micro_overhead(client, settings, OVERHEAD_RUNS[level]))
            say("throughput with worker processes")
            stub.latency_s = LLM_LATENCY_S
            result.update(_throughput(client, settings, *THROUGHPUT[level]))
            stub.latency_s = 0.0
            say("worker memory over many jobs")
            result.update(_rss_growth(client, settings, *RSS_JOBS[level]))
            client.close()
        finally:
            _restore_env(previous_env)
            server.stop()
    return result


# -- sessions --------------------------------------------------------------------------------


def _turn(n: int, output_chars: int) -> list[dict[str, Any]]:
    words = " ".join(f"word{(n * 7 + i) % 997}" for i in range(output_chars // 8))
    return [
        {"type": "user", "turnId": n, "content": f"step {n}: please continue"},
        {"type": "assistant", "turnId": n, "content": f"doing step {n}",
         "toolCalls": [{"id": f"c{n}", "name": "read_file", "arguments": {"path": f"src/m{n}.py"}}]},
        {"type": "tool_result", "turnId": n, "toolCallId": f"c{n}", "toolName": "read_file", "output": words},
        {"type": "turn_end", "turnId": n, "model": MODEL, "contextWindow": 128_000},
    ]


def _write_session(client: redis.Redis, settings: Settings, sid: str, turns: int, output_chars: int) -> int:
    events: list[dict[str, Any]] = [{"type": "session_meta", "sessionId": sid, "cwd": CWD, "model": MODEL}]
    for n in range(1, turns + 1):
        events.extend(_turn(n, output_chars))
    for index, event in enumerate(events):  # every line carries a uuid, as the watcher writes them
        event["uuid"] = str(uuid.uuid5(uuid.NAMESPACE_URL, f"bench/{sid}/{index}"))
    return SessionStore(client, settings).apply(sid, CWD, events).state.prompt_estimate


# -- overhead --------------------------------------------------------------------------------


class _InstantSummarizer:
    def complete(self, model: str, messages: list[dict[str, str]]) -> str:
        return SUMMARY


def _overhead(client: redis.Redis, settings: Settings, runs: int) -> dict[str, Any]:
    from worker import context as worker_context
    from worker.context import WorkerContext
    from worker.jobs import llm_compact
    from worker.runner import preload

    estimate = _write_session(client, settings, "big", turns=100, output_chars=4_600)
    store = SessionStore(client, settings)
    template = store.log("big", CWD).path
    worker_context.install(WorkerContext.build(settings, client, summarizer=_InstantSummarizer))
    preload()
    freeze_heap()  # as a worker process does after its imports (worker.runner.main)
    job_ms, parse_ms = [], []
    try:
        for i in range(runs):
            sid = f"big-{i}"
            target = store.log(sid, CWD).path
            shutil.copyfile(template, target)
            store.refresh(sid, CWD)
            parse_ms.append(_timed(lambda sid=sid: SessionLog(settings.data_dir, CWD, sid).read()))
            job_ms.append(_timed(lambda sid=sid: llm_compact(sid, CWD, forced=True)))
    finally:
        worker_context.clear()
    job, parse = statistics.median(job_ms), statistics.median(parse_ms)
    return {"session_tokens": estimate, "overhead_ms_p50": round(job, 2), "overhead_baseline_ms": round(parse, 2),
            "parse_ms_p50": round(parse, 2), "overhead_ratio": round(job / parse, 2)}


def _micro_overhead(client: redis.Redis, settings: Settings, runs: int) -> dict[str, Any]:
    from events.tokens import forget_shown_counts
    from worker import context as worker_context
    from worker.context import WorkerContext
    from worker.jobs import micro_compact

    store = SessionStore(client, settings)
    _write_session(client, settings, "steady", turns=100, output_chars=4_600)
    worker_context.install(WorkerContext.build(settings, client, summarizer=_InstantSummarizer))
    try:
        micro_compact("steady", CWD)  # compacts turns 1..98
        later = [*_turn(101, 4_600), *_turn(102, 4_600)]
        for index, event in enumerate(later):
            event["uuid"] = str(uuid.uuid5(uuid.NAMESPACE_URL, f"bench/steady/later/{index}"))
        store.apply("steady", CWD, later)
        template = store.log("steady", CWD).path
        job_ms, parse_ms = [], []
        for i in range(runs):
            sid = f"steady-{i}"
            shutil.copyfile(template, store.log(sid, CWD).path)
            store.refresh(sid, CWD)
            parse_ms.append(_timed(lambda sid=sid: SessionLog(settings.data_dir, CWD, sid).read()))
            forget_shown_counts()  # a worker that never counted this session's elided outputs
            job_ms.append(_timed(lambda sid=sid: micro_compact(sid, CWD)))
    finally:
        worker_context.clear()
    job, parse = statistics.median(job_ms), statistics.median(parse_ms)
    return {"micro_overhead_ms_p50": round(job, 2), "micro_parse_ms_p50": round(parse, 2),
            "micro_overhead_ratio": round(job / parse, 2)}


def _timed(fn: Callable[..., Any]) -> float:
    gc.collect()
    started = time.perf_counter()
    fn()
    return (time.perf_counter() - started) * 1000


# -- throughput ------------------------------------------------------------------------------


def _throughput(client: redis.Redis, settings: Settings, workers: int, jobs: int) -> dict[str, Any]:
    ids = []
    for i in range(jobs):
        sid = f"tp-{i}"
        _write_session(client, settings, sid, turns=3, output_chars=400)
        ids.append(enqueue_compaction(client, settings, sid, CWD, "llm", forced=True))
    config = Path(settings.data_dir).parent / "bench.yaml"
    config.write_text(json.dumps({"dataDir": str(settings.data_dir), "redis": {"url": settings.redis.url},
                                  "context": {"compactionModel": MODEL, "llmTimeoutSeconds": 30}}))
    code = ("from events.config import load_settings\nfrom worker.runner import main\n"
            f"main(load_settings({str(config)!r}), count={workers}, burst=True)\n")
    subprocess.run(our_python("-c", code), check=True, env=child_env(os.getpid()), timeout=600,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    fetched = [Job.fetch(i, connection=client) for i in ids if i]
    finished = [j for j in fetched if j.get_status() == "finished" and j.started_at and j.ended_at]
    span = (max(j.ended_at for j in finished) - min(j.started_at for j in finished)).total_seconds()  # type: ignore[type-var,operator]
    rate = len(finished) / span if span > 0 else 0.0
    ideal = workers / LLM_LATENCY_S
    return {"workers": workers, "jobs": jobs, "jobs_finished": len(finished), "jobs_per_s": round(rate, 3),
            "ideal_jobs_per_s": round(ideal, 3), "ratio": round(rate / ideal, 3)}


# -- memory ----------------------------------------------------------------------------------


def _rss_growth(client: redis.Redis, settings: Settings, warmup: int, jobs: int) -> dict[str, Any]:
    from worker.runner import CompactionWorker

    _write_session(client, settings, "rss-template", turns=3, output_chars=400)
    store = SessionStore(client, settings)
    template = store.log("rss-template", CWD).path
    process = psutil.Process()

    def run_jobs(start: int, count: int) -> None:
        for i in range(start, start + count):
            sid = f"rss-{i}"
            shutil.copyfile(template, store.log(sid, CWD).path)
            store.refresh(sid, CWD)
            enqueue_compaction(client, settings, sid, CWD, "llm", forced=True)
        CompactionWorker.for_settings(client, settings).work(burst=True, logging_level="WARNING")

    run_jobs(0, warmup)
    gc.collect()
    before = process.memory_info().rss
    run_jobs(warmup, jobs)
    gc.collect()
    after = process.memory_info().rss
    return {"rss_jobs": jobs, "worker_rss_mb": round(after / 2**20, 1),
            "worker_rss_growth_pct": round((after - before) / before * 100, 2)}


# -- the LLM stub ----------------------------------------------------------------------------


def _point_litellm_at(base_url: str) -> dict[str, str | None]:
    updates = {"OPENAI_API_BASE": base_url, "OPENAI_API_KEY": "sk-bench", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    previous = {key: os.environ.get(key) for key in updates}
    os.environ.update(updates)
    return previous


def _restore_env(previous: dict[str, str | None]) -> None:
    for key, value in previous.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
