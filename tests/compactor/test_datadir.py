"""A watcher or worker refuses a data dir other than the one the sessions Redis knows were written
to (``compactor.datadir``), and records the first one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import redis

from compactor.datadir import ID_FILE, check_data_dir, data_dir_id
from compactor.keys import Keys
from events.config import Settings
from events.errors import InvalidConfig
from tests.producer.test_api import write_session


@pytest.fixture(autouse=True)
def _data_dir_made(settings: Settings) -> None:
    settings.data_dir.mkdir(parents=True, exist_ok=True)  # (as every command makes it first)


def _on(settings: Settings, data_dir: Path) -> Settings:
    return settings.model_copy(update={"data_dir": data_dir})


def test_the_first_data_dir_is_recorded_and_kept(r: redis.Redis, settings: Settings) -> None:
    mine = check_data_dir(r, settings)
    assert data_dir_id(settings.data_dir) == mine and r.get(Keys().data_dir) == mine.encode()
    assert check_data_dir(r, settings) == mine  # (the same, again: nothing made anew)
    assert (settings.data_dir / ID_FILE).read_text() == mine + "\n"
    assert not [p for p in settings.data_dir.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("other_has_an_id", [False, True])
def test_another_data_dir_is_refused_while_redis_knows_sessions(
        r: redis.Redis, settings: Settings, tmp_path: Path, other_has_an_id: bool) -> None:
    """An empty or wrong data dir (a volume not mounted): the watcher wrote the known sessions'
    next events into logs without their start, and acked them off the streams."""
    theirs = check_data_dir(r, settings)
    write_session(r, settings, 2)
    other = _on(settings, tmp_path / "elsewhere")
    other.data_dir.mkdir()
    if other_has_an_id:
        (other.data_dir / ID_FILE).write_text("0123456789abcdef\n")
    with pytest.raises(InvalidConfig) as refused:
        check_data_dir(r, other)
    message = str(refused.value)
    assert message.startswith(f"dataDir: {other.data_dir} is not the data dir the sessions this Redis knows "
                              f"were written to (")
    assert ("its id is 0123456789abcdef" if other_has_an_id else f"it has no {ID_FILE}") in message
    assert f"theirs is {theirs}, recorded in compaction:datadir" in message
    assert r.get(Keys().data_dir) == theirs.encode()  # nothing recorded, nothing made
    assert data_dir_id(other.data_dir) == ("0123456789abcdef" if other_has_an_id else None)
    r.delete(Keys().data_dir)  # what OPERATIONS says to do when the old logs are gone for good
    assert check_data_dir(r, other) == data_dir_id(other.data_dir)


def test_a_data_dir_is_adopted_when_redis_knows_no_session(r: redis.Redis, settings: Settings,
                                                           tmp_path: Path) -> None:
    check_data_dir(r, settings)
    other = _on(settings, tmp_path / "new")
    other.data_dir.mkdir()
    adopted = check_data_dir(r, other)
    assert r.get(Keys().data_dir) == adopted.encode() != data_dir_id(settings.data_dir)


@pytest.mark.parametrize("command", ["watch", "work"])
def test_watch_and_work_on_another_data_dir_exit_2_before_writing_anything(
        r: redis.Redis, settings: Settings, tmp_path: Path, command: str) -> None:
    check_data_dir(r, settings)
    write_session(r, settings, 2)
    empty = tmp_path / "not-mounted"
    args = [sys.executable, "-m", "compactor", command, "--redis-url", settings.redis.url, "--data-dir", str(empty)]
    done = subprocess.run([*args, *(["--burst"] if command == "work" else [])],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"compactor: dataDir: {empty} is not the data dir the sessions" in done.stderr
    assert [p.name for p in empty.iterdir()] == []
    ran = subprocess.run([*args[:-1], str(settings.data_dir), "--burst"] if command == "work" else ["true"],
                         capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr  # (on its own data dir, the worker runs)
