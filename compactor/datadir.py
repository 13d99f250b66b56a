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
(``{p}:datadir``). At its start a watcher or worker (``compactor watch`` / ``work``, so the
children of ``serve`` too) compares them: no record (a new or emptied Redis) -> this data
dir's id is recorded; the same id -> fine; another one, or none in this data dir, while Redis
knows sessions -> ``InvalidConfig`` on ``dataDir``, exit 2, before anything is read or written.
With no session known (none written yet, or all idle past the 7 days Redis keeps them), the data
dir is adopted. With no record but sessions known (the first start since data dirs have ids: an
upgrade), the data dir is recorded if it holds the log of any of the few most recent sessions,
else refused. To adopt one on purpose (the old logs are gone for good), record its id
(``redis-cli SET {p}:datadir <the id in .compactor-id>``): the refusal says so. The Redis that ``serve`` embeds lives inside its data dir: it
takes that data dir's id whatever it recorded.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import redis

from compactor.keys import Keys
from events.config import Settings
from events.errors import CompactorError, InvalidConfig

ID_FILE = ".compactor-id"


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
        temporary.write_text(made + "\n", encoding="utf-8")
        try:
            os.link(temporary, path)  # (never a half-written id: the file appears whole, or not at all)
        except FileExistsError:
            pass
        finally:
            temporary.unlink()
    except OSError as e:
        raise InvalidConfig("dataDir", f"cannot write {path}: {e.strerror or e}") from e
    there = data_dir_id(data_dir)
    if there is None:
        raise InvalidConfig("dataDir", f"{path} is empty")
    return there


RECENT_CHECKED = 5  # the most recent sessions whose logs a first start looks for


def check_data_dir(client: redis.Redis, settings: Settings, *, embedded: bool = False) -> str:
    """Refuse (``InvalidConfig`` on ``dataDir``) a data dir other than the one the sessions Redis
    knows were written to; record this one's id when Redis has none (or knows no session). The
    data dir's id. ``embedded``: Redis is the one ``serve`` runs inside this data dir, which
    belongs to it whatever is recorded (its id is recorded)."""
    keys = Keys(settings.redis.prefix, settings.redis.shards)
    data_dir = settings.data_dir
    mine = data_dir_id(data_dir)
    raw = client.get(keys.data_dir)
    recorded = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    if recorded is not None and recorded == mine:
        return mine
    known = 0 if embedded else int(client.zcard(keys.sessions))
    if recorded is not None and known:
        what = f"its id is {mine}" if mine else f"it has no {ID_FILE}: empty, or not the one meant?"
        raise InvalidConfig("dataDir", (
            f"{data_dir} is not the data dir the {known} session(s) this Redis knows were written to "
            f"({what}; theirs is {recorded}, recorded in {keys.data_dir}): point dataDir at that one; "
            f"if this is it and its {ID_FILE} was lost, write {recorded} into {data_dir / ID_FILE}; "
            f"{_start_over(keys, data_dir, mine)}"))
    if recorded is None and known:  # (the first start since ids: this version's upgrade, or a Redis of
        checked, found = _recent_logs_here(client, settings, keys)  # an older one)
        if checked and not found:
            raise InvalidConfig("dataDir", (
                f"{data_dir} holds the log of none of the {checked} most recent of the {known} session(s) "
                f"this Redis knows: point dataDir at the data dir they were written to; "
                f"{_start_over(keys, data_dir, mine)}"))
    mine = mine or _make_id(data_dir)
    if recorded is None and not embedded:
        client.set(keys.data_dir, mine, nx=True)
        return check_data_dir(client, settings)  # (another process may have recorded its own first)
    client.set(keys.data_dir, mine)  # (no session known, or serve's own Redis: this one is adopted)
    return mine


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
