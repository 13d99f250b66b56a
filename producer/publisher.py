"""The agent-side Python API: push a session's events into its stream shard.

Invariants:
- Nothing reaches Redis unless the session id, the cwd and *every* event of the
  call are valid (all or nothing); the error names the bad event's index and field.
  Valid means: each event alone (its schema, no value the log would change:
  ``events.checks.check_json``), then the batch as the watcher will apply it
  (no uuid twice, no turn going backwards: ``events.checks.check_batch``).
- One call is one ``MULTI``/``EXEC``: its entries land contiguously, in the
  order given, or not at all; sent twice (a redis-py client with ``retry`` resends a
  transaction whose reply was lost, as after a dropped connection or a ``socket_timeout``
  (``Redis(host=...)`` has one by default, ``Redis.from_url`` none); or the
  caller ``send``s a batch again after an error), its events are applied once:
  ``prepare`` gives each event without a ``uuid`` a random one, and the watcher
  dead-letters an event whose uuid its session already has. A call sent again
  by the caller (a new call: after a lost reply, say) is applied once when its
  events carry uuids, their own or derived from an ``idempotency_key``.
- Each entry has exactly the fields of SPEC §6 — ``session``, ``cwd`` and
  ``event`` (compact JSON of the validated event without ``sessionId``/``cwd``);
  ``docs/STREAM_PROTOCOL.md`` describes them for agents in other languages.
- The publisher never trims a stream: unconsumed entries are the watcher's to ack.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import redis
from pydantic import BaseModel

from compactor.applied import parse_stream_id
from compactor.keys import Keys
from compactor.redis_errors import connection_lost
from compactor.queue import check_bound_cwd, enqueue_compaction, redis_time_s, sync_clock
from events.config import Settings
from events.errors import InvalidEvent, InvalidInput
from events.log import session_log_path
from events.checks import check_batch, check_json
from events.models import parse_event, to_wire, validate_cwd, validate_session_id

logger = logging.getLogger(__name__)

# Keys the stream entry carries outside the event (SPEC §6).
IDENTITY_FIELDS = ("sessionId", "cwd")

EventLike = Mapping[str, Any] | BaseModel


@dataclass(frozen=True)
class PreparedBatch:
    """Events validated and encoded for one session, ready for ``Publisher.send``."""

    session_id: str
    cwd: str
    stream: str
    payloads: tuple[bytes, ...]
    events: tuple[dict[str, Any], ...] = ()  # the payloads' events, as the watcher will read them

    def without(self, indexes: set[int]) -> PreparedBatch:
        """The batch less the events at ``indexes`` (those a retry had published already)."""
        if not indexes:
            return self
        kept = [i for i in range(len(self.payloads)) if i not in indexes]
        return PreparedBatch(self.session_id, self.cwd, self.stream, tuple(self.payloads[i] for i in kept),
                             tuple(self.events[i] for i in kept))


class Publisher:
    """Validates events and XADDs them to ``Keys.stream_for(session_id)``.

    ``publish`` = ``send(prepare(...))``; an agent that builds its events ahead
    of time (or a load generator) can prepare them first and send them later.
    """

    def __init__(self, redis_client: redis.Redis, settings: Settings) -> None:
        if type(redis_client).__module__.startswith("redis.asyncio"):  # (its commands are coroutines: a
            # TypeError "'coroutine' object is not iterable" came from deep inside a publish)
            raise InvalidInput("redis_client", "Publisher needs a synchronous redis.Redis (from asyncio, make one "
                               "and call the publisher through asyncio.to_thread)")
        self.redis = redis_client
        self.settings = settings
        self.keys = Keys(settings.redis.prefix, settings.redis.shards)
        # session -> the stream id of its last event this publisher sent (the newest LAST_IDS_KEPT
        # sessions): what ``request_compaction`` asks its job to wait for
        self._last_ids: dict[str, str] = {}
        self._last_ids_lock = threading.Lock()

    def publish(self, session_id: str, cwd: str, events: EventLike | Sequence[EventLike], *,
                idempotency_key: str | None = None) -> list[str]:
        """Validate all events, then XADD them in one transaction; return their stream ids.
        ``idempotency_key``: see ``prepare``. A batch of more than ``limits.maxBodyBytes`` as JSON
        is refused, as the HTTP API refuses it (ten 4 MiB events in one transaction held every
        shard's watcher up for 18 s)."""
        batch = self.prepare(session_id, cwd, events, idempotency_key=idempotency_key)
        limit = self.settings.limits.max_body_bytes
        size = sum(len(payload) for payload in batch.payloads)  # (uuids and defaults in: within a few per cent
        if len(batch.payloads) > 1 and size > limit:  # of the API's body)
            raise InvalidInput("events", f"are {size} bytes as written to the stream, more than limits.maxBodyBytes "
                                         f"({limit}): publish them in smaller batches (each applied in order all the same)")
        return self.send(batch)

    def prepare(self, session_id: str, cwd: str, events: EventLike | Sequence[EventLike], *,
                idempotency_key: str | None = None) -> PreparedBatch:
        """Validate and encode the events (nothing is sent); raises like ``publish``. An event
        without a ``uuid`` gets a random one; with an ``idempotency_key``, one derived from the key,
        the session, its index in the batch and its content (``keyed_uuid``), so the same batch sent
        again under the same key (a retry after a lost reply) carries the same uuids and is applied
        once."""
        session_id = validate_session_id(session_id)
        cwd = validate_cwd(cwd, new=True)  # (as the watcher checks it: a control character in it was
        # published, then every entry dead-lettered)
        session_log_path(self.settings.data_dir, cwd, session_id)  # a cwd no log can live under: refused now
        if idempotency_key is not None:
            check_idempotency_key(idempotency_key)
        if isinstance(events, (Mapping, BaseModel)):
            batch = [events]
        elif isinstance(events, (str, bytes)) or not isinstance(events, Iterable):  # (None: a bare TypeError)
            raise InvalidInput("events", f"must be an event (a mapping or a pydantic model) or a sequence of "
                                         f"them, not {type(events).__name__}")
        else:
            batch = list(events)
        wires = tuple(self._wire(session_id, cwd, event, index) for index, event in enumerate(batch))
        key_digest = None if idempotency_key is None else batch_digest(wires)
        encoded = [self._encode(session_id, wire, index, idempotency_key, key_digest)
                   for index, wire in enumerate(wires)]
        check_batch(wires)
        return PreparedBatch(session_id, cwd, self.keys.stream_for(session_id),
                             tuple(payload for _, payload in encoded), wires)

    def send(self, batch: PreparedBatch) -> list[str]:
        """XADD a prepared batch in one transaction; its stream ids."""
        if not batch.payloads:
            return []
        pipe = self.redis.pipeline(transaction=True)
        _queue_xadds(pipe, batch)
        pipe.set(self.keys.bound(batch.session_id), batch.cwd, nx=True, ex=BOUND_TTL_S)
        ids = [_as_str(entry_id) for entry_id in pipe.execute()[:len(batch.payloads)]]
        logger.debug("published session=%s events=%d stream=%s last=%s",
                     batch.session_id, len(ids), batch.stream, ids[-1])
        self._sent(batch.session_id, ids)
        return ids

    def _sent(self, session_id: str, ids: list[str]) -> None:
        """Note the last of ``ids``, the session's events just sent (``request_compaction``'s wait)."""
        if not ids:
            return
        with self._last_ids_lock:
            self._last_ids.pop(session_id, None)  # (re-inserted: the newest last)
            self._last_ids[session_id] = ids[-1]
            if len(self._last_ids) > LAST_IDS_KEPT:
                del self._last_ids[next(iter(self._last_ids))]

    def send_unsent(self, batch: PreparedBatch, window_s: float) -> tuple[list[str], set[int]]:
        """``send`` the events of ``batch`` whose uuids no ``send_unsent`` published in the last
        ``window_s`` (a retry's, perhaps not applied yet), noting theirs in ``{p}:sent:{session}``
        (the newest ``SENT_KEPT`` per session) in the same transaction, which WATCHes that key: two
        identical batches sent at once publish one. The stream ids, and the indexes left out."""
        if len(batch.events) != len(batch.payloads):  # (a hand-built batch: Redis's DataError said nothing)
            raise ValueError("send_unsent needs the batch's events, their uuids: build it with prepare")
        key = self.keys.sent(batch.session_id)
        uuids = [event["uuid"] for event in batch.events]
        sync_clock(self.redis)  # (the window in Redis's time: an API whose clock was 11 minutes ahead
        # of another's published a retry again, and one behind pruned the others' records)
        unanswered: set[int] = set()  # the events of a transaction sent, its reply lost: perhaps published
        with self.redis.pipeline(transaction=True) as pipe:
            while True:
                attempted: set[int] = set()
                try:
                    pipe.watch(key)  # type: ignore[no-untyped-call]
                    now = redis_time_s()
                    scores = pipe.zmscore(key, uuids) if uuids else []
                    sent = {i for i, score in enumerate(scores) if score is not None and float(score) > now - window_s}
                    if sent & unanswered:  # (perhaps its own: said duplicates, a batch published whole
                        # was answered accepted 0, with no stream id)
                        pipe.reset()
                        raise redis.ConnectionError(
                            "Redis did not answer the transaction publishing the batch, and its events are "
                            "found sent since: it may have taken them; send the batch again as it was")
                    fresh = batch.without(sent)
                    pipe.multi()
                    _queue_xadds(pipe, fresh)
                    if fresh.payloads:
                        # (only those that can stay: a batch's 94 000 uuids added, then trimmed to the newest
                        # SENT_KEPT, held Redis, the API's /healthz and every other client with it, 0.17 s)
                        pipe.zadd(key, {event["uuid"]: now for event in fresh.events[-SENT_KEPT:]})
                        pipe.zremrangebyscore(key, "-inf", f"({now - window_s}")
                        pipe.zremrangebyrank(key, 0, -SENT_KEPT - 1)
                        pipe.expire(key, int(window_s) + 1)
                        pipe.set(self.keys.bound(batch.session_id), batch.cwd, nx=True, ex=BOUND_TTL_S)
                    attempted = set(range(len(uuids))) - sent
                    replies = pipe.execute()
                    ids = [_as_str(entry_id) for entry_id in replies[:len(fresh.payloads)]]
                    self._sent(batch.session_id, ids)
                    return ids, sent
                except redis.WatchError as e:  # (another send to the session meanwhile: look again)
                    # redis-py says a connection lost while watching a WatchError too: the EXEC's (sent,
                    # its reply not read: a socket timeout while Redis stalled) leaves its events unsure
                    if connection_lost(e):
                        unanswered |= attempted
                    continue

    def end_turn(
        self, session_id: str, cwd: str, turn_id: int, model: str, context_window: int | None = None, *,
        idempotency_key: str | None = None,
    ) -> str:
        """Publish the ``turn_end`` of ``turn_id``; the watcher checks the thresholds after it.
        ``idempotency_key``: as ``publish``'s (a retry of the call is applied once)."""
        event: dict[str, Any] = {"type": "turn_end", "turnId": turn_id, "model": model}
        if context_window is not None:
            event["contextWindow"] = context_window
        try:
            return self.publish(session_id, cwd, event, idempotency_key=idempotency_key)[0]
        except InvalidInput as e:  # (named as its argument: "events[0].turnId" named no argument of this call)
            argument = _END_TURN_ARGUMENTS.get(e.field) if e.index == 0 else None
            if argument is None:
                raise
            raise type(e)(argument, e.reason) from e  # (the same class: InvalidEvent is caught as such)

    def request_compaction(self, session_id: str, cwd: str, forced: bool = True, *,
                           after: str | None = None) -> str | None:
        """Request an LLM compaction; the job id. ``forced`` (the default): the forced job that
        answers it, queued now or waiting for the session's pending job (never None); not forced:
        None when a job is already pending (the request is coalesced into it). A forced job first
        waits for the watcher to apply stream entry ``after`` (by default the last event of the
        session this publisher sent), up to ``worker.jobs.after_wait_s``: it compacts the events
        sent before the request (queued right after a new session's first events, it had run
        before the watcher wrote the log). The session's log
        is not looked for (a producer need not see the data dir, and its first events may still
        wait in the stream): a job for a session with no log fails ``SessionNotFound``, where the
        HTTP API's ``compact`` answers 404 first."""
        session_id = validate_session_id(session_id)
        cwd = validate_cwd(cwd)  # (no events come in: a session logged before the control-character rule is one)
        session_log_path(self.settings.data_dir, cwd, session_id)  # a cwd no log can live under: refused now
        if not forced:  # (a forced request checks the binding where it claims the session; a job under
            check_bound_cwd(self.redis, self.settings, session_id, cwd)  # another spelling only failed later)
        if self.redis.get_connection_kwargs().get("decode_responses"):  # (refused before anything is written:
            # RQ's job hash fails to decode after the job was created and recorded as the session's trigger)
            raise InvalidInput("redis_client", "request_compaction needs a Redis client made with "
                               "decode_responses=False: RQ stores its jobs pickled (publish takes either)")
        if after is not None:
            parse_stream_id(after, "after")
        else:
            with self._last_ids_lock:
                after = self._last_ids.get(session_id)
        return enqueue_compaction(self.redis, self.settings, session_id, cwd, "llm", forced=forced, after=after)

    def _wire(self, session_id: str, cwd: str, event: object, index: int) -> dict[str, Any]:
        """The event as sent: validated, its identity fields checked and dropped (no uuid added)."""
        try:
            data = _as_data(event)
            check_json(data)  # orjson would write NaN as null
            wire = to_wire(parse_event(data))
            _check_identity(wire, session_id, cwd)
        except InvalidInput as e:
            raise e.at(index) from e
        if wire.get("uuid") is None:  # (none, or null: the watcher would derive one from the entry id)
            wire.pop("uuid", None)
        return wire

    def _encode(self, session_id: str, wire: dict[str, Any], index: int, idempotency_key: str | None,
                key_digest: str | None) -> tuple[dict[str, Any], bytes]:
        """The event as sent, a uuid given when it has none, and the entry's ``event`` field,
        size-limited. ``key_digest``: the batch's ``batch_digest`` when it is sent under a key."""
        added = "uuid" not in wire  # (46 bytes the watcher reads too)
        # (the watcher would derive one from the entry id: a resent entry has another id, so the
        # resent copy was applied as a second event)
        if added:
            wire["uuid"] = str(uuid.uuid4() if idempotency_key is None or key_digest is None else
                               keyed_uuid(session_id, idempotency_key, index, key_digest))
        try:
            payload = orjson.dumps(wire)
        except TypeError as e:  # orjson: a value JSON cannot hold
            raise _unwritable(e, index) from e
        limit = self.settings.limits.max_event_bytes
        if len(payload) > limit:  # (as JSON: its escapes counted, a text's line breaks two bytes each)
            by_uuid = added and len(payload) - len(f',"uuid":"{wire["uuid"]}"') <= limit
            raise InvalidEvent("event", f"is {len(payload)} bytes as JSON, more than limits.maxEventBytes ({limit})"
                               + (" with the uuid it was given" if by_uuid else ""), index)
        return wire, payload


IDEMPOTENCY_KEY_MAX = 255
_END_TURN_ARGUMENTS = {"turnId": "turn_id", "model": "model", "contextWindow": "context_window"}
SENT_KEPT = 10_000  # uuids send_unsent remembers per session, at most (the newest)
BOUND_TTL_S = 600  # how long a session's first published cwd is kept for the API's check (Keys.bound)
LAST_IDS_KEPT = 10_000  # sessions whose last sent stream id a publisher remembers (the newest)


def batch_digest(wires: Sequence[dict[str, Any]]) -> str:
    """The hex sha256 of a batch's events as written to the stream, in order, without their
    ``timestamp`` (a retry may stamp them again) and without the uuids given to them
    (``keyed_uuid``): compact JSON with sorted keys, one event per line."""
    digest = hashlib.sha256()
    for index, wire in enumerate(wires):
        content = {name: value for name, value in wire.items() if name != "timestamp"}
        try:
            digest.update(orjson.dumps(content, option=orjson.OPT_SORT_KEYS) + b"\n")
        except TypeError as e:  # orjson: a value JSON cannot hold
            raise _unwritable(e, index) from e
    return digest.hexdigest()


MAX_JSON_DEPTH = 254  # the most nested objects and lists orjson writes (its recursion limit past it)


def _unwritable(error: TypeError, index: int) -> InvalidEvent:
    """orjson's refusal to write an event, named: "Recursion limit reached" says no limit."""
    if "Recursion limit" in str(error):
        return InvalidEvent("event", f"is nested too deeply to be written as JSON ({MAX_JSON_DEPTH} levels at most)",
                            index)
    return InvalidEvent("event", f"is not JSON-serialisable: {error}", index)


def keyed_uuid(session_id: str, key: str, index: int, digest: str) -> uuid.UUID:
    """The uuid of the event at ``index`` of a batch sent under idempotency ``key``, whose
    ``batch_digest`` is ``digest``: a resent batch gets the same uuids (applied once), and a key
    reused for another batch (one per turn, say) other ones, for all its events. (Derived from the
    key and the index alone, that batch was dropped as duplicates of the first, after ``publish``
    had returned its stream ids; from each event's own content, an event of the second batch equal
    to the first's at the same place, a user's "yes", was.)"""
    return uuid.uuid5(uuid.NAMESPACE_URL, f"compactor:{session_id}:{key}:{index}:{digest}")


def check_idempotency_key(key: str, field: str = "idempotency_key") -> None:
    """An idempotency key: 1 to 255 printable ASCII characters (an HTTP header's value); the
    error names ``field`` (the API's: ``Idempotency-Key``)."""
    if not isinstance(key, str):  # (``idempotency_key=17``: a bare TypeError from len)
        raise InvalidInput(field, f"must be a string, not {type(key).__name__}")
    if not 1 <= len(key) <= IDEMPOTENCY_KEY_MAX or not all("!" <= c <= "~" for c in key):
        raise InvalidInput(field, f"must be 1 to {IDEMPOTENCY_KEY_MAX} printable ASCII characters without spaces")


def _queue_xadds(pipe: Any, batch: PreparedBatch) -> None:
    """Queue one XADD per event of ``batch`` on ``pipe`` (SPEC §6's three fields)."""
    for payload in batch.payloads:
        pipe.xadd(batch.stream, {"session": batch.session_id, "cwd": batch.cwd, "event": payload})


def _check_identity(wire: dict[str, Any], session_id: str, cwd: str) -> None:
    """Drop ``sessionId``/``cwd`` from the event; they must match the entry's when present."""
    expected = {"sessionId": session_id, "cwd": cwd}
    for field in IDENTITY_FIELDS:
        if field in wire and wire.pop(field) != expected[field]:
            raise InvalidEvent(field, f"differs from the {field} the events are published for")


def _as_data(event: object) -> object:
    """A plain dict for a model or a mapping; anything else as it is (parse_event rejects it).
    A model gives the values it holds: the fields it was given, a null one too (as a dict does:
    SPEC §3 keeps unknown fields as they are; ``exclude_none`` dropped ``extra=None`` and sent
    ``content=None`` as ""), and its defaults but a null one (``exclude_unset`` dropped a
    ``contextWindow: int = 32000`` and a ``type: Literal["user"] = "user"``: the window became
    litellm's, the event was refused for its type)."""
    if isinstance(event, BaseModel):
        given = event.model_dump(by_alias=True, exclude_unset=True)  # (nested: what they were given too)
        return {**given, **{key: value for key, value in event.model_dump(by_alias=True).items()
                            if key not in given and value is not None}}
    if isinstance(event, Mapping):
        return dict(event)
    return event


def _as_str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
