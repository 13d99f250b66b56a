"""Reading the dead-letter stream ``{p}:dead``: what ``GET /api/dead-letters`` and
``compactor dead-letters`` show.

A letter (written by the watcher, ``producer.watcher.batch.BatchOutcome.letter``) holds the
refused entry's fields (``session``, ``cwd``, ``event`` first; a value past
``limits.maxEventBytes`` cut, named in ``truncated``), then ``reason``, ``id`` (the entry's id)
and ``stream``.

Invariants: reading never changes the stream; the newest letters come first; at most
``MAX_SCANNED`` letters (and ``MAX_SCANNED_BYTES`` of them, read ``READ_CHUNK`` at a time) are
looked through per call (``scanned`` says how many, ``complete``
whether that was all of them), so a filter on a session costs bounded Redis work however long
the stream (``complete`` is False when that bound, not ``limit`` or the stream's start, ended
the scan); a value that is not UTF-8 (a malformed entry's) is shown with U+FFFD in its place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import redis

from compactor.keys import Keys

MAX_SCANNED = 10_000  # letters looked through per call, at most
MAX_SCANNED_BYTES = 16 * 1024 * 1024  # ... and bytes of them read (a letter keeps an event up to maxEventBytes)
READ_CHUNK = 20  # letters per XREVRANGE (one reply of 500 letters of 100 KB blocked Redis ~90 ms)
SHOWN_FIELDS = (b"session", b"cwd", b"event", b"reason", b"id", b"stream", b"truncated", b"fieldsDropped")


@dataclass(frozen=True)
class DeadLetter:
    """One letter: when it was written (its id's time), what was refused and why."""

    letter_id: str
    written_at: float  # unix seconds: the time in the letter's stream id (Redis's clock)
    session: str | None
    cwd: str | None
    reason: str
    entry_id: str | None
    stream: str | None
    event: str | None
    truncated: str | None = None
    extra: dict[str, str] = field(default_factory=dict)  # the entry's other fields


@dataclass(frozen=True)
class DeadLetters:
    letters: list[DeadLetter]
    scanned: int  # letters looked through
    complete: bool  # False: the scan stopped at its bound before the oldest letter (older matches may exist)
    total: int  # letters the stream holds


def read_dead_letters(client: redis.Redis, keys: Keys, *, session: str | None = None, limit: int = 50,
                      max_scanned: int | None = None, letter_bytes: int = 0) -> DeadLetters:
    """The newest ``limit`` letters (of ``session`` only, when given), newest first, looking
    through ``max_scanned`` letters at most (``MAX_SCANNED``). ``letter_bytes``: how large a
    letter may be (``limits.maxEventBytes``): each read takes no more letters than that many
    bytes' worth fit in what is left of ``MAX_SCANNED_BYTES`` (one at least)."""
    max_scanned = MAX_SCANNED if max_scanned is None else max_scanned
    letters: list[DeadLetter] = []
    scanned = read = 0
    end = "+"
    oldest_reached = False
    while len(letters) < limit and scanned < max_scanned and read < MAX_SCANNED_BYTES:
        fit = (MAX_SCANNED_BYTES - read) // letter_bytes if letter_bytes else READ_CHUNK
        count = max(1, min(READ_CHUNK, max_scanned - scanned, fit))
        chunk: list[Any] = client.xrevrange(keys.dead, max=end, min="-", count=count) or []
        for letter_id, fields in chunk:
            fields = fields or {}
            scanned += 1
            read += sum(len(name) + len(value) for name, value in fields.items())
            letter = _letter(letter_id, fields)
            if session is None or letter.session == session:
                letters.append(letter)
                if len(letters) == limit:
                    break
        if len(chunk) < count:
            oldest_reached = True
            break
        end = "(" + _text(chunk[-1][0])
    complete = oldest_reached or len(letters) == limit
    return DeadLetters(letters, scanned, complete, int(client.xlen(keys.dead)))


def _letter(letter_id: Any, fields: dict[Any, Any]) -> DeadLetter:
    data = {_raw(name): value for name, value in fields.items()}

    def get(name: bytes) -> str | None:
        value = data.get(name)
        return None if value is None else _text(value)

    ms = int(_text(letter_id).partition("-")[0])
    return DeadLetter(
        letter_id=_text(letter_id), written_at=ms / 1000, session=get(b"session"), cwd=get(b"cwd"),
        reason=get(b"reason") or "", entry_id=get(b"id"), stream=get(b"stream"), event=get(b"event"),
        truncated=get(b"truncated"),
        extra={_text(name): _text(value) for name, value in data.items() if name not in SHOWN_FIELDS})


def _raw(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
