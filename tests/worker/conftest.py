"""Fixtures for the worker tests: the LLM stub, settings that reach it, sessions, in-process workers.

Sessions are written through ``SessionStore.apply`` (the real write path), so
every line carries its token stamp and the Redis state matches the log.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from compactor.store import SessionStore
from events.config import Settings
from events.log import SessionLog
from compactor.llm_stub import STUB_MODEL, LLMStub
from worker import context as worker_context
from worker.context import WorkerContext
from worker.runner import CompactionWorker

CWD = "/home/dev/project"
LONG = "x" * 400  # a tool output well over microCompactMinChars


@pytest.fixture
def stub(monkeypatch: pytest.MonkeyPatch) -> Iterator[LLMStub]:
    """The LLM stub, with litellm's OpenAI settings pointing at it."""
    with LLMStub() as server:
        monkeypatch.setenv("OPENAI_API_BASE", server.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-stub")
        yield server


def make_settings(base: Settings, **context: Any) -> Settings:
    """``base`` with ``context`` overrides (snake_case names)."""
    return base.model_copy(update={"context": base.context.model_copy(update=context)})


@pytest.fixture
def wsettings(settings: Settings) -> Settings:
    """Test settings: short LLM timeout, the stub model as the compaction model."""
    return make_settings(settings, llm_timeout_seconds=5.0, compaction_model=STUB_MODEL)


@pytest.fixture(autouse=True)
def _no_leftover_context() -> Iterator[None]:
    yield
    worker_context.clear()


def turn(n: int, *, output: str = LONG, user: str | None = None, tool: str = "read_file",
         window: int | None = 4000, model: str = STUB_MODEL) -> list[dict[str, Any]]:
    """The events of one complete turn: user, assistant with a tool call, its result, turn_end."""
    call = f"call-{n}"
    end: dict[str, Any] = {"type": "turn_end", "turnId": n, "model": model, "uuid": f"e{n}"}
    if window is not None:
        end["contextWindow"] = window
    return [
        {"type": "user", "turnId": n, "content": user or f"please do step {n}", "uuid": f"u{n}"},
        {"type": "assistant", "turnId": n, "content": f"working on step {n}", "uuid": f"a{n}",
         "toolCalls": [{"id": call, "name": tool, "arguments": {"path": f"src/mod{n}.py"}}]},
        {"type": "tool_result", "turnId": n, "toolCallId": call, "toolName": tool, "output": output,
         "uuid": f"t{n}"},
        end,
    ]


def write_session(client: redis.Redis, settings: Settings, session_id: str, turns: int,
                  first: int = 1, **kwargs: Any) -> list[dict[str, Any]]:
    """Append ``turns`` complete turns starting at ``first``; the lines written."""
    events: list[dict[str, Any]] = []
    if first == 1:
        events.append({"type": "session_meta", "sessionId": session_id, "cwd": CWD, "model": STUB_MODEL,
                       "uuid": "meta"})
    for n in range(first, first + turns):
        events.extend(turn(n, **kwargs))
    return SessionStore(client, settings).apply(session_id, CWD, events).appended


def read_log(settings: Settings, session_id: str) -> list[dict[str, Any]]:
    return SessionLog(settings.data_dir, CWD, session_id).read()


def log_lines(settings: Settings, session_id: str) -> list[bytes]:
    return Path(SessionLog(settings.data_dir, CWD, session_id).path).read_bytes().splitlines(keepends=True)


def run_burst(client: redis.Redis, settings: Settings, context: WorkerContext | None = None) -> bool:
    """Run every queued compaction job in this process with a real RQ SimpleWorker."""
    worker = CompactionWorker.for_settings(client, settings, context=context)
    return worker.work(burst=True)


@pytest.fixture
def env_for_subprocess(stub: LLMStub, redis_url: str) -> dict[str, str]:
    """Environment for worker subprocesses: the stub and offline litellm."""
    env = dict(os.environ)
    env.update(OPENAI_API_BASE=stub.base_url, OPENAI_API_KEY="sk-stub", LITELLM_LOCAL_MODEL_COST_MAP="True",
               REDIS_URL=redis_url, PYTHONUNBUFFERED="1")
    return env
