from __future__ import annotations

import re
import uuid
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from compactor.keys import Keys
from compactor.queue import parse_job_id, pending_job_id
from events.config import Settings
from events.errors import InvalidEvent, InvalidInput
from events.log import session_log_path
from events.models import AssistantEvent, UserEvent
from producer.publisher import Publisher
from producer.watcher import Watcher
from tests.producer.conftest import CWD, drain, log_lines, turn_end, user


def entries(r: redis.Redis, settings: Settings, session_id: str) -> list[dict[bytes, bytes]]:
    stream = Keys(settings.redis.prefix, settings.redis.shards).stream_for(session_id)
    return [fields for _, fields in r.xrange(stream)]


def without_uuid(event: dict[str, Any]) -> dict[str, Any]:
    """The event without the uuid ``prepare`` gave it (a random one: see test_a_batch_sent_twice...)."""
    assert isinstance(event.pop("uuid"), str)
    return event


def test_publish_xadds_session_cwd_and_compact_event_json(r: redis.Redis, settings: Settings) -> None:
    ids = Publisher(r, settings).publish("s1", CWD, [user(1), turn_end(1, window=1000)])
    assert len(ids) == 2 and ids[0] < ids[1]
    [first, second] = entries(r, settings, "s1")
    assert set(first) == {b"session", b"cwd", b"event"}
    assert first[b"session"] == b"s1" and first[b"cwd"] == CWD.encode()
    user_event, end_event = orjson.loads(first[b"event"]), orjson.loads(second[b"event"])
    assert user_event == {"type": "user", "turnId": 1, "content": "hello world", "uuid": user_event["uuid"]}
    assert first[b"event"] == orjson.dumps(user_event)  # compact JSON
    assert end_event == {"type": "turn_end", "turnId": 1, "model": "gpt-4", "contextWindow": 1000,
                         "uuid": end_event["uuid"]}
    assert str(uuid.UUID(user_event["uuid"])) == user_event["uuid"] != end_event["uuid"]


def test_a_batch_sent_twice_is_applied_once(r: redis.Redis, fast: Settings) -> None:
    """redis-py resends a transaction whose reply was lost (a dropped connection, a socket
    timeout), and publish returned normally: each event was applied twice, as the watcher derives
    a missing uuid from the entry id and the copy's entries have other ids. Now the copy's events
    carry the same uuids as the original's, and are dead-lettered."""
    publisher = Publisher(r, fast)
    batch = publisher.prepare("s1", CWD, [user(1), {"type": "assistant", "turnId": 1, "content": "on it"}])
    publisher.send(batch)
    publisher.send(batch)  # the resend (mid-turn: no turn_end refuses it as going backwards)
    drain(Watcher(r, fast, name="w"), r, fast)
    assert [line["type"] for line in log_lines(fast, "s1")] == ["user", "assistant"]
    letters = [fields for _, fields in r.xrange(Keys().dead)]
    assert len(letters) == 2 and all(b"duplicates an event already in this session" in f[b"reason"] for f in letters)


def test_request_compaction_with_a_decoding_client_is_refused_before_anything_is_written(
        redis_url: str, r: redis.Redis, settings: Settings) -> None:
    """RQ's job hash failed to decode after the forced job was created and recorded as the
    session's trigger (``forced:{id}``, with no expiry)."""
    Publisher(r, settings).publish("s1", CWD, user(1))
    decoding = redis.Redis.from_url(redis_url, decode_responses=True)
    with pytest.raises(InvalidInput, match="^redis_client: request_compaction needs a Redis client made with "
                                          "decode_responses=False"):
        Publisher(decoding, settings).request_compaction("s1", CWD)
    assert not [key for key in r.scan_iter() if b"retrigger" in key or key.startswith(b"rq:job:")]


def test_publish_accepts_a_single_event_and_a_model(r: redis.Redis, settings: Settings) -> None:
    publisher = Publisher(r, settings)
    assert len(publisher.publish("s1", CWD, user(1))) == 1
    assert len(publisher.publish("s1", CWD, UserEvent(type="user", turn_id=1, content="x"))) == 1
    assert [orjson.loads(e[b"event"])["content"] for e in entries(r, settings, "s1")] == ["hello world", "x"]


def test_publish_keeps_unknown_fields_and_producer_uuid(r: redis.Redis, settings: Settings) -> None:
    Publisher(r, settings).publish("s1", CWD, {**user(1), "uuid": "u-1", "extra": {"a": 1}})
    event = orjson.loads(entries(r, settings, "s1")[0][b"event"])
    assert event["uuid"] == "u-1" and event["extra"] == {"a": 1}


def test_publish_is_all_or_nothing_and_names_index_and_field(r: redis.Redis, settings: Settings) -> None:
    bad: dict[str, Any] = {"type": "user", "turnId": "2", "content": "x"}
    with pytest.raises(InvalidEvent) as caught:
        Publisher(r, settings).publish("s1", CWD, [user(1), bad])
    assert caught.value.index == 1 and caught.value.field == "turnId"
    assert "events[1].turnId" in str(caught.value)
    assert entries(r, settings, "s1") == []


@pytest.mark.parametrize("event, field", [
    ({"type": "nope"}, "type"),
    ([1, 2], "event"),
    ({"type": "user", "turnId": 1}, "content"),
    ({"type": "user", "turnId": 1, "content": "x", "sessionId": "other"}, "sessionId"),
    ({"type": "user", "turnId": 1, "content": "x", "cwd": "/elsewhere"}, "cwd"),
])
def test_publish_rejects_bad_events(r: redis.Redis, settings: Settings, event: Any, field: str) -> None:
    with pytest.raises(InvalidEvent) as caught:
        Publisher(r, settings).publish("s1", CWD, [event])
    assert caught.value.field == field and caught.value.index == 0


@pytest.mark.parametrize("batch, index, field, fragment", [
    ([{"type": "user", "turnId": 1, "content": "x", "score": float("nan")}], 0, "score", "finite number"),
    ([{"type": "user", "turnId": 1, "content": "x", "big": 2**70}], 0, "big", "64-bit"),
    ([{"type": "user", "turnId": 1, "content": "a", "uuid": "u"},
      {"type": "user", "turnId": 1, "content": "b", "uuid": "u"}], 1, "uuid", "duplicates events[0]"),
    ([{"type": "turn_end", "turnId": 2, "model": "m"}, {"type": "user", "turnId": 1, "content": "late"}],
     1, "turnId", "goes backwards"),
], ids=["nan", "65-bit int", "uuid twice", "turn backwards"])
def test_publish_refuses_what_the_log_would_change_or_the_watcher_half_apply(
    r: redis.Redis, settings: Settings, batch: list[dict[str, Any]], index: int, field: str, fragment: str,
) -> None:
    """The Python client gets the API's checks: orjson wrote NaN as null, and a batch with a uuid
    twice or a turn going backwards was published and then partly dead-lettered."""
    with pytest.raises(InvalidEvent) as caught:
        Publisher(r, settings).publish("s1", CWD, batch)
    assert (caught.value.index, caught.value.field) == (index, field) and fragment in str(caught.value)
    assert entries(r, settings, "s1") == []


@pytest.mark.parametrize("extra, field, kind", [
    ({"x": {"deep": [1, Decimal(1)]}}, "x.deep[1]", "Decimal"),  # "events[0].event: is not JSON-serialisable"
    ({"when": datetime(2024, 1, 1)}, "when", "datetime"),  # written as a string, silently, its zone lost
    ({"raw": b"x"}, "raw", "bytes"),
    ({"tags": {"a"}}, "tags", "set"),
])
def test_a_python_value_json_cannot_hold_is_refused_naming_its_field(
        r: redis.Redis, settings: Settings, extra: dict[str, Any], field: str, kind: str) -> None:
    with pytest.raises(InvalidEvent, match=rf"^events\[0\]\.{re.escape(field)}: is a Python {kind}, not a JSON value"):
        Publisher(r, settings).publish("s1", CWD, {**user(1), **extra})
    with pytest.raises(InvalidEvent, match=r"^events\[0\]\.k: has a key 1 that is not a string$"):
        Publisher(r, settings).publish("s1", CWD, {**user(1), "k": {1: "a"}})
    Publisher(r, settings).publish("s1", CWD, {**user(1), "pair": (1, 2)})  # a tuple is a list
    assert orjson.loads(entries(r, settings, "s1")[0][b"event"])["pair"] == [1, 2]


def test_publish_drops_matching_session_id_and_cwd_from_the_event(r: redis.Redis, settings: Settings) -> None:
    meta = {"type": "session_meta", "sessionId": "s1", "cwd": CWD, "model": "gpt-4"}
    Publisher(r, settings).publish("s1", CWD, meta)
    assert without_uuid(orjson.loads(entries(r, settings, "s1")[0][b"event"])) == {"type": "session_meta", "model": "gpt-4"}


@pytest.mark.parametrize("session_id, cwd, field", [
    ("bad id", CWD, "sessionId"), ("-lead", CWD, "sessionId"), ("s1", "relative/dir", "cwd"), ("s1", "", "cwd"),
    # absolute, but no log can live under them: the watcher would dead-letter every event
    ("s1", "/", "cwd"), ("s1", "/..", "cwd"), ("s1", "/" + "d" * 300, "cwd"),
    # a control character: published, then every entry dead-lettered by the watcher
    ("s1", "/home/me/a\tb", "cwd"), ("s1", "/home/me/\x1b[31m", "cwd"), ("s1", "/home/me/a\x85", "cwd"),
])
def test_publish_rejects_bad_session_id_or_cwd(
    r: redis.Redis, settings: Settings, session_id: str, cwd: str, field: str
) -> None:
    with pytest.raises(InvalidEvent) as caught:
        Publisher(r, settings).publish(session_id, cwd, [user(1)])
    assert caught.value.field == field
    assert r.keys("*") == []


def test_publish_rejects_an_event_over_max_event_bytes(r: redis.Redis, settings: Settings) -> None:
    small = settings.model_copy(update={"limits": settings.limits.model_copy(update={"max_event_bytes": 1024})})
    publisher = Publisher(r, small)
    publisher.publish("s1", CWD, user(1, "x" * 900))
    with pytest.raises(InvalidEvent) as caught:
        publisher.publish("s1", CWD, [user(1), user(1, "x" * 1100)])
    assert caught.value.index == 1 and "maxEventBytes" in str(caught.value)
    assert len(entries(r, settings, "s1")) == 1
    # over the limit only by the uuid the publisher gave it: said so (the same event with a short uuid
    # of its own fits)
    near = {**user(2, "x"), "content": "x" * (1024 - len(orjson.dumps({**user(2, ""), "toolCalls": []})) - 30)}
    with pytest.raises(InvalidEvent, match=r"\(1024\) with the uuid it was given$"):
        publisher.publish("s1", CWD, near)
    assert publisher.publish("s1", CWD, {**near, "uuid": "u2"})
    # over by its escapes, far beyond a uuid: the uuid is not blamed
    with pytest.raises(InvalidEvent, match=r"bytes as JSON, more than limits.maxEventBytes \(1024\)$"):
        publisher.publish("s1", CWD, user(3, "\n" * 700))


def test_publish_refuses_a_batch_the_api_would_refuse(r: redis.Redis, settings: Settings) -> None:
    """No batch limit: ten 4 MiB events went in one transaction (the API refuses such a body, 413),
    and every shard's watcher waited 18 s behind it."""
    small = settings.model_copy(update={"limits": settings.limits.model_copy(
        update={"max_event_bytes": 1024, "max_body_bytes": 4096})})
    publisher = Publisher(r, small)
    with pytest.raises(InvalidInput, match=r"^events: are \d+ bytes as written to the stream, more than limits.maxBodyBytes"):
        publisher.publish("s1", CWD, [user(1, "x" * 900) for _ in range(6)])
    assert entries(r, settings, "s1") == []
    assert len(publisher.publish("s1", CWD, [user(1, "x" * 900) for _ in range(3)])) == 3


def test_end_turn_names_its_own_arguments(r: redis.Redis, settings: Settings) -> None:
    """It said ``events[0].turnId``: the call has no events."""
    publisher = Publisher(r, settings)
    with pytest.raises(InvalidEvent, match=r"^turn_id: "):  # (the class callers caught it as)
        publisher.end_turn("s1", CWD, 0, "gpt-4o")
    with pytest.raises(InvalidInput, match=r"^context_window: "):
        publisher.end_turn("s1", CWD, 1, "gpt-4o", context_window=0)


def test_end_turn_publishes_a_turn_end(r: redis.Redis, settings: Settings) -> None:
    Publisher(r, settings).end_turn("s1", CWD, 3, "gpt-4o", context_window=5000)
    Publisher(r, settings).end_turn("s1", CWD, 4, "gpt-4o")
    events = [without_uuid(orjson.loads(e[b"event"])) for e in entries(r, settings, "s1")]
    assert events == [
        {"type": "turn_end", "turnId": 3, "model": "gpt-4o", "contextWindow": 5000},
        {"type": "turn_end", "turnId": 4, "model": "gpt-4o"},
    ]


def test_request_compaction_enqueues_a_forced_llm_job(r: redis.Redis, settings: Settings) -> None:
    job_id = Publisher(r, settings).request_compaction("s1", CWD)
    assert job_id is not None and parse_job_id(job_id)[1:] == ("llm", "s1")  # type: ignore[index]
    import rq

    assert job_id in rq.Queue(settings.redis.prefix, connection=r).job_ids


def test_request_compaction_unforced_coalesces_while_one_is_pending(r: redis.Redis, settings: Settings) -> None:
    publisher = Publisher(r, settings)
    first = publisher.request_compaction("s1", CWD, forced=False)
    assert first is not None and pending_job_id(r, settings, "s1") == first
    assert publisher.request_compaction("s1", CWD, forced=False) is None


def test_request_compaction_validates_the_session(r: redis.Redis, settings: Settings) -> None:
    with pytest.raises(InvalidEvent):
        Publisher(r, settings).request_compaction("../etc", CWD)


@pytest.mark.parametrize("forced", [True, False])
def test_request_compaction_refuses_another_spelling_of_the_cwd_and_a_cwd_no_log_can_have(
        r: redis.Redis, settings: Settings, forced: bool) -> None:
    """Unforced, a cwd the session is not bound to (or ``/``, which no log can live under) was
    queued, and its job failed later ("no log for session ...", "encodes to the unusable directory
    name"); forced, the binding was checked. Both refuse both now, naming the cwd."""
    publisher = Publisher(r, settings)
    publisher.publish("s1", CWD, [user(1), turn_end(1)])
    drain(Watcher(r, settings, name="w"), r, settings)
    for cwd, why in ((CWD + "/", "is bound to cwd"), ("/", "unusable directory name")):
        with pytest.raises(InvalidInput, match=why) as refused:
            publisher.request_compaction("s1", cwd, forced=forced)
        assert refused.value.field == "cwd"
    assert pending_job_id(r, settings, "s1") is None


def test_a_session_logged_under_a_cwd_with_a_control_character_is_still_compacted_not_sent_events(
        r: redis.Redis, settings: Settings) -> None:
    """A cwd with a tab was valid before the control-character rule: its session's log stays
    readable and compactable (by the API, the CLI and the publisher alike), though no event of it
    can come in any more (the watcher refuses it, so the publisher does)."""
    legacy = "/srv/proj\tlegacy"
    path = session_log_path(settings.data_dir, legacy, "s1")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps({"type": "user", "turnId": 1, "content": "hi",
                                   "uuid": "00000000-0000-4000-8000-000000000001"}) + b"\n")
    publisher = Publisher(r, settings)
    assert publisher.request_compaction("s1", legacy, forced=True)
    with pytest.raises(InvalidEvent, match="control character"):
        publisher.publish("s1", legacy, [user(2)])


def test_publish_keeps_unknown_fields_whose_value_is_null(r: redis.Redis, settings: Settings) -> None:
    """SPEC §3: unknown extra fields are kept as they are, null included (here and in a tool call);
    an optional field nobody sent is still left out."""
    assistant = {"type": "assistant", "turnId": 1, "content": None, "note": None,
                 "toolCalls": [{"id": "c1", "name": "read_file", "arguments": {"path": None}, "hint": None}]}
    Publisher(r, settings).publish("s1", CWD, [{**user(1), "extra": None}, assistant, turn_end(1)])
    first, second, third = [orjson.loads(e[b"event"]) for e in entries(r, settings, "s1")]
    assert first["extra"] is None and "extra" in first
    assert second["content"] is None and second["note"] is None and "note" in second
    assert second["toolCalls"] == [{"id": "c1", "name": "read_file", "arguments": {"path": None}, "hint": None}]
    assert "contextWindow" not in third and "usage" not in second


def test_a_model_is_published_as_the_same_event_as_a_dict(r: redis.Redis, settings: Settings) -> None:
    """A model's null fields were dropped (``exclude_none``): an extra ``None`` vanished and
    ``content=None`` was sent as "", where the same event as a dict kept both."""
    as_dict = {"type": "assistant", "turnId": 1, "content": None, "note": None,
               "toolCalls": [{"id": "c1", "name": "read_file", "arguments": {"path": "/a"}, "hint": None}]}
    publisher = Publisher(r, settings)
    publisher.publish("s1", CWD, as_dict)
    publisher.publish("s1", CWD, AssistantEvent.model_validate(as_dict))
    publisher.publish("s1", CWD, UserEvent(type="user", turn_id=1, content="x", extra=None))
    from_dict, from_model, user_model = [without_uuid(orjson.loads(e[b"event"])) for e in entries(r, settings, "s1")]
    assert from_model == from_dict and from_model["content"] is None and from_model["note"] is None
    assert user_model == {"type": "user", "turnId": 1, "content": "x", "extra": None}


@pytest.mark.parametrize("events", [None, 7, "user"])
def test_publish_of_no_event_nor_sequence_names_the_argument(r: redis.Redis, settings: Settings, events: Any) -> None:
    """``publish(s, cwd, None)`` raised a bare TypeError (and a string was taken for its characters)."""
    with pytest.raises(InvalidInput, match="^events: must be an event") as refused:
        Publisher(r, settings).publish("s1", CWD, events)
    assert refused.value.field == "events"


def test_a_models_defaults_are_published_as_the_values_it_holds(r: redis.Redis, settings: Settings) -> None:
    """A producer's own model was dumped with ``exclude_unset``: a ``contextWindow`` default was not
    sent (the session's window became another), and a ``type`` default made the event refused for
    its type. A default of None is still left out, as a field nobody sent."""
    from typing import Literal

    from pydantic import BaseModel

    class User(BaseModel):
        type: Literal["user"] = "user"
        turnId: int
        content: str
        note: str | None = None

    class TurnEnd(BaseModel):
        type: Literal["turn_end"] = "turn_end"
        turnId: int
        model: str
        contextWindow: int = 32_000

    Publisher(r, settings).publish("s1", CWD, [User(turnId=1, content="hi"), TurnEnd(turnId=1, model="gpt-4o")])
    sent = [without_uuid(orjson.loads(e[b"event"])) for e in entries(r, settings, "s1")]
    assert sent == [{"type": "user", "turnId": 1, "content": "hi"},
                    {"type": "turn_end", "turnId": 1, "model": "gpt-4o", "contextWindow": 32_000}]


def test_a_call_repeated_under_its_idempotency_key_is_applied_once(r: redis.Redis, settings: Settings) -> None:
    """Random uuids make a batch redis-py resends apply once, but not a call the agent makes again
    after an error: its events got new uuids, and were applied twice."""
    publisher = Publisher(r, settings)
    batch = [user(1, "hello"), turn_end(1)]
    publisher.publish("s1", CWD, batch, idempotency_key="req-1")
    publisher.publish("s1", CWD, batch, idempotency_key="req-1")  # the retry
    publisher.publish("s1", CWD, [user(2, "hello"), turn_end(2)], idempotency_key="req-2")
    sent = [orjson.loads(e[b"event"])["uuid"] for e in entries(r, settings, "s1")]
    assert sent[:2] == sent[2:4] and len(set(sent[2:])) == 4
    drain(Watcher(r, settings, name="w"), r, settings)
    assert [(line["type"], line["turnId"]) for line in log_lines(settings, "s1")] == [
        ("user", 1), ("turn_end", 1), ("user", 2), ("turn_end", 2)]
    # a key reused for another batch (one key per turn number, say): its events are new ones, not
    # duplicates of the first batch's (they were dead-lettered after publish returned their ids)
    lettered = r.xlen(Keys(settings.redis.prefix, settings.redis.shards).dead)  # (the retry's two)
    publisher.publish("s1", CWD, [user(3, "again"), turn_end(3)], idempotency_key="req-1")
    # a retry that stamps its events again is still the same batch
    stamped = [{**user(4, "stamped"), "timestamp": stamp} for stamp in ("2026-12-03T00:00:00Z", "2026-12-03T00:00:09Z")]
    publisher.publish("s1", CWD, [stamped[0]], idempotency_key="req-4")
    publisher.publish("s1", CWD, [stamped[1]], idempotency_key="req-4")
    drain(Watcher(r, settings, name="w"), r, settings)
    assert [(line["type"], line["turnId"]) for line in log_lines(settings, "s1")][4:] == [
        ("user", 3), ("turn_end", 3), ("user", 4)]
    assert r.xlen(Keys(settings.redis.prefix, settings.redis.shards).dead) == lettered + 1  # the re-stamped retry
    with pytest.raises(InvalidInput, match="^idempotency_key: must be"):  # (the argument, not the API's header)
        publisher.publish("s1", CWD, batch, idempotency_key="two words")
    with pytest.raises(InvalidInput, match="^idempotency_key: must be a string, not int$"):  # (a bare TypeError)
        publisher.publish("s1", CWD, batch, idempotency_key=17)  # type: ignore[arg-type]


def test_the_readme_python_example_runs_and_its_client_resends_a_lost_reply(
        r: redis.Redis, settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's example, run as written: its client (``Redis.from_url``) had no retries, while
    the README said redis-py resends a transaction whose reply was lost."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    [example] = re.findall(r"```python\n(.*?)```", readme.split("Python agents use", 1)[1], re.S)[:1]
    monkeypatch.chdir(tmp_path)  # (no ./codingcode.yaml: the defaults and the environment)
    monkeypatch.setenv("REDIS_URL", settings.redis.url)
    monkeypatch.setenv("COMPACTION_DATA_DIR", str(tmp_path / "data"))
    namespace: dict[str, Any] = {}
    exec(compile(example, "README.md", "exec"), namespace)
    sent = [orjson.loads(fields[b"event"])["type"] for _, fields in r.xrange(Keys().stream_for("s-42"))]
    assert sent == ["user", "turn_end"]
    assert parse_job_id(namespace["job_id"]) is not None
    assert namespace["client"].connection_pool.make_connection().retry.get_retries() >= 1


def test_an_asyncio_client_is_refused_when_the_publisher_is_made(settings: Settings) -> None:
    """Its commands are coroutines: a publish failed deep inside with "'coroutine' object is not
    iterable" (or an "Unknown type" from redis-py)."""
    import redis.asyncio

    with pytest.raises(InvalidInput, match="^redis_client: Publisher needs a synchronous redis.Redis"):
        Publisher(redis.asyncio.Redis.from_url(settings.redis.url), settings)


def test_a_key_reused_for_another_batch_gives_all_its_events_new_uuids(r: redis.Redis, settings: Settings) -> None:
    """A key reused for another batch whose first event equals the first batch's (a user's "yes"
    in the same turn): each uuid was derived from its own event's content, so that event got the
    first batch's uuid and the second "yes" was dropped as its duplicate, half the batch lost."""
    publisher = Publisher(r, settings)
    assistant = {"type": "assistant", "turnId": 1}
    first = publisher.publish("s1", CWD, [user(1, "yes"), {**assistant, "content": "ok 1"}], idempotency_key="t1")
    again = publisher.publish("s1", CWD, [user(1, "yes"), {**assistant, "content": "ok 1"}], idempotency_key="t1")
    other = publisher.publish("s1", CWD, [user(1, "yes"), {**assistant, "content": "ok 2"}], idempotency_key="t1")
    sent = [orjson.loads(e[b"event"])["uuid"] for e in entries(r, settings, "s1")]
    assert len(first) == len(again) == len(other) == 2
    assert sent[:2] == sent[2:4] and not set(sent[4:]) & set(sent[:4])  # the retry the same; the other batch new
    drain(Watcher(r, settings, name="w"), r, settings)
    assert [line.get("content") for line in log_lines(settings, "s1")] == ["yes", "ok 1", "yes", "ok 2"]
    # an event too deep for the encoder: the error says so, and its limit (orjson said "Recursion limit reached")
    deep: Any = "x"
    for _ in range(300):
        deep = [deep]
    with pytest.raises(InvalidEvent, match=r"^events\[1\]\.event: is nested too deeply to be written as JSON \(254"):
        publisher.publish("s1", CWD, [user(2, "a"), {**user(2, "b"), "extra": deep}], idempotency_key="t2")


def test_end_turn_under_an_idempotency_key_is_applied_once_when_retried(r: redis.Redis, settings: Settings) -> None:
    """A retried ``end_turn`` (a lost reply) was a second ``turn_end`` with a random uuid, dead-lettered
    as "turnId goes backwards"; under its key it is the same event, dropped as a resend."""
    publisher = Publisher(r, settings)
    publisher.publish("s1", CWD, user(1))
    first = publisher.end_turn("s1", CWD, 1, "gpt-4o", idempotency_key="t1")
    again = publisher.end_turn("s1", CWD, 1, "gpt-4o", idempotency_key="t1")
    assert first != again
    uuids = [orjson.loads(e[b"event"])["uuid"] for e in entries(r, settings, "s1")]
    assert uuids[1] == uuids[2]
    drain(Watcher(r, settings, name="w"), r, settings)
    assert [line["type"] for line in log_lines(settings, "s1")] == ["user", "turn_end"]
    [letter] = [fields for _, fields in r.xrange(Keys(settings.redis.prefix, settings.redis.shards).dead)]
    assert b"duplicates an event already in this session" in letter[b"reason"]


def test_the_window_of_sent_uuids_is_kept_in_redis_time(r: redis.Redis, settings: Settings,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each API scored the uuids it sent by its own host's clock: a retry sent to an API 11 minutes
    ahead of the first was published again (then dead-lettered as a duplicate uuid), and one behind
    pruned the others' records. The scores are Redis's time (the offset measured once a minute)."""
    from compactor import queue as queue_module

    monkeypatch.setattr(queue_module, "_clock_offset_ns", 0)
    monkeypatch.setattr(queue_module, "_clock_synced_at", None)
    redis_time = r.time

    def skewed() -> tuple[int, int]:  # Redis 11 minutes ahead of this host
        seconds, micros = redis_time()
        return seconds + 660, micros

    monkeypatch.setattr(r, "time", skewed)
    publisher = Publisher(r, settings)
    publisher.send_unsent(publisher.prepare("s1", CWD, [{**user(1), "uuid": "u-1"}]), 600)  # (the API's send)
    score = r.zscore(Keys().sent("s1"), "u-1")
    assert score is not None and abs(score - skewed()[0]) <= 2


def test_a_batch_whose_transaction_reply_was_lost_is_not_answered_as_duplicates(
    r: redis.Redis, settings: Settings, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Redis stalled past the socket timeout while it ran the EXEC: redis-py said the lost reply as
    a WatchError, the loop looked again, found the batch's own uuids sent, and answered every
    event a duplicate (accepted 0, no stream id) for a batch it had published whole. (The reply
    is lost here as a socket timeout loses it: read, then the timeout raised in its place, so
    the EXEC certainly ran; a stall timed by a busy script was at the mercy of the machine's load.)"""
    from redis.client import Pipeline

    parse, execute = Pipeline.parse_response, Pipeline._execute_transaction
    replies_left: list[int] = []  # the replies of the transaction to lose: its EXEC's is the last

    def transaction(self: Pipeline, connection: Any, commands: Any, raise_on_error: bool) -> Any:
        if not replies_left and not getattr(transaction, "done", False):
            transaction.done = True  # type: ignore[attr-defined]
            replies_left.append(len(commands) + 2)  # MULTI, each command's QUEUED, EXEC
        return execute(self, connection, commands, raise_on_error)

    def reply(self: Pipeline, connection: Any, command_name: Any, **options: Any) -> Any:
        answer = parse(self, connection, command_name, **options)
        if replies_left:
            replies_left[0] -= 1
            if replies_left[0] == 0:
                replies_left.clear()
                raise redis.TimeoutError("Timeout reading from socket")  # (its EXEC ran: the reply is lost)
        return answer

    monkeypatch.setattr(Pipeline, "_execute_transaction", transaction)
    monkeypatch.setattr(Pipeline, "parse_response", reply)
    publisher = Publisher(r, settings)
    batch = publisher.prepare("s1", CWD, [{**user(1), "uuid": f"u-{i}"} for i in range(3)])
    with pytest.raises(redis.ConnectionError, match="it may have taken them; send the batch again as it was"):
        publisher.send_unsent(batch, 600)
    monkeypatch.undo()
    assert len(entries(r, settings, "s1")) == 3  # (published, once: what the 503 says may have happened)
    again = Publisher(r, settings)
    assert again.send_unsent(batch, 600) == ([], {0, 1, 2})  # the retry the 503 asks for: duplicates now


def test_a_connection_lost_before_the_transaction_leaves_a_retrys_duplicates_said_as_such(
    r: redis.Redis, settings: Settings, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A connection lost while the uuids were looked up (no EXEC sent) is a WatchError too: taken for
    a lost EXEC reply, a retry holding two events sent before was a 503 "it may have taken them"
    (nothing of it was), not a 202 publishing the other two."""
    from producer import publisher as publisher_module

    client = redis.Redis(connection_pool=redis.ConnectionPool(
        connection_class=r.connection_pool.connection_class, **r.connection_pool.connection_kwargs))
    publisher = Publisher(client, settings)
    events = [{**user(1), "uuid": f"u-{i}"} for i in range(4)]
    publisher.send_unsent(publisher.prepare("s1", CWD, events[:2]), 600)
    real_time, killed = publisher_module.redis_time_s, []

    def connection_lost() -> float:  # between the WATCH and the lookup of the uuids
        if not killed:
            killed.append(r.client_kill_filter(_type="normal", skipme=True))
        return real_time()

    monkeypatch.setattr(publisher_module, "redis_time_s", connection_lost)
    try:
        ids, sent = publisher.send_unsent(publisher.prepare("s1", CWD, events), 600)
    finally:
        client.close()
    assert killed and len(ids) == 2 and sent == {0, 1}
    assert len(entries(r, settings, "s1")) == 4

