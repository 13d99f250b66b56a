"""A watcher or worker refuses a data dir other than the one the sessions Redis knows were written
to (``compactor.datadir``), and records the first one."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from compactor.datadir import ID_FILE, DataDirChanged, Mark, check_data_dir, data_dir_id
from compactor.keys import Keys
from events.config import Settings
from events.errors import InvalidConfig
from tests.producer.conftest import CWD
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
    assert message.startswith(f"dataDir: {other.data_dir} is not the data dir the 1 session(s) this Redis knows "
                              f"were written to (")
    assert ("its id is 0123456789abcdef" if other_has_an_id else f"it has no {ID_FILE}") in message
    assert f"theirs is {theirs}, recorded in compaction:datadir" in message
    assert r.get(Keys().data_dir) == theirs.encode()  # nothing recorded, nothing made
    assert data_dir_id(other.data_dir) == ("0123456789abcdef" if other_has_an_id else None)
    # to go on with this one (the old logs gone for good), the refusal says what to run
    how = message.partition("to go on with this data dir, ")[2]
    if other_has_an_id:
        assert how.startswith("record its id: redis-cli SET compaction:datadir 0123456789abcdef (OPERATIONS")
        r.set(Keys().data_dir, "0123456789abcdef")
    else:
        made = re.search(r"echo ([0-9a-f]{16}) > (\S+); redis-cli SET compaction:datadir \1 \(", how)
        assert made is not None and made[2] == str(other.data_dir / ID_FILE), how
        Path(made[2]).write_text(made[1] + "\n")
        r.set(Keys().data_dir, made[1])
    assert check_data_dir(r, other) == data_dir_id(other.data_dir)


def test_a_record_is_never_replaced_on_its_own_even_with_no_session_known(
        r: redis.Redis, settings: Settings, tmp_path: Path) -> None:
    """A worker given a volume of its own, started while Redis knew no session yet, took the record
    over: the watcher on the right data dir was refused at its restart, and told to use the empty
    one."""
    check_data_dir(r, settings)
    other = _on(settings, tmp_path / "its-own-volume")
    other.data_dir.mkdir()
    with pytest.raises(InvalidConfig, match="is not the data dir this Redis's sessions are written to"):
        check_data_dir(r, other)
    assert r.get(Keys().data_dir) == data_dir_id(settings.data_dir).encode()  # type: ignore[union-attr]


def test_a_running_watcher_stops_when_its_data_dir_changes_under_it(r: redis.Redis, settings: Settings) -> None:
    """A volume unmounted under a running watcher left the empty mount point: the next events of
    every session went into new logs without their start, acked off the streams."""
    from producer.publisher import Publisher
    from producer.watcher import Watcher
    from tests.producer.conftest import drain, fast_settings, turn_end, user

    fast = fast_settings(settings.data_dir, settings.redis.url)
    check_data_dir(r, fast)
    watcher = Watcher(r, fast, name="w")
    Publisher(r, fast).publish("s1", CWD, [user(1), turn_end(1)])
    drain(watcher, r, fast)
    r.delete(Keys().data_dir)  # Redis lost it: written back at the next tick
    watcher._next_tick = 0.0
    watcher.run_once()
    assert r.get(Keys().data_dir) == watcher._data_dir.id.encode()  # type: ignore[union-attr]
    mounted = fast.data_dir.rename(fast.data_dir.with_name("mounted"))
    fast.data_dir.mkdir()  # (the empty mount point)
    Publisher(r, fast).publish("s1", CWD, [user(2), turn_end(2)])
    watcher._next_tick = 0.0
    with pytest.raises(DataDirChanged, match=r"changed under the watcher: its \.compactor-id is gone, was "):
        watcher.run_once()
    assert list(fast.data_dir.iterdir()) == [] and (mounted / "work-project" / "sessions" / "s1.jsonl").exists()
    fast.data_dir.rmdir()
    mounted.rename(fast.data_dir)
    r.set(Keys().data_dir, "0123456789abcdef")  # a process on another data dir took the record
    watcher = Watcher(r, fast, name="w2")
    with pytest.raises(DataDirChanged, match="Redis now records another data dir"):
        watcher.run_once()


def test_a_copy_of_the_data_dir_is_refused_while_a_watcher_runs_on_the_original(
        r: redis.Redis, settings: Settings, tmp_path: Path) -> None:
    """A copy (a backup restored beside it, a staging copy) has the same id: a second watcher on it,
    sharing the Redis, was let start, the two took half the shards each, and each data dir got a
    part of every session's events, without a word from either."""
    import shutil

    from producer.publisher import Publisher
    from producer.watcher import Watcher
    from tests.producer.conftest import drain, fast_settings, turn_end, user

    fast = fast_settings(settings.data_dir, settings.redis.url)
    check_data_dir(r, fast)
    first = Watcher(r, fast, name="w1")
    Publisher(r, fast).publish("s1", CWD, [user(1), turn_end(1)])
    drain(first, r, fast)
    copy = _on(fast, tmp_path / "copy")
    shutil.copytree(fast.data_dir, copy.data_dir, symlinks=True)  # (its id, and the first watcher's mark)
    assert data_dir_id(copy.data_dir) == data_dir_id(fast.data_dir)
    with pytest.raises(InvalidConfig, match=(
            rf"^dataDir: {re.escape(str(copy.data_dir))} is not the data dir a running watcher writes to, though "
            r"it has the same id \([0-9a-f]+\): the mark of watcher \S+ pid \d+ \(its dataDir "
            rf"{re.escape(str(fast.data_dir))}\) in it is another file \(a copy's\)")):
        check_data_dir(r, copy)  # what watch, work and serve run at their start
    second = Watcher(r, copy, name="w2")  # (one run without the start's check)
    with pytest.raises(DataDirChanged, match="in it is another file"):
        second.run_once()
    assert r.hkeys(Keys().data_dir_marks) == [first._data_dir.mark.name.encode()]  # type: ignore[union-attr]
    first._next_tick = 0.0  # (the refused one's mark is never recorded: the first goes on)
    first.run_once()
    # a watcher on the copy that started first: the one on the original sees its mark missing from
    # its own data dir at its next tick (both stop: which one is the copy, only the operator knows)
    second._data_dir.mark = Mark.make(copy.data_dir)  # type: ignore[union-attr]
    r.hset(Keys().data_dir_marks, second._data_dir.mark.name,  # type: ignore[union-attr]
           f"{r.time()[0]} 60 " + second._data_dir.mark.record(copy.data_dir))  # type: ignore[union-attr]
    with pytest.raises(DataDirChanged, match=rf"the mark of watcher \S+ pid \d+ \(its dataDir "
                                             rf"{re.escape(str(copy.data_dir))}\) is not in it"):
        first._next_tick = 0.0
        first.run_once()
    second.close()  # a clean stop forgets its mark: the first goes on, and a new watcher on the same data
    first._next_tick = 0.0  # dir (a shared volume) is welcome
    first.run_once()
    third = Watcher(r, fast, name="w3")
    third.run_once()
    first._next_tick = 0.0
    first.run_once()
    assert check_data_dir(r, fast) == data_dir_id(fast.data_dir)
    marks = {path.name for path in (fast.data_dir / ".compactor-marks").iterdir()}
    assert marks == {first._data_dir.mark.name, third._data_dir.mark.name}  # type: ignore[union-attr]
    first.close()
    third.close()
    assert list((fast.data_dir / ".compactor-marks").iterdir()) == [] and not r.exists(Keys().data_dir_marks)
    # a copy with serve's own Redis inside it (copied along, the original's marks in it): its own
    fourth = Watcher(r, fast, name="w4")
    fourth.run_once()
    assert r.exists(Keys().data_dir_marks)
    assert check_data_dir(r, copy, embedded=True) == data_dir_id(copy.data_dir)
    assert not r.exists(Keys().data_dir_marks)
    fourth.close()


def test_a_live_watchers_mark_is_neither_forgotten_nor_removed_by_another_process(
        r: redis.Redis, settings: Settings) -> None:
    """A start's check forgot the record of a watcher with a long lease (ticking every minute or
    more) by its own 60 s, and a mark file no live watcher recorded, 10 minutes old, was removed:
    that watcher, recording its old mark again, stopped every other one, and every start after."""
    import os
    import time

    from producer.watcher import Watcher
    from tests.producer.conftest import fast_settings

    fast = fast_settings(settings.data_dir, settings.redis.url)
    check_data_dir(r, fast)
    slow = fast.model_copy(update={"watcher": fast.watcher.model_copy(update={"lease_ms": 300_000})})
    first, second = Watcher(r, slow, name="w1"), Watcher(r, fast, name="w2")
    first.run_once()
    second.run_once()
    marks = Keys().data_dir_marks
    name = first._data_dir.mark.name  # type: ignore[union-attr]
    at, ttl, record = r.hget(marks, name).decode().split(" ", 2)  # type: ignore[union-attr]
    assert ttl == "900"  # 3 leases of 300 s
    r.hset(marks, name, f"{int(at) - 120} {ttl} {record}")  # its last tick 2 minutes ago, as a long lease's
    assert check_data_dir(r, fast) == data_dir_id(fast.data_dir)
    assert r.hexists(marks, name)
    # paused past its own TTL: forgotten, and its file (10 minutes old) removed by the other's tick
    r.hset(marks, name, f"{int(at) - 1_000} {ttl} {record}")
    path = fast.data_dir / ".compactor-marks" / name
    os.utime(path, (time.time() - 700, time.time() - 700))
    second._next_tick = 0.0
    second.run_once()
    assert not path.exists() and not r.hexists(marks, name)
    first._next_tick = 0.0  # resumed: a new mark, made before it is recorded
    first.run_once()
    assert first._data_dir.mark.name != name and (  # type: ignore[union-attr]
        fast.data_dir / ".compactor-marks" / first._data_dir.mark.name).exists()  # type: ignore[union-attr]
    second._next_tick = 0.0
    second.run_once()
    assert check_data_dir(r, fast) == data_dir_id(fast.data_dir)
    first.close()
    second.close()


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
    assert f"compactor: dataDir: {empty} is not the data dir the 1 session(s)" in done.stderr
    assert [p.name for p in empty.iterdir()] == []
    ran = subprocess.run([*args[:-1], str(settings.data_dir), "--burst"] if command == "work" else ["true"],
                         capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr  # (on its own data dir, the worker runs)


@pytest.mark.parametrize("logs_here", [False, True])
def test_the_first_start_since_ids_records_only_a_data_dir_holding_recent_logs(
        r: redis.Redis, settings: Settings, tmp_path: Path, logs_here: bool) -> None:
    """An upgrade: Redis knows sessions and has no record. Recording whichever data dir came
    first let an empty one in (a worker started on a volume not mounted), and refused the right
    one after it."""
    write_session(r, settings, 2)
    assert r.get(Keys().data_dir) is None
    other = _on(settings, tmp_path / "not-mounted")
    other.data_dir.mkdir()
    if logs_here:
        recorded = check_data_dir(r, settings)
        assert r.get(Keys().data_dir) == recorded.encode() and data_dir_id(settings.data_dir) == recorded
        return
    with pytest.raises(InvalidConfig) as refused:
        check_data_dir(r, other)
    assert str(refused.value).startswith(f"dataDir: {other.data_dir} holds the log of none of the 1 most "
                                         f"recent of the 1 session(s) this Redis knows")
    assert r.get(Keys().data_dir) is None and data_dir_id(other.data_dir) is None
    assert check_data_dir(r, settings) == data_dir_id(settings.data_dir)  # the right one is recorded


def test_serves_own_redis_takes_its_data_dirs_id_whatever_it_recorded(r: redis.Redis, settings: Settings) -> None:
    """The embedded Redis lives in the data dir: an id file lost there (the operator cannot even
    reach that Redis to delete the record while serve is down) is no reason to refuse."""
    check_data_dir(r, settings)
    write_session(r, settings, 2)
    (settings.data_dir / ID_FILE).unlink()
    mine = check_data_dir(r, settings, embedded=True)
    assert r.get(Keys().data_dir) == mine.encode() and data_dir_id(settings.data_dir) == mine


def test_serve_on_an_external_redis_and_another_data_dir_exits_2_before_any_child(
        r: redis.Redis, settings: Settings, tmp_path: Path) -> None:
    """Its children each exited 2, were restarted five times over 13 s (the API taking events
    meanwhile), and serve gave up with exit 1, the reason buried."""
    check_data_dir(r, settings)
    write_session(r, settings, 2)
    empty = tmp_path / "not-mounted"
    done = subprocess.run([sys.executable, "-m", "compactor", "serve", "--redis-url", settings.redis.url,
                           "--data-dir", str(empty), "--port", "0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"compactor: dataDir: {empty} is not the data dir the 1 session(s) this Redis knows" in done.stderr
    assert "restarting" not in done.stderr and "API" not in done.stderr


def test_two_processes_starting_at_once_on_a_new_data_dir_agree(
        r: redis.Redis, settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """One read the (missing) id file, the other made it and recorded its id, then the first read
    the record: refused, told to write a new id over the right one (a compose up: watcher and
    worker at once on a new volume)."""
    from compactor import datadir

    real = datadir.data_dir_id
    others: list[str] = []

    def read_then_let_the_other_start(data_dir: Path) -> str | None:
        seen = real(data_dir)
        if not others:  # (the other process, all of it, between this one's read and what follows)
            monkeypatch.setattr(datadir, "data_dir_id", real)
            others.append(check_data_dir(redis.Redis.from_url(settings.redis.url), settings))
        return seen

    monkeypatch.setattr(datadir, "data_dir_id", read_then_let_the_other_start)
    assert check_data_dir(r, settings) == others[0] == data_dir_id(settings.data_dir)
