"""Per-shard read position and per-batch bookkeeping of the watcher.

Invariants:
- A shard is read from its PEL (``start`` = an id) until the PEL is exhausted,
  then from ``>``; a PEL sweep clears the held-back sessions, so each is
  retried in stream order.
- Once a full sweep is over, the PEL holds only the held sessions' entries. So
  the sweep that retries them (``retry_held``) starts at the first pending
  entry of the first of them, jumps from one held session's first pending
  entry to the next's once the sessions before were held again, and ends as soon
  as every one of them was: the rest of the PEL is theirs, and re-reading it
  once a second kept the shard's other sessions waiting (seconds with tens of
  thousands of entries held). Once one of them is applied again, the sweep reads
  on in order to the PEL's end (its later entries are there).
- A run (one ``SessionStore.apply``) never spans a ``turn_end`` or a cwd
  change, so thresholds are checked on the state exactly as it was after the
  turn, and a cwd refused for a session refuses only its own entries.
"""

from __future__ import annotations

import itertools
import logging
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from compactor.metrics import reason_kind
from compactor.store import stream_id_key
from events.models import SESSION_ID_RE
from producer.watcher.entries import REQUIRED_FIELDS, Entry
from producer.watcher.streams import NEW_ENTRIES, PEL_START, Letter, entry_mark

logger = logging.getLogger(__name__)

HOLD_RETRY_S = 1.0  # a held-back session is retried by a PEL sweep this often
HELD_LOG_EVERY_S = 60.0  # a session held back (a full disk, say) is logged again this often
# A dead letter copies at most this many of the entry's fields (name, value pairs): Lua's unpack
# in the ack script fails past ~8 000 values, which would wedge the shard on every retry.
MAX_DEAD_LETTER_FIELDS = 1_000
# A value of a letter past ``BatchOutcome.whole_up_to`` (the watcher: ``limits.maxEventBytes``, so
# never a value a replay could apply) keeps only its first this many bytes: the letter says so in
# ``truncated`` (``name:bytes``). Ten 5 MB events refused for their size took 58 MB of Redis, and
# the dead-letter stream keeps 100 000 letters.
TRUNCATED_LETTER_VALUE_BYTES = 64 * 1024


@dataclass
class ShardCursor:
    """Where the watcher reads one shard: ``start`` in the PEL while sweeping, else ``>``."""

    start: str = PEL_START
    top: str = PEL_START  # the newest id seen when nothing new was left (for XREAD BLOCK)
    held: set[str] = field(default_factory=set)  # sessions with entries left pending
    retry_at: float = 0.0
    trimmed_at: float = field(default_factory=time.monotonic)
    claimed: set[str] = field(default_factory=set)  # ids claimed from another consumer, not yet applied
    # held sessions -> (held since, last logged), monotonic: logged when held, then every
    # HELD_LOG_EVERY_S (each retry, once a second, logged it), and once when applied again
    held_log: dict[str, tuple[float, float]] = field(default_factory=dict)
    # the sessions this sweep retries, when it is a retry of held sessions only (None: a full sweep)
    retrying: set[str] | None = None
    retry_seen: set[str] = field(default_factory=set)  # those of them the retry has read entries of
    held_first: dict[str, str] = field(default_factory=dict)  # held session -> its first pending entry's id

    @property
    def sweeping(self) -> bool:
        return self.start != NEW_ENTRIES

    def restart_sweep(self) -> None:
        """Sweep the whole PEL (an owner starts, a Redis error): every pending entry is retried."""
        self.start = PEL_START
        self.held.clear()
        self.held_first.clear()
        self.retrying = None

    def retry_held(self) -> None:
        """Sweep the PEL to retry the held sessions, the only ones it holds entries of: from the
        first pending entry of the first of them."""
        self.retrying, self.retry_seen = set(self.held), set()
        self.held.clear()
        self.start = self._next_first(PEL_START)

    def swept(self, last_id: str, sessions: set[str]) -> None:
        """A batch of the sweep is done, up to ``last_id``, holding entries of ``sessions``: read on
        past it; in a retry, from the next held session's first pending entry when every one read
        so far was held again, or from ``>`` when every one was (all the PEL has left is theirs)."""
        if self.retrying is None:
            self.start = last_id
            return
        self.retry_seen |= sessions & self.retrying
        if self.retry_seen - self.held:  # one was applied again: its later entries are further on
            self.retrying, self.start = None, last_id
        elif self.retrying <= self.retry_seen:
            self.retrying, self.start = None, NEW_ENTRIES
        else:
            self.start = self._next_first(last_id)

    def _next_first(self, last_id: str) -> str:
        """Where a retry reads next, from ``last_id`` on: right before the first pending entry of the
        held sessions it has not read yet, when that is further (each one's is known)."""
        unseen = (self.retrying or set()) - self.retry_seen
        if not unseen or any(sid not in self.held_first for sid in unseen):
            return last_id
        first = min((self.held_first[sid] for sid in unseen), key=stream_id_key)
        before = id_before(first)
        return before if last_id == PEL_START or stream_id_key(before) > stream_id_key(last_id) else last_id

    def swept_all(self) -> None:
        """The sweep found no more pending entries: read from ``>``."""
        self.start = NEW_ENTRIES
        self.retrying = None

    def held_log_due(self, session_id: str) -> bool:
        """Whether a failure of the held session ``session_id`` is to be logged now."""
        now = time.monotonic()
        since, logged = self.held_log.get(session_id, (now, 0.0))
        due = logged == 0.0 or now - logged >= HELD_LOG_EVERY_S
        self.held_log[session_id] = (since, now if due else logged)
        return due

    def held_for(self, session_id: str) -> float:
        """How long ``session_id`` has been held back (0: it is not)."""
        held = self.held_log.get(session_id)
        return 0.0 if held is None else time.monotonic() - held[0]

    def released(self, session_id: str) -> float | None:
        """How long ``session_id`` was held back, now it is applied again (None: it was not)."""
        self.held_first.pop(session_id, None)
        held = self.held_log.pop(session_id, None)
        return None if held is None else time.monotonic() - held[0]

    def hold(self, session_id: str, first_id: str) -> None:
        """Hold ``session_id`` back: ``first_id`` is the entry whose apply failed, its first pending."""
        self.held.add(session_id)
        known = self.held_first.get(session_id)
        if known is None or stream_id_key(first_id) < stream_id_key(known):
            self.held_first[session_id] = first_id
        self.retry_at = time.monotonic() + HOLD_RETRY_S


def id_before(entry_id: str) -> str:
    """The id right before ``entry_id`` (a read from it starts at ``entry_id``)."""
    ms, seq = stream_id_key(entry_id)
    if seq:
        return f"{ms}-{seq - 1}"
    return f"{ms - 1}-{2 ** 64 - 1}" if ms else PEL_START


@dataclass
class BatchOutcome:
    """What to do with a batch once it is applied: ids to ack, dead letters (flat fields)."""

    stream: str
    whole_up_to: int | None = None  # a letter's values longer than this are cut (None: kept whole)
    acks: list[str] = field(default_factory=list)
    dead: list[Letter] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)  # of ``dead``, for the metrics after the ack

    def reject(self, entry_id: str, reason: str, fields: list[bytes], *, written: bool = False) -> None:
        """Dead-letter an entry with the batch's ack, and ack it; ``written``: its letter was
        written ahead (before its run's append, this round), so only the ack and the count are
        left. (One written ahead in an earlier try is not written again either: ``ShardStreams.ack``.)"""
        extra = dead_letter_fields(self.stream, entry_id, reason, fields)
        logger.warning("dead-lettered session=%s stream=%s id=%s reason=%s", _shown(extra["session_id"]),
                       self.stream, entry_id, _one_line(reason), extra=extra)
        self.reasons.append(reason)
        if not written:
            self.dead.append(self.letter(entry_id, reason, fields))
        self.acks.append(entry_id)

    def letter(self, entry_id: str, reason: str, fields: list[bytes]) -> Letter:
        """The entry's dead letter, whose flat fields are the entry's (at most ``MAX_DEAD_LETTER_FIELDS``; its
        ``session``, ``cwd`` and ``event`` first, so a letter can always be replayed), reason,
        id, stream. An entry's own field of a name the letter adds (those three and
        ``fieldsDropped``) is kept as ``entry.<name>`` (a letter naming one twice read as the
        service's or the producer's value, depending on the client)."""
        names, values = fields[::2], fields[1::2]  # (an odd last name, with no value, is left out)
        first = [i for i, name in enumerate(names[:len(values)]) if name in REQUIRED_FIELDS]
        chosen = set(first)  # (``not in`` the list, for each field: 80 000 fields named ``event`` took
        # minutes, past the shard's lease, and the entry was read again and again, its shard stopped)
        order = list(itertools.islice(itertools.chain(
            first, (i for i in range(len(values)) if i not in chosen)), MAX_DEAD_LETTER_FIELDS))
        kept: list[bytes] = []
        cut: list[bytes] = []
        for i in order:
            name, value = b"entry." + names[i] if names[i] in _LETTER_FIELDS else names[i], values[i]
            if self.whole_up_to is not None and len(value) > self.whole_up_to:
                cut.append(name + b":" + str(len(value)).encode())
                value = value[:TRUNCATED_LETTER_VALUE_BYTES]
            kept += [name, value]
        if len(values) > len(order):  # how many were left out, so the letter says it is partial
            kept += [b"fieldsDropped", str(len(values) - len(order)).encode()]
        if cut:
            kept += [b"truncated", b",".join(cut)]
        return Letter(entry_id, entry_mark(fields),
                      [*kept, b"reason", reason.encode(), b"id", entry_id.encode(), b"stream", self.stream.encode()])


_LETTER_FIELDS = (b"reason", b"id", b"stream", b"fieldsDropped", b"truncated")  # what the letter itself adds


def dead_letter_fields(stream: str, entry_id: str, reason: str,
                       fields: list[bytes]) -> dict[str, Any]:
    """The structured fields of a dead-letter log line (``extra=``)."""
    session = next((fields[i + 1] for i in range(0, len(fields) - 1, 2)
                    if fields[i] in (b"session", "session")), b"")
    session_id = session.decode("utf-8", "replace") if isinstance(session, bytes) else str(session)
    return {"session_id": session_id[:128] or None, "job_id": None, "kind": reason_kind(reason),
            "outcome": "dead_lettered", "duration_ms": None, "stream": stream,
            "entry_id": entry_id, "reason": reason}


def _shown(session_id: str | None) -> str:
    """An entry's session as a text log line shows it: a valid id as it is, anything else quoted
    (a producer's bad one may hold a line break), ``-`` when the entry has none."""
    if session_id is None:
        return "-"
    return session_id if SESSION_ID_RE.fullmatch(session_id) else repr(session_id)


_BREAKING = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def _one_line(reason: str) -> str:
    """A reason as a text log line shows it: its control characters escaped. It names the JSON keys
    and tool-call ids a producer chose: one holding a line break and an escape sequence forged a
    second log record, colours on the operator's terminal."""
    return _BREAKING.sub(lambda m: f"\\u{ord(m.group()):04x}", reason)


def runs(entries: list[Entry]) -> Iterator[list[Entry]]:
    """Consecutive entries sharing a cwd, each cut right after a ``turn_end``.

    One run is one ``SessionStore.apply``; cutting at a turn end means the
    thresholds are checked on the state exactly as it was after that turn.
    """
    run: list[Entry] = []
    for entry in entries:
        if run and entry.cwd != run[0].cwd:
            yield run
            run = []
        run.append(entry)
        if entry.event["type"] == "turn_end":
            yield run
            run = []
    if run:
        yield run
