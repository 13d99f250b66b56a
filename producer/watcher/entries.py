"""Turning a raw stream entry into an event for the log, or a reason to dead-letter it.

Invariants:
- Decoding is pure: the same entry always yields the same result, so a
  redelivered entry produces the very same log line. A missing ``uuid`` is
  uuid5 of the session and entry id; a missing ``timestamp`` is the entry
  id's time (when Redis received it); a ``session_meta`` without
  ``createdAt`` gets its ``timestamp``.
- Every line carries ``streamId`` (the entry id), which the store uses to drop
  a redelivered entry it already applied. A producer's ``streamId`` is replaced.
- An entry is rejected, never raised on: missing field, invalid UTF-8,
  oversize event, invalid JSON, not an object, unknown type, a field that
  fails the wire model, a bad session id or cwd, an event naming another
  session or cwd. The reason says which.
- ``session_meta`` lines get ``sessionId`` and ``cwd`` from the entry (SPEC §3
  lists them on that line); other events never carry them.
- An entry read from a shard its session does not hash to is refused
  (``misrouted``): stream ids are per stream, so a session's entries are
  ordered, and redeliveries told apart, only within its own shard.
"""

from __future__ import annotations

import hashlib
import logging
import uuid as uuidlib
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any

import orjson

from compactor.keys import Keys
from events.checks import json_problem
from events.errors import InvalidInput
from events.models import (
    parse_event,
    validate_cwd,
    validate_session_id,
    wire_of,
)

logger = logging.getLogger(__name__)

REQUIRED_FIELDS = (b"session", b"cwd", b"event")
DELETED = "entry has no fields (deleted from the stream before it was applied)"  # (a letter's reason)
# the letter of entries deleted before the watchers' group read them (``ShardStreams.trim``): ``after``
# the group's last read id, ``lost`` how many (at least; 0: unknown), ``id`` the highest deleted when
# an entry amid others was; nothing of the entries survives
UNREAD_DELETED = ("entries deleted from the stream before the watchers read them (a producer trimmed or "
                  "deleted unread entries: their events are lost), after id 'after'")
IDENTITY_FIELDS = {"sessionId": "session", "cwd": "cwd"}
# Namespace of the uuids derived from entry ids (fixed forever: logs depend on it).
ENTRY_UUID_NAMESPACE = uuidlib.UUID("6f1c2d1e-4b7a-5c52-9f0e-3c2a8d7b9e41")


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs 4x, on every entry
class Entry:
    """A valid entry: whose it is and the event dict to append (never modified after decoding)."""

    id: str
    session_id: str
    cwd: str
    event: dict[str, Any]
    fields: list[bytes] = field(repr=False, default_factory=list)  # as received, for a dead letter
    derived_uuid: bool = False  # the event came without a uuid: ``entry_uuid`` gave it one


@dataclass(frozen=True)
class Rejected:
    """An entry to dead-letter with ``reason``; ``fields`` as received (flat k, v list)."""

    id: str
    reason: str
    fields: list[bytes]


Decoded = Entry | Rejected


class _Reject(Exception):
    pass


def decode_entry(entry_id: bytes | str, fields: list[bytes] | None, max_event_bytes: int) -> Decoded:
    """Validate one raw entry (flat field list as Redis returned it)."""
    eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    raw = fields or []
    try:
        return _decode(eid, raw, max_event_bytes)
    except _Reject as e:
        return Rejected(eid, str(e), raw)
    except Exception as e:  # a bug here must cost one entry (kept as a letter), not stop the watcher's shards
        logger.exception("decoding entry %s failed", eid)
        return Rejected(eid, f"event: could not be decoded ({type(e).__name__}: {e})", raw)


def _decode(eid: str, raw: list[bytes], max_event_bytes: int) -> Entry:
    if not raw:
        raise _Reject(DELETED)
    values = _field_map(raw)
    event_bytes = values[b"event"]
    if len(event_bytes) > max_event_bytes:
        raise _Reject(f"event is {len(event_bytes)} bytes, more than limits.maxEventBytes ({max_event_bytes})")
    session_id, cwd = _identity(values[b"session"], values[b"cwd"])
    data = _json_object(event_bytes)
    derived = type(data) is dict and data.get("uuid") is None
    return Entry(eid, session_id, cwd, _wire_event(eid, session_id, cwd, data), raw, derived)


def _field_map(raw: list[bytes]) -> dict[bytes, bytes]:
    if type(raw[0]) is not bytes:  # a client decoding responses gives str throughout
        raw = [_bytes(value) for value in raw]
    values = dict(zip(raw[::2], raw[1::2]))  # an odd last name (no value) is dropped
    for name in REQUIRED_FIELDS:
        if name not in values:
            raise _Reject(f"missing field {name.decode()!r}")
    if 2 * len(values) < len(raw) - 1:  # a name given twice: one of ours would be one value dropped
        for name in REQUIRED_FIELDS:
            if (times := raw[::2].count(name)) > 1:
                raise _Reject(f"field {name.decode()!r} given {times} times (one value would be dropped)")
    return values


@lru_cache(maxsize=4096)
def _identity(session: bytes, cwd: bytes) -> tuple[str, str]:
    """The entry's session id and cwd, checked (a session's entries repeat the same pair:
    checked once; a refusal raises, so it is never cached)."""
    session_id, path = _text(session, "session"), _text(cwd, "cwd")
    try:
        return validate_session_id(session_id), validate_cwd(path, new=True)
    except InvalidInput as e:
        raise _Reject(str(e)) from e


def _text(value: bytes, name: str) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _Reject(f"invalid UTF-8 in field {name!r} at byte {e.start}") from e


# orjson reads 1 024 levels of nesting but writes 254: an event it could not write as a log line
# must be refused on its own here, not fail the append of its whole run.
_WRITABLE_NESTING = 254


def _json_object(event_bytes: bytes) -> Any:
    try:
        data = orjson.loads(event_bytes)  # refuses invalid UTF-8 too
    except orjson.JSONDecodeError as e:
        try:
            event_bytes.decode("utf-8")  # only to say where, as for the other fields
        except UnicodeDecodeError as bad:
            raise _Reject(f"invalid UTF-8 in field 'event' at byte {bad.start}") from e
        raise _Reject(f"invalid JSON in field 'event': {e}") from e
    if event_bytes.count(b"[") + event_bytes.count(b"{") >= _WRITABLE_NESTING:  # else it cannot be that deep
        try:
            orjson.dumps(data)
        except TypeError as e:  # orjson.JSONEncodeError
            raise _Reject(f"event: cannot be written as a log line: {e} (nested too deeply)") from e
    # what orjson passes over silently (the API refuses the same body): a key given twice in one
    # object (it keeps the last value), an integer past 64 bits (read as a float), a nonzero number
    # read as 0 (1e-400). Written as orjson writes it (the publisher's form) it has none: one
    # encode, not a second, slower decode
    if orjson.dumps(data) != event_bytes and (problem := json_problem(event_bytes, "event")) is not None:
        raise _Reject(problem)
    return data


def _wire_event(eid: str, session_id: str, cwd: str, data: Any) -> dict[str, Any]:
    if type(data) is dict:  # fill a missing uuid / timestamp before validating: no model copy after
        if data.get("uuid") is None:
            data["uuid"] = entry_uuid(session_id, eid)
        if data.get("timestamp") is None:
            data["timestamp"] = entry_timestamp(eid)
        if data.get("type") == "session_meta" and data.get("createdAt") is None \
                and ("createdAt" in data or data.get("created_at") is None):  # (created_at alone: a name the
            # model takes too, as the Publisher does; a createdAt given as null is filled all the same)
            data["createdAt"] = data["timestamp"]  # SPEC §3 lists it unconditionally: when the session said hello
    try:
        event = parse_event(data)
    except InvalidInput as e:
        raise _Reject(str(e)) from e
    wire = wire_of(data, event)  # ``data`` is an object here: parse_event refuses anything else
    _check_identity(wire, {"sessionId": session_id, "cwd": cwd})
    if wire["type"] == "session_meta":
        wire["sessionId"], wire["cwd"] = session_id, cwd
    wire["streamId"] = eid
    return wire


def _check_identity(wire: dict[str, Any], expected: dict[str, str]) -> None:
    if wire.keys().isdisjoint(IDENTITY_FIELDS):  # the usual case: neither is sent
        return
    for name, entry_field in IDENTITY_FIELDS.items():
        if name in wire and wire.pop(name) != expected[name]:
            raise _Reject(f"{name}: differs from the entry's {entry_field!r} field")


def misrouted(keys: Keys, session_id: str, shard: int) -> str | None:
    """The reason to refuse a session's entry read from ``shard`` when the session hashes to
    another one (a producer with a signed CRC-32 or another shard count), else None."""
    home = keys.shard_of(session_id)
    if home == shard:
        return None
    return (f"session: belongs to shard {home} (crc32(utf8(sessionId)) % {keys.shards}), which differs "
            f"from the entry's shard {shard} (read from {keys.stream(shard)})")


def entry_uuid(session_id: str, entry_id: str) -> str:
    """The uuid of an entry's event when the producer sent none (stable across redeliveries):
    ``str(uuid.uuid5(ENTRY_UUID_NAMESPACE, f"{session_id}/{entry_id}"))``, formatted from the
    SHA-1 directly (a quarter of the cost of building ``uuid.UUID`` objects, on every event)."""
    h = hashlib.sha1(_NAMESPACE_BYTES + f"{session_id}/{entry_id}".encode()).hexdigest()
    # version 5 in the 13th digit, the RFC 4122 variant (binary 10xx) in the 17th, as uuid5 sets them
    return f"{h[:8]}-{h[8:12]}-5{h[13:16]}-{_VARIANT_DIGIT[h[16]]}{h[17:20]}-{h[20:32]}"


def requalified_uuid(session_id: str, event: dict[str, Any]) -> str | None:
    """For an event whose uuid ``entry_uuid`` derived from its entry id: one of its id *and*
    content, for when a line of other content holds the derived one (a lost stream gave a new
    entry an old entry's id: ``SessionStore._requalified``); None for a uuid of the producer's."""
    stream_id = event.get("streamId")
    if not isinstance(stream_id, str) or event.get("uuid") != entry_uuid(session_id, stream_id):
        return None
    body = {key: value for key, value in event.items() if key != "uuid"}
    digest = hashlib.sha256(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)).hexdigest()
    return entry_uuid(session_id, f"{stream_id}/{digest}")


_NAMESPACE_BYTES = ENTRY_UUID_NAMESPACE.bytes
_VARIANT_DIGIT = {f"{n:x}": f"{n & 0x3 | 0x8:x}" for n in range(16)}


def entry_timestamp(entry_id: str) -> str:
    """The time Redis stamped on the entry id, as ISO-8601 UTC with milliseconds; the time of
    reading when the id's time is no date (past the year 9999: an id a producer chose, and every
    ``XADD *`` after it on that stream, which Redis numbers above it). That raised, and the watcher
    retried the round forever, every shard it owns stopped."""
    ms = entry_id.partition("-")[0]
    if ms != _last_timestamp[0]:  # entries of one millisecond share it: format once
        seconds, millis = divmod(int(ms), 1000)
        if seconds != _last_second[0]:  # and those of one second share all but the milliseconds
            try:
                moment = datetime.fromtimestamp(seconds, tz=UTC)
            except (ValueError, OverflowError, OSError):
                now = datetime.now(UTC)
                return now.strftime("%Y-%m-%dT%H:%M:%S.") + f"{now.microsecond // 1000:03d}Z"
            _last_second[:] = [seconds, moment.strftime("%Y-%m-%dT%H:%M:%S")]
        _last_timestamp[:] = [ms, f"{_last_second[1]}.{millis:03d}Z"]
    return _last_timestamp[1]  # type: ignore[return-value]


_last_timestamp: list[object] = ["", ""]  # (the ms part of an entry id, its timestamp)
_last_second: list[object] = [-1, ""]  # (seconds since the epoch, formatted to the second)


def _bytes(value: bytes | str) -> bytes:
    return value.encode("utf-8", "surrogateescape") if isinstance(value, str) else value
