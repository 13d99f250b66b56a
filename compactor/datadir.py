"""Which data dir a Redis's sessions were written to: the watcher and the workers refuse to start on
another one.

Redis holds only derived state, but it knows the sessions, and each session's state says how
far into its log it has seen. Started on an empty or wrong data dir (a volume not mounted, a
path mistyped), the watcher wrote every known session's next events into new logs without
their start (a "log shrank" warning each), acking them off the streams, and the workers saved
states rebuilt from those copies: the right data dir, mounted again, missed those events for
good.

So each data dir carries an id (``{dataDir}/.compactor-id``, made once, at the first start of
a watcher or worker on it) and Redis records the id of the one its sessions are written to
(``{p}:datadir``). At its start a watcher or worker (``compactor watch`` / ``work``, the
children of ``serve`` too, and ``serve`` itself on an external Redis) compares them:

- the same id: fine;
- another one, or none in this data dir: ``InvalidConfig`` on ``dataDir``, exit 2, before any
  log is read or written (a record is never replaced on its own: a worker given a volume of its
  own, started while Redis knew no session, took the record over and the right data dir was
  refused after it); the message says how to go on (``redis-cli SET {p}:datadir <id>``);
- no record (a new or emptied Redis, or the first start since data dirs have ids: an upgrade):
  this data dir's id is recorded, unless Redis knows sessions and the data dir holds the log of
  none of the few most recent (refused: an empty or wrong one).

A running watcher checks again at each tick (``DataDirWatch``): the data dir's id file still
its own (a volume unmounted under it, leaving the empty mount point), and the record still its
id (written back when Redis lost it); else it stops, exit 2. The Redis that ``serve`` embeds
lives inside its data dir: it takes that data dir's id whatever it recorded.

A copy of the data dir (a backup restored beside it, a staging copy) has its id too. So each
running watcher keeps a mark in its data dir (``{dataDir}/.compactor-marks/{name}``, an empty
file made at its first tick, and again when it is gone) and records it in Redis
(``{p}:datadir:marks``: the file's inode and change time, refreshed each tick, forgotten
``MARK_TTL_S``, or 3 leases, after the last: each by its own). A process
whose data dir lacks the mark of a live watcher, or holds a file of that name that is another
file (inode and change time both other: a copy's), is on another data dir than that watcher:
``watch``, ``work`` and ``serve`` refuse to start (``check_data_dir``), and a running watcher
stops, exit 2 (``DataDirWatch``): both watchers of a split see it within a tick. (Two watchers
on a copy each took every other shard, and each data dir got a part of every session's events,
without a word.)
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import socket
import time
from pathlib import Path
from typing import Any

import redis
from rq.utils import as_text

from compactor.keys import Keys
from events.config import Settings
from events.errors import CompactorError, InvalidConfig
from events.log import fsync_dir

ID_FILE = ".compactor-id"
EMPTY_READ_RETRIES = 20  # an id file read empty is read again this many times, this far apart
EMPTY_READ_PAUSE_S = 0.05

logger = logging.getLogger(__name__)


def data_dir_id(data_dir: Path) -> str | None:
    """The id written in ``data_dir``, or None when it has none yet."""
    try:
        return (data_dir / ID_FILE).read_text(encoding="utf-8").strip() or None
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidConfig("dataDir", f"cannot read {data_dir / ID_FILE}: {e}") from e


def _make_id(data_dir: Path) -> str:
    """Write a new id in ``data_dir`` unless one is there (another process's, made meanwhile):
    the one there."""
    path = data_dir / ID_FILE
    made = secrets.token_hex(8)
    temporary = data_dir / f"{ID_FILE}.{made}.tmp"
    try:
        with open(temporary, "w", encoding="utf-8") as f:
            f.write(made + "\n")
            f.flush()
            os.fsync(f.fileno())  # (an id file that came back empty after a power loss refused every start)
        try:
            os.link(temporary, path)  # (never a half-written id: the file appears whole, or not at all)
        except FileExistsError:
            pass
        except OSError as e:  # (a file system without hard links: vfat, some FUSE and SMB mounts)
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK):
                raise
            _write_once(path, made)
        finally:
            temporary.unlink()
        fsync_dir(data_dir)
    except OSError as e:
        raise InvalidConfig("dataDir", f"cannot write {path}: {e.strerror or e}") from e
    for _ in range(EMPTY_READ_RETRIES):  # (made by another process without hard links: O_EXCL, then written)
        there = data_dir_id(data_dir)
        if there:
            return there
        time.sleep(EMPTY_READ_PAUSE_S)
    raise InvalidConfig("dataDir", f"{path} is empty: write an id in it (OPERATIONS: The data dir's id)")


RECENT_CHECKED = 5  # the most recent sessions whose logs a first start looks for


def _write_once(path: Path, made: str) -> None:
    """``path`` made with ``made`` in it unless it exists (O_EXCL: another process's wins)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(made + "\n")
        f.flush()
        os.fsync(f.fileno())


def _text(value: bytes | str | None) -> str | None:
    return None if value is None else as_text(value)


def check_data_dir(client: redis.Redis, settings: Settings, *, embedded: bool = False) -> str:
    """Refuse (``InvalidConfig`` on ``dataDir``) a data dir other than the one the sessions Redis
    knows were written to; record this one's id when Redis has none (or knows no session). The
    data dir's id. ``embedded``: Redis is the one ``serve`` runs inside this data dir, which
    belongs to it whatever is recorded (its id is recorded)."""
    keys = Keys(settings.redis.prefix, settings.redis.shards)
    data_dir = settings.data_dir
    if embedded:  # (no other data dir shares serve's own Redis: the marks it holds are this one's watcher's,
        client.delete(keys.data_dir_marks)  # recorded again at its next tick, or a copy's, come with the copy)
    recorded = _text(client.get(keys.data_dir))  # (first: a process writes the file before it records the
    mine = data_dir_id(data_dir)  # id, so a record read here has its file there; the other way round,
    # starts at once refused each other)
    if recorded is not None and recorded == mine:
        if not embedded:
            check_marks(client, keys, data_dir, mine)
        return mine
    known = 0 if embedded else int(client.zcard(keys.sessions))
    if recorded is not None and not embedded:  # (never replaced on its own: a worker given a volume of its
        what = f"its id is {mine}" if mine else _no_id(data_dir)  # own
        whose = f"the {known} session(s) this Redis knows were written to" if known else \
            "this Redis's sessions are written to"  # took the record over, and the right one was refused)
        raise InvalidConfig("dataDir", (
            f"{data_dir} is not the data dir {whose} ({what}; theirs is {recorded}, recorded in "
            f"{keys.data_dir}): point dataDir at that one; if this is it and its {ID_FILE} was lost, "
            f"write {recorded} into {data_dir / ID_FILE}; {_start_over(keys, data_dir, mine)}"))
    if recorded is None and known:  # (the first start since ids: this version's upgrade, or a Redis of
        checked, found = _recent_logs_here(client, settings, keys)  # an older one)
        if checked and not found:
            raise InvalidConfig("dataDir", (
                f"{data_dir} holds the log of none of the {checked} most recent of the {known} session(s) "
                f"this Redis knows: point dataDir at the data dir they were written to; "
                f"{_start_over(keys, data_dir, mine)}"))
    mine = mine or _make_id(data_dir)
    if embedded:
        client.set(keys.data_dir, mine)  # (serve's own Redis, inside this data dir: it is this one's)
        return mine
    client.set(keys.data_dir, mine, nx=True)
    return check_data_dir(client, settings)  # (another process may have recorded its own first)


def _no_id(data_dir: Path) -> str:
    if (data_dir / ID_FILE).exists():
        return f"its {ID_FILE} is empty"
    return f"it has no {ID_FILE}: empty, or not the one meant?"


def _start_over(keys: Keys, data_dir: Path, mine: str | None) -> str:
    """How to adopt ``data_dir`` on purpose: record its id (write one in it first if it has none)."""
    if mine:
        how = f"record its id: redis-cli SET {keys.data_dir} {mine}"
    else:
        made = secrets.token_hex(8)
        how = f"give it an id and record it: echo {made} > {data_dir / ID_FILE}; redis-cli SET {keys.data_dir} {made}"
    return f"if their logs are gone for good, to go on with this data dir, {how} (OPERATIONS: The data dir's id)"


def _recent_logs_here(client: redis.Redis, settings: Settings, keys: Keys) -> tuple[int, int]:
    """Of the ``RECENT_CHECKED`` most recently active sessions whose state Redis holds: how many
    there are, and how many have their log in the data dir."""
    from compactor.store import SessionStore
    from events.log import session_log_path

    store = SessionStore(client, settings)
    checked = found = 0
    for raw in client.zrevrange(keys.sessions, 0, RECENT_CHECKED - 1):
        session_id = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
        try:
            state = store.load(session_id)
            path = session_log_path(settings.data_dir, state.cwd, session_id) if state is not None else None
        except CompactorError:  # (a state or id that does not parse: not counted)
            continue
        if path is not None:
            checked += 1
            found += path.is_file()
    return checked, found


class DataDirChanged(InvalidConfig):
    """The running watcher's data dir is no longer the one it started on, or Redis records another."""


class DataDirWatch:
    """A running watcher's check, each tick, that its data dir is still the one it started on (its
    id file unchanged: a volume unmounted under it left the empty mount point, and the watcher
    wrote the next events of every session into new logs without their start) and that Redis
    records it (written back when Redis lost its data, so a wrong-dir process cannot take the
    record meanwhile). A data dir with no id at the start (a watcher run outside the commands,
    in a test or a benchmark) is not watched."""

    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        self.client = client
        self.data_dir = settings.data_dir
        self.keys = Keys(settings.redis.prefix, settings.redis.shards)
        self.key = self.keys.data_dir
        self.id = data_dir_id(self.data_dir)
        self.mark: Mark | None = None  # this watcher's, made at its first check
        self.ttl_s = max(MARK_TTL_S, 3 * settings.watcher.lease_ms / 1000)  # (a tick: a third of a lease)

    def check(self) -> None:
        """Raise ``DataDirChanged`` when the id file or Redis's record says another data dir."""
        if self.id is None:
            return
        try:
            now = data_dir_id(self.data_dir)
        except InvalidConfig as e:  # (unreadable now: an I/O error, say; looked at again next tick)
            logger.warning("could not read the data dir's id this tick: %s", e)
            return
        if now != self.id:
            raise DataDirChanged("dataDir", (
                f"{self.data_dir} changed under the watcher: its {ID_FILE} is "
                f"{'gone' if now is None else now}, was {self.id} (a volume unmounted?); stopped before "
                f"writing a log there"))
        pipe = self.client.pipeline(transaction=False)
        pipe.set(self.key, self.id, nx=True)
        pipe.get(self.key)
        recorded = _text(pipe.execute()[1])
        if recorded != self.id:
            raise DataDirChanged("dataDir", (
                f"Redis now records another data dir ({recorded}, in {self.key}) than this watcher's "
                f"{self.data_dir} ({self.id}): a process on another data dir took the record (Redis lost "
                f"its data?); see OPERATIONS: The data dir's id"))
        if self.mark is None or not self.mark.there(self.data_dir):  # (its file removed as stale while this
            self.mark = Mark.make(self.data_dir)  # watcher was paused past its TTL: recorded, it stopped the others)
        check_marks(self.client, self.keys, self.data_dir, self.id, mine=self.mark, ttl_s=self.ttl_s,
                    error=DataDirChanged)

    def close(self) -> None:
        """Forget this watcher's mark (a clean stop; a crashed one's is forgotten ``MARK_TTL_S`` later)."""
        if self.mark is not None:
            try:
                self.client.hdel(self.keys.data_dir_marks, self.mark.name)
            except redis.RedisError:
                pass
            self.mark.remove(self.data_dir)
            self.mark = None


MARKS_DIR = ".compactor-marks"
MARK_TTL_S = 60.0  # a watcher's mark counts this long after its last tick refreshed it
STALE_MARK_S = 600.0  # a mark file no live watcher records, this old, is removed (a crashed watcher's)

# KEYS: the marks' hash. ARGV: a mark's name, its TTL (s) and record (no name: only read). The
# marks refreshed within their own TTL, by Redis's clock, as name, "time TTL record" pairs; older
# ones forgotten. (Each by its own: a caller's shorter one forgot a live watcher's of a long lease.)
LIVE_MARKS = """
local now = tonumber(redis.call('TIME')[1])
if ARGV[1] ~= '' then redis.call('HSET', KEYS[1], ARGV[1], now .. ' ' .. ARGV[2] .. ' ' .. ARGV[3]) end
local all = redis.call('HGETALL', KEYS[1])
local live = {}
for i = 1, #all, 2 do
  local at, ttl = string.match(all[i + 1], '^(%d+) (%d+) ')
  if at == nil or now - tonumber(at) > tonumber(ttl) then
    redis.call('HDEL', KEYS[1], all[i])
  else
    live[#live + 1] = all[i]
    live[#live + 1] = all[i + 1]
  end
end
return live
"""


class Mark:
    """A watcher's mark: an empty file in its data dir, known by its inode and change time."""

    def __init__(self, name: str, inode: int, changed_ns: int) -> None:
        self.name, self.inode, self.changed_ns = name, inode, changed_ns

    @classmethod
    def make(cls, data_dir: Path) -> Mark:
        """A new mark in ``data_dir`` (and the removal of marks no watcher recorded for long)."""
        folder = data_dir / MARKS_DIR
        name = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            folder.mkdir(exist_ok=True)
            path = folder / name
            path.touch(exist_ok=False)
            made = path.stat()
        except OSError as e:
            raise InvalidConfig("dataDir", f"cannot write {folder / name}: {e.strerror or e}") from e
        return cls(name, made.st_ino, made.st_ctime_ns)

    def record(self, data_dir: Path) -> str:
        return json.dumps({"inode": self.inode, "ctime": self.changed_ns, "host": socket.gethostname(),
                           "pid": os.getpid(), "dataDir": str(data_dir)}, separators=(",", ":"))

    def there(self, data_dir: Path) -> bool:
        """Whether this mark's file is still in ``data_dir``."""
        try:
            here = (data_dir / MARKS_DIR / self.name).stat()
        except OSError:
            return False
        return _same_file(here, self.inode, self.changed_ns)

    def remove(self, data_dir: Path) -> None:
        try:
            (data_dir / MARKS_DIR / self.name).unlink()
        except OSError:
            pass


def _same_file(here: os.stat_result, inode: Any, changed_ns: Any) -> bool:
    """Whether ``here`` is the mark file recorded with ``inode`` and change time ``changed_ns``: a
    copy differs in both (a file system whose inodes are not stable keeps the change time)."""
    return bool(here.st_ino == inode or here.st_ctime_ns == changed_ns)


def check_marks(client: redis.Redis, keys: Keys, data_dir: Path, data_id: str, *, mine: Mark | None = None,
                ttl_s: float = MARK_TTL_S, error: type[InvalidConfig] = InvalidConfig) -> None:
    """Raise ``error`` on ``dataDir`` when a live watcher's mark is not in ``data_dir`` (missing,
    or another file of its name: a copy's); with ``mine``, then record (refresh) this watcher's,
    kept ``ttl_s`` (recorded before the check, a refused one's stopped the watcher on the other
    data dir too, when that one's tick fell between)."""
    live = _live_marks(client, keys)
    for name, value in live.items():
        if mine is not None and name == mine.name:
            continue
        record = _record(value)
        if record is None or "/" in name or name.startswith("."):
            continue  # (not one of ours: passed over)
        path = data_dir / MARKS_DIR / name
        try:
            here = path.stat()
        except FileNotFoundError:
            here = None
        except OSError as e:  # (unreadable now: looked at again next tick)
            logger.warning("could not look at the mark %s: %s", path, e)
            continue
        if here is not None and _same_file(here, record.get("inode"), record.get("ctime")):
            continue
        what = "is not in it" if here is None else "in it is another file (a copy's)"
        raise error("dataDir", (
            f"{data_dir} is not the data dir a running watcher writes to, though it has the same id ({data_id}): "
            f"the mark of watcher {record.get('host')} pid {record.get('pid')} (its dataDir "
            f"{record.get('dataDir')}) {what}: one of the two is a copy of the other (a backup restored "
            f"beside it, a staging copy), and each would get a part of every session's events; stop "
            f"the processes on the copy, or give the copy a Redis of its own; a watcher that is not running any "
            f"more (killed) is forgotten {ttl_s:.0f} s after its last tick (OPERATIONS: The data dir's id)"))
    if mine is not None:
        live = _live_marks(client, keys, mine.name, int(ttl_s), mine.record(data_dir))
        _remove_stale(data_dir, set(live))


def _live_marks(client: redis.Redis, keys: Keys, *record: Any) -> dict[str, str]:
    """The live marks (``LIVE_MARKS``), this one's ``(name, ttl_s, record)`` recorded first when given."""
    flat = client.eval(LIVE_MARKS, 1, keys.data_dir_marks, *(record or ("", "", "")))
    return {as_text(flat[i]): as_text(flat[i + 1]) for i in range(0, len(flat), 2)}


def _record(value: str) -> dict[str, Any] | None:
    try:
        record = json.loads(value.split(" ", 2)[2])
    except (ValueError, IndexError):
        return None
    return record if isinstance(record, dict) else None


def _remove_stale(data_dir: Path, live: set[str]) -> None:
    """Remove the mark files no live watcher records that are ``STALE_MARK_S`` old (crashed
    watchers'; a new one's file is made before it is recorded, and is younger; a live one's
    removed while it was paused past its TTL is made again at its next tick, before it records it)."""
    folder = data_dir / MARKS_DIR
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    cutoff = time.time() - STALE_MARK_S
    for entry in entries:
        try:
            if entry.name not in live and entry.stat().st_mtime < cutoff:
                os.unlink(entry.path)
        except OSError:
            pass
