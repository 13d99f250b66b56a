from pathlib import Path

import redis

from compactor.embedded import EmbeddedRedis


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
