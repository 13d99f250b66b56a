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
dir is adopted. To adopt one on purpose (the old logs are gone for good), delete the record:
``redis-cli DEL {p}:datadir``.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import redis

from compactor.keys import Keys
from events.config import Settings
from events.errors import InvalidConfig

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


def check_data_dir(client: redis.Redis, settings: Settings) -> str:
    """Refuse (``InvalidConfig`` on ``dataDir``) a data dir other than the one the sessions Redis
    knows were written to; record this one's id when Redis has none (or knows no session). The
    data dir's id."""
    keys = Keys(settings.redis.prefix, settings.redis.shards)
    data_dir = settings.data_dir
    mine = data_dir_id(data_dir)
    raw = client.get(keys.data_dir)
    recorded = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    if recorded is not None and recorded == mine:
        return mine
    if recorded is not None and client.zcard(keys.sessions):
        what = f"its id is {mine}" if mine else f"it has no {ID_FILE}: empty, or not the one meant?"
        raise InvalidConfig("dataDir", (
            f"{data_dir} is not the data dir the sessions this Redis knows were written to ({what}; "
            f"theirs is {recorded}, recorded in {keys.data_dir}): point dataDir at that one; if its "
            f"logs are gone for good, delete {keys.data_dir} to start over here (OPERATIONS: The data "
            f"dir's id)"))
    mine = mine or _make_id(data_dir)
    if recorded is None:
        client.set(keys.data_dir, mine, nx=True)
        return check_data_dir(client, settings)  # (another process may have recorded its own first)
    client.set(keys.data_dir, mine)  # (no session known: this one is adopted)
    return mine
