"""The session log: one JSONL file per session, the source of truth (SPEC §3).

Layout: ``{data_dir}/{encode_project_path(cwd)}/sessions/{session_id}.jsonl``,
with a sibling ``{id}.jsonl.torn`` (fragments cut off a torn tail, kept for
forensics). The cross-process lock is a ``flock`` on the log file itself: a
new session costs one file creation, not two (creating a file is the dearest
step of a session's first append on ext4: ~0.7 ms measured here), and the
descriptor that holds the lock is the one appends write through.

Invariants:
- The session id and cwd are validated before anything touches the disk, and
  the log path is always inside ``data_dir``.
- The log is append-only: lines are never rewritten. The only truncations are
  (a) cutting a torn tail (a last line without ``\\n``, left by a crashed
  writer) after copying it to the ``.torn`` file, and (b) undoing an append
  that failed half-way. No complete line is ever dropped.
- Every append happens under an exclusive ``flock`` on the log file, through
  the ``O_APPEND`` descriptor that holds the lock, in whole lines; taking the
  lock creates the (empty) log when it is missing; an append either lands entirely
  or leaves the file as it was and raises ``LogWriteFailed``.
- Readers take no lock: they parse complete lines only and ignore a torn last
  line (a writer may be mid-way). A complete line that does not parse is
  ``LogCorrupted``.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from events.errors import InvalidEvent, LogCorrupted, LogLocked, LogWriteFailed, SessionNotFound
from events.models import validate_cwd, validate_session_id

logger = logging.getLogger(__name__)

LOG_SUFFIX = ".jsonl"
TORN_SUFFIX = ".jsonl.torn"
MAX_NAME_BYTES = 255  # NAME_MAX of common file systems (a smaller one's, eCryptfs's 143, is asked: ``_limits``)
PATH_MAX_BYTES = 4096  # Linux's PATH_MAX, its NUL included
WRITE_CHUNK_BYTES = 1 << 22  # lines are batched into writes of about this size (whole lines only)
TAIL_SCAN_BYTES = 1 << 16  # read backwards in blocks of this size to find the last newline
UUID_SCAN_BLOCK_BYTES = 1 << 20  # ``uuids_among`` reads the log in blocks of about this size
LOCK_POLL_FIRST_S = 0.0005  # a bounded wait for a busy lock looks again after this, then twice as long
LOCK_POLL_MAX_S = 0.02  # ... up to this (a worker's read holds a lock for a few ms)

_SEPARATOR_RUN = re.compile(r"[:/\\ ]+")
_DRIVE = re.compile(r"^([A-Za-z]):")


def encode_project_path(cwd: str) -> str:
    """SPEC §3's encodeProjectPath: ``/Users/Foo/my app`` -> ``users-foo-my-app``."""
    path = cwd.replace("\\", "/")
    path = _DRIVE.sub(lambda m: m.group(1).lower() + ":", path)
    return _SEPARATOR_RUN.sub("-", path).strip("-").lower()


# The data dir's own entries (``compactor.datadir``'s id file and its temporary copies, its
# watchers' marks, the embedded Redis's directory): a project of that name had its session held
# back for good, a watcher retrying it every second and its shard never trimmed (or, for
# ``.redis``, its logs written among the embedded Redis's files).
RESERVED_NAMES = (".redis", ".compactor-marks")
RESERVED_PREFIXES = (".compactor-id",)


def _project_dir_name(cwd: str) -> str:
    encoded = encode_project_path(validate_cwd(cwd))
    if encoded in ("", ".", ".."):
        raise InvalidEvent("cwd", f"encodes to the unusable directory name {encoded!r}")
    if encoded in RESERVED_NAMES or encoded.startswith(RESERVED_PREFIXES):
        raise InvalidEvent("cwd", f"encodes to the directory name {encoded!r}, which the service keeps for its "
                                  "own files in the data dir")
    if len(encoded.encode("utf-8")) > MAX_NAME_BYTES:
        raise InvalidEvent("cwd", f"encodes to a directory name longer than {MAX_NAME_BYTES} bytes")
    return encoded


def project_dirs(data_dir: str | os.PathLike[str]) -> list[Path]:
    """The project directories of a data dir (one scan of it); none when it cannot be listed. (A
    project directory that is a symlink counts: the writers follow it, and skipped, a session
    logged there was taken by another cwd after Redis lost its state.)"""
    try:
        with os.scandir(os.path.abspath(os.path.expanduser(data_dir))) as entries:
            return [Path(entry.path) for entry in entries if entry.is_dir()]
    except OSError:
        return []


def session_log_path(data_dir: str | os.PathLike[str], cwd: str, session_id: str) -> Path:
    """The log file of a session; validates both ids; the result is always inside ``data_dir``, and
    a path the system takes (``InvalidEvent`` on ``cwd`` else: a path over ``PATH_MAX`` answered
    every request of its session 500 and held its entries back for good, each retried)."""
    validate_session_id(session_id)  # letters, digits, ``_`` and ``-``: a plain file name
    root = os.path.abspath(os.path.expanduser(data_dir))
    directory, room = _sessions_dir(root, cwd)
    if len(session_id) + len(TORN_SUFFIX) > room:  # (the longest of its files' names)
        raise InvalidEvent("cwd", f"makes the paths of session {session_id}'s files (its log, and the "
                                  f"{TORN_SUFFIX} beside it) longer than the {_limits(root)[1] - 1} bytes the "
                                  f"system takes (under a dataDir of {len(os.fsencode(root))} bytes)")
    return directory / f"{session_id}{LOG_SUFFIX}"


@functools.lru_cache(maxsize=4096)
def _sessions_dir(root: str, cwd: str) -> tuple[Path, int]:
    """The ``sessions`` directory of ``cwd``'s project under the absolute ``root`` (checked to be
    inside it, its name within the file system's ``NAME_MAX``), and the bytes left for a file name
    in it within ``PATH_MAX``. Cached: a worker or the watcher opens the logs of the same projects
    all day, and the checks cost more than the read of a small log."""
    name = _project_dir_name(cwd)
    directory = Path(root) / name / "sessions"
    if os.path.commonpath([root, os.path.abspath(directory)]) != root:
        raise InvalidEvent("cwd", "resolves outside the data directory")
    name_max, path_max = _limits(root)
    if len(name.encode("utf-8")) > name_max:  # (eCryptfs: 143)
        raise InvalidEvent("cwd", f"encodes to a directory name longer than the {name_max} bytes the data dir's "
                                  "file system takes")
    return directory, path_max - 1 - len(os.fsencode(directory)) - 1  # (the NUL, the "/")


@functools.lru_cache(maxsize=64)
def _limits(root: str) -> tuple[int, int]:
    """``NAME_MAX`` and ``PATH_MAX`` (its NUL included) where ``root`` is, or would be (its
    nearest existing directory's file system); 255 and 4096 where the system does not say (no
    limit, -1; or a FUSE file system's 0)."""
    path = root
    while True:
        try:
            name_max, path_max = os.pathconf(path, "PC_NAME_MAX"), os.pathconf(path, "PC_PATH_MAX")
        except (OSError, ValueError):
            parent = os.path.dirname(path)
            if parent == path:
                return MAX_NAME_BYTES, PATH_MAX_BYTES
            path = parent
            continue
        return (min(name_max, MAX_NAME_BYTES) if name_max > 0 else MAX_NAME_BYTES,
                min(path_max, PATH_MAX_BYTES) if path_max > 0 else PATH_MAX_BYTES)


def _sibling(path: Path, suffix: str) -> Path:
    return path.with_name(path.name[: -len(LOG_SUFFIX)] + suffix)


# The data dirs this process has held a log under. One of them gone is not created again (a data
# dir moved or unmounted under a running watcher was: the events of that while went to the new,
# empty one, acked, and were missing from the logs once it was put back).
_ROOTS_SEEN: set[Path] = set()
# with ``fsync`` on: the logs whose directory entry this process synced (``SessionLog._sync_directories``,
# at a log's first lock in the process: one another process created, or a crashed one, is synced
# too), and the directories made for a log it created, to sync with it
_SYNCED: dict[Path, None] = {}
_MADE: dict[Path, list[Path]] = {}


def keep_data_dir(data_dir: str | os.PathLike[str]) -> None:
    """Never create ``data_dir`` again in this process: a service process calls it at start, once
    the data dir is there (a log whose data dir went away is then refused, ``LogWriteFailed``)."""
    _ROOTS_SEEN.add(Path(os.path.abspath(os.path.expanduser(data_dir))))


class SessionLog:
    """One session's JSONL log: locked appends, lock-free reads from a byte offset."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        cwd: str,
        session_id: str,
        *,
        fsync: bool = False,
        create: bool = True,
        lock_wait_s: float | None = None,
    ) -> None:
        self._open_at(session_log_path(data_dir, cwd, session_id), fsync=fsync, create=create,
                      lock_wait_s=lock_wait_s)

    @classmethod
    def at_path(cls, path: Path) -> SessionLog:
        """The log at ``path`` (``{dataDir}/{project}/sessions/{id}.jsonl``), to read: found by
        ``elsewhere``, whose cwd is not known (the project's name does not give it back)."""
        log = cls.__new__(cls)
        log._open_at(path, fsync=False, create=False, lock_wait_s=None)
        return log

    def _open_at(self, path: Path, *, fsync: bool, create: bool, lock_wait_s: float | None) -> None:
        self.path = path
        self._root = self.path.parents[2]  # the data dir, as the path spells it
        self.torn_path = _sibling(self.path, TORN_SUFFIX)
        self.fsync = fsync
        self.create = create  # False: ``lock`` raises SessionNotFound for a missing log (a worker's)
        # None: ``lock`` waits for another holder as long as it takes; else LogLocked after this long
        # (the watcher's: one paused process holding one log's lock stopped every session's appends)
        self.lock_wait_s = lock_wait_s
        self._mutex = threading.RLock()
        self._depth = 0
        self._lock_fd: int | None = None
        self._clean_size: int | None = None  # while locked: the size, known to end with a whole line
        # (log inode, offset, length, .torn's size before) of a torn tail this object copied to the
        # .torn file and could not cut off the log: its next try does not copy it again
        self._torn_copied: tuple[int, int, int, int] | None = None
        self._held = _Held(self)

    def __repr__(self) -> str:
        return f"SessionLog({str(self.path)!r})"

    def elsewhere(self) -> list[SessionLog]:
        """The logs of this session under the other projects of the data dir (the same session id,
        another cwd's directory): one scan of the data dir, a ``stat`` per project."""
        name, own = self.path.name, self.path.parent.parent
        return [SessionLog.at_path(path)
                for path in sorted(project / "sessions" / name for project in project_dirs(self._root))
                if path.parent.parent != own and path.is_file()]

    def exists(self) -> bool:
        """Whether the log file exists."""
        return self.path.is_file()

    def found(self) -> bool:
        """Whether there is a log to read: False when nothing is at its path, ``LogCorrupted`` when
        something other than a file is (a directory: the reads answered 404 "no session" where an
        append's 500 said why)."""
        try:
            mode = os.stat(self.path).st_mode
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as e:
            raise LogCorrupted(f"{self.path}: cannot be read: {e.strerror or e}") from e
        if not stat.S_ISREG(mode):
            raise LogCorrupted(f"{self.path}: cannot be read: {_not_a_file(mode)}")
        return True

    def size(self) -> int:
        """The log's size in bytes (0 when it does not exist)."""
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0

    def complete_size(self) -> int:
        """Bytes up to the end of the last complete line (a torn tail excluded).

        The offset to record as "read up to": a torn tail is cut by the next
        append, so an offset inside it would later point into the middle of a line.
        """
        if self._lock_fd is not None:  # under the lock: its descriptor, no open
            size = os.fstat(self._lock_fd).st_size
            complete = _complete_size(self._lock_fd, size)
            if complete == size:  # nobody else appends while we hold the lock: ``append`` trusts it
                self._clean_size = size
            return complete
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return 0
        try:
            return _complete_size(fd)
        finally:
            os.close(fd)

    # -- locking -------------------------------------------------------------

    def lock(self) -> _Held:
        """Hold the exclusive cross-process lock (re-entrant within this object): ``with log.lock():``."""
        return self._held

    def _acquire(self) -> None:
        """Open the log for appending (creating it, and its directory, when missing, unless
        ``create`` is False: SessionNotFound) and flock it; again when the file was removed (or
        replaced) while this waited for the lock (``discard_if_empty``): lines appended through
        that descriptor would be lost with the file."""
        flags = os.O_RDWR | os.O_APPEND | os.O_CLOEXEC
        while True:
            try:
                fd = os.open(self.path, flags)
            except FileNotFoundError:  # a new session (the directory too, perhaps): not on every lock
                if not self.create:
                    raise SessionNotFound(f"{self.path}: no such log (deleted?)") from None
                fd = self._create()
            except OSError as e:
                raise LogWriteFailed(f"{self.path}: cannot open: {e}") from e
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO took the appends and lost them (or
                    # blocked the watcher on a full pipe, every shard with it)
                    raise LogWriteFailed(f"{self.path}: is not a regular file")
                self._flock(fd)
                if self._still_the_path(fd):
                    break
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
        self._sync_directories(fd)
        try:
            size = os.fstat(fd).st_size
            self._end_whole_last_line(fd, size, _complete_size(fd, size))
        except (LogWriteFailed, OSError) as e:  # (``append`` tries again, and raises)
            logger.warning("%s", e)
        except BaseException:  # (a job's timeout, mid-fsync): the lock goes with the descriptor
            os.close(fd)
            raise
        self._lock_fd = fd
        _ROOTS_SEEN.add(self._root)

    def _end_whole_last_line(self, fd: int, size: int, keep: int) -> int | None:
        """When only the newline of the log's last line is missing (an editor dropped it, or a
        writer died right before it), add it and return the new size; None when the log ends
        with a newline or a torn fragment. Done as the lock is taken, so that every reader under
        it sees the line ``append`` would have kept: the store's catch-up read past its recorded
        size without it, then the append kept it, so its uuid went unknown (a redelivered entry
        written twice) and the stored estimate never counted it. (``keep``: ``_complete_size``.)"""
        if keep == size or not _whole_event(_pread_all(fd, size - keep, keep)):
            return None
        logger.warning("the last line of %s had no newline: one added", self.path)
        try:
            os.write(fd, b"\n")  # (the descriptor appends)
            if self.fsync:
                os.fsync(fd)
        except OSError as e:
            raise LogWriteFailed(f"{self.path}: cannot end its last line: {e}") from e
        return size + 1

    def _flock(self, fd: int) -> None:
        """``flock`` ``fd`` exclusively: at once when free, else waiting up to ``lock_wait_s``
        (LogLocked past it), or for good when that is None."""
        if self.lock_wait_s is None:
            fcntl.flock(fd, fcntl.LOCK_EX)
            return
        deadline, pause = time.monotonic() + self.lock_wait_s, LOCK_POLL_FIRST_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LogLocked(f"{self.path}: locked by another process for more than {self.lock_wait_s:g} s "
                                    "(a paused or stuck compactor process?)") from None
                time.sleep(min(pause, left))
                pause = min(pause * 2, LOCK_POLL_MAX_S)

    def _still_the_path(self, fd: int) -> bool:
        """Whether ``fd`` is still the file at ``path`` (not removed or replaced meanwhile)."""
        held = os.fstat(fd)
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            return False
        return (held.st_ino, held.st_dev) == (now.st_ino, now.st_dev)

    def discard_if_empty(self) -> bool:
        """Remove the log when it holds nothing (call under the lock): one a writer created for a
        batch it then refused whole. Left there, the session was known (SPEC §7's 404 is for no
        log file) though nothing of it was ever written. A writer waiting for the lock meanwhile
        opens the path again (``_acquire``)."""
        fd = self._lock_fd
        if fd is None or os.fstat(fd).st_size != 0:
            return False
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            return False
        return True

    def _create(self) -> int:
        if self._root in _ROOTS_SEEN and not self._root.is_dir():
            raise LogWriteFailed(f"{self.path}: cannot create: the data dir {self._root} is gone (removed, moved or "
                                 "unmounted while the service ran): it is not created again, so that no event "
                                 "lands outside the logs; put it back, or restart the service to begin afresh")
        made = [d for d in (self.path.parent, self.path.parent.parent) if not d.is_dir()]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise LogWriteFailed(f"{self.path}: cannot create: {e}") from e
        if self.fsync:  # (a new file: its entry synced at its lock, whatever was synced under this path
            _SYNCED.pop(self.path, None)  # before: a log removed and made again)
            if made:  # (the entries of the directories made for it: in their parents)
                _MADE[self.path] = [d.parent for d in made]
        return fd

    def _sync_directories(self, fd: int) -> None:
        """With ``fsync``, make the log durable as a file at its first lock in this process: its
        directory entry (and those of the directories made for it here), synced under the lock,
        whoever created it (another process, or one that crashed before its sync). A failure is
        LogWriteFailed, and the next lock tries again (it was a raw OSError, its descriptor leaked,
        and the retry found the file there: never synced); the file is removed when no event has
        reached it yet (an empty log reads as a known session), else left for the next lock."""
        if not self.fsync or self.path in _SYNCED:
            return
        try:
            for directory in (self.path.parent, *_MADE.get(self.path, ())):
                fsync_dir(directory)
        except BaseException as e:  # (a job's timeout too: the descriptor, and the flock, go with it)
            try:
                if os.fstat(fd).st_size == 0:  # (a log no event reached: not left to read as a session)
                    os.unlink(self.path)
            except OSError:
                pass
            os.close(fd)
            if isinstance(e, OSError):
                raise LogWriteFailed(f"{self.path}: its directory cannot be synced: {e}") from e
            raise
        if len(_SYNCED) >= SAID_KEPT:
            _SYNCED.clear()  # (synced again at their next lock: harmless)
        _SYNCED[self.path] = None
        _MADE.pop(self.path, None)

    def _release(self) -> None:
        fd, self._lock_fd, self._clean_size = self._lock_fd, None, None
        if fd is not None:
            os.close(fd)  # closing the descriptor releases the flock

    # -- reading -------------------------------------------------------------

    def _read_bytes(self, start: int) -> bytes:
        fd = self._lock_fd
        if fd is not None:  # under the lock: through its descriptor, no open
            return _pread_all(fd, os.fstat(fd).st_size - start, start)
        with self._opened() as f:  # (no permission: a traceback from ``compactor context``, a bare 500)
            if f is None:
                return b""
            if start:
                f.seek(start)
            return f.read()

    def check_room(self, need: int) -> None:
        """Raise LogWriteFailed when an append of ``need`` bytes certainly fails now: the file
        system is read-only, or has fewer bytes free (for this process: root may use the blocks
        kept for it). Call under the lock. (A job called its LLM, then failed to write the summary,
        once per janitor pass while the disk stayed full: each call paid for and thrown away.)"""
        fd = self._lock_fd
        if fd is None:
            return
        try:
            fs = os.fstatvfs(fd)
        except OSError:
            return  # (the append says what is wrong, if anything)
        if fs.f_flag & os.ST_RDONLY:
            raise LogWriteFailed(f"{self.path}: cannot append: [Errno 30] Read-only file system")
        if fs.f_blocks == 0:  # (a file system that tells no sizes: a FUSE one without statfs says 0 of 0)
            return
        free = (fs.f_bfree if os.geteuid() == 0 else fs.f_bavail) * fs.f_frsize
        if free < need:
            raise LogWriteFailed(f"{self.path}: cannot append: [Errno 28] No space left on device "
                                 f"({free} bytes free, {need} needed)")

    def bytes_before(self, end: int, length: int) -> bytes:
        """The (at most) ``length`` bytes of the log before byte ``end`` (fewer at its start;
        through the lock's descriptor when held)."""
        start = max(0, end - length)
        fd = self._lock_fd
        if fd is not None:
            return _pread_all(fd, end - start, start)
        with self._opened() as f:
            if f is None:
                return b""
            f.seek(start)
            return f.read(end - start)

    @contextmanager
    def _opened(self) -> Iterator[BinaryIO | None]:
        """The log opened to read, lock-free (never created); None when there is none. Failing to
        open or read it (a directory, no permission, EIO) is LogCorrupted naming the path: the API
        answered a bare 500 internal_error, ``compactor context`` a traceback."""
        try:  # (non-blocking, then a regular file or refused: a FIFO there held each reader for good,
            # the API's threads one by one, /healthz too)
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            yield None
            return
        except OSError as e:
            raise LogCorrupted(f"{self.path}: cannot be read: {e.strerror or e}") from e
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise LogCorrupted(f"{self.path}: cannot be read: {_not_a_file(mode)}")
        os.set_blocking(fd, True)
        f = os.fdopen(fd, "rb")
        with f:
            try:
                yield f
            except OSError as e:
                raise LogCorrupted(f"{self.path}: cannot be read: {e.strerror or e}") from e

    def first_of_type(self, kind: str) -> dict[str, Any] | None:
        """The first complete line whose ``type`` is ``kind``, read from the start and no further
        (lock-free; a line that is not a JSON object is passed over: this finds, it does not
        check). A session's ``session_meta`` is usually its first line."""
        needle = orjson.dumps(kind)
        with self._opened() as f:
            for line in f or ():
                if not line.endswith(b"\n"):
                    break  # a torn tail
                if needle not in line:
                    continue
                try:
                    event = orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue
                if type(event) is dict and event.get("type") == kind:
                    return event
        return None

    def uuids_among(self, wanted: Iterable[str]) -> set[str]:
        """Those of ``wanted`` that are the ``uuid`` of an event of the log, as its writers write
        it (``"uuid":"..."``), on a complete line (lock-free, and the file is never created: a
        reader that finds it gone finds none; a line that is not a JSON object is passed over).
        Read in blocks, each searched for each uuid not found yet; the lines that hold one are
        parsed, so a uuid only named inside another event is no match."""
        needles = {uuid: b'"uuid":' + orjson.dumps(uuid) for uuid in set(wanted)}
        found: set[str] = set()
        if not needles:
            return found
        with self._opened() as f:
            if f is None:
                return found
            rest = b""
            while len(found) < len(needles) and (chunk := f.read(UUID_SCAN_BLOCK_BYTES)):
                block = rest + chunk
                cut = block.rfind(b"\n") + 1  # (complete lines; the rest waits for the next block)
                block, rest = block[:cut], block[cut:]
                for uuid, needle in needles.items():
                    at = -1
                    while uuid not in found and (at := block.find(needle, at + 1)) >= 0:
                        line = block[block.rfind(b"\n", 0, at) + 1:block.find(b"\n", at)]
                        try:
                            event = orjson.loads(line)
                        except orjson.JSONDecodeError:
                            continue
                        if type(event) is dict and event.get("uuid") == uuid:
                            found.add(uuid)
        if rest and len(found) < len(needles) and _whole_event(rest):  # (see ``read``)
            uuid = orjson.loads(rest).get("uuid")
            if type(uuid) is str and uuid in needles:
                found.add(uuid)
        return found

    def read(self, start: int = 0) -> list[dict[str, Any]]:
        """The events of the complete lines from byte ``start`` on; a torn last line is ignored, a
        last line that is a whole event missing only its newline is not by a reader without the
        lock: the next lock holder ends it with one (``_end_whole_last_line``), and such a reader
        (the API's context, ``compactor context``) left it out where one with the lock counted it."""
        lines = self._read_bytes(start).split(b"\n")
        if not lines[-1] or self._lock_fd is not None or not _whole_event(lines[-1]):
            del lines[-1]  # b"" after the last newline, or a torn fragment (under the lock: one whose newline
            # could not be written as the lock was taken, which the sizes the holder stores leave out)
        try:
            events = [orjson.loads(line) for line in lines if line]
        except orjson.JSONDecodeError:
            events = []  # locate the bad line below
        if len(events) != len(lines) or not all(
                type(e) is dict and (type(e.get("type")) is str or e.get("type") is None) for e in events):
            return [event for _, event in self._parse_records(start, lines)]
        return events

    def _started_mid_line(self, start: int, error: LogCorrupted) -> LogCorrupted:
        """The error to raise for a bad line met reading from byte ``start``: when ``start`` is no
        longer the start of a line (a line was inserted or edited before it by hand, and the reader's
        stored offset now falls inside one), the first bad line of the whole log, else that; ``error``
        when ``start`` is the start of a line. (A line inserted mid-log was reported at the line the
        stale offset fell in, which was a valid one.)"""
        if start == 0 or self._read_bytes(start - 1)[:1] == b"\n":
            return error
        lines = self._read_bytes(0).split(b"\n")
        del lines[-1]
        try:
            self._parse_records(0, lines)
        except LogCorrupted as first:
            return first
        return LogCorrupted(f"{self.path}: byte {start}, where reading resumed, is not the start of a line: the "
                            "log was changed before it (a line inserted or edited), and the state's stored size "
                            "no longer matches it")

    def read_records(self, start: int = 0) -> list[tuple[int, dict[str, Any]]]:
        """``(end_offset, event)`` per complete line from byte ``start``.

        ``end_offset`` is the byte offset just past the line's newline: the log
        size a reader has consumed once it has seen that event.
        """
        lines = self._read_bytes(start).split(b"\n")
        del lines[-1]
        return self._parse_records(start, lines)

    def _parse_records(self, start: int, lines: list[bytes]) -> list[tuple[int, dict[str, Any]]]:
        records: list[tuple[int, dict[str, Any]]] = []
        offset = start
        try:
            for line in lines:
                offset += len(line) + 1
                if not line.strip():
                    continue
                records.append((offset, self._parse_line(line, offset - len(line) - 1)))
        except LogCorrupted as e:
            raise self._started_mid_line(start, e) from e.__cause__
        return records

    def _parse_line(self, line: bytes, offset: int) -> dict[str, Any]:
        try:
            event = orjson.loads(line)
        except orjson.JSONDecodeError as e:
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as bad:  # (orjson words it "str is not valid UTF-8: surrogates not allowed")
                raise LogCorrupted(f"{self.path}: {self._where(offset)} is not UTF-8: byte {bad.start} of the line "
                                   f"is {line[bad.start]:#04x}") from e
            raise LogCorrupted(f"{self.path}: {self._where(offset)} is not JSON: {e}") from e
        if type(event) is not dict:
            raise LogCorrupted(f"{self.path}: {self._where(offset)} is not a JSON object")
        kind = event.get("type")
        if kind is not None and type(kind) is not str:  # (every reader tells events apart by it)
            raise LogCorrupted(f"{self.path}: {self._where(offset)} has a \"type\" that is not a string")
        return event

    def _where(self, offset: int) -> str:
        """``line N (byte B)`` of the line starting at byte ``offset``, N counted from the
        file's start (a reader may have started mid-file): what an operator opens to repair it."""
        newlines = 0
        try:
            with open(self.path, "rb") as f:
                while f.tell() < offset:
                    chunk = f.read(min(1 << 20, offset - f.tell()))
                    if not chunk:
                        break
                    newlines += chunk.count(b"\n")
        except OSError:
            return f"the line at byte {offset}"
        return f"line {newlines + 1} (byte {offset})"

    # -- appending -----------------------------------------------------------

    def append(self, events: list[dict[str, Any]]) -> int:
        """Append one line per event (under the lock); return the new size in bytes.

        A torn tail is moved to the ``.torn`` file first. On a disk error the
        file is truncated back to its size before this call and
        ``LogWriteFailed`` is raised.
        """
        chunks = _serialize(events)
        with self.lock():
            fd = self._lock_fd
            assert fd is not None  # held by lock()
            size = self._clean_size if self._clean_size is not None else self._repair_torn_tail(fd)
            self._clean_size = None  # until this write is known to have landed whole
            if not chunks:
                return size
            self._clean_size = self._write_all(fd, chunks, size)
            return self._clean_size

    def _repair_torn_tail(self, fd: int) -> int:
        size = os.fstat(fd).st_size
        keep = _complete_size(fd, size)
        if keep == size:
            return size
        ended = self._end_whole_last_line(fd, size, keep)  # (when taking the lock could not)
        if ended is not None:
            return ended
        try:
            fragment = _pread_all(fd, size - keep, keep)
            if len(fragment) != size - keep:
                raise OSError(errno.EIO, f"short read of the torn tail: {len(fragment)} of {size - keep} bytes")
            logger.warning("torn tail of %d bytes moved from %s to %s", len(fragment), self.path, self.torn_path)
            torn = os.open(self.torn_path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
            try:  # (a FIFO there held the log's lock, and the watcher with it, every shard)
                if not stat.S_ISREG(os.fstat(torn).st_mode):
                    raise OSError(errno.EINVAL, f"{self.torn_path} is not a regular file")
                end = os.fstat(torn).st_size
                copied = (os.fstat(fd).st_ino, keep, len(fragment), end)
                if self._torn_copied is None or self._torn_copied[:3] != copied[:3] or \
                        self._torn_copied[3] != end - len(fragment) - 1:  # (copied by this repair's last try,
                    # whose truncate failed: the fragment was there twice)
                    try:
                        _write_fully(torn, fragment + b"\n")  # (a short write had left part of it, cut off)
                    except BaseException:
                        os.ftruncate(torn, end)  # (a part written, then an error: the next try wrote it whole after it)
                        raise
                    self._torn_copied = copied
                if self.fsync:  # (its directory entry too, at each repair: the fragment is cut off the log next)
                    os.fsync(torn)
                    fsync_dir(self.torn_path.parent)
            finally:
                os.close(torn)
            os.ftruncate(fd, keep)
            self._torn_copied = None
        except OSError as e:
            raise LogWriteFailed(f"{self.path}: cannot repair the torn tail: {e}") from e
        return keep

    def _write_all(self, fd: int, chunks: list[bytes], size: int) -> int:
        try:
            for chunk in chunks:
                _write_fully(fd, chunk)  # (a short write is written on, so the real error, ENOSPC, EFBIG, surfaces)
            if self.fsync:
                os.fsync(fd)
        except BaseException as e:  # (a job's timeout, a SIGINT mid-batch: undone too, then raised as it is)
            try:
                written = max(0, os.fstat(fd).st_size - size)  # (what landed, for the messages)
            except OSError:
                written = 0
            undone = self._undo(fd, size, written)
            if not isinstance(e, OSError):
                raise
            raise LogWriteFailed(f"{self.path}: append failed, " + (
                "log left unchanged" if undone else f"and its first {written} bytes could not be taken back "
                "(the next writer reads what landed)") + f": {e}") from e
        return size + sum(len(chunk) for chunk in chunks)

    def _undo(self, fd: int, size: int, written: int) -> bool:
        """Truncate the log back to ``size``; whether that worked."""
        try:
            os.ftruncate(fd, size)
        except OSError:
            logger.exception("could not truncate %s back to %d bytes after a failed append", self.path, size)
            return False
        # (once per size: a held session's append is retried about once a second, each an ERROR line)
        level = logging.ERROR if first_time(_undo_said, str(self.path), (size, written)) else logging.DEBUG
        logger.log(level, "append to %s failed after %d bytes; truncated back to %d", self.path, written, size)
        return True


SAID_KEPT = 10_000  # keys a ``first_time`` memo remembers (then it forgets them all at once)


def first_time(said: dict[Any, Any], key: Any, value: Any) -> bool:
    """Whether ``value`` is new for ``key`` in ``said`` (then noted; ``said`` forgotten whole past
    ``SAID_KEPT`` keys): a line each retry would repeat is said once."""
    if said.get(key) == value:
        return False
    if len(said) >= SAID_KEPT:
        said.clear()
    said[key] = value
    return True


_undo_said: dict[str, tuple[int, int]] = {}  # log path -> (size, bytes written) of the last undo logged


def _whole_event(fragment: bytes) -> bool:
    """Whether a log's unterminated last line is a whole event, not a crashed writer's fragment:
    a JSON object whose ``type`` is a string (a fragment of one is never JSON: its closing brace
    comes last; a writer that died right before the newline wrote the whole event)."""
    try:
        event = orjson.loads(fragment)
    except orjson.JSONDecodeError:
        return False
    return type(event) is dict and type(event.get("type")) is str


class _Held:
    """``SessionLog.lock()``: a class, not a generator context manager (half the cost per use;
    the watcher takes the lock once or twice per run of events)."""

    __slots__ = ("log",)

    def __init__(self, log: SessionLog) -> None:
        self.log = log

    def __enter__(self) -> SessionLog:
        log = self.log
        log._mutex.acquire()
        try:
            if log._depth == 0:
                log._acquire()
        except BaseException:
            log._mutex.release()
            raise
        log._depth += 1
        return log

    def __exit__(self, *exc_info: object) -> None:
        log = self.log
        log._depth -= 1
        try:
            if log._depth == 0:
                log._release()
        finally:
            log._mutex.release()


def _serialize(events: list[dict[str, Any]]) -> list[bytes]:
    """The events as ``\\n``-terminated lines, batched into whole-line chunks."""
    chunks: list[bytes] = []
    current: list[bytes] = []
    current_size = 0
    for index, event in enumerate(events):
        try:
            line = orjson.dumps(event) + b"\n"
        except TypeError as e:  # orjson.JSONEncodeError is a TypeError
            raise InvalidEvent("event", f"cannot be written as JSON: {e}", index) from e
        if current and current_size + len(line) > WRITE_CHUNK_BYTES:
            chunks.append(b"".join(current))
            current, current_size = [], 0
        current.append(line)
        current_size += len(line)
    if current:
        chunks.append(b"".join(current))
    return chunks


def _pread_all(fd: int, length: int, offset: int) -> bytes:
    """``length`` bytes from ``offset`` (fewer at the end of the file): a short read (POSIX allows
    one; FUSE and network file systems give them) is read on from where it stopped."""
    parts = []
    while length > 0:
        data = os.pread(fd, length, offset)
        if not data:
            break
        parts.append(data)
        offset, length = offset + len(data), length - len(data)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _write_fully(fd: int, data: bytes) -> None:
    """Write all of ``data`` (a short write is written on; none at all is EIO)."""
    rest = memoryview(data)
    while rest:
        n = os.write(fd, rest)
        if n <= 0:
            raise OSError(errno.EIO, f"short write: 0 of {len(rest)} bytes")
        rest = rest[n:]


def _complete_size(fd: int, size: int | None = None) -> int:
    """Bytes up to the end of the last complete line: one byte read when there is no torn tail."""
    size = os.fstat(fd).st_size if size is None else size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return size
    return _end_of_last_line(fd, size)


def _end_of_last_line(fd: int, size: int) -> int:
    """The offset just past the last ``\\n`` in the file (0 when there is none)."""
    end = size
    while end > 0:
        start = max(0, end - TAIL_SCAN_BYTES)
        block = _pread_all(fd, end - start, start)  # (a short read had cut whole lines off as a "torn tail")
        index = block.rfind(b"\n")
        if index >= 0:
            return start + index + 1
        end = start
    return 0


def fsync_dir(directory: Path) -> None:
    """Make the entries of ``directory`` (a file just created or renamed in it) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _not_a_file(mode: int) -> str:
    """What a path of ``mode`` that is no regular file is, in the words of the error reading it gives."""
    return os.strerror(errno.EISDIR) if stat.S_ISDIR(mode) else "not a regular file"
