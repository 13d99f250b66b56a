"""The session store against a real Redis: exactly-once appends, state in step with the log."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import pytest
import redis

import compactor.store as store_module
from compactor.store import SessionStore, is_applied
from events.config import Settings
from events.errors import InvalidEvent, LogCorrupted, LogWriteFailed
from events.log import SessionLog
from events.state import rebuild
from events.view import build_view

CWD = "/home/dev/project"
SID = "sess-1"


def user(turn: int, text: str, stream_id: str | None = None, uuid: str | None = None) -> dict[str, Any]:
    event: dict[str, Any] = {
        "type": "user", "uuid": uuid or f"u{turn}-{text}", "timestamp": "2026-01-01T00:00:00Z",
        "turnId": turn, "content": text,
    }
    if stream_id:
        event["streamId"] = stream_id
    return event


def turn_end(turn: int, stream_id: str | None = None) -> dict[str, Any]:
    event: dict[str, Any] = {
        "type": "turn_end", "uuid": f"te{turn}", "timestamp": "2026-01-01T00:00:00Z",
        "turnId": turn, "model": "gpt-4", "contextWindow": 1000,
    }
    if stream_id:
        event["streamId"] = stream_id
    return event


@pytest.fixture
def store(r: redis.Redis, settings: Settings) -> SessionStore:
    return SessionStore(r, settings)


def test_apply_appends_and_state_equals_a_rebuild_from_the_log(store: SessionStore) -> None:
    store.apply(SID, CWD, [user(1, "hello world", "1-0"), turn_end(1, "2-0")])
    state = store.load(SID)
    log = store.log(SID, CWD)
    expected = rebuild(SID, CWD, log.read(), store.settings.context, log.size())
    assert state is not None
    assert state.prompt_estimate == expected.prompt_estimate == 6
    assert state.current_turn_id == expected.current_turn_id == 2
    assert state.log_size == log.size()
    assert state.last_stream_id == "2-0"


def test_a_sessions_last_activity_is_in_redis_s_time_whatever_the_writers_clock(
        store: SessionStore, r: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """It was the writer's time.time(): a host an hour behind ranked its sessions' activity an hour
    behind the others' (the status page's order, lastActivity) and pruned them from the active
    sessions an hour late."""
    monkeypatch.setattr(time, "time", lambda: 1_000_000_000.0)  # (a writer whose clock is off)
    store.apply(SID, CWD, [user(1, "hello world", "1-0")])
    score = r.zscore(store.keys.sessions, SID)
    seconds, _ = r.time()
    assert score is not None and abs(score - int(seconds)) < 5


def test_a_batch_that_appends_nothing_is_no_activity(store: SessionStore, r: redis.Redis) -> None:
    """A batch refused whole (a dead-lettered entry), a redelivery of what the log has, or a forced
    job with nothing to write moved the session's last activity: to the top of every list, and
    one sent only refused entries never idled out."""
    store.apply(SID, CWD, [user(1, "a", "1-0"), turn_end(1, "1-1"), user(2, "b", "2-0")])
    before = r.zscore(store.keys.sessions, SID)
    ttl = r.ttl(store.keys.session(SID))
    r.zadd(store.keys.sessions, {SID: 1_000.0})  # (long ago)
    r.expire(store.keys.session(SID), 100)
    result = store.apply(SID, CWD, [user(1, "late", "3-0")])  # turnId goes backwards: refused
    assert [e["uuid"] for e, _ in result.rejected] == ["u1-late"] and not result.appended
    store.apply(SID, CWD, [user(2, "b", "2-0")])  # a redelivery: a duplicate, nothing appended
    assert r.zscore(store.keys.sessions, SID) == 1_000.0 and r.ttl(store.keys.session(SID)) <= 100
    store.apply(SID, CWD, [turn_end(2, "4-0")])
    assert r.zscore(store.keys.sessions, SID) > 1_000.0 and r.ttl(store.keys.session(SID)) > 100
    assert before is not None and ttl > 100
    r.zadd(store.keys.sessions, {SID: 1_000.0})
    r.expire(store.keys.session(SID), 100)
    lost = r.pipeline(transaction=False)  # a writer whose state save never reached Redis (it crashed)
    assert store.apply(SID, CWD, [user(3, "c", "5-0")], pipeline=lost).appended
    store.apply(SID, CWD, [user(3, "c", "5-0")])  # its redelivery: caught up from the log, appended once
    assert r.zscore(store.keys.sessions, SID) > 1_000.0 and r.ttl(store.keys.session(SID)) > 100


def test_a_new_sessions_first_append_stopped_by_a_timeout_leaves_no_log(
        store: SessionStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a write failure removed the new session's empty log: one stopped by a job's timeout
    left it, and the session read as known and empty (SPEC §7's 404 is for no log)."""
    class Timeout(BaseException):
        pass

    def stopped(*args: Any) -> int:
        raise Timeout

    monkeypatch.setattr(SessionLog, "append", stopped)
    with pytest.raises(Timeout):
        store.apply(SID, CWD, [user(1, "hello world", "1-0")])
    assert not store.log(SID, CWD).exists()
    monkeypatch.undo()
    monkeypatch.setattr(SessionStore, "_admit", stopped)  # (while its tokens were counted, before any append)
    with pytest.raises(Timeout):
        store.apply(SID, CWD, [user(1, "hello world", "1-0")])
    assert not store.log(SID, CWD).exists()


def test_redelivered_entry_is_skipped_not_written_twice(store: SessionStore) -> None:
    store.apply(SID, CWD, [user(1, "a", "5-0")])
    result = store.apply(SID, CWD, [user(1, "a", "5-0"), user(1, "b", "6-0")])
    assert result.duplicates == 1
    assert [e["content"] for e in store.log(SID, CWD).read()] == ["a", "b"]


@pytest.mark.parametrize("redis_lost", [False, True], ids=["index kept", "Redis lost"])
def test_entries_of_a_stream_renumbered_below_the_last_applied_id_are_applied(
    store: SessionStore, r: redis.Redis, redis_lost: bool
) -> None:
    """A producer chose an id in the future (or Redis came back on a host whose clock is behind),
    then Redis lost the stream: its new entries are numbered below the log's last streamId, and
    were acked as duplicates, every new event of the session dropped without a word."""
    store.apply(SID, CWD, [user(1, "a", "4102444800000-0"), {**turn_end(1), "streamId": "4102444800000-1"}])
    if redis_lost:
        r.flushall()
    result = store.apply(SID, CWD, [
        user(1, "a", "4102444800000-0"),  # a redelivery: in the log
        user(2, "after", "1800000000000-0"), {**turn_end(2), "streamId": "1800000000000-1"},
    ])
    assert (result.duplicates, result.rejected) == (1, [])
    log = store.log(SID, CWD)
    assert [(e["type"], e.get("content")) for e in log.read()] == [
        ("user", "a"), ("turn_end", None), ("user", "after"), ("turn_end", None)]
    again = store.apply(SID, CWD, [user(2, "after", "1800000000000-0")])  # and a redelivery of those
    assert again.duplicates == 1 and len(log.read()) == 4
    assert store.load(SID) == rebuild(SID, CWD, log.read(), store.settings.context, log.size())


def test_crash_between_append_and_state_save_does_not_duplicate(store: SessionStore) -> None:
    store.apply(SID, CWD, [user(1, "a", "5-0")])
    stale = store.load(SID)
    # A watcher appended entry 6-0 and died before saving the state.
    store.log(SID, CWD).append([user(1, "b", "6-0")])
    assert stale is not None and store.load(SID) == stale
    result = store.apply(SID, CWD, [user(1, "b", "6-0"), user(1, "c", "7-0")])
    assert result.duplicates == 1
    assert [e["content"] for e in store.log(SID, CWD).read()] == ["a", "b", "c"]
    state = store.load(SID)
    assert state is not None and state.log_size == store.log(SID, CWD).size()


def test_turn_going_backwards_is_rejected_and_not_written(store: SessionStore) -> None:
    store.apply(SID, CWD, [user(1, "a"), turn_end(1), user(2, "b")])
    result = store.apply(SID, CWD, [user(1, "late"), user(2, "ok")])
    assert [e["content"] for e, _ in result.rejected] == ["late"]
    assert "goes backwards" in str(result.rejected[0][1])
    assert [e.get("content") for e in store.log(SID, CWD).read() if e["type"] == "user"] == ["a", "b", "ok"]


def test_session_is_bound_to_its_first_cwd(store: SessionStore) -> None:
    store.apply(SID, CWD, [user(1, "a")])
    with pytest.raises(InvalidEvent) as err:
        store.apply(SID, "/somewhere/else", [user(1, "b")])
    assert err.value.field == "cwd"


def test_a_session_refused_for_its_cwd_leaves_no_log_under_that_cwd(store: SessionStore) -> None:
    store.apply(SID, CWD, [user(1, "a")])
    elsewhere = store.log(SID, "/somewhere/else")
    with pytest.raises(InvalidEvent):
        store.apply(SID, "/somewhere/else", [user(1, "b")])
    assert not elsewhere.path.exists()  # an empty log there would make the session known under that cwd
    assert not elsewhere.path.parent.parent.exists()


@pytest.mark.parametrize("with_meta", [True, False], ids=["session_meta", "no session_meta"])
def test_after_redis_lost_a_session_its_log_under_another_project_keeps_it_bound(
        store: SessionStore, r: redis.Redis, with_meta: bool) -> None:
    """Redis lost the session's state (a restart without persistence, its 7-day idle TTL): one
    entry of another cwd started a second log and took the session, every later entry of its
    own cwd refused as bound elsewhere (or, in the same round, the session split over two logs)."""
    meta = {"type": "session_meta", "uuid": "m", "timestamp": "2026-01-01T00:00:00Z", "cwd": CWD}
    first = [meta] if with_meta else []
    store.apply(SID, CWD, [*first, user(1, "a")])
    r.flushall()
    elsewhere = store.log(SID, "/somewhere/else")
    with pytest.raises(InvalidEvent) as err:
        store.apply(SID, "/somewhere/else", [user(2, "b")])
    bound = (f"is bound to cwd {CWD!r}" if with_meta else
             f"is logged under another cwd ({store.log(SID, CWD).path}; no session_meta records which)")
    assert str(err.value) == f"cwd: session {SID} {bound}, not '/somewhere/else'"
    assert not elsewhere.path.exists() and not elsewhere.path.parent.parent.exists()
    store.apply(SID, CWD, [user(2, "c")])  # its own cwd goes on
    assert [e["content"] for e in store.log(SID, CWD).read() if e["type"] == "user"] == ["a", "c"]
    store.apply("another", "/somewhere/else", [user(1, "d")])  # another session's first cwd is its own


def rollback(through: int) -> dict[str, Any]:
    return {"type": "rollback", "uuid": f"rb{through}", "timestamp": "2026-01-01T00:00:00Z",
            "throughTurnId": through, "reason": "undo"}


@pytest.mark.parametrize("batched", [True, False], ids=["one batch", "two batches"])
def test_turn_order_after_a_rollback_does_not_depend_on_the_batching(store: SessionStore, batched: bool) -> None:
    store.apply(SID, CWD, [user(1, "a"), turn_end(1), user(2, "b"), turn_end(2), user(3, "c"), turn_end(3)])
    after = [user(1, "too old"), user(2, "again"), {**turn_end(2), "uuid": "te2-again"}, user(2, "late")]
    if batched:
        rejected = store.apply(SID, CWD, [rollback(2), *after]).rejected
    else:
        store.apply(SID, CWD, [rollback(2)])
        rejected = store.apply(SID, CWD, after).rejected
    # after the rollback the current turn is 2; once turn 2 ends again, 3
    assert [(e["content"], err.field) for e, err in rejected] == [("too old", "turnId"), ("late", "turnId")]
    log = store.log(SID, CWD)
    assert [e.get("content") for e in log.read() if e["type"] == "user"] == ["a", "b", "c", "again"]
    assert store.load(SID) == rebuild(SID, CWD, log.read(), store.settings.context, log.size())


def test_a_batch_of_many_rollbacks_reads_the_log_once_and_checks_each_turn_as_one_by_one(
        store: SessionStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rollback of a batch read and rebuilt the whole log to learn the turn it left: a batch of
    128 rollbacks on a 120 000-line log took 26 s, the shard's other sessions waiting."""
    seed = [event for n in range(1, 6) for event in (user(n, f"t{n}"), turn_end(n))]
    store.apply(SID, CWD, seed)
    store.apply("twin", CWD, seed)
    batch: list[dict[str, Any]] = []
    for n in range(40):
        through = 5 - n % 4  # (5, 4, 3, 2, 5, ...: each lower than the turn the one before left, or not)
        batch += [{**rollback(through), "uuid": f"rb-{n}"}, {**user(through, f"again {n}"), "uuid": f"u-{n}"},
                  {**user(through - 1, f"too old {n}"), "uuid": f"o-{n}"}]
    expected = [refused["uuid"] for event in batch for refused, _ in store.apply("twin", CWD, [event]).rejected]
    reads: list[int] = []
    real = SessionLog.read

    def counted(self: SessionLog, *args: Any, **kwargs: Any) -> Any:
        reads.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(SessionLog, "read", counted)
    rejected = store.apply(SID, CWD, batch).rejected
    assert len(reads) <= 2  # (the turns noted once; the state rebuilt once, after the append)
    assert [event["uuid"] for event, _ in rejected] == expected == [f"o-{n}" for n in range(40)]
    monkeypatch.undo()
    log = store.log(SID, CWD)
    assert store.load(SID) == rebuild(SID, CWD, log.read(), store.settings.context, log.size())


def summary(through: int, uuid: str) -> dict[str, Any]:
    return {"type": "summary", "uuid": uuid, "timestamp": "2026-01-01T00:00:00Z", "replaces": [],
            "summaryText": "### Primary Request\nx", "lastSummarizedTurnId": through}


def compact(end: int, uuid: str) -> dict[str, Any]:
    return {"type": "compact", "uuid": uuid, "timestamp": "2026-01-01T00:00:00Z", "startTurnId": 1, "endTurnId": end}


@pytest.mark.parametrize("batched", [True, False], ids=["one batch", "one by one"])
def test_a_summary_or_compact_past_the_sessions_turns_is_refused(store: SessionStore, batched: bool) -> None:
    """A producer's summary with ``lastSummarizedTurnId: 1000000`` was written: every later turn
    fell at or below it, so no LLM job ever had a target again (a forced one answered
    ``didCompress: false``), the session over its window for good."""
    store.apply(SID, CWD, [user(1, "a"), turn_end(1), user(2, "b"), turn_end(2), user(3, "c"), turn_end(3)])
    events = [summary(1_000_000, "s-far"), compact(9, "c-far"), summary(3, "s-ok"), rollback(2),
              compact(3, "c-undone"), compact(1, "c-ok")]  # after the rollback turn 1 is the highest
    if batched:
        rejected = store.apply(SID, CWD, events).rejected
    else:
        rejected = [refusal for event in events for refusal in store.apply(SID, CWD, [event]).rejected]
    assert [(e["uuid"], str(err)) for e, err in rejected] == [
        ("s-far", "lastSummarizedTurnId: is past the session's turns: 1000000 > 3, the last turn that is over "
                  "(currentTurnId 4: a summary covers turns that are over, not one still running)"),
        ("c-far", "endTurnId: is past the session's turns: 9 > 3, the last turn that is over (currentTurnId 4: "
                  "a compact covers turns that are over, not one still running)"),
        ("c-undone", "endTurnId: is past the session's turns: 3 > 1, the last turn that is over (currentTurnId 2: "
                     "a compact covers turns that are over, not one still running)")]
    log = store.log(SID, CWD)
    assert [e["uuid"] for e in log.read() if e["type"] in ("summary", "compact")] == ["s-ok", "c-ok"]
    assert store.load(SID) == rebuild(SID, CWD, log.read(), store.settings.context, log.size())


@pytest.mark.parametrize("batched", [True, False], ids=["one batch", "one by one"])
def test_a_summary_or_compact_of_the_turn_still_running_is_refused(store: SessionStore, batched: bool) -> None:
    """Turn 3 running (no turn_end): a producer's compact of turns 1-3 elided turn 3's outputs as
    they came, and its summary of them left turn 3's later events out of every LLM job's
    targets (SPEC §5: they start after its lastSummarizedTurnId), the session over its window
    for good. A turn is over at its turn_end, or once a later one started."""
    store.apply(SID, CWD, [user(1, "a"), turn_end(1), user(2, "b"), user(3, "c")])  # (turn 2 over: 3 started)
    events = [compact(3, "c-running"), summary(3, "s-running"), compact(2, "c-ok"), user(3, "more"),
              turn_end(3), summary(3, "s-ok")]
    if batched:
        rejected = store.apply(SID, CWD, events).rejected
    else:
        rejected = [refusal for event in events for refusal in store.apply(SID, CWD, [event]).rejected]
    assert [(e["uuid"], err.field) for e, err in rejected] == [("c-running", "endTurnId"),
                                                                ("s-running", "lastSummarizedTurnId")]
    assert "3 > 2, the last turn that is over (currentTurnId 3" in str(rejected[0][1])
    log = store.log(SID, CWD)
    assert [e["uuid"] for e in log.read() if e["type"] in ("summary", "compact")] == ["c-ok", "s-ok"]
    assert store.load(SID) == rebuild(SID, CWD, log.read(), store.settings.context, log.size())


@pytest.mark.parametrize("batched", [True, False], ids=["one batch", "one by one"])
def test_a_turn_id_on_an_event_outside_the_turns_does_not_raise_the_highest_turn(
        store: SessionStore, batched: bool) -> None:
    """``turnId`` is an unknown extra field on a session_meta (SPEC §3 keeps it as it is): in one
    batch it raised the highest turn a summary may cover, so a summary of turn 50 of a session
    at turn 1 was written (and left turns 2..50 out of every LLM job's targets), while sent
    alone it was refused."""
    store.apply(SID, CWD, [user(1, "a"), turn_end(1)])
    meta = {"type": "session_meta", "uuid": "m", "timestamp": "2026-01-01T00:00:00Z", "turnId": 50}
    events = [compact(1, "c-ok"), meta, summary(50, "s-far")]
    if batched:
        rejected = store.apply(SID, CWD, events).rejected
    else:
        rejected = [refusal for event in events for refusal in store.apply(SID, CWD, [event]).rejected]
    assert [(e["uuid"], err.field) for e, err in rejected] == [("s-far", "lastSummarizedTurnId")]
    assert [e["uuid"] for e in store.log(SID, CWD).read()][-2:] == ["c-ok", "m"]


@pytest.mark.parametrize("batched", [True, False], ids=["one batch", "two batches"])
def test_a_refused_events_uuid_stays_free(store: SessionStore, batched: bool) -> None:
    """An event refused for going backwards had its uuid taken all the same: a later event of the
    batch with that uuid was refused as a duplicate of an event never written, and the outcome
    depended on the batching."""
    store.apply(SID, CWD, [user(1, "a"), turn_end(1), user(2, "b"), turn_end(2)])
    late, fixed = user(1, "late", uuid="X"), user(3, "now", uuid="X")
    if batched:
        rejected = store.apply(SID, CWD, [late, fixed]).rejected
    else:
        rejected = store.apply(SID, CWD, [late]).rejected + store.apply(SID, CWD, [fixed]).rejected
    assert [(e["content"], err.field) for e, err in rejected] == [("late", "turnId")]
    assert [e.get("content") for e in store.log(SID, CWD).read() if e["type"] == "user"] == ["a", "b", "now"]


def test_a_rebuild_after_an_append_never_refuses_what_it_wrote(store: SessionStore, r: redis.Redis) -> None:
    """A session an earlier bug bound to another spelling of its cwd (its session_meta says the
    first one): a rollback under that spelling was appended, then its rebuild refused the cwd,
    and the watcher dead-lettered lines that were in the log."""
    meta = {"type": "session_meta", "uuid": "m", "timestamp": "2026-01-01T00:00:00Z", "cwd": CWD}
    store.apply(SID, CWD, [meta, user(1, "a"), turn_end(1), user(2, "b"), turn_end(2)])
    other = CWD + "/"
    r.hset(store.keys.session(SID), "cwd", other)
    result = store.apply(SID, other, [rollback(2)])
    assert [e["type"] for e in result.appended] == ["rollback"] and result.rejected == []
    assert store.log(SID, CWD).read()[-1]["type"] == "rollback"


def test_lost_redis_state_is_rebuilt_from_the_log(store: SessionStore, r: redis.Redis) -> None:
    store.apply(SID, CWD, [user(1, "hello world", "1-0"), turn_end(1, "2-0")])
    before = store.load(SID)
    r.flushall()
    result = store.apply(SID, CWD, [turn_end(1, "2-0"), user(2, "y", "3-0")])
    assert result.duplicates == 1  # 2-0 is in the log already (a redelivery: the same event, its uuid)
    assert before is not None and result.state.prompt_estimate > before.prompt_estimate
    assert [e.get("content") for e in store.log(SID, CWD).read() if e["type"] == "user"] == [
        "hello world", "y",
    ]


def test_producer_token_stamp_is_replaced(store: SessionStore) -> None:
    forged = dict(user(1, "hello world"), tokenCount=999_999, tokenEncoding="cl100k_base")
    store.apply(SID, CWD, [forged])
    line = store.log(SID, CWD).read()[0]
    assert line["tokenCount"] == 6
    state = store.load(SID)
    assert state is not None and state.prompt_estimate == 6


def test_cached_state_is_not_modified_and_stale_cache_is_ignored(store: SessionStore) -> None:
    first = store.apply(SID, CWD, [user(1, "a")]).state
    snapshot = first.to_hash()
    store.log(SID, CWD).append([user(1, "written by someone else")])
    second = store.apply(SID, CWD, [user(1, "b")], cached=first).state
    assert first.to_hash() == snapshot
    assert second.events == 3


def test_is_applied_compares_stream_ids_numerically() -> None:
    assert is_applied("9-0", "10-0") is True
    assert is_applied("10-1", "10-0") is False
    assert is_applied("10-0", "10-0") is True
    assert is_applied(None, "10-0") is False
    assert is_applied("10-0", None) is False


def _long_turn(turn: int) -> list[dict[str, Any]]:
    return [
        user(turn, f"q{turn}"),
        {"type": "assistant", "uuid": f"a{turn}", "turnId": turn, "content": "",
         "toolCalls": [{"id": f"c{turn}", "name": "read_file", "arguments": {"path": "x"}}]},
        {"type": "tool_result", "uuid": f"t{turn}", "turnId": turn, "toolCallId": f"c{turn}",
         "toolName": "read_file", "output": "word " * 100},
        turn_end(turn),
    ]


@pytest.mark.parametrize("appended", [
    [{"type": "compact", "uuid": "c", "startTurnId": 1, "endTurnId": 2}],
    [{"type": "summary", "uuid": "s", "replaces": ["u1-q1", "a1", "t1"], "summaryText": "S",
      "lastSummarizedTurnId": 1}],
    [{"type": "rollback", "uuid": "r", "throughTurnId": 3, "reason": "undo"}],
])
@pytest.mark.parametrize("with_view", [False, True])
def test_apply_with_known_events_gives_the_state_of_a_reread(
    store: SessionStore, r: redis.Redis, appended: list[dict[str, Any]], with_view: bool,
) -> None:
    store.apply(SID, CWD, [e for t in (1, 2, 3) for e in _long_turn(t)])
    store.apply(SID, CWD, [{"type": "compact", "uuid": "c0", "startTurnId": 1, "endTurnId": 1}])
    log = store.log(SID, CWD)
    with log.lock():
        known = log.read()
        view = build_view(known, store.settings.context, messages=False) if with_view else None
        result = store.apply(SID, CWD, appended, log=log, known=known, known_view=view)
    expected = rebuild(SID, CWD, log.read(), store.settings.context, log.size())
    assert result.state == expected and store.load(SID) == expected
    assert result.view is not None and result.view.prompt_estimate == expected.prompt_estimate
    # the same append without known events (a re-read of the log) gives the same state
    r.flushall()
    other = SessionStore(r, store.settings)
    other.apply("sess-2", CWD, [e for t in (1, 2, 3) for e in _long_turn(t)])
    other.apply("sess-2", CWD, [{"type": "compact", "uuid": "c0", "startTurnId": 1, "endTurnId": 1}])
    assert other.apply("sess-2", CWD, appended).state.prompt_estimate == expected.prompt_estimate


def test_apply_ignores_known_events_that_do_not_cover_the_log(store: SessionStore) -> None:
    store.apply(SID, CWD, [e for t in (1, 2) for e in _long_turn(t)])
    log = store.log(SID, CWD)
    with log.lock():
        stale = log.read()[:-1]  # a line short: not the log as it is
        result = store.apply(SID, CWD, [{"type": "compact", "uuid": "c", "startTurnId": 1, "endTurnId": 1}],
                             log=log, known=stale)
    assert result.view is None
    assert result.state == rebuild(SID, CWD, log.read(), store.settings.context, log.size())


def test_torn_tail_of_a_crashed_writer_is_not_counted_as_read(store: SessionStore) -> None:
    """A torn tail is cut by the next append; an offset recorded inside it would point mid-line."""
    store.apply(SID, CWD, [user(1, "a", "1-0")])
    log = store.log(SID, CWD)
    complete = log.size()
    with open(log.path, "ab") as f:
        f.write(b'{"type":"user","turnId":1,"cont')  # a writer died mid-line
    assert log.complete_size() == complete
    state = store.apply(SID, CWD, [user(1, "a", "1-0")]).state  # a redelivery: nothing appended
    assert state.log_size == complete
    store.apply(SID, CWD, [user(1, "b", "2-0")])  # the append cuts the fragment
    store.apply(SID, CWD, [user(1, "c", "3-0")])
    assert [e["content"] for e in log.read()] == ["a", "b", "c"]
    stored = store.load(SID)
    assert stored is not None and stored.log_size == log.size()


def test_a_whole_last_line_without_its_newline_is_folded_and_its_redelivery_is_a_duplicate(
        store: SessionStore) -> None:
    """A writer died right before a line's newline (or an editor dropped it): the next append keeps
    the line, so the store must count it too. Its catch-up read without it: the redelivered
    entry was written a second time and the stored estimate never counted the line."""
    store.apply(SID, CWD, [user(1, "hello world", "1-0"), turn_end(1, "2-0")])
    log = store.log(SID, CWD)
    stamped = user(2, "second message here", "3-0")
    SessionLog(store.settings.data_dir, CWD, SID).append([stamped])  # the line, then no state save
    os.truncate(log.path, log.size() - 1)  # ... and no newline
    result = store.apply(SID, CWD, [user(2, "second message here", "3-0"), user(2, "third", "4-0")])
    assert result.duplicates == 1
    assert [e.get("content") for e in log.read()] == ["hello world", None, "second message here", "third"]
    stored = store.load(SID)
    assert stored is not None
    assert stored == rebuild(SID, CWD, log.read(), store.settings.context, log.size())
    assert not log.torn_path.exists()


def test_a_uuid_the_session_already_has_is_refused(store: SessionStore) -> None:
    store.apply(SID, CWD, [user(1, "a", "1-0", uuid="u-a")])
    result = store.apply(SID, CWD, [user(1, "again", "2-0", uuid="u-a"), user(1, "b", "3-0", uuid="u-b"),
                                    user(1, "twice in one batch", "4-0", uuid="u-b")])
    assert [(e["content"], err.field) for e, err in result.rejected] == [
        ("again", "uuid"), ("twice in one batch", "uuid")]
    assert [e["uuid"] for e in store.log(SID, CWD).read()] == ["u-a", "u-b"]


def test_uuid_index_is_rebuilt_from_the_log_after_redis_loses_it(store: SessionStore, r: redis.Redis) -> None:
    store.apply(SID, CWD, [user(1, "a", "1-0", uuid="u-a")])
    r.flushall()
    result = store.apply(SID, CWD, [user(1, "again", "2-0", uuid="u-a")])
    assert [err.field for _, err in result.rejected] == ["uuid"]


def test_uuids_of_lines_a_crashed_writer_left_are_indexed(store: SessionStore) -> None:
    store.apply(SID, CWD, [user(1, "a", "1-0", uuid="u-a")])
    store.log(SID, CWD).append([user(1, "b", "2-0", uuid="u-b")])  # appended, state never saved
    result = store.apply(SID, CWD, [user(1, "c", "3-0", uuid="u-b")])
    assert [err.field for _, err in result.rejected] == ["uuid"]


def test_a_catch_up_of_the_same_lines_is_said_once(store: SessionStore, caplog: pytest.LogCaptureFixture) -> None:
    """A session held back on a bad line catches up the same tail at every retry (about once a
    second): each said "state catch-up" again, a flood of the same line."""
    store.apply(SID, CWD, [user(1, "a", "1-0", uuid="u-a")])
    log = store.log(SID, CWD)
    log.append([user(1, "b", "2-0", uuid="u-b")])  # appended, state never saved
    caplog.set_level(logging.INFO, logger="compactor.store")
    for _ in range(3):
        with log.lock():
            store.current(SID, CWD, log)
    log.append([user(1, "c", "3-0", uuid="u-c")])  # more: said again
    with log.lock():
        store.current(SID, CWD, log)
    said = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("state catch-up")]
    assert len(said) == 2 and said[0] != said[1], said


def test_a_round_lookup_made_before_a_crashed_writers_lines_were_caught_up_is_corrected(
    store: SessionStore,
) -> None:
    """The watcher's lookup (before the lock) cannot see the uuids of lines a crashed writer
    appended but never indexed; catching those lines up under the lock adds them, so a
    producer's retry of such an event is refused instead of written twice."""
    store.apply(SID, CWD, [user(1, "a", "1-0", uuid="u-a")])
    store.log(SID, CWD).append([user(1, "b", "2-0", uuid="u-b")])  # appended, never saved nor indexed
    incoming = [user(1, "b retried", "3-0", uuid="u-b"), user(1, "c", "4-0", uuid="u-c")]
    found = store.lookup({SID: incoming})
    assert found.taken[SID] == set()
    result = store.apply(SID, CWD, incoming, taken=found.taken[SID])
    assert [(e["content"], err.field) for e, err in result.rejected] == [("b retried", "uuid")]
    assert [e["uuid"] for e in store.log(SID, CWD).read()] == ["u-a", "u-b", "u-c"]


def test_a_round_lookup_made_before_redis_lost_the_index_is_corrected_from_the_log(
    store: SessionStore, r: redis.Redis,
) -> None:
    """The watcher looks a round's uuids (and states) up before it locks each log. When the
    state turns out to be missing, the state and the uuid index are rebuilt from the log, and
    the lookup's answer is replaced by the log's: a uuid the log holds is still refused."""
    store.apply(SID, CWD, [user(1, "a", "1-0", uuid="u-a")])
    r.flushall()
    incoming = [user(1, "again", "2-0", uuid="u-a"), user(1, "b", "3-0", uuid="u-b")]
    found = store.lookup({SID: incoming}, load=[SID])
    assert found.taken[SID] == set() and found.stored[SID] is None  # what Redis says now
    pipe = r.pipeline(transaction=False)
    result = store.apply(SID, CWD, incoming, pipeline=pipe, taken=found.taken[SID], stored=found.stored[SID])
    pipe.execute()
    assert [(e["content"], err.field) for e, err in result.rejected] == [("again", "uuid")]
    assert [e["uuid"] for e in store.log(SID, CWD).read()] == ["u-a", "u-b"]
    assert r.smembers(store.keys.uuids(SID)) == {b"u-a", b"u-b"}
    assert store.load(SID) == rebuild(SID, CWD, store.log(SID, CWD).read(), store.settings.context,
                                      store.log(SID, CWD).size())


def test_lookup_reads_the_stored_states_it_is_asked_for(store: SessionStore) -> None:
    store.apply(SID, CWD, [user(1, "a", "1-0", uuid="u-a")])
    found = store.lookup({SID: [user(1, "b", uuid="u-a")], "other": []}, load=[SID, "other"])
    assert found.taken == {SID: {"u-a"}, "other": set()}
    assert found.stored == {SID: store.load(SID), "other": None}


def test_a_deferred_save_overtaken_by_a_later_state_still_indexes_its_uuids(
    store: SessionStore, r: redis.Redis,
) -> None:
    """SAVE_STATE refuses a state older than the stored one, but the uuids of the lines it
    appended are in the log whatever happens to the state: they are indexed all the same."""
    store.apply(SID, CWD, [user(1, "a", "1-0", uuid="u-a")])
    pipe = r.pipeline(transaction=False)
    result = store.apply(SID, CWD, [user(1, "b", "2-0", uuid="u-b")], pipeline=pipe)
    r.hset(store.keys.session(SID), "log_size", result.state.log_size + 1000)  # a later writer's
    r.zrem(store.keys.sessions, SID)
    pipe.execute()
    assert r.hget(store.keys.session(SID), "log_size") == str(result.state.log_size + 1000).encode()
    assert r.smembers(store.keys.uuids(SID)) == {b"u-a", b"u-b"}
    assert r.zscore(store.keys.sessions, SID) is not None


def test_a_shrunk_log_whose_rebuild_fails_is_warned_of_once(store: SessionStore, r: redis.Redis,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """A log cut short by hand and left with a bad line: each retry of the held session (once a
    second) failed its rebuild, kept the stale state, and logged "log shrank" again."""
    store.apply(SID, CWD, [user(1, "a" * 200, "1-0"), turn_end(1, "2-0"), user(2, "b" * 200, "3-0")])
    log = store.log(SID, CWD)
    lines = log.path.read_bytes().splitlines(keepends=True)
    log.path.write_bytes(b"".join([lines[0], b"{not json\n"]))
    with caplog.at_level(logging.WARNING, logger="compactor.store"):
        for attempt in range(3):
            with pytest.raises(LogCorrupted):
                store.apply(SID, CWD, [turn_end(2, f"{4 + attempt}-0")])
    assert [rec.getMessage().split(" path=")[0] for rec in caplog.records] == [f"log shrank session={SID}"]


@pytest.mark.parametrize("deferred", [True, False])
def test_a_log_that_shrank_gets_a_state_rebuilt_from_it(store: SessionStore, r: redis.Redis,
                                                        deferred: bool, caplog: pytest.LogCaptureFixture) -> None:
    """A log truncated or restored from an older copy: the rebuilt state was refused by the
    deferred save (the stored one had seen more bytes), so the stale state stayed in Redis
    (status and the status page showed it) and every apply rebuilt again, until the log grew
    past its old size. And nothing said that lines were gone."""
    store.apply(SID, CWD, [user(1, "a" * 200, "1-0", uuid="u-a"), turn_end(1, "2-0"),
                           user(2, "b" * 200, "3-0", uuid="u-b"), turn_end(2, "4-0")])
    log = store.log(SID, CWD)
    lines = log.path.read_bytes().splitlines(keepends=True)
    log.path.write_bytes(b"".join(lines[:2]))  # back to turn 1
    pipe = r.pipeline(transaction=False) if deferred else None
    with caplog.at_level(logging.WARNING, logger="compactor.store"):
        result = store.apply(SID, CWD, [user(2, "c", "5-0", uuid="u-c")], pipeline=pipe)
    assert [rec.getMessage().split(" path=")[0] for rec in caplog.records] == [f"log shrank session={SID}"]
    if pipe is not None:
        pipe.execute()
    events = log.read()
    assert [e.get("content") for e in events if e["type"] == "user"] == ["a" * 200, "c"]
    expected = rebuild(SID, CWD, events, store.settings.context, log.size())
    assert store.load(SID) == result.state == expected
    assert r.smembers(store.keys.uuids(SID)) == {b"u-a", b"te1", b"u-c"}


def test_a_deferred_save_is_stored_with_its_uuids_when_nothing_newer_was(store: SessionStore, r: redis.Redis) -> None:
    store.apply(SID, CWD, [user(1, "a", "1-0", uuid="u-a")])
    pipe = r.pipeline(transaction=False)
    result = store.apply(SID, CWD, [user(1, "b", "2-0", uuid="u-b"), turn_end(1, "3-0")], pipeline=pipe)
    pipe.execute()
    assert store.load(SID) == result.state
    assert r.smembers(store.keys.uuids(SID)) == {b"u-a", b"u-b", b"te1"}


def test_a_cached_state_does_not_recreate_a_state_redis_lost(store: SessionStore, r: redis.Redis) -> None:
    """A writer holding a state that matches the log (the watcher's cache) appends after Redis lost
    the session: storing that state would have left an index of the new uuids only, under a
    ``logSize`` matching the log, which no writer would rebuild. Nothing is stored; the next
    writer finds no state and rebuilds both from the log."""
    held = store.apply(SID, CWD, [user(1, "a", "1-0", uuid="u-a")]).state
    r.delete(store.keys.session(SID), store.keys.uuids(SID))  # Redis lost them
    pipe = r.pipeline(transaction=False)
    store.apply(SID, CWD, [user(1, "b", "2-0", uuid="u-b")], pipeline=pipe, cached=held, stored=held)
    assert pipe.execute()[-1] == -1
    assert not r.exists(store.keys.session(SID)) and not r.exists(store.keys.uuids(SID))
    again = store.apply(SID, CWD, [user(1, "c", "3-0", uuid="u-a")])  # a re-sent uuid
    assert [str(e) for _, e in again.rejected] == ["uuid: 'u-a' duplicates an event already in this session"]
    assert r.smembers(store.keys.uuids(SID)) == {b"u-a", b"u-b"}
    assert store.load(SID) == again.state and again.state.events == 2


def test_an_idle_sessions_state_expires_and_comes_back_from_its_log(
        store: SessionStore, r: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every session ever seen kept its state, its uuid index (growing with its events) and its
    place in the active sessions' index for good: ~6 kB of Redis each."""
    store.apply(SID, CWD, [user(1, "a", "1-0", uuid="u-a"), turn_end(1, "2-0")])
    for key in (store.keys.session(SID), store.keys.uuids(SID)):
        assert store_module.STATE_IDLE_TTL_S - 10 < r.ttl(key) <= store_module.STATE_IDLE_TTL_S, key
    monkeypatch.setattr(store_module, "STATE_IDLE_TTL_S", 1)
    store.apply(SID, CWD, [user(2, "b", "3-0", uuid="u-b")])  # a write sets it again
    time.sleep(2.2)
    assert not r.exists(store.keys.session(SID)) and not r.exists(store.keys.uuids(SID))
    store.apply("other", CWD, [user(1, "o", "1-0", uuid="u-o")])  # a later write prunes the index
    assert r.zrange(store.keys.sessions, 0, -1) == [b"other"]
    # the watcher holds the state still, and asks Redis for it (a producer's uuid): gone, so not trusted
    assert store.lookup({SID: [user(2, "c", uuid="u-a")]}, check=[SID]).gone == {SID}
    again = store.apply(SID, CWD, [user(2, "c", "4-0", uuid="u-a")], stored=None)  # (dropped from its cache)
    assert [str(e) for _, e in again.rejected] == ["uuid: 'u-a' duplicates an event already in this session"]
    assert store.load(SID) == again.state == store.rebuild(SID, CWD) and again.state.events == 3
    assert r.smembers(store.keys.uuids(SID)) == {b"u-a", b"te1", b"u-b"}


def test_a_new_sessions_first_append_failing_leaves_no_log(store: SessionStore, r: redis.Redis,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk full at a new session's first line left its log empty: the API and ``compactor
    context`` read it as an existing, empty session (200, estimate 0) where no event had landed."""
    def full(self: SessionLog, events: Any) -> int:
        raise LogWriteFailed(f"{self.path}: append failed: [Errno 28] No space left on device")

    monkeypatch.setattr(SessionLog, "append", full)
    with pytest.raises(LogWriteFailed):
        store.apply(SID, CWD, [user(1, "a", "1-0")])
    assert not store.log(SID, CWD).exists() and store.load(SID) is None


def test_lookup_tells_which_held_sessions_redis_has_no_state_of(store: SessionStore, r: redis.Redis) -> None:
    store.apply(SID, CWD, [user(1, "a", "1-0", uuid="u-a")])
    store.apply("other", CWD, [user(1, "a", "1-0", uuid="u-o")])
    r.delete(store.keys.session("other"))
    found = store.lookup({SID: [user(1, "b", uuid="u-x")], "other": [user(1, "b", uuid="u-y")]},
                         check=[SID, "other"])
    assert found.gone == {"other"}


@pytest.mark.parametrize("recorded", ["other", "none"])
@pytest.mark.parametrize("lagging", [False, True])
def test_a_state_derived_under_other_settings_is_rebuilt_under_these(
    r: redis.Redis, settings: Settings, recorded: str, lagging: bool,
) -> None:
    """A changed ``microCompactKeepChars`` changes every elided output's count: the stored
    estimate is not folded on but derived again (a state of an older version records none),
    and the lines a crashed writer left past it are indexed all the same."""
    before = SessionStore(r, settings)
    before.apply(SID, CWD, [*_long_turn(1), *_long_turn(2), *_long_turn(3),
                            {"type": "compact", "uuid": "c", "startTurnId": 1, "endTurnId": 2}])
    if recorded == "none":
        r.hdel(before.keys.session(SID), "settings")
    if lagging:
        before.log(SID, CWD).append([user(4, "late", uuid="u-late")])  # appended, state never saved
    changed = settings.model_copy(update={"context": settings.context.model_copy(
        update={"micro_compact_keep_chars": 200})})
    store = SessionStore(r, changed)
    log = store.log(SID, CWD)
    with log.lock():
        state = store.current(SID, CWD, log)
    assert state == rebuild(SID, CWD, log.read(), changed.context, log.size())
    assert state.settings == changed.context.state_fingerprint != settings.context.state_fingerprint
    stale = before.load(SID)
    assert stale is not None and state.prompt_estimate > stale.prompt_estimate  # 2 outputs shown longer
    if lagging:
        assert [err.field for _, err in store.apply(SID, CWD, [user(4, "again", uuid="u-late")]).rejected] == ["uuid"]


def test_a_state_under_other_settings_whose_log_this_reader_may_not_write_is_kept_as_stored(
        r: redis.Redis, settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rebuild takes the log's lock, which opens it to write: one read-only log (chattr +i, a
    mount) made ``GET /api/sessions`` and ``compactor status`` fail whole (500 log_write_failed)."""
    before = SessionStore(r, settings)
    before.apply(SID, CWD, [*_long_turn(1), *_long_turn(2)])
    stored = before.load(SID)
    changed = settings.model_copy(update={"context": settings.context.model_copy(
        update={"micro_compact_keep_chars": 200})})

    def read_only(self: SessionLog) -> None:
        raise LogWriteFailed(f"{self.path}: cannot open: [Errno 1] Operation not permitted")

    monkeypatch.setattr(SessionLog, "_acquire", read_only)
    assert SessionStore(r, changed).load_current(SID) == stored


def test_a_state_under_other_settings_whose_log_another_process_keeps_locked_is_kept_as_stored(
        r: redis.Redis, settings: Settings) -> None:
    """A reader's store (``READER_LOCK_WAIT_S``) stops waiting for a lock a stopped process holds:
    ``GET /api/sessions`` and ``compactor status`` waited as long, for every session."""
    import fcntl

    before = SessionStore(r, settings)
    before.apply(SID, CWD, [*_long_turn(1), *_long_turn(2)])
    stored = before.load(SID)
    changed = settings.model_copy(update={"context": settings.context.model_copy(
        update={"micro_compact_keep_chars": 200})})
    holder = os.open(before.log(SID, CWD).path, os.O_RDONLY)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)  # another open file: another process, as flock sees it
        started = time.monotonic()
        assert SessionStore(r, changed, lock_wait_s=0.2).load_current(SID) == stored
        assert time.monotonic() - started < 2
    finally:
        os.close(holder)
    assert SessionStore(r, changed, lock_wait_s=0.2).load_current(SID) != stored  # free: rebuilt, stored


def test_a_new_sessions_batch_refused_whole_leaves_no_log_and_no_state(store: SessionStore) -> None:
    """The log was created by the lock before the batch was refused: an empty file made the
    session known (the API's 200 instead of SPEC §7's 404, a row in ``status``) though nothing of
    it was ever written."""
    far = summary(1, "s-far")  # past the turns of a session that has none
    result = store.apply(SID, CWD, [far])
    assert [err.field for _, err in result.rejected] == ["lastSummarizedTurnId"] and result.discarded
    log = store.log(SID, CWD)
    assert not log.exists() and store.load(SID) is None
    store.apply(SID, CWD, [user(1, "a")])  # the session's first accepted event creates it
    assert [e["content"] for e in log.read()] == ["a"] and store.load(SID) is not None
    assert not store.apply(SID, CWD, [far]).discarded and log.exists()  # a log with lines stays


def test_a_writer_waiting_for_the_lock_of_a_removed_log_opens_it_again(
        store: SessionStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second writer opened the log, then waited for the lock while the first removed it
    (``discard_if_empty``): its lines went into the removed file, lost. It opens the path again."""
    first, second = store.log(SID, CWD), store.log(SID, CWD)
    opened = threading.Event()
    real_open = os.open

    def spying_open(path: Any, *args: Any, **kwargs: Any) -> int:
        fd = real_open(path, *args, **kwargs)
        if threading.current_thread() is not threading.main_thread():
            opened.set()
        return fd

    with first.lock():
        monkeypatch.setattr(os, "open", spying_open)
        writer = threading.Thread(target=lambda: second.append([user(1, "kept")]))
        writer.start()
        assert opened.wait(5)
        time.sleep(0.2)  # the writer now waits in flock on the file it opened
        assert first.discard_if_empty()
    writer.join(5)
    monkeypatch.undo()
    assert [e["content"] for e in first.read()] == ["kept"]


def test_a_deferred_save_of_a_rebuilt_state_yields_to_a_later_writers(store: SessionStore, r: redis.Redis) -> None:
    """The watcher's save (sent at the end of its round) of a state it rebuilt for a session Redis
    had no state of was stored over the state a micro job saved meanwhile: status showed the
    session over its threshold, uncompacted, until its next event (a backlog after a restart)."""
    pipe = r.pipeline(transaction=False)
    store.apply(SID, CWD, [user(1, "a"), turn_end(1)], pipeline=pipe)  # the watcher's round
    store.apply(SID, CWD, [user(2, "b")])  # a worker's append, stored at once
    pipe.execute()  # the round's saves
    log = store.log(SID, CWD)
    assert store.load(SID) == rebuild(SID, CWD, log.read(), store.settings.context, log.size())


def test_lines_are_stamped_with_the_encoding_of_the_model_known_as_they_come(store: SessionStore) -> None:
    """A session_meta naming gpt-4o in the batch of turn 1 (the usual first batch of an agent):
    turn 1 was stamped with cl100k_base, the state's encoding before the batch, so every reader
    recounted those lines with o200k_base."""
    meta = {"type": "session_meta", "uuid": "m", "timestamp": "2026-01-01T00:00:00Z", "model": "gpt-4o"}
    store.apply(SID, CWD, [meta, user(1, "hello there"), {**turn_end(1), "model": "gpt-4o"}, user(2, "and gpt-4?"),
                           {**turn_end(2), "model": "gpt-4"}, user(3, "back to cl100k")])
    stamps = {e.get("content"): e.get("tokenEncoding") for e in store.log(SID, CWD).read() if e["type"] == "user"}
    assert stamps == {"hello there": "o200k_base", "and gpt-4?": "o200k_base", "back to cl100k": "cl100k_base"}
    log = store.log(SID, CWD)
    assert store.load(SID) == rebuild(SID, CWD, log.read(), store.settings.context, log.size())


@pytest.mark.parametrize("how", ["redis lost the state", "settings changed", "rollback appended"])
def test_a_long_rebuild_keeps_the_callers_progress(store: SessionStore, r: redis.Redis, settings: Settings,
                                                   monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """A 100 MB log without stamps took 17 s to rebuild, in the watcher's apply, with no progress
    kept: the watcher lost every shard lease, took them again, rebuilt again: every shard stalled
    for good. The read and fold of a big log run while ``progress`` (the lease renewal) is called."""
    import compactor.store as store_module

    store.apply(SID, CWD, [user(1, "hello world", "1-0"), turn_end(1, "2-0")])
    monkeypatch.setattr(store_module, "BIG_LOG_BYTES", 1, raising=False)  # every log is big
    slow = store_module.rebuild

    def slow_rebuild(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.5)
        return slow(*args, **kwargs)

    monkeypatch.setattr(store_module, "rebuild", slow_rebuild)
    if how == "redis lost the state":
        r.flushall()
    elif how == "settings changed":
        ctx = settings.context.model_copy(update={"micro_compact_min_chars": 50})
        store = SessionStore(r, settings.model_copy(update={"context": ctx}))
    calls: list[float] = []
    events = [user(2, "y", "3-0")] if how != "rollback appended" else [
        {"type": "rollback", "uuid": "rb", "timestamp": "2026-01-01T00:00:00Z", "throughTurnId": 1, "reason": "x",
         "streamId": "3-0"}]
    store.apply(SID, CWD, events, progress=lambda: calls.append(time.monotonic()))
    assert len(calls) >= 5, len(calls)  # every ~50 ms through the 0.5 s rebuild, not once per event


@pytest.mark.parametrize("bound, cwd", [("/srv/caf\u00e9", "/srv/cafe\u0301"), ("/srv/app", "/srv/a\u034fpp"),
                                        ("/srv/app", "/srv/\u0430pp")], ids=["nfc-nfd", "joiner", "cyrillic"])
def test_a_cwd_refused_for_one_past_ascii_is_written_escaped(bound: str, cwd: str) -> None:
    """"session s1 is bound to cwd '/srv/café', not '/srv/café'": two paths that read the same."""
    from compactor.store import bound_elsewhere

    message = str(bound_elsewhere("s1", bound, cwd))
    assert f"is bound to cwd {ascii(bound)}, not {ascii(cwd)}" in message
    assert message.isascii()
    assert str(bound_elsewhere("s1", "/srv/app", "/srv/other")).endswith("is bound to cwd '/srv/app', not '/srv/other'")
