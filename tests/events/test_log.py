from __future__ import annotations

import errno
import multiprocessing
import os
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from events.errors import InvalidEvent, LogCorrupted, LogLocked, LogWriteFailed
from events.log import SessionLog, encode_project_path, keep_data_dir, session_log_path
from events import log as log_module

CWD = "/Users/Foo/my app"


def _event(i: int, text: str = "x") -> dict[str, Any]:
    return {"type": "user", "uuid": f"u{i}", "turnId": 1, "content": f"{text} {i}"}


def _log(tmp_path: Path, **kwargs: Any) -> SessionLog:
    return SessionLog(tmp_path / "data", CWD, "s1", **kwargs)


# -- paths ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cwd", "encoded"),
    [
        ("/Users/Foo/my app", "users-foo-my-app"),
        ("C:\\Users\\Foo\\proj", "c-users-foo-proj"),
        ("c:/Work", "c-work"),
        ("/a//b  c/", "a-b-c"),
        ("/srv/x:y", "srv-x-y"),
        ("/Mixed/CASE_and-dash", "mixed-case_and-dash"),
    ],
)
def test_encode_project_path_follows_spec(cwd: str, encoded: str) -> None:
    assert encode_project_path(cwd) == encoded


def test_session_log_path_layout(tmp_path: Path) -> None:
    assert session_log_path(tmp_path, CWD, "s-1_x") == tmp_path / "users-foo-my-app" / "sessions" / "s-1_x.jsonl"


@pytest.mark.parametrize("session_id", ["", "../x", "a/b", "-lead", "x" * 129, "a b", "a.b"])
def test_bad_session_ids_are_rejected_before_touching_disk(tmp_path: Path, session_id: str) -> None:
    data = tmp_path / "data"
    with pytest.raises(InvalidEvent) as info:
        SessionLog(data, CWD, session_id)
    assert info.value.field == "sessionId"
    assert not data.exists()


@pytest.mark.parametrize("cwd", ["relative/dir", "", "/", "/..", "/.", "//", "/ ", "/a\x00b", "/" + "x" * 300])
def test_unusable_cwds_are_rejected_before_touching_disk(tmp_path: Path, cwd: str) -> None:
    data = tmp_path / "data"
    with pytest.raises(InvalidEvent) as info:
        SessionLog(data, cwd, "s1")
    assert info.value.field == "cwd"
    assert not data.exists()


def test_a_cwd_whose_log_path_the_system_cannot_take_is_refused_naming_cwd(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A log path over PATH_MAX (a long dataDir and cwd), or a project name over the data dir's file
    system's NAME_MAX (eCryptfs: 143), failed at every open with ENAMETOOLONG: the API answered 500,
    the watcher held the session back for good, retrying its entries."""
    data = tmp_path.joinpath(*["d" * 200] * ((3_800 - len(str(tmp_path))) // 201))
    data = data / ("d" * (3_830 - len(str(data)) - 1))  # (3 830 bytes: a 250-byte project's log is 4 104)
    session_log_path(data, "/" + "e" * 200, "s1")
    with pytest.raises(InvalidEvent, match=r"files \(its log, and the \.jsonl\.torn beside it\) longer than the 4095 bytes the system takes") as info:
        SessionLog(data, "/" + "e" * 250, "s1")
    assert info.value.field == "cwd"
    real = os.pathconf
    monkeypatch.setattr(os, "pathconf", lambda path, name: 143 if name == "PC_NAME_MAX" else real(path, name))
    log_module._limits.cache_clear()
    log_module._sessions_dir.cache_clear()
    try:
        session_log_path(tmp_path, "/" + "e" * 143, "s1")
        with pytest.raises(InvalidEvent, match="longer than the 143 bytes the data dir's file system takes") as info:
            session_log_path(tmp_path, "/" + "e" * 144, "s1")
        assert info.value.field == "cwd"
    finally:
        log_module._limits.cache_clear()
        log_module._sessions_dir.cache_clear()
    assert not data.exists()


@given(cwd=st.text(min_size=1, max_size=60).map(lambda s: "/" + s))
@settings(max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_accepted_cwd_maps_to_a_directory_directly_inside_data_dir(tmp_path: Path, cwd: str) -> None:
    try:
        path = session_log_path(tmp_path, cwd, "s1")
    except InvalidEvent:
        return
    assert path.parent.parent.parent == tmp_path
    assert Path(os.path.abspath(path)) == path
    assert path.parent.parent.name not in ("", ".", "..")


# -- append and read ----------------------------------------------------------


def test_append_writes_one_newline_terminated_json_line_per_event(tmp_path: Path) -> None:
    log = _log(tmp_path)
    assert not log.exists() and log.size() == 0 and log.read() == []
    events = [_event(1, "héllo"), {"type": "x", "nested": {"a": [1, 2]}}]
    size = log.append(events)
    raw = log.path.read_bytes()
    assert size == len(raw) == log.size()
    assert raw.count(b"\n") == 2 and raw.endswith(b"\n")
    assert [orjson.loads(line) for line in raw.splitlines()] == events
    assert log.read() == events


def test_a_data_dir_gone_under_a_running_service_is_not_created_again(tmp_path: Path) -> None:
    """A data dir moved or unmounted under a running watcher was created again, empty: the
    events of that while were appended there and acked, and were missing from the logs once the
    data dir was put back."""
    (tmp_path / "data").mkdir()
    keep_data_dir(tmp_path / "data")  # (a service process, once the data dir is there)
    _log(tmp_path).append([_event(1)])
    (tmp_path / "data").rename(tmp_path / "away")
    for log in (_log(tmp_path), SessionLog(tmp_path / "data", CWD, "s2")):  # its log, a new session's
        with pytest.raises(LogWriteFailed, match=r"the data dir .*/data is gone \(removed, moved or unmounted"):
            log.append([_event(2)])
    assert not (tmp_path / "data").exists()
    (tmp_path / "away").rename(tmp_path / "data")
    _log(tmp_path).append([_event(2)])
    assert [e["uuid"] for e in _log(tmp_path).read()] == ["u1", "u2"]
    fresh = tmp_path / "elsewhere"  # a data dir no process kept is created as before
    SessionLog(fresh, CWD, "s1").append([_event(1)])
    assert SessionLog(fresh, CWD, "s1").read() == [_event(1)]


def test_a_log_that_is_not_a_regular_file_is_refused(tmp_path: Path) -> None:
    """A FIFO in a log's place took small appends and lost them, and blocked the writer (the
    watcher, every shard with it) on a full pipe."""
    log = _log(tmp_path)
    log.path.parent.mkdir(parents=True)
    os.mkfifo(log.path)
    with pytest.raises(LogWriteFailed, match=r"s1\.jsonl: is not a regular file"):
        log.append([_event(1, "x" * 100_000)])


def test_read_from_an_offset_and_read_records_offsets(tmp_path: Path) -> None:
    log = _log(tmp_path)
    first = log.append([_event(1), _event(2)])
    log.append([_event(3)])
    assert log.read(first) == [_event(3)]
    records = log.read_records()
    assert [offset for offset, _ in records][1] == first
    assert records[-1][0] == log.size()
    assert [event for _, event in log.read_records(first)] == [_event(3)]


def test_a_torn_last_line_is_ignored_by_readers(tmp_path: Path) -> None:
    log = _log(tmp_path)
    log.append([_event(1)])
    with open(log.path, "ab") as f:
        f.write(b'{"type":"user","uu')
    assert log.read() == [_event(1)]
    assert len(log.read_records()) == 1


def test_a_corrupt_complete_line_raises_log_corrupted_naming_file_and_line(tmp_path: Path) -> None:
    log = _log(tmp_path)
    log.append([_event(1)])
    with open(log.path, "ab") as f:
        f.write(b"not json\n")
    log.append([_event(3)])
    with pytest.raises(LogCorrupted, match=r"s1\.jsonl: line 2"):
        log.read()
    with pytest.raises(LogCorrupted, match="line 2"):
        log.read_records()


def test_a_corrupt_line_is_numbered_from_the_start_of_the_file_when_read_from_an_offset(tmp_path: Path) -> None:
    log = _log(tmp_path)
    log.append([_event(1), _event(2)])
    offset = log.size()
    with open(log.path, "ab") as f:
        f.write(b"not json\n")
    with pytest.raises(LogCorrupted, match=rf"line 3 \(byte {offset}\)"):  # the line to open and repair
        log.read(offset)
    with pytest.raises(LogCorrupted, match=rf"line 3 \(byte {offset}\)"):
        log.read_records(offset)


@pytest.mark.parametrize("inserted", [b'{"type":"user","turnId":2,"cont\n', b'{"type": "user"}\n'])
def test_a_line_inserted_before_a_readers_offset_is_named_not_the_line_the_offset_fell_in(
    tmp_path: Path, inserted: bytes,
) -> None:
    """A line inserted mid-log by hand moved a reader's stored offset (the watcher's ``logSize``)
    into another line, which it reported as corrupt: a valid line, and the wrong place to repair."""
    log = _log(tmp_path)
    log.append([_event(1), _event(2), _event(3)])
    offset = log.size()
    lines = log.path.read_bytes().splitlines(keepends=True)
    log.path.write_bytes(b"".join([lines[0], inserted, *lines[1:]]))
    log.append([_event(4)])
    bad = len(lines[0])
    why = (rf"line 2 \(byte {bad}\) is not JSON" if inserted.endswith(b"cont\n") else
           rf"byte {offset}, where reading resumed, is not the start of a line: the log was changed before it")
    for read in (log.read, log.read_records):
        with pytest.raises(LogCorrupted, match=why):
            read(offset)


def test_first_of_type_reads_up_to_the_line_it_finds(tmp_path: Path) -> None:
    """The API finds a session's cwd in its session_meta when Redis lost the state: reading and
    parsing the whole log for it cost every request the size of the log."""
    log = _log(tmp_path)
    assert log.first_of_type("session_meta") is None  # no log
    log.append([_event(1), {"type": "session_meta", "cwd": "/a", "n": 1}, {"type": "session_meta", "cwd": "/b"}])
    with open(log.path, "ab") as f:
        f.write(b'not json, never read\n{"type":"session_meta"')  # a corrupt line after it, a torn tail
    assert log.first_of_type("session_meta") == {"type": "session_meta", "cwd": "/a", "n": 1}
    assert log.first_of_type("summary") is None


def test_a_line_that_is_not_utf8_is_named_so(tmp_path: Path) -> None:
    """orjson's wording, "str is not valid UTF-8: surrogates not allowed", sent the operator
    looking for surrogates in a line holding a Latin-1 byte."""
    log = _log(tmp_path)
    log.append([_event(1)])
    with open(log.path, "ab") as f:
        f.write(b'{"type":"user","turnId":2,"content":"caf\xe9"}\n')
    with pytest.raises(LogCorrupted, match=r"line 2 \(byte \d+\) is not UTF-8: byte 40 of the line is 0xe9"):
        log.read()


def test_a_json_line_that_is_not_an_object_is_corrupt(tmp_path: Path) -> None:
    log = _log(tmp_path)
    log.path.parent.mkdir(parents=True)
    log.path.write_bytes(b'{"a":1}\n[1,2]\n')
    with pytest.raises(LogCorrupted, match="line 2"):
        log.read()


@pytest.mark.parametrize("kind", [b'["user"]', b'{"a":1}', b"5"])
def test_a_line_whose_type_is_not_a_string_is_corrupt(tmp_path: Path, kind: bytes) -> None:
    """Every reader tells events apart by ``type``: a list or an object there (a hand-edited
    log) crashed the view, the API, both jobs and the watcher with TypeError (unhashable)."""
    log = _log(tmp_path)
    log.append([_event(1)])
    with open(log.path, "ab") as f:
        f.write(b'{"type":' + kind + b',"turnId":2,"content":"x"}\n')
    for read in (log.read, log.read_records):
        with pytest.raises(LogCorrupted, match=r'line 2 \(byte \d+\) has a "type" that is not a string'):
            read()
    with open(log.path, "ab") as f:
        f.write(b'{"turnId":3}\n')  # no type at all: an unknown kind of line, as before
    log.path.write_bytes(log.path.read_bytes().replace(b'{"type":' + kind, b'{"type":"user"'))
    assert [e.get("type") for e in log.read()] == ["user", "user", None]


def test_an_unserializable_event_is_rejected_and_nothing_is_written(tmp_path: Path) -> None:
    log = _log(tmp_path)
    log.append([_event(1)])
    before = log.path.read_bytes()
    with pytest.raises(InvalidEvent) as info:
        log.append([_event(2), {"type": "user", "bad": {1: object()}}])
    assert info.value.index == 1
    assert log.path.read_bytes() == before


def test_torn_tail_is_moved_aside_before_an_append(tmp_path: Path) -> None:
    log = _log(tmp_path)
    log.append([_event(1), _event(2)])
    with open(log.path, "ab") as f:
        f.write(b'{"type":"user","uuid":"half')
    log.append([_event(3)])
    assert log.read() == [_event(1), _event(2), _event(3)]
    assert log.path.read_bytes().count(b"\n") == 3
    assert log.torn_path.read_bytes() == b'{"type":"user","uuid":"half\n'


def test_a_whole_last_line_missing_only_its_newline_is_kept(tmp_path: Path) -> None:
    """An editor that drops a file's final newline: the last event was moved to the .torn file by
    the next append (its stream entry acked long before: the event lost)."""
    log = _log(tmp_path)
    log.append([_event(1), _event(2)])
    os.truncate(log.path, log.path.stat().st_size - 1)
    # a reader without the lock shows it as the lock's holders will (the API's context left it out,
    # the session's estimate, read under the lock, counted it); a fragment it still passes over
    assert log.read() == [_event(1), _event(2)]
    assert log.uuids_among(["u1", "u2", "u3"]) == {"u1", "u2"}
    assert log.path.read_bytes().count(b"\n") == 1  # (no reader writes)
    with log.lock():  # the lock's holder is the writer: it ends the line (what its append would)
        assert log.read() == [_event(1), _event(2)]
        assert log.complete_size() == log.path.stat().st_size
        os.truncate(log.path, log.path.stat().st_size - 1)  # as if that newline could not be written (ENOSPC)
        # a holder reads what it stores the size of: the line, counted and then caught up again, was twice
        assert log.read() == [_event(1)] and log.complete_size() < log.path.stat().st_size
    with log.lock():
        assert log.read() == [_event(1), _event(2)]
    log.append([_event(3)])
    assert log.read() == [_event(1), _event(2), _event(3)]
    assert not log.torn_path.exists()


class _Timeout(BaseException):
    """What RQ raises from SIGALRM at a job's timeout, wherever the job is."""


def test_a_timeout_while_the_lock_ends_a_last_line_releases_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The repair ran after the descriptor was kept: an exception there (a job's timeout in its
    fsync) left the flock held by the process for good, and the session stalled."""
    log = _log(tmp_path, fsync=True)
    log.append([_event(1), _event(2)])
    os.truncate(log.path, log.path.stat().st_size - 1)

    def timed_out(fd: int) -> None:
        raise _Timeout

    monkeypatch.setattr(os, "fsync", timed_out)
    with pytest.raises(_Timeout), log.lock():
        pass
    monkeypatch.undo()
    other = _log(tmp_path, lock_wait_s=0.5)
    with other.lock():
        assert other.read() == [_event(1), _event(2)]
    with log.lock():  # (and the first one can lock it again)
        pass


def test_short_reads_cut_no_whole_line_off_as_a_torn_tail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """POSIX lets pread return fewer bytes than asked (FUSE, network file systems): the scan for
    the last line's end took a half block for the whole one, and cut whole lines off with the
    torn fragment (acked events moved to the .torn file)."""
    log = _log(tmp_path)
    log.append([_event(i, "y" * 200) for i in range(5)])
    with open(log.path, "ab") as f:
        f.write(b'{"type":"user","uuid":"half')
    pread = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, offset: pread(fd, n // 2 if n > 100 else n, offset))
    log.append([_event(5)])
    monkeypatch.undo()
    assert [e["uuid"] for e in log.read()] == ["u0", "u1", "u2", "u3", "u4", "u5"]
    assert log.torn_path.read_bytes() == b'{"type":"user","uuid":"half\n'


def test_an_append_stopped_by_a_timeout_is_taken_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only an OSError was undone: a job's timeout (SIGALRM) mid-write left part of the batch,
    a torn line after it, while the job reported failure."""
    log = _log(tmp_path)
    log.append([_event(0)])
    before = log.path.read_bytes()
    write, calls = os.write, []

    def interrupted(fd: int, data: Any) -> int:
        calls.append(len(data))
        if len(calls) == 1:
            return write(fd, bytes(data)[:len(data) // 2 + 5])
        raise _Timeout

    monkeypatch.setattr(os, "write", interrupted)
    with pytest.raises(_Timeout):
        log.append([_event(1), _event(2), _event(3)])
    monkeypatch.undo()
    assert log.path.read_bytes() == before


def test_a_torn_tail_is_copied_whole_and_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A short write to the .torn file kept part of the fragment, the log cut anyway; and a repair
    whose truncate failed, done again, copied the fragment a second time."""
    log = _log(tmp_path)
    log.append([_event(0)])
    fragment = b'{"type":"user","uuid":"half-way through'
    with open(log.path, "ab") as f:
        f.write(fragment)
    write, ftruncate = os.write, os.ftruncate
    monkeypatch.setattr(os, "write", lambda fd, data: write(fd, bytes(data)[:10]))  # (short, every time)
    monkeypatch.setattr(os, "ftruncate", lambda fd, n: (_ for _ in ()).throw(OSError(errno.EIO, "EIO")))
    with pytest.raises(LogWriteFailed):
        log.append([_event(1)])
    monkeypatch.setattr(os, "ftruncate", ftruncate)
    log.append([_event(1)])
    monkeypatch.undo()
    assert [e["uuid"] for e in log.read()] == ["u0", "u1"]
    assert log.torn_path.read_bytes() == fragment + b"\n"


def test_a_new_logs_directory_that_cannot_be_synced_is_a_write_failure_synced_by_the_next_lock(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """It raised a raw OSError, leaked its descriptor, and the retry found the file there: the
    directory was never synced. The file is left (another writer may have it already)."""
    from events import log as log_module

    log = _log(tmp_path, fsync=True)
    monkeypatch.setattr(log_module, "_SYNCED", {})
    fsync, synced = os.fsync, []

    def dir_fails(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EIO, "EIO")
        fsync(fd)

    monkeypatch.setattr(os, "fsync", dir_fails)
    opened = len(os.listdir("/proc/self/fd"))
    with pytest.raises(LogWriteFailed, match="its directory cannot be synced"):
        log.append([_event(0)])
    assert len(os.listdir("/proc/self/fd")) == opened and not log.path.exists()  # (empty: not a session)
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(stat.S_ISDIR(os.fstat(fd).st_mode)) or fsync(fd))
    log.append([_event(0)])
    assert [e["uuid"] for e in log.read()] == ["u0"] and True in synced


def test_each_new_log_and_torn_file_has_its_directory_entry_synced(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The directory was synced once per process: every later session of the project (and a .torn
    file) could vanish after a power loss with log.fsync on."""
    fsync, synced = os.fsync, []

    def counted(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", counted)
    first = SessionLog(tmp_path / "data", CWD, "a", fsync=True)
    first.append([_event(0)])
    sessions = str(first.path.parent)
    assert synced.count(sessions) == 1 and synced.count(str(first.path.parent.parent)) == 1  # (made for it)
    SessionLog(tmp_path / "data", CWD, "b", fsync=True).append([_event(0)])
    assert synced.count(sessions) == 2
    with open(first.path, "ab") as f:
        f.write(b'{"type":"user","uu')
    first.append([_event(1)])
    assert synced.count(sessions) == 3  # (the .torn file's entry)
    first.append([_event(2)])
    assert synced.count(sessions) == 3
    from events import log as log_module

    log_module._SYNCED.clear()  # (another process, or this one restarted: its first lock of a log syncs it)
    first.append([_event(3)])
    assert synced.count(sessions) == 4
    third = SessionLog(tmp_path / "data", CWD, "c", fsync=True)
    with third.lock():
        third.discard_if_empty()  # (a refused first batch)
    third.append([_event(0)])  # (made again: synced again)
    assert synced.count(sessions) == 6


def test_torn_tails_are_each_copied_once_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A .torn write failing part-way left a part the retry wrote the whole fragment after; a later
    tear identical to an earlier one, or a short one matching an earlier one's end, was taken for
    a copy already made and dropped."""
    log = _log(tmp_path)
    log.append([_event(0)])

    def tear(data: bytes) -> None:
        with open(log.path, "ab") as f:
            f.write(data)

    tear(b'{"type":"user","uuid":"half-way through')
    write, calls = os.write, []

    def fails_part_way(fd: int, data: Any) -> int:
        calls.append(1)
        if len(calls) == 1:
            write(fd, bytes(data)[:10])
            raise OSError(errno.ENOSPC, "ENOSPC")
        return write(fd, data)

    monkeypatch.setattr(os, "write", fails_part_way)
    with pytest.raises(LogWriteFailed):
        log.append([_event(1)])
    monkeypatch.undo()
    log.append([_event(1)])
    tear(b'{"type":"user","uui')
    log.append([_event(2)])
    tear(b'{"type":"user","uui')  # (the same crash point again)
    log.append([_event(3)])
    tear(b'{"')
    log.append([_event(4)])
    assert [e["uuid"] for e in log.read()] == ["u0", "u1", "u2", "u3", "u4"]
    assert log.torn_path.read_bytes() == (b'{"type":"user","uuid":"half-way through\n{"type":"user","uui\n'
                                          b'{"type":"user","uui\n{"\n')


def test_a_file_that_is_all_fragment_is_emptied_into_the_torn_file(tmp_path: Path) -> None:
    log = _log(tmp_path)
    log.path.parent.mkdir(parents=True)
    log.path.write_bytes(b"x" * 100_000)  # longer than one backwards scan block
    log.append([_event(1)])
    assert log.read() == [_event(1)]
    assert log.torn_path.stat().st_size == 100_001


@given(
    texts=st.lists(st.text(max_size=40), min_size=1, max_size=8),
    cut=st.floats(min_value=0, max_value=1, exclude_max=True),
)
@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
def test_torn_tail_repair_keeps_every_complete_line(tmp_path: Path, texts: list[str], cut: float) -> None:
    log = SessionLog(tmp_path / f"d{time.monotonic_ns()}", CWD, "s1")
    events = [_event(i, t) for i, t in enumerate(texts)]
    log.append(events)
    raw = log.path.read_bytes()
    keep = int(len(raw) * cut)
    os.truncate(log.path, keep)
    complete = raw[:keep].count(b"\n")
    if raw[keep:keep + 1] == b"\n" and keep and raw[keep - 1:keep] != b"\n":
        complete += 1  # cut right before a newline: the line is whole, and kept
    log.append([_event(99)])
    assert log.read() == events[:complete] + [_event(99)]


def test_fsync_appends_work(tmp_path: Path) -> None:
    log = _log(tmp_path, fsync=True)
    log.append([_event(1)])
    assert log.read() == [_event(1)]


# -- write failures -------------------------------------------------------------


def test_a_partial_write_is_undone_and_raises_log_write_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = _log(tmp_path)
    log.append([_event(1)])
    before = log.path.read_bytes()
    real_write = os.write

    def half_then_fail(fd: int, data: bytes) -> int:
        real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", half_then_fail)
    with pytest.raises(LogWriteFailed) as info:
        log.append([_event(2), _event(3)])
    assert isinstance(info.value.__cause__, OSError)
    monkeypatch.undo()
    assert log.path.read_bytes() == before
    log.append([_event(4)])
    assert log.read() == [_event(1), _event(4)]


@pytest.mark.slow
def test_a_file_size_limit_leaves_the_log_unchanged(tmp_path: Path) -> None:
    log = _log(tmp_path)
    log.append([_event(1)])
    before = log.path.read_bytes()
    script = textwrap.dedent(
        f"""
        import resource, signal, sys
        from events.errors import LogWriteFailed
        from events.log import SessionLog
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        limit = {len(before) + 500}
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        log = SessionLog({str(tmp_path / "data")!r}, {CWD!r}, "s1")
        try:
            log.append([{{"type": "user", "turnId": 1, "content": "y" * 5000}}])
        except LogWriteFailed as e:
            print("failed:", e)
            sys.exit(3)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "left unchanged" in done.stdout
    assert log.path.read_bytes() == before


# -- locking and concurrency ------------------------------------------------------


def test_the_lock_is_reentrant_within_one_object(tmp_path: Path) -> None:
    log = _log(tmp_path)
    with log.lock():
        with log.lock():
            log.append([_event(1)])
        log.append([_event(2)])
    assert log.read() == [_event(1), _event(2)]


def _append_under_lock(data_dir: str, marker: str) -> None:
    SessionLog(data_dir, CWD, "s1").append([{"type": "user", "content": marker}])


@pytest.mark.slow
def test_another_process_waits_for_the_lock(tmp_path: Path) -> None:
    log = _log(tmp_path)
    ctx = multiprocessing.get_context("spawn")
    with log.lock():
        child = ctx.Process(target=_append_under_lock, args=(str(tmp_path / "data"), "child"))
        child.start()
        time.sleep(1.0)
        assert log.read() == []  # the child is blocked on the lock
        log.append([{"type": "user", "content": "parent"}])
    child.join(30)
    assert child.exitcode == 0
    assert [e["content"] for e in log.read()] == ["parent", "child"]


def test_a_bounded_wait_for_the_lock_gives_up_with_log_locked_and_writes_nothing(tmp_path: Path) -> None:
    """``lock_wait_s``: the watcher's logs (one paused holder had stopped every session's appends)."""
    holder = _log(tmp_path)
    holder.append([{"type": "user", "content": "before"}])
    waiter = SessionLog(tmp_path / "data", CWD, "s1", lock_wait_s=0.2)
    with holder.lock():  # another open file description: flock treats it as another process
        started = time.monotonic()
        with pytest.raises(LogLocked, match=r"locked by another process for more than 0\.2 s"):
            waiter.append([{"type": "user", "content": "refused"}])
        assert 0.2 <= time.monotonic() - started < 2
    waiter.append([{"type": "user", "content": "after"}])  # free again: taken at once
    assert [e["content"] for e in holder.read()] == ["before", "after"]


def _hammer(data_dir: str, worker: int, batches: int) -> None:
    log = SessionLog(data_dir, CWD, "s1")
    for batch in range(batches):
        log.append([{"type": "user", "w": worker, "b": batch, "i": i, "pad": "z" * (97 * i)} for i in range(3)])


@pytest.mark.slow
def test_four_processes_appending_at_once_lose_and_tear_nothing(tmp_path: Path) -> None:
    data_dir, batches = str(tmp_path / "data"), 150
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_hammer, args=(data_dir, w, batches)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    log = SessionLog(data_dir, CWD, "s1")
    raw = log.path.read_bytes()
    assert raw.endswith(b"\n")
    events = [orjson.loads(line) for line in raw.splitlines()]
    assert len(events) == 4 * batches * 3
    for start in range(0, len(events), 3):  # each batch landed as one contiguous run of lines
        assert len({(e["w"], e["b"]) for e in events[start:start + 3]}) == 1
    for worker in range(4):
        mine = [(e["b"], e["i"]) for e in events if e["w"] == worker]
        assert mine == [(b, i) for b in range(batches) for i in range(3)]  # whole batches, in order
    assert not log.torn_path.exists()


def test_complete_size_stops_at_the_last_newline(tmp_path: Path) -> None:
    log = SessionLog(tmp_path, "/p", "s")
    assert log.complete_size() == 0
    log.append([{"type": "user", "turnId": 1, "content": "x" * 100_000}])
    whole = log.size()
    assert log.complete_size() == whole
    with open(log.path, "ab") as f:
        f.write(b"y" * 200_000)  # a torn tail longer than one backwards scan chunk
    assert log.complete_size() == whole


def test_a_torn_tail_seen_under_the_lock_is_still_repaired_by_the_append(tmp_path: Path) -> None:
    """``complete_size`` under the lock lets the append skip its own tail check only when the
    tail was clean."""
    log = _log(tmp_path)
    log.append([_event(1)])
    with open(log.path, "ab") as f:
        f.write(b'{"type":"user","uuid":"half')
    with log.lock():
        complete = log.complete_size()
        log.append([_event(2)])
        log.append([_event(3)])  # the size after a whole write is trusted too
    assert complete == len(orjson.dumps(_event(1))) + 1
    assert log.read() == [_event(1), _event(2), _event(3)]
    assert log.torn_path.read_bytes() == b'{"type":"user","uuid":"half\n'


@pytest.mark.parametrize("block", [1 << 20, 64])
def test_uuids_among_finds_the_events_uuids_and_nothing_else(tmp_path: Path, block: int,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The API's look for a retry's uuids when Redis lost the session: lock-free, the file never
    created, a uuid only named inside another event (or on a torn tail, or a bad line) no match;
    the same across the blocks the file is read in."""
    import events.log as log_module

    monkeypatch.setattr(log_module, "UUID_SCAN_BLOCK_BYTES", block)
    log = _log(tmp_path)
    assert log.uuids_among({"a"}) == set() and not log.path.exists()  # (nothing created)
    named = {"type": "assistant", "turnId": 1, "uuid": "u-2", "content": 'says "uuid":"u-9"',
             "toolCalls": [{"id": "c", "name": "f", "arguments": {"uuid": "u-8"}}]}
    odd = {"type": "user", "turnId": 1, "uuid": 'we"ird\\id', "content": "x" * 300}
    log.append([_event(1), named, odd, *(_event(i) for i in range(3, 40))])
    with log.path.open("ab") as f:
        f.write(b'not json "uuid":"u-7"\n{"type":"user","uuid":"u-6"')  # a bad line, a torn tail
    asked = {"u1", "u-2", 'we"ird\\id', "u39", "u-6", "u-7", "u-8", "u-9", "nope"}
    assert log.uuids_among(asked) == {"u1", "u-2", 'we"ird\\id', "u39"}
    assert log.uuids_among(set()) == set()


def test_a_log_that_cannot_be_read_is_log_corrupted_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A log with no read permission (mode 000, a process without CAP_DAC_OVERRIDE) failed
    ``compactor context`` with a PermissionError traceback and the API with a bare 500: only the
    look for session_meta named the path."""
    log = SessionLog(tmp_path, "/w", "s1")
    log.append([{"type": "user", "turnId": 1, "content": "hi", "uuid": "u1"}])

    real_open = os.open

    def refused(path: Any, *args: Any, **kwargs: Any) -> Any:
        if str(path) != str(log.path):
            return real_open(path, *args, **kwargs)
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(os, "open", refused)
    for read in (log.read, lambda: log.bytes_before(5, 5), lambda: log.first_of_type("user")):
        with pytest.raises(LogCorrupted, match=f"^{log.path}: cannot be read: Permission denied$"):
            read()


def test_an_append_undone_again_at_the_same_size_is_logged_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A held session's append is retried about once a second: each undo was an ERROR line (20 in
    5 s for 4 sessions on a full disk), where OPERATIONS promises one a minute from the watcher."""
    log = SessionLog(tmp_path, "/w", "s1")
    log.append([{"type": "user", "turnId": 1, "content": "hi", "uuid": "u1"}])
    size = log.size()
    real_write = os.write

    def full(fd: int, data: Any) -> int:
        if len(data) > 10:
            return real_write(fd, bytes(data[:10]))  # part of the line lands, then the disk is full
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("events.log.os.write", full)
    caplog.set_level("DEBUG", logger="events.log")
    for _ in range(3):
        with pytest.raises(LogWriteFailed, match="No space left on device"):
            log.append([{"type": "user", "turnId": 2, "content": "more", "uuid": "u2"}])
    assert log.size() == size
    undone = [r for r in caplog.records if "truncated back to" in r.getMessage()]
    assert [r.levelname for r in undone] == ["ERROR", "DEBUG", "DEBUG"]


@pytest.mark.timeout(20)
def test_a_fifo_where_a_log_is_is_refused_by_its_readers_at_once(tmp_path: Path) -> None:
    """Opened to read, a FIFO with no writer held the reader for good: the API's first_of_type held
    one thread per request until none was left, /healthz too, and SIGTERM could not stop it."""
    log = _log(tmp_path)
    log.path.parent.mkdir(parents=True)
    os.mkfifo(log.path)
    for read in (log.read, lambda: log.first_of_type("session_meta"), lambda: log.uuids_among(["u"])):
        with pytest.raises(LogCorrupted, match="not a regular file"):
            read()


@pytest.mark.timeout(20)
def test_a_fifo_where_the_torn_file_goes_fails_the_append_at_once(tmp_path: Path) -> None:
    """Moving a torn tail opened the ``.torn`` path to append: a FIFO there held the log's lock,
    and the watcher with it (every shard), until something read it."""
    log = _log(tmp_path)
    log.append([_event(1)])
    with open(log.path, "ab") as f:
        f.write(b'{"type":"user","tu')  # a crashed writer's fragment
    os.mkfifo(log.torn_path)
    with pytest.raises(LogWriteFailed, match="cannot repair the torn tail"):
        log.append([_event(2)])
    assert log.read() == [_event(1)]


def test_a_session_logged_under_a_symlinked_project_is_found_elsewhere(tmp_path: Path) -> None:
    """The writers follow a project directory that is a symlink; the look for the session under
    the other projects skipped it, and after Redis lost the session's state another cwd took it (a
    second log)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    data = tmp_path / "data"
    data.mkdir()
    (data / encode_project_path("/linked")).symlink_to(outside, target_is_directory=True)
    SessionLog(data, "/linked", "s1").append([_event(1)])
    assert (outside / "sessions" / "s1.jsonl").is_file()
    [found] = SessionLog(data, "/other", "s1").elsewhere()
    assert found.read() == [_event(1)]
