"""The watcher in-process: ordering, exactly-once, redelivery, fencing, group loss, held-back sessions."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from rq.utils import as_text

from compactor.keys import Keys
from compactor.store import SessionStore
from events.config import Settings
from events.errors import LogWriteFailed
from events.log import SessionLog
from events.state import rebuild
from events.tokens import count_tokens
from producer.publisher import Publisher
from producer.watcher import Watcher
from producer.watcher.entries import entry_uuid
from producer.watcher.orphans import letter_orphans
from tests.producer.conftest import (
    CWD,
    backlog,
    drain,
    fast_settings,
    log_lines,
    sessions_on_shard,
    turn_end,
    user,
)


def publish_turns(publisher: Publisher, sessions: list[str], turns: int) -> dict[str, list[str]]:
    """Interleave ``turns`` turns (user + turn_end) of every session; the stream ids per session."""
    ids: dict[str, list[str]] = {sid: [] for sid in sessions}
    for turn in range(1, turns + 1):
        for sid in sessions:
            ids[sid] += publisher.publish(sid, CWD, [user(turn, f"{sid} turn {turn}"), turn_end(turn)])
    return ids


def assert_applied_once_in_order(settings: Settings, published: dict[str, list[str]]) -> None:
    for sid, ids in published.items():
        lines = log_lines(settings, sid)
        assert [line["streamId"] for line in lines] == ids, sid


def test_two_sessions_per_shard_are_applied_in_order_exactly_once(
    r: redis.Redis, tmp_path: Path, redis_url: str
) -> None:
    settings = fast_settings(tmp_path / "data", redis_url, shards=2, batch_size=7)
    sessions = sessions_on_shard(settings, 0, 2) + sessions_on_shard(settings, 1, 2)
    published = publish_turns(Publisher(r, settings), sessions, turns=25)
    # an agent in another language XADDs its events without a uuid: the watcher derives one
    raw = r.xadd(Keys(settings.redis.prefix, 2).stream_for(sessions[0]),
                 {"session": sessions[0], "cwd": CWD, "event": orjson.dumps(user(26, "raw"))}).decode()
    published[sessions[0]].append(raw)
    watcher = Watcher(r, settings, name="w")
    drain(watcher, r, settings)
    assert_applied_once_in_order(settings, published)
    first, last = log_lines(settings, sessions[0])[0], log_lines(settings, sessions[0])[-1]
    assert first["uuid"] != entry_uuid(sessions[0], first["streamId"])  # the Publisher's own
    assert last["uuid"] == entry_uuid(sessions[0], raw)
    assert first["timestamp"].endswith("Z")
    assert first["tokenCount"] == count_tokens(f"{sessions[0]} turn 1", "cl100k_base") + 4
    watcher.close()


def test_a_read_brings_a_bounded_number_of_bytes_beginning_at_the_next_shard_each_time(r: redis.Redis) -> None:
    """One read of 256 entries per shard, each under maxEventBytes, was a reply of gigabytes built
    inside Redis (every client waiting) past the watcher's socket timeout, and read again at each
    retry: a backlog of large events wedged the watcher for good. A read stops once its entries
    pass its byte budget (by one chunk at most); the shards after are read next time, first."""
    from producer.watcher.streams import READ_CHUNK, ShardStreams

    keys = Keys()
    streams = ShardStreams(r, keys, "me")
    size = 10_000
    for n in (0, 1):
        r.set(keys.lease(n), "me")
        streams.ensure_group(n)
        for i in range(100):
            r.xadd(keys.stream(n), {"session": "x", "cwd": CWD, "event": f"{n}:{i}:" + "y" * size})

    def read(starts: dict[int, str]) -> tuple[int, list[Any], int]:
        results = streams.read_many(starts, 256, budget=50_000)
        [(shard, entries)] = [(n, result.entries) for n, result in results.items() if result.entries]
        [deferred] = [n for n, result in results.items() if result.deferred]
        brought = sum(len(item) for _, fields in entries for item in fields)  # (flat: field, value, ...)
        assert 50_000 <= brought <= 50_000 + READ_CHUNK * (size + 100), brought
        return shard, entries, deferred

    first, entries, other = read({0: ">", 1: ">"})
    assert other != first
    assert [fields[fields.index(b"event") + 1][:4] for _, fields in entries][:2] == [f"{first}:0:".encode(),
                                                                                      f"{first}:1:".encode()]
    again, more, _ = read({0: ">", 1: ">"})
    assert again == other  # (the shard left out begins the next read)
    # ... and a sweep of a PEL goes on from the last entry it brought, as far as the budget
    sweep, swept, _ = read({first: "0-0", other: "0-0"} if again == 1 else {other: "0-0", first: "0-0"})
    pending = [entry_id for entry_id, _ in (entries if sweep == first else more)]
    assert swept and [entry_id for entry_id, _ in swept] == pending[:len(swept)]
    [result] = streams.read_many({sweep: as_text(swept[-1][0])}, 256, budget=50_000).values()
    assert [entry_id for entry_id, _ in result.entries][0] == pending[len(swept)]
    # a shard's entries seen large, its next read starts in chunks the budget takes: past it by one entry
    [result] = streams.read_many({first: ">"}, 256, budget=50_000).values()
    assert 50_000 <= sum(len(item) for _, fields in result.entries for item in fields) < 50_000 + size + 100


def test_a_shard_deferred_by_a_read_begins_the_next(r: redis.Redis) -> None:
    """Each read began one shard further on: the shard right after one of large entries, which
    spends each read's budget, was deferred 7 reads in 8 (its sessions' turns waited minutes)."""
    from producer.watcher.streams import ShardStreams

    keys = Keys()
    streams = ShardStreams(r, keys, "me")
    for n in range(4):
        r.set(keys.lease(n), "me")
        streams.ensure_group(n)
        pipe = r.pipeline(transaction=False)
        for i in range(100 if n == 0 else 1_500):
            pipe.xadd(keys.stream(n), {"session": "x", "cwd": CWD, "event": "y" * (10_000 if n == 0 else 50)})
        pipe.execute()
    deferred_before: set[int] = set()
    for _ in range(8):
        results = streams.read_many({n: ">" for n in range(4)}, 256, budget=50_000)
        deferred = {n for n, result in results.items() if result.deferred}
        assert not deferred & deferred_before - {0}, (deferred, deferred_before)  # (a small shard: one read at most)
        deferred_before = deferred


def test_a_backlog_of_large_events_is_applied_whole_in_bounded_reads(
    r: redis.Redis, tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reads cut short by their budget (here: one chunk per read) lose nothing and keep the order."""
    from producer.watcher import streams

    monkeypatch.setattr(streams, "READ_BUDGET_BYTES", 1)
    settings = fast_settings(tmp_path / "data", redis_url, shards=2, batch_size=256)
    sessions = sessions_on_shard(settings, 0, 2) + sessions_on_shard(settings, 1, 2)
    published = publish_turns(Publisher(r, settings), sessions, turns=30)
    watcher = Watcher(r, settings, name="w")
    drain(watcher, r, settings)
    assert_applied_once_in_order(settings, published)
    watcher.close()


def test_entries_redelivered_after_a_crash_before_the_ack_are_not_applied_twice(
    r: redis.Redis, fast: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    published = publish_turns(Publisher(r, fast), ["a1", "b2", "c3"], turns=10)
    crashed = Watcher(r, fast, name="crashed")

    def crash(*args: Any, **kwargs: Any) -> bool:
        raise redis.ConnectionError("killed before the ack")

    monkeypatch.setattr(crashed.streams, "ack_many", crash)
    crashed.run_once()
    with pytest.raises(redis.ConnectionError):
        while True:
            crashed.run_once()
    assert sum(len(log_lines(fast, sid)) for sid in published) > 0
    assert backlog(r, fast) == 60  # everything still pending
    for n in list(crashed.leases.owned):  # the process died: its leases lapse
        r.delete(Keys().lease(n))
    successor = Watcher(r, fast, name="successor")
    drain(successor, r, fast)
    assert_applied_once_in_order(fast, published)


def test_a_watcher_whose_lease_was_taken_writes_and_acks_nothing(r: redis.Redis, fast: Settings) -> None:
    watcher = Watcher(r, fast, name="old")
    watcher.run_once()
    assert len(watcher.leases.owned) == 8
    for n in range(8):
        r.set(Keys().lease(n), "someone-else")
    published = publish_turns(Publisher(r, fast), ["a1"], turns=2)
    assert watcher.run_once() == 0
    assert log_lines(fast, "a1") == [] and not watcher.leases.owned
    for n in range(8):
        r.delete(Keys().lease(n))
    drain(Watcher(r, fast, name="new"), r, fast)
    assert_applied_once_in_order(fast, published)


def test_a_lease_that_expires_while_the_batch_is_in_hand_stops_the_write(
    r: redis.Redis, fast: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    watcher = Watcher(r, fast, name="paused")
    watcher.run_once()
    published = publish_turns(Publisher(r, fast), ["a1"], turns=1)
    shard = Keys().shard_of("a1")
    read_many = watcher.streams.read_many

    def read_then_pause(*args: Any) -> Any:
        results = read_many(*args)
        watcher.leases.owned[shard].valid_until = 0.0  # paused past its lease...
        watcher.leases.owned[shard].renewed_at = 1e18  # ...(no renewal on the spot)
        r.set(Keys().lease(shard), "taker")  # ...and another watcher took the shard
        return results

    monkeypatch.setattr(watcher.streams, "read_many", read_then_pause)
    assert watcher.run_once() == 2
    assert log_lines(fast, "a1") == [] and shard not in watcher.leases.owned
    assert backlog(r, fast) == 2
    r.delete(Keys().lease(shard))
    drain(Watcher(r, fast, name="taker"), r, fast)
    assert_applied_once_in_order(fast, published)


def test_a_run_longer_than_the_lease_is_applied_and_the_other_leases_kept(
    r: redis.Redis, fast: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A turn of many large outputs (their tokens counted, ~1 s per 4 MiB) outlived the lease
    before its write: the write was refused, the run read again, forever; the watcher's other
    leases lapsed meanwhile. Here each event takes 0.3 s against a 1 s lease."""
    from compactor import store as store_module

    real = store_module.stamp

    def slow(event: dict[str, Any], encoding: str) -> dict[str, Any]:
        time.sleep(0.3)
        return real(event, encoding)

    watcher = Watcher(r, fast, name="slow")
    watcher.run_once()
    owned = set(watcher.leases.owned)
    assert len(owned) == fast.redis.shards
    monkeypatch.setattr(store_module, "stamp", slow)
    published = {"a1": Publisher(r, fast).publish("a1", CWD, [user(1, f"part {n}") for n in range(8)] + [turn_end(1)])}
    drain(watcher, r, fast, timeout_s=30)  # one run of 9 events: 2.7 s
    assert_applied_once_in_order(fast, published)
    assert set(watcher.leases.owned) == owned  # no lease lapsed, none changed hands


# One output whose count takes tiktoken well over the 1 s lease: 2.5 M characters took 0.73-0.9 s
# on a quiet VM, and the tests' own check of that failed.
BIG_CHARS = 6_000_000


def _roomy(settings: Settings) -> Settings:
    """``settings`` taking an event of ``BIG_CHARS`` (over the 4 MiB default)."""
    return settings.model_copy(update={"limits": settings.limits.model_copy(update={"max_event_bytes": 8 << 20})})


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_one_event_whose_count_outlasts_the_lease_is_applied_and_the_leases_kept(
    r: redis.Redis, fast: Settings
) -> None:
    """An output of one character repeated takes tiktoken seconds to count (here ~2 s against a
    1 s lease): the write was refused, the entry read again, forever, and every shard of the
    watcher stalled (renewals came between events only)."""
    fast = _roomy(fast)
    big = "." * BIG_CHARS
    started = time.monotonic()
    assert count_tokens(big, "cl100k_base") > 0
    assert time.monotonic() - started > fast.watcher.lease_ms / 1000  # (the case: longer than the lease)
    watcher = Watcher(r, fast, name="slow")
    watcher.run_once()
    owned = set(watcher.leases.owned)
    assert len(owned) == fast.redis.shards
    publisher = Publisher(r, fast)
    published = {"big": publisher.publish("big", CWD, [user(1, big), turn_end(1)])}
    for n in range(6):  # on the other shards too
        published[f"s{n}"] = publisher.publish(f"s{n}", CWD, [user(1), turn_end(1)])
    drain(watcher, r, fast, timeout_s=60)
    assert_applied_once_in_order(fast, published)
    assert set(watcher.leases.owned) == owned  # no lease lapsed, none changed hands


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_recount_of_the_log_longer_than_the_lease_keeps_the_leases(r: redis.Redis, fast: Settings) -> None:
    """Events after a rollback are checked against the log replayed; once the session's model
    changed encoding, every line is recounted there: with such an output in the log that took
    longer than the lease, before the write, so the entries were read again, forever."""
    fast = _roomy(fast)
    big = "." * BIG_CHARS
    publisher = Publisher(r, fast)
    watcher = Watcher(r, fast, name="slow")
    published = {"big": publisher.publish("big", CWD, [user(1, big), turn_end(1), user(2),
                                                       turn_end(2, model="gpt-4o")])}  # cl100k, then o200k
    drain(watcher, r, fast, timeout_s=60)
    owned = set(watcher.leases.owned)
    assert len(owned) == fast.redis.shards
    started = time.monotonic()
    assert count_tokens(big, "o200k_base") > 0
    assert time.monotonic() - started > fast.watcher.lease_ms / 1000  # (the case: longer than the lease)
    rollback = {"type": "rollback", "throughTurnId": 3, "reason": "nothing to undo"}
    published["big"] += publisher.publish("big", CWD, [rollback, user(3)])  # user(3): checked against a replay
    drain(watcher, r, fast, timeout_s=60)
    assert_applied_once_in_order(fast, published)
    assert set(watcher.leases.owned) == owned  # no lease lapsed, none changed hands


def test_a_session_state_deleted_while_the_watcher_runs_is_stored_again_at_its_next_event(
    r: redis.Redis, fast: Settings
) -> None:
    """README's remedy for a repaired log is ``DEL {p}:session:ID``. The running watcher's cached
    state still matched the log, and a save that may not create the hash stored nothing: the
    session stayed missing (``status``, the status page) while its events kept coming."""
    keys = Keys(fast.redis.prefix, fast.redis.shards)
    publisher = Publisher(r, fast)
    watcher = Watcher(r, fast, name="w")
    published = publisher.publish("a1", CWD, [user(1), turn_end(1)])
    drain(watcher, r, fast)
    r.delete(keys.session("a1"))
    published += publisher.publish("a1", CWD, [user(2), turn_end(2)])  # no uuids: no lookup of the session
    drain(watcher, r, fast)
    published += publisher.publish("a1", CWD, [user(3), turn_end(3)])
    drain(watcher, r, fast)
    assert_applied_once_in_order(fast, {"a1": published})
    log = SessionLog(fast.data_dir, CWD, "a1")
    assert SessionStore(r, fast).load("a1") == rebuild("a1", CWD, log.read(), fast.context, log.size())


def test_lost_stream_and_group_are_recreated(r: redis.Redis, fast: Settings) -> None:
    publisher = Publisher(r, fast)
    watcher = Watcher(r, fast, name="w")
    first = publish_turns(publisher, ["a1"], turns=1)
    drain(watcher, r, fast)
    r.delete(Keys().stream_for("a1"))  # Redis lost the stream and its group
    watcher.run_once()
    second = publish_turns(publisher, ["a1"], turns=3)
    second["a1"] = second["a1"][2:]  # turn 1 again: its turnId goes backwards now
    drain(watcher, r, fast)
    assert [line["streamId"] for line in log_lines(fast, "a1")] == first["a1"] + second["a1"]
    assert r.xinfo_groups(Keys().stream_for("a1"))[0]["name"] == Keys().group.encode()


def test_a_lost_stream_that_numbers_its_entries_lower_than_the_log_loses_none(r: redis.Redis, fast: Settings) -> None:
    """A producer had chosen an id in the future (or Redis came back on a host whose clock is
    behind), then Redis lost the stream: the new entries sort below the log's last streamId,
    and were acked as duplicates, every new event of the session dropped without a word."""
    stream = Keys().stream_for("a1")
    watcher = Watcher(r, fast, name="w")
    future = [r.xadd(stream, {"session": "a1", "cwd": CWD, "event": json.dumps(event)}, id=entry_id).decode()
              for event, entry_id in ((user(1), "4102444800000-0"), (turn_end(1), "4102444800000-1"))]
    drain(watcher, r, fast)
    r.delete(stream)  # Redis lost the stream (and its group); it numbers from the clock again
    watcher.run_once()
    later = Publisher(r, fast).publish("a1", CWD, [user(2), turn_end(2)])
    drain(watcher, r, fast)
    assert [line["streamId"] for line in log_lines(fast, "a1")] == future + later
    assert r.xlen(Keys().dead) == 0


def test_a_lost_streams_new_entries_below_the_log_are_applied_once_later_ones_pass_it(
        r: redis.Redis, fast: Settings) -> None:
    """Redis lost the stream and its clock is 10 s behind: by the time the watcher read them, the
    newest entries had passed the log's last streamId, and every older one not in the log was
    acked as a duplicate, unsaid (turns 2 and 3 lost). Only an entry dead-lettered ahead of its ack
    is one: whether it was is kept in ``{p}:lettered:{n}``."""
    stream = Keys().stream_for("a1")
    watcher = Watcher(r, fast, name="w")
    last = int(time.time() * 1000) + 10_000
    first = [r.xadd(stream, {"session": "a1", "cwd": CWD, "event": json.dumps(event)}, id=entry_id).decode()
             for event, entry_id in ((user(1), f"{last}-0"), (turn_end(1), f"{last}-1"))]
    drain(watcher, r, fast)
    r.delete(stream)  # Redis lost the stream (and its group)
    watcher.run_once()
    later = [r.xadd(stream, {"session": "a1", "cwd": CWD, "event": json.dumps(event)}, id=entry_id).decode()
             for event, entry_id in ((user(2), f"{last - 9000}-0"), (turn_end(2), f"{last - 9000}-1"),
                                     (user(3), f"{last - 3000}-0"), (turn_end(3), f"{last - 3000}-1"),
                                     (user(4), f"{last + 2000}-0"), (turn_end(4), f"{last + 2000}-1"))]
    drain(watcher, r, fast)
    assert [line["streamId"] for line in log_lines(fast, "a1")] == first + later
    for cursor in watcher.cursors.values():  # all of them delivered again (a restart): none applied twice
        cursor.restart_sweep()
    r.xgroup_setid(stream, Keys().group, "0")
    drain(watcher, r, fast)
    assert [line["streamId"] for line in log_lines(fast, "a1")] == first + later
    assert r.xlen(Keys().dead) == 0


def test_after_redis_lost_its_data_a_new_entry_given_an_old_entrys_id_is_applied_not_dropped(
        r: redis.Redis, fast: Settings) -> None:
    """With no uuid sent, the watcher derives one from the entry id: after Redis lost its data, a
    new entry numbered like an old one (a producer's own ids) took the old line's uuid and was
    acked as its redelivery, dropped without a word. One whose content is its line's is one."""
    stream = Keys().stream_for("a1")
    watcher = Watcher(r, fast, name="w")
    meta = {"type": "session_meta", "model": "gpt-4", "createdAt": "2024-01-01T00:00:00Z"}
    call = {"type": "assistant", "turnId": 1, "content": "", "tokenCount": 7,
            "toolCalls": [{"id": "c", "name": "read_file", "arguments": {"path": "/a"}}]}
    result = {"type": "tool_result", "turnId": 1, "toolCallId": "c", "toolName": "read_file", "output": "x"}
    bare = {"type": "assistant", "turnId": 1, "content": "no calls", "flag": True}  # (defaults filled in the log?)
    old = [meta, user(1, "old 1"), call, result, bare, turn_end(1), {**user(2, "old 2"), "attachments": ["a"]}]
    ids = [f"7-{n}" for n in range(1, len(old) + 1)]

    def add(pairs: list[tuple[dict[str, Any], str]]) -> None:
        for event, entry_id in pairs:
            r.xadd(stream, {"session": "a1", "cwd": CWD, "event": json.dumps(event)}, id=entry_id)

    add(list(zip(old, ids)))
    drain(watcher, r, fast)
    written = log_lines(fast, "a1")
    r.flushall()  # Redis lost everything: the state, the uuid index, the stream
    watcher.run_once()
    add(list(zip(old, ids)))  # the same entries again (a producer's retry, a restored copy): the same lines
    drain(watcher, r, fast)
    assert log_lines(fast, "a1") == written
    r.flushall()
    watcher.run_once()
    add([(user(2, "new below"), "6-1"), (user(2, "new under an old id"), "7-3"),
         (user(2, "old 2"), "7-7"), (turn_end(2), "7-9")])  # (7-7: its line's but for a field less)
    drain(watcher, r, fast)
    lines = log_lines(fast, "a1")
    assert [line.get("content") for line in lines[len(written):]] == ["new below", "new under an old id",
                                                                      "old 2", None]
    assert len({line["uuid"] for line in lines}) == len(lines)
    for cursor in watcher.cursors.values():  # all of them delivered again (a restart): none applied twice
        cursor.restart_sweep()
    r.xgroup_setid(stream, Keys().group, "0")
    drain(watcher, r, fast)
    assert log_lines(fast, "a1") == lines and r.xlen(Keys().dead) == 0


def test_a_round_reads_every_shard_in_one_script_call(r: redis.Redis, fast: Settings) -> None:
    """All owned shards are read by one fenced script call (8 before), also when one shard's
    group is missing: that shard is recreated, the others are read in the same call."""
    publisher = Publisher(r, fast)
    watcher = Watcher(r, fast, name="w")
    drain(watcher, r, fast)
    r.config_resetstat()
    assert watcher.run_once() == 0
    calls = {name.removeprefix("cmdstat_"): stats["calls"] for name, stats in r.info("commandstats").items()}
    assert calls.get("evalsha") == 1 and "eval" not in calls
    sessions = [f"g{n}" for n in range(40)]
    published = publish_turns(publisher, sessions, turns=1)
    lost = Keys().shard_of(sessions[0])
    r.xgroup_destroy(Keys().stream(lost), Keys().group)
    handled = watcher.run_once()
    others = [sid for sid in sessions if Keys().shard_of(sid) != lost]
    assert handled == sum(len(published[sid]) for sid in others)
    drain(watcher, r, fast)
    for sid in sessions:
        assert [line["streamId"] for line in log_lines(fast, sid)] == published[sid]


def fail_appends(monkeypatch: pytest.MonkeyPatch, times: int, stem: str | None = None) -> dict[str, int]:
    """``SessionLog.append`` fails as on a full disk ``times`` times (only the log named ``stem``'s,
    when given); the count of failures left."""
    original = SessionLog.append
    failures = {"left": times}

    def append(self: SessionLog, events: list[dict[str, Any]]) -> int:
        if (stem is None or self.path.stem == stem) and failures["left"] > 0:
            failures["left"] -= 1
            raise LogWriteFailed("No space left on device")
        return original(self, events)

    monkeypatch.setattr(SessionLog, "append", append)
    return failures


def test_a_session_whose_append_fails_is_held_back_and_retried_in_order(
    r: redis.Redis, fast: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    published = publish_turns(Publisher(r, fast), ["full", "fine"], turns=3)
    full_disk = 1_000_000  # "full"'s appends fail until told otherwise, below
    failures = fail_appends(monkeypatch, full_disk, stem="full")
    watcher = Watcher(r, fast, name="w")
    # Rounds until both sessions were read, not two: a round reads only the shards whose lease is
    # still trusted (0.8 s of the 1 s lease), and a first tick slowed past that on a loaded machine
    # left a shard unread by two rounds.
    deadline = time.monotonic() + 20
    while len(log_lines(fast, "fine")) < len(published["fine"]) or failures["left"] == full_disk:
        assert time.monotonic() < deadline, "the watcher never read both sessions"
        watcher.run_once()
    assert [line["streamId"] for line in log_lines(fast, "fine")] == published["fine"]
    assert log_lines(fast, "full") == [] and backlog(r, fast) == 6
    failures["left"] = 1  # the disk stays full for one more try
    more = publish_turns(Publisher(r, fast), ["full"], turns=4)["full"][6:]
    drain(watcher, r, fast)
    assert failures["left"] == 0
    assert [line["streamId"] for line in log_lines(fast, "full")] == published["full"] + more


def test_a_log_another_process_keeps_locked_holds_back_its_session_only(
    r: redis.Redis, fast: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One paused process holding one log's lock (a worker stopped mid-read: ``docker pause``, a
    frozen VM) blocked the watcher in ``flock`` for as long: no session of any shard was written,
    and its leases lapsed. The session is held back, the others go on, and once the lock is free
    its entries are applied in order, once."""
    import fcntl
    import threading

    monkeypatch.setattr("producer.watcher.core.LOG_LOCK_WAIT_S", 0.1)
    monkeypatch.setattr("producer.watcher.batch.HOLD_RETRY_S", 0.2)
    publisher = Publisher(r, fast)
    published = publish_turns(publisher, ["stuck", "free"], turns=1)
    watcher = Watcher(r, fast, name="w")
    drain(watcher, r, fast)
    holder = os.open(SessionLog(fast.data_dir, CWD, "stuck").path, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)  # another open file: another process, as flock sees it
    once = threading.Lock()

    def release() -> None:
        if once.acquire(blocking=False):
            os.close(holder)

    safety = threading.Timer(10, release)  # (the code before: blocked until this)
    safety.start()
    try:
        for turn in (2, 3):
            for sid in ("stuck", "free"):
                published[sid] += publisher.publish(sid, CWD, [user(turn), turn_end(turn)])
        started = time.monotonic()
        while len(log_lines(fast, "free")) < 6 and time.monotonic() - started < 5:
            watcher.run_once()
        assert time.monotonic() - started < 5 and safety.is_alive()  # while the lock is held
        assert [line["streamId"] for line in log_lines(fast, "free")] == published["free"]
        assert [line["streamId"] for line in log_lines(fast, "stuck")] == published["stuck"][:2]
        assert b"locked by another process" in r.hget(Keys().held, "stuck")
    finally:
        safety.cancel()
        release()
    drain(watcher, r, fast)
    assert [line["streamId"] for line in log_lines(fast, "stuck")] == published["stuck"]
    assert not r.hexists(Keys().held, "stuck")


def test_an_entry_refused_beside_a_failing_append_is_lettered_once(
    r: redis.Redis, fast: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its letter is written before the append; the append failed (a full disk) and was retried
    once a second, each retry writing the letter again: 9 copies in 10 s, pushing genuine letters
    out of a stream kept 100 000 long."""
    publisher = Publisher(r, fast)
    publisher.publish("full", CWD, [user(1), turn_end(1), user(2)])
    drain(Watcher(r, fast, name="first"), r, fast)
    publisher.publish("full", CWD, user(2, "more"))
    publisher.publish("full", CWD, user(1, "backwards"))  # refused by the watcher, in the same run
    failures = fail_appends(monkeypatch, 3)
    watcher = Watcher(r, fast, name="w")
    monkeypatch.setattr("producer.watcher.batch.HOLD_RETRY_S", 0.0)
    deadline = time.monotonic() + 20
    while (failures["left"] or backlog(r, fast)) and time.monotonic() < deadline:
        watcher.run_once()
    assert failures["left"] == 0 and backlog(r, fast) == 0
    letters = [fields for _, fields in r.xrange(Keys().dead)]
    assert [f[b"reason"] for f in letters] == [b"turnId: goes backwards: 1 < currentTurnId 2"]
    assert [line.get("content") for line in log_lines(fast, "full")][-1] == "more"


def _lettered_ahead_and_held(r: redis.Redis, fast: Settings, monkeypatch: pytest.MonkeyPatch,
                             send: Any, session_id: str = "full") -> tuple[str, int]:
    """Session ``session_id`` with a refused entry lettered ahead of its append, the append failed (held,
    still pending), then the watcher gone (its leases lapse); the entry's id and its shard.
    ``send(event)`` publishes one event of the session and gives its stream id."""
    for event in [user(1), turn_end(1), user(2)]:
        send(event)
    first = Watcher(r, fast, name="first")
    drain(first, r, fast)
    first.close()
    send(user(2, "more"))
    back = send(user(1, "backwards"))  # refused by the watcher, in the same run
    failures = fail_appends(monkeypatch, 1)
    crashed = Watcher(r, fast, name="crashed")
    for _ in range(10):
        if failures["left"] == 0:
            break
        crashed.run_once()
    assert failures["left"] == 0 and backlog(r, fast) == 2  # lettered ahead, the append failed: held
    shard = Keys().shard_of(session_id)
    assert r.hkeys(Keys().lettered(shard)) == [back.encode()]
    for n in list(crashed.leases.owned):  # the process died: its leases lapse
        r.delete(Keys().lease(n))
    return back, shard


def test_an_entry_lettered_before_a_failed_append_is_not_lettered_again_by_the_watcher_after(
    r: redis.Redis, fast: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The letter written ahead of an append that failed was remembered in the watcher's memory
    only: after a crash (or the shard's lease lost and taken again) the entry, still pending,
    was refused and lettered a second time, and a replay of the letters applied it twice."""
    publisher = Publisher(r, fast)
    back, shard = _lettered_ahead_and_held(r, fast, monkeypatch, lambda event: publisher.publish("full", CWD, event)[0])
    drain(Watcher(r, fast, name="successor"), r, fast)
    letters = [fields for _, fields in r.xrange(Keys().dead)]
    assert [(f[b"id"].decode(), f[b"reason"]) for f in letters] == [
        (back, b"turnId: goes backwards: 1 < currentTurnId 2")]
    assert [line.get("content") for line in log_lines(fast, "full")][-1] == "more"
    assert not r.exists(Keys().lettered(shard))  # forgotten with the entry's ack


def test_an_entry_lettered_ahead_is_not_lettered_again_by_the_sweep_of_a_lowered_shard_count(
    r: redis.Redis, fast: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``redis.shards`` lowered while the entry waited: the sweep of the streams past the count
    wrote a second letter (``wrong_shard``) and left the entry's mark behind."""
    publisher = Publisher(r, fast)
    back, shard = _lettered_ahead_and_held(r, fast, monkeypatch, lambda event: publisher.publish("a", CWD, event)[0],
                                           session_id="a")
    assert shard >= 2  # past the lowered count
    assert letter_orphans(r, Keys(shards=2), "sweeper") == 2  # both pending entries: one letter each
    assert [f[b"id"].decode() for _, f in r.xrange(Keys().dead)].count(back) == 1
    assert not r.exists(Keys().lettered(shard))


def test_an_entry_with_the_id_of_one_lettered_ahead_before_the_stream_was_lost_is_lettered(
    r: redis.Redis, fast: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lost stream numbers its new entries from where its producers say (or from a clock behind):
    another entry can come with the id of one lettered ahead, and it was acked with no letter."""
    stream = Keys().stream_for("full")
    numbers = iter(range(1, 100))

    def send(event: dict[str, Any]) -> str:
        entry_id = f"1-{next(numbers)}"
        r.xadd(stream, {"session": "full", "cwd": CWD, "event": orjson.dumps(event)}, id=entry_id)
        return entry_id

    back, shard = _lettered_ahead_and_held(r, fast, monkeypatch, send)
    r.delete(stream)  # lost with its backlog; the marks stay
    r.xadd(stream, {"session": "full", "cwd": CWD, "event": b"{not json"}, id=back)
    drain(Watcher(r, fast, name="successor"), r, fast)
    reasons = [f[b"reason"].decode() for _, f in r.xrange(Keys().dead) if f[b"id"].decode() == back]
    assert len(reasons) == 2 and "goes backwards" in reasons[0] and reasons[1].startswith("invalid JSON"), reasons
    assert backlog(r, fast) == 0


def _retry_then_apply_new_turn(watcher: Watcher, publisher: Publisher, settings: Settings, session_id: str,
                               turn: int, within_rounds: int) -> None:
    """Make shard 0's retry of its held sessions due, publish a turn of ``session_id``, and assert
    the watcher applies it within ``within_rounds`` rounds (not behind a read of every held entry)."""
    watcher.cursors[0].retry_at = 0.0
    late = publisher.publish(session_id, CWD, [user(turn), turn_end(turn)])
    rounds = 0
    while [line["streamId"] for line in log_lines(settings, session_id)][-2:] != late:
        assert rounds < within_rounds, "the new entries waited behind a read of every held entry"
        watcher.run_once()
        rounds += 1


def test_a_retry_of_held_sessions_reads_their_pending_entries_once_not_the_whole_pel(
    r: redis.Redis, tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each retry of a held session (once a second) re-read the shard's whole PEL before any new
    entry: with tens of thousands of entries held, the shard's other sessions waited seconds. The
    retry ends once every held session is held again; one that recovers is applied in order."""
    settings = fast_settings(tmp_path / "data", redis_url, shards=1, batch_size=10)
    full, other, fine = sessions_on_shard(settings, 0, 3)
    publisher = Publisher(r, settings)
    published = publish_turns(publisher, [full, other], turns=30)  # 60 entries of `full` held: 6 reads
    failures = fail_appends(monkeypatch, 10_000, stem=full)
    monkeypatch.setattr("producer.watcher.batch.HOLD_RETRY_S", 3600.0)  # retried below, by hand
    watcher = Watcher(r, settings, name="w")
    deadline = time.monotonic() + 20
    while [line["streamId"] for line in log_lines(settings, other)] != published[other]:
        assert time.monotonic() < deadline
        watcher.run_once()
    for retry in range(3):
        _retry_then_apply_new_turn(watcher, publisher, settings, fine, retry + 1, within_rounds=3)
    assert failures["left"] == 10_000 - 4  # held, then retried three times
    failures["left"] = 0  # the disk recovers: the held session's 60 entries are applied in order
    watcher.cursors[0].retry_at = 0.0
    drain(watcher, r, settings)
    assert [line["streamId"] for line in log_lines(settings, full)] == published[full]
    watcher.close()


def test_a_retry_of_held_sessions_far_apart_jumps_from_one_to_the_next(
    r: redis.Redis, tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a second session held behind a thousand entries of the first, each retry read all of
    them to reach the second (102 reads at batchSize 10) before any new entry of the shard."""
    settings = fast_settings(tmp_path / "data", redis_url, shards=1, batch_size=10)
    a, b, fine = sessions_on_shard(settings, 0, 3)
    publisher = Publisher(r, settings)
    publish_turns(publisher, [a, b], turns=1)
    watcher = Watcher(r, settings, name="w")
    drain(watcher, r, settings)
    broken = {a}
    original = SessionLog.append

    def append(self: SessionLog, events: list[dict[str, Any]]) -> int:
        if self.path.stem in broken:
            raise LogWriteFailed("Permission denied")
        return original(self, events)

    monkeypatch.setattr(SessionLog, "append", append)
    monkeypatch.setattr("producer.watcher.batch.HOLD_RETRY_S", 3600.0)  # retried below, by hand
    published = {a: [], b: []}
    for turn in range(2, 102):  # 200 entries of `a` held
        published[a] += publisher.publish(a, CWD, [user(turn), turn_end(turn)])
    while watcher.run_once():
        pass
    broken.add(b)
    published[b] += publisher.publish(b, CWD, [user(2), turn_end(2)])
    while watcher.run_once():
        pass
    assert watcher.cursors[0].held == {a, b}
    for retry in range(2):
        _retry_then_apply_new_turn(watcher, publisher, settings, fine, retry + 1, within_rounds=4)
    broken.discard(b)  # `b` recovers first: applied in order, `a` still held
    watcher.cursors[0].retry_at = 0.0
    for _ in range(6):
        watcher.run_once()
    assert [line["streamId"] for line in log_lines(settings, b)][-2:] == published[b]
    assert watcher.cursors[0].held == {a}
    broken.clear()
    watcher.cursors[0].retry_at = 0.0
    drain(watcher, r, settings)
    assert [line["streamId"] for line in log_lines(settings, a)][2:] == published[a]
    assert r.xlen(Keys().dead) == 0
    watcher.close()


def test_a_shard_lost_and_taken_again_in_one_tick_is_swept_from_its_start(
    r: redis.Redis, tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A watcher whose lease lapsed (paused) and that took the shard back in the same tick kept its
    cursor: no sweep, so entries another owner had left pending meanwhile were skipped, then acked
    as duplicates once a later entry of their session was applied: lost without a word (found
    when the early end of a held session's retry stopped hiding it)."""
    settings = fast_settings(tmp_path / "data", redis_url, shards=1, batch_size=10)
    full, other = sessions_on_shard(settings, 0, 2)
    publisher = Publisher(r, settings)
    keys = Keys(settings.redis.prefix, settings.redis.shards)
    publish_turns(publisher, [full, other], turns=1)
    first = Watcher(r, settings, name="first")
    drain(first, r, settings)
    failures = fail_appends(monkeypatch, 10_000, stem=full)
    monkeypatch.setattr("producer.watcher.batch.HOLD_RETRY_S", 3600.0)
    for turn in range(2, 17):
        publisher.publish(full, CWD, [user(turn), turn_end(turn)])
    first.run_once()  # `full` held back, its entries pending
    assert first.cursors[0].held == {full}
    r.delete(keys.lease(0))  # `first` pauses past its lease
    second = Watcher(r, settings, name="second")
    missed = publisher.publish(other, CWD, [user(2, "read by second, never acked"), turn_end(2)])
    original = SessionLog.append

    def other_fails_once(self: SessionLog, events: list[dict[str, Any]]) -> int:
        if self.path.stem == other and not getattr(other_fails_once, "done", False):
            other_fails_once.done = True  # type: ignore[attr-defined]
            raise LogWriteFailed("No space left on device")
        return original(self, events)

    monkeypatch.setattr(SessionLog, "append", other_fails_once)
    for _ in range(20):  # it takes the shard, sweeps, holds `full`, reads `other`'s entries and holds it
        second.run_once()
        if getattr(other_fails_once, "done", False):
            break
    assert getattr(other_fails_once, "done", False)  # then it dies, `other`'s entries left pending
    r.delete(keys.lease(0))
    first.leases.owned[0].renewed_at = 0.0  # `first` wakes: its renewal fails, the rebalance takes it back
    first._next_tick = 0.0
    first.run_once()
    later = publisher.publish(other, CWD, [user(3), turn_end(3)])
    for i in range(12):  # `full` still held: its retries (every other round here) end early, new entries are read
        first.cursors[0].retry_at = 0.0 if i % 2 else time.monotonic() + 3600.0
        first.run_once()
    assert [line["streamId"] for line in log_lines(settings, other)][-4:] == missed + later
    failures["left"] = 0
    first.cursors[0].retry_at = 0.0
    drain(first, r, settings)
    assert [line["turnId"] for line in log_lines(settings, full)] == [n for n in range(1, 17) for _ in (0, 1)]
    assert r.xlen(keys.dead) == 0
    first.close()


def test_a_held_session_is_logged_once_while_held_and_once_when_applied_again(
    r: redis.Redis, fast: Settings, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Each retry of a held session (once a second) logged two ERROR lines, and nothing said when
    it was applied again."""
    publish_turns(Publisher(r, fast), ["full"], turns=2)
    failures = fail_appends(monkeypatch, 5)
    monkeypatch.setattr("producer.watcher.batch.HOLD_RETRY_S", 0.0)
    watcher = Watcher(r, fast, name="w")
    with caplog.at_level(logging.INFO, logger="producer.watcher.core"):
        drain(watcher, r, fast)
    messages = [rec.getMessage() for rec in caplog.records if "session=full" in rec.getMessage()]
    assert failures["left"] == 0 and len(log_lines(fast, "full")) == 4
    assert [m.split(" session=")[0] for m in messages] == ["append failed, session held back", "session applied again"]


def _held_back(watcher: Watcher, r: redis.Redis, settings: Settings, session_id: str) -> None:
    """Run the watcher until it holds ``session_id`` back (its appends failing)."""
    deadline = time.monotonic() + 20
    while not r.hexists(Keys().held, session_id):
        assert time.monotonic() < deadline, "the session was never held back"
        watcher.run_once()


def test_a_held_session_is_shown_held_back_by_the_api_the_metrics_and_status_until_applied_again(
    r: redis.Redis, fast: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing but the ERROR line (once a minute) and the backlog gauges said a session was held
    back: its state read as if all was well, its new events missing from its context."""
    import io

    from fastapi.testclient import TestClient
    from rich.console import Console

    from compactor.cli.sessions import session_bodies, status_table
    from producer.api import create_app

    publisher = Publisher(r, fast)
    publisher.publish("full", CWD, [user(1), turn_end(1)])
    publisher.publish("fine", CWD, [user(1), turn_end(1)])
    watcher = Watcher(r, fast, name="w")
    drain(watcher, r, fast)
    publisher.publish("full", CWD, [user(2), turn_end(2)])
    failures = fail_appends(monkeypatch, 1_000, stem="full")
    monkeypatch.setattr("producer.watcher.batch.HOLD_RETRY_S", 3600.0)  # retried below, by hand
    _held_back(watcher, r, fast, "full")
    with TestClient(create_app(fast, r)) as client:
        held = client.get("/api/sessions/full", params={"cwd": CWD}).json()["heldBack"]
        assert held["error"] == "No space left on device" and held["watcher"] == watcher.id
        assert abs(held["since"] - time.time()) < 10
        assert client.get("/api/sessions/fine", params={"cwd": CWD}).json()["heldBack"] is None
        rows = {row["sessionId"]: row["heldBack"] for row in client.get("/api/sessions").json()}
        assert rows["full"] == held and rows["fine"] is None
        overview = client.get("/api/overview").json()
        assert overview["sessionsHeldBack"] == 1
        assert overview["heldBack"] == [{"sessionId": "full", "since": held["since"], "error": held["error"]}]
        assert "compactor_sessions_held_back 1.0" in client.get("/metrics").text
        out = io.StringIO()
        Console(file=out, width=200).print(status_table(session_bodies(r, fast, 10)))
        assert [line.split()[:3] for line in out.getvalue().splitlines() if "full" in line] == [
            ["full", "held", "back"]]
        failures["left"] = 0  # the disk recovers
        watcher.cursors[Keys(fast.redis.prefix, fast.redis.shards).shard_of("full")].retry_at = 0.0
        drain(watcher, r, fast)
        assert [line.get("turnId") for line in log_lines(fast, "full")] == [1, 1, 2, 2]
        assert client.get("/api/sessions/full", params={"cwd": CWD}).json()["heldBack"] is None
        assert client.get("/api/overview").json()["sessionsHeldBack"] == 0
        assert "compactor_sessions_held_back 0.0" in client.get("/metrics").text
    assert not r.exists(Keys().held)
    watcher.close()


def test_a_held_record_outlives_a_takeover_and_only_the_holders_fresh_one_is_shown(
    r: redis.Redis, fast: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A paused former owner's write landed after the new owner had applied the session: shown as
    held back, and never deleted; a takeover reset `since`; records of stopped watchers stayed."""
    from fastapi.testclient import TestClient

    from producer.api import create_app

    keys = Keys(fast.redis.prefix, fast.redis.shards)
    publisher = Publisher(r, fast)
    publisher.publish("full", CWD, [user(1), turn_end(1)])
    first = Watcher(r, fast, name="first")
    drain(first, r, fast)
    publisher.publish("full", CWD, [user(2), turn_end(2)])
    failures = fail_appends(monkeypatch, 1_000, stem="full")
    _held_back(first, r, fast, "full")
    with TestClient(create_app(fast, r)) as client:
        path = "/api/sessions/full"
        held = client.get(path, params={"cwd": CWD}).json()["heldBack"]
        assert held["watcher"] == first.id
        r.delete(keys.lease(keys.shard_of("full")))  # `first` dies (its lease lapses)
        assert client.get(path, params={"cwd": CWD}).json()["heldBack"] is None  # its watcher is gone
        second = Watcher(r, fast, name="second")
        time.sleep(0.05)
        _held_back_by(second, r, "full")
        again = client.get(path, params={"cwd": CWD}).json()["heldBack"]
        assert again["watcher"] == second.id and again["since"] == held["since"]  # held since the first failure
        late = json.dumps({"since": 1.0, "until": time.time() + 100, "error": "late", "watcher": first.id,
                           "shard": keys.shard_of("full")})
        r.hset(keys.held, "other", late)  # a paused former owner's write, landing now
        r.hset(keys.held, "stale", json.dumps({**json.loads(late), "watcher": second.id, "until": 1.0}))
        assert client.get("/api/overview").json()["sessionsHeldBack"] == 1
        failures["left"] = 0
        second.cursors[keys.shard_of("full")].retry_at = 0.0
        second._next_held_prune = second._next_tick = 0.0
        drain(second, r, fast)
        assert [line.get("turnId") for line in log_lines(fast, "full")] == [1, 1, 2, 2]
        assert client.get(path, params={"cwd": CWD}).json()["heldBack"] is None
        assert client.get("/api/overview").json()["sessionsHeldBack"] == 0
    assert set(r.hkeys(keys.held)) == {b"other"}  # pruned once its `until` passes
    second.close()


def _held_back_by(watcher: Watcher, r: redis.Redis, session_id: str) -> None:
    """Run ``watcher`` until the held record of ``session_id`` is its own."""
    deadline = time.monotonic() + 20
    while json.loads(r.hget(Keys().held, session_id) or b'{"watcher": null}')["watcher"] != watcher.id:
        assert time.monotonic() < deadline, "the session was never held back by this watcher"
        watcher.run_once()


def test_graceful_stop_releases_leases_and_leaves_the_registry(r: redis.Redis, fast: Settings) -> None:
    import threading

    stop = threading.Event()
    watcher = Watcher(r, fast, name="w")
    thread = threading.Thread(target=watcher.run, args=(stop,))
    thread.start()
    published = publish_turns(Publisher(r, fast), ["a1", "b2"], turns=3)
    while backlog(r, fast) or not log_lines(fast, "b2") or len(log_lines(fast, "b2")) < 6:
        thread.join(0.02)
    stop.set()
    thread.join(5)
    assert not thread.is_alive()
    assert_applied_once_in_order(fast, published)
    assert [k for k in r.keys("compaction:lease:*")] == []
    assert r.zcard(Keys().watchers) == 0


def test_session_meta_gets_session_id_and_cwd_back_on_its_line(r: redis.Redis, fast: Settings) -> None:
    Publisher(r, fast).publish("a1", CWD, {"type": "session_meta", "model": "gpt-4", "uuid": "m-1"})
    drain(Watcher(r, fast, name="w"), r, fast)
    [line] = log_lines(fast, "a1")
    assert (line["sessionId"], line["cwd"], line["uuid"], line["model"]) == ("a1", CWD, "m-1", "gpt-4")
    assert line["createdAt"] == line["timestamp"]  # SPEC §3 lists createdAt: the entry's time when not sent


def test_a_session_meta_keeps_the_created_at_it_was_sent_with(r: redis.Redis, fast: Settings) -> None:
    sent = "2025-03-01T10:00:00.000Z"
    Publisher(r, fast).publish("a2", CWD, {"type": "session_meta", "createdAt": sent})
    drain(Watcher(r, fast, name="w"), r, fast)
    [line] = log_lines(fast, "a2")
    assert line["createdAt"] == sent != line["timestamp"]
    # sent straight to the stream as created_at (a name the model takes, as the Publisher does): it
    # was replaced by the entry's time and kept beside it as an unknown field, a bad one not refused
    stream = Keys().stream_for("a3")
    for value in (sent, "bad"):
        r.xadd(stream, {"session": "a3", "cwd": CWD,
                        "event": orjson.dumps({"type": "session_meta", "created_at": value})})
    drain(Watcher(r, fast, name="w2"), r, fast)
    [line] = log_lines(fast, "a3")
    assert line["createdAt"] == sent and "created_at" not in line
    r.xadd(Keys().stream_for("a4"), {"session": "a4", "cwd": CWD, "event": orjson.dumps(
        {"type": "session_meta", "createdAt": None, "created_at": sent})})  # null given: filled as before
    drain(Watcher(r, fast, name="w3"), r, fast)
    [line] = log_lines(fast, "a4")
    assert line["createdAt"] == line["timestamp"]
    [letter] = [fields for _, fields in r.xrange(Keys().dead)]
    assert b"created_at" in letter[b"reason"] or b"createdAt" in letter[b"reason"], letter[b"reason"]


def test_trimming_keeps_pending_entries(r: redis.Redis, fast: Settings) -> None:
    publisher = Publisher(r, fast)
    watcher = Watcher(r, fast, name="w")
    publish_turns(publisher, ["a1"], turns=50)
    drain(watcher, r, fast)
    shard = Keys().shard_of("a1")
    stream = Keys().stream(shard)
    r.xreadgroup(Keys().group, Keys().consumer(shard), {stream: ">"})  # nothing new: no-op
    pending_ids = publisher.publish("a1", CWD, [user(51), turn_end(51)])
    r.xreadgroup(Keys().group, "hand-run", {stream: ">"})  # delivered, never acked
    watcher.streams.trim(shard)
    remaining = [entry_id.decode() for entry_id, _ in r.xrange(stream)]
    assert set(pending_ids) <= set(remaining)
    assert len(remaining) < 102


def test_a_tick_trims_one_due_stream_the_one_trimmed_longest_ago(
    r: redis.Redis, fast: Settings, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Trims are spread over ticks (all shards' trims at once stopped the loop for ~17 ms)."""
    watcher = Watcher(r, fast, name="w")
    watcher.run_once()  # takes the leases
    assert len(watcher.cursors) == fast.redis.shards > 2
    trimmed: list[int] = []
    monkeypatch.setattr(watcher.streams, "trim", trimmed.append)
    for n, cursor in watcher.cursors.items():
        cursor.trimmed_at = -1000.0 - n  # all due; the last shard the longest ago
    watcher._trim_due()
    watcher._trim_due()
    last = fast.redis.shards - 1
    assert trimmed == [last, last - 1]
    for cursor in watcher.cursors.values():
        cursor.trimmed_at = time.monotonic()
    watcher._trim_due()
    assert trimmed == [last, last - 1]  # none due


def test_a_redis_that_forgot_the_scripts_is_read_and_acked_all_the_same(r: redis.Redis, fast: Settings) -> None:
    """Reads and acks go out as bare EVALSHA in one pipeline; after ``SCRIPT FLUSH`` (or a
    Redis restart) the calls Redis refused with NOSCRIPT are run again, so nothing is
    skipped, and nothing is left pending."""
    watcher = Watcher(r, fast, name="w")
    watcher.run_once()
    published = publish_turns(Publisher(r, fast), ["a1", "b2"], turns=3)
    r.script_flush()
    drain(watcher, r, fast)
    assert_applied_once_in_order(fast, published)
    assert backlog(r, fast) == 0


def test_entry_uuid_is_uuid5_of_session_and_entry_id() -> None:
    """The hand-formatted uuid equals ``uuid.uuid5`` (its stability across redeliveries and
    versions of this code depends on it), version and variant bits included."""
    import random
    import uuid

    from producer.watcher.entries import ENTRY_UUID_NAMESPACE

    rng = random.Random(5)
    for n in range(2000):
        session_id = "".join(rng.choice("abcdef0123456789-_.é") for _ in range(rng.randint(1, 40)))
        entry_id = f"{rng.randint(0, 2**48)}-{rng.randint(0, 2**20)}"
        expected = uuid.uuid5(ENTRY_UUID_NAMESPACE, f"{session_id}/{entry_id}")
        assert entry_uuid(session_id, entry_id) == str(expected), (session_id, entry_id)


def test_entry_timestamp_is_the_entry_ids_millisecond_in_iso_utc() -> None:
    """Consecutive ids share the formatted second; each still gets its own milliseconds."""
    import random
    from datetime import UTC, datetime

    from producer.watcher.entries import entry_timestamp

    rng = random.Random(3)
    start = 1_764_460_799_990  # 2025-11-29T23:59:59.990Z: the ids below cross a second and a day
    moments = [start + n for n in range(25)] + [rng.randint(0, 4 * 10**12) for _ in range(2000)]
    for ms in moments:
        expected = datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="milliseconds")
        assert entry_timestamp(f"{ms}-{rng.randint(0, 9)}") == expected.replace("+00:00", "Z"), ms
    assert entry_timestamp("1764460800005-0") == "2025-11-30T00:00:00.005Z"


def test_an_entry_id_past_the_year_9999_does_not_stop_the_watcher(r: redis.Redis, fast: Settings) -> None:
    """``XADD ... 253402300800000-0`` (a producer's own id): formatting its time raised, the round
    was retried forever and every shard of the watcher stopped; each ``XADD *`` after it on that
    stream is numbered above it. The time of reading stands in for such an id's time."""
    keys = Keys(fast.redis.prefix, fast.redis.shards)
    [far, other] = sessions_on_shard(fast, 0, 1) + sessions_on_shard(fast, 1, 1)
    r.xadd(keys.stream_for(far), {"session": far, "cwd": CWD, "event": '{"type":"user","turnId":1,"content":"x"}'},
           id="253402300800000-0")
    r.xadd(keys.stream_for(far), {"session": far, "cwd": CWD, "event": json.dumps(turn_end(1))})  # above it too
    Publisher(r, fast).publish(other, CWD, [user(1), turn_end(1)])
    before = time.time()
    drain(Watcher(r, fast, name="w"), r, fast)
    lines = log_lines(fast, far)
    assert [e["type"] for e in lines] == ["user", "turn_end"]
    assert all(e["timestamp"].startswith(time.strftime("%Y-%m-%dT", time.gmtime(before))) for e in lines)
    assert [e["type"] for e in log_lines(fast, other)] == ["user", "turn_end"]


def test_unknown_fields_set_to_null_reach_the_log(r: redis.Redis, fast: Settings) -> None:
    Publisher(r, fast).publish("a3", CWD, [{**user(1, "hi"), "trace": None, "meta": {"k": None}}, turn_end(1)])
    drain(Watcher(r, fast, name="w"), r, fast)
    line = log_lines(fast, "a3")[0]
    assert ("trace", None) in line.items() and line["meta"] == {"k": None}


def test_entries_pending_under_a_foreign_consumer_are_applied_first_and_in_order(
    r: redis.Redis, fast: Settings, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An entry read by a reader of another name (an older deployment) and never acked is
    claimed when a watcher takes the shard, before anything newer, and applied in stream order."""
    keys = Keys(fast.redis.prefix, fast.redis.shards)
    publisher = Publisher(r, fast)
    [old] = publisher.publish("s1", CWD, [user(1, "first, read by the old reader")])
    stream = keys.stream_for("s1")
    r.xgroup_create(stream, keys.group, id="0", mkstream=True)
    assert r.xreadgroup(keys.group, "old-reader", {stream: ">"})  # it dies here, the entry pending
    publisher.publish("s1", CWD, [user(1, "second"), turn_end(1)])
    watcher = Watcher(r, fast, name="w")
    drain(watcher, r, fast)
    assert [e.get("content") for e in log_lines(fast, "s1")] == ["first, read by the old reader", "second", None]
    assert log_lines(fast, "s1")[0]["streamId"] == old
    assert r.xpending(stream, keys.group)["pending"] == 0


def test_an_entry_a_foreign_consumer_held_then_deleted_from_the_stream_is_dead_lettered(
    r: redis.Redis, fast: Settings, caplog: pytest.LogCaptureFixture,
) -> None:
    """XAUTOCLAIM drops an entry deleted from the stream from the pending list and names it in
    its reply's third part, which was ignored: the entry was gone without a letter (one pending
    under the watcher's own consumer is dead-lettered). Its log line carries the fields every
    dead-letter line does (it had none: ``jq 'select(.outcome)'`` missed it)."""
    keys = Keys(fast.redis.prefix, fast.redis.shards)
    publisher = Publisher(r, fast)
    [gone] = publisher.publish("s1", CWD, [user(1, "read by the old reader, then deleted")])
    stream = keys.stream_for("s1")
    r.xgroup_create(stream, keys.group, id="0", mkstream=True)
    assert r.xreadgroup(keys.group, "old-reader", {stream: ">"})  # it dies here, the entry pending
    r.xdel(stream, gone)
    later = publisher.publish("s1", CWD, [user(1, "second"), turn_end(1)])
    with caplog.at_level(logging.WARNING, logger="producer.watcher.streams"):
        drain(Watcher(r, fast, name="w"), r, fast)
    [line] = [rec for rec in caplog.records if rec.getMessage().startswith("dead-lettered session=-")]
    assert (getattr(line, "outcome", None), getattr(line, "entry_id", None), getattr(line, "kind", None)) == (
        "dead_lettered", gone, "malformed")
    assert [line["streamId"] for line in log_lines(fast, "s1")] == later
    letters = [fields for _, fields in r.xrange(keys.dead)]
    assert [(f[b"id"].decode(), f[b"reason"].decode()) for f in letters] == [
        (gone, "entry has no fields (deleted from the stream before it was applied)")]
    assert r.xpending(stream, keys.group)["pending"] == 0


def test_an_entry_a_hand_run_reader_took_while_the_shard_was_owned_is_dead_lettered_not_lost(
    r: redis.Redis, fast: Settings,
) -> None:
    """The reader takes an entry from the watchers' group while a watcher owns its shard; later
    entries of the session are applied; the next owner claims the entry, whose id is now below
    the last applied one: it was acked as a duplicate, in neither the log nor the dead letters."""
    taken, applied = _an_entry_taken_by_hand(r, fast, [user(2, "after it"), turn_end(2)])
    drain(Watcher(r, fast, name="next"), r, fast)
    _dead_lettered_out_of_order(r, fast, taken, applied)


def test_a_claimed_entry_whose_claimer_stopped_before_applying_it_is_dead_lettered_by_the_next_owner(
    r: redis.Redis, fast: Settings,
) -> None:
    """The claim was remembered in the claimer's memory only: it stopped (or lost its lease)
    before its first read, and the next owner, finding the entry pending under its own consumer,
    took it for a lost stream's renumbered entry and wrote it after later entries of its session,
    out of order, with no letter."""
    keys = Keys(fast.redis.prefix, fast.redis.shards)
    # (in the same turn: no turn going backwards refuses it)
    taken, applied = _an_entry_taken_by_hand(r, fast, [{"type": "assistant", "turnId": 2, "content": "after it"}])
    claimer = Watcher(r, fast, name="claimer")
    claimer._start()
    claimer._tick()  # takes the shards: the entry claimed ...
    assert r.xpending(keys.stream_for("s1"), keys.group)["consumers"] == [
        {"name": keys.consumer(keys.shard_of("s1")).encode(), "pending": 1}]
    claimer.close()  # ... and it stops before its first read
    drain(Watcher(r, fast, name="next"), r, fast)
    _dead_lettered_out_of_order(r, fast, taken, applied)
    assert not r.exists(keys.claimed(keys.shard_of("s1")))  # (forgotten with the entry's ack)


def _an_entry_taken_by_hand(r: redis.Redis, fast: Settings, later: list[dict[str, Any]]) -> tuple[str, list[str]]:
    """A hand-run reader takes an entry of s1 from the watchers' group while a watcher owns its
    shard, which then applies ``later`` and stops: the entry's id, and those of what was applied."""
    keys = Keys(fast.redis.prefix, fast.redis.shards)
    publisher = Publisher(r, fast)
    first = Watcher(r, fast, name="first")
    applied = publisher.publish("s1", CWD, [user(1, "one"), turn_end(1)])
    drain(first, r, fast)
    [taken] = publisher.publish("s1", CWD, [user(2, "taken by a hand-run reader")])
    assert r.xreadgroup(keys.group, "debug", {keys.stream_for("s1"): ">"}, count=1)
    applied += publisher.publish("s1", CWD, later)
    deadline = time.monotonic() + 20
    while len(log_lines(fast, "s1")) < len(applied):  # (not ``drain``: the reader's entry stays pending)
        assert time.monotonic() < deadline
        first.run_once()
    first.close()  # its shards change hands: the next owner claims the entry
    return taken, applied


def _dead_lettered_out_of_order(r: redis.Redis, fast: Settings, taken: str, applied: list[str]) -> None:
    keys = Keys(fast.redis.prefix, fast.redis.shards)
    assert [line["streamId"] for line in log_lines(fast, "s1")] == applied
    [letter] = [fields for _, fields in r.xrange(keys.dead)]
    assert letter[b"id"].decode() == taken
    assert letter[b"reason"].decode().startswith(f"streamId: {taken} is not in the log, and later entries")
    assert r.xpending(keys.stream_for("s1"), keys.group)["pending"] == 0


def test_a_shard_whose_take_failed_is_taken_again_on_the_next_tick(
    r: redis.Redis, fast: Settings, monkeypatch: pytest.MonkeyPatch,
) -> None:
    publisher = Publisher(r, fast)
    publisher.publish("s1", CWD, [user(1), turn_end(1)])
    watcher = Watcher(r, fast, name="w")
    real, failed = watcher.streams.claim_foreign, []

    def flaky(shard: int, min_idle_ms: int) -> set[str]:
        if not failed:
            failed.append(shard)
            raise redis.ConnectionError("lost for a moment")
        return real(shard, min_idle_ms)

    monkeypatch.setattr(watcher.streams, "claim_foreign", flaky)
    watcher.run_once()
    assert failed and failed[0] not in watcher.cursors and failed[0] in watcher.leases.owned
    drain(watcher, r, fast)
    assert failed[0] in watcher.cursors
    assert [e["type"] for e in log_lines(fast, "s1")] == ["user", "turn_end"]


def test_a_redis_restarted_without_its_data_still_refuses_a_re_sent_uuid(tmp_path: Path) -> None:
    """Redis restarted empty under a running watcher, and the agent re-sent what it was not sure
    had landed: the watcher's cached states matched the logs, so the uuid index was never rebuilt,
    and both events were appended again; later saves then stored a state over an index of the new
    uuids only, which no writer rebuilt, so even a new watcher let a re-sent event in."""
    from compactor.embedded import EmbeddedRedis
    from compactor.store import SessionStore

    def restart(server: EmbeddedRedis) -> EmbeddedRedis:
        server.stop()
        return EmbeddedRedis(server.directory, persist=False).start()

    server = EmbeddedRedis(tmp_path / "redis", persist=False).start()
    try:
        r = redis.Redis.from_url(server.url)
        fast = fast_settings(tmp_path / "data", server.url)
        publisher = Publisher(r, fast)
        first = {**user(1), "uuid": "u-1"}
        watcher = Watcher(r, fast, name="w")
        publisher.publish("rr", CWD, [first])
        drain(watcher, r, fast)
        server = restart(server)
        publisher.publish("rr", CWD, [first, {**turn_end(1), "uuid": "e-1"},  # re-sent, then new ones
                                      {**user(2, "new"), "uuid": "n-2"}])
        drain(watcher, r, fast)
        assert [line["uuid"] for line in log_lines(fast, "rr")] == ["u-1", "e-1", "n-2"]
        refused = [fields[b"reason"].decode() for _, fields in r.xrange(Keys().dead)]
        assert refused == ["uuid: 'u-1' duplicates an event already in this session"]

        server = restart(server)
        publisher.publish("rr", CWD, [user(3, "no uuid of its own")])  # a save from the cached state only
        drain(watcher, r, fast)
        stored = SessionStore(r, fast).load("rr")
        assert stored is not None and stored.events == 4  # rebuilt from the whole log, not the cache
        assert r.smembers(Keys().uuids("rr")) >= {b"u-1", b"e-1", b"n-2"}
        watcher.close()
        fresh = Watcher(r, fast, name="w2")
        publisher.publish("rr", CWD, [{**user(4, "again"), "uuid": "u-1"}])
        drain(fresh, r, fast)
        assert [line["uuid"] for line in log_lines(fast, "rr")][:3] == ["u-1", "e-1", "n-2"]
        assert sum(line["uuid"] == "u-1" for line in log_lines(fast, "rr")) == 1
    finally:
        server.stop()


def test_a_re_sent_uuid_redis_lost_with_its_last_writes_is_refused_by_a_watcher_that_cached_it(
        r: redis.Redis, fast: Settings) -> None:
    """Redis restarted and lost its last second of writes (AOF ``everysec``): the round that
    applied ``u-2`` had its state save and uuid index entry lost, the line stays in the log. The
    watcher's cached state matched the log, so it was used as is, and the agent's re-send of
    ``u-2`` (its reply lost with Redis) was looked up in the index alone: appended twice. A read
    that finds Redis without the watcher's script (a restart, or a script flush) now drops the
    cached states first, so each is caught up from its log and the lost uuids indexed again."""
    keys = Keys()
    publisher = Publisher(r, fast)
    watcher = Watcher(r, fast, name="w")
    publisher.publish("tl", CWD, [{**user(1, "a"), "uuid": "u-1"}])
    drain(watcher, r, fast)
    kept = {k: v for k, v in r.hgetall(keys.session("tl")).items()}
    publisher.publish("tl", CWD, [{**user(2, "b"), "uuid": "u-2"}])
    drain(watcher, r, fast)
    # what Redis keeps of it after the restart: the state before that round, no u-2 anywhere
    r.hset(keys.session("tl"), mapping=kept)
    r.srem(keys.uuids("tl"), "u-2")
    r.delete(keys.sent("tl"))
    r.script_flush()
    publisher.publish("tl", CWD, [{**user(3, "b again"), "uuid": "u-2"}])
    drain(watcher, r, fast)
    watcher.close()
    assert [line["uuid"] for line in log_lines(fast, "tl")] == ["u-1", "u-2"]
    refused = [fields[b"reason"].decode() for _, fields in r.xrange(keys.dead)]
    assert refused == ["uuid: 'u-2' duplicates an event already in this session"]


def test_after_redis_lost_a_session_a_re_sent_uuid_in_a_later_run_of_the_round_is_refused(
        r: redis.Redis, fast: Settings) -> None:
    """The session's state and uuid index gone (its idle TTL, a Redis restarted empty), then
    a round of several runs (one per turn): the first run rebuilt the state from the log and kept,
    as taken, only its own uuids the log held; a uuid re-sent in a later run of the round was
    appended a second time (a re-sent rollback then hid the turn after it)."""
    publisher = Publisher(r, fast)
    watcher = Watcher(r, fast, name="w")
    publisher.publish("lr", CWD, [{**user(1, "a"), "uuid": "A"}, {**turn_end(1), "uuid": "B"},
                                  {"type": "rollback", "throughTurnId": 2, "reason": "redo", "uuid": "R"}])
    drain(watcher, r, fast)
    watcher.close()
    r.delete(Keys().session("lr"), Keys().uuids("lr"))
    publisher.publish("lr", CWD, [{**user(2, "c"), "uuid": "C"}, {**turn_end(2), "uuid": "D"},
                                  {"type": "rollback", "throughTurnId": 2, "reason": "redo", "uuid": "R"},
                                  {**user(3, "again"), "uuid": "A"}])
    fresh = Watcher(r, fast, name="w2")
    drain(fresh, r, fast)
    fresh.close()
    assert [line["uuid"] for line in log_lines(fast, "lr")] == ["A", "B", "R", "C", "D"]
    refused = sorted(fields[b"reason"].decode() for _, fields in r.xrange(Keys().dead))
    assert refused == [f"uuid: {u!r} duplicates an event already in this session" for u in ("A", "R")]


def test_a_watcher_warns_when_redis_may_evict_any_key(r: redis.Redis, fast: Settings,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A session's uuid index evicted while its state survived let a re-sent event into the log
    twice: the watcher says so at its start when Redis runs with an allkeys-* policy."""
    policy = r.config_get("maxmemory-policy")["maxmemory-policy"]
    for evicting in ("allkeys-lru", "volatile-lru"):  # (volatile-*: the states and uuid indexes have a TTL)
        r.config_set("maxmemory-policy", evicting)
        try:
            with caplog.at_level(logging.WARNING, logger="producer.watcher.core"):
                Watcher(r, fast, name=f"w-{evicting}").run_once()
        finally:
            r.config_set("maxmemory-policy", policy)
        assert any(f"maxmemory-policy {evicting}" in rec.getMessage() for rec in caplog.records), evicting
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="producer.watcher.core"):
        Watcher(r, fast, name="w2").run_once()
    assert not any("maxmemory-policy" in rec.getMessage() for rec in caplog.records)


def test_a_dead_letter_reason_naming_a_producers_key_stays_one_log_line(
    r: redis.Redis, fast: Settings, caplog: pytest.LogCaptureFixture,
) -> None:
    """A reason names the JSON keys and tool-call ids a producer chose: a key holding a line break
    and an escape sequence forged a second record in the text log, colours on the terminal."""
    keys = Keys(fast.redis.prefix, fast.redis.shards)
    event = {"type": "user", "turnId": 1, "content": "x", "a\nFAKE ERROR forged\x1b[31m": 2**64}
    r.xadd(keys.stream_for("s1"), {"session": "s1", "cwd": CWD, "event": json.dumps(event)})
    with caplog.at_level(logging.WARNING, logger="producer.watcher"):
        drain(Watcher(r, fast, name="w"), r, fast)
    [line] = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("dead-lettered")]
    assert "\n" not in line and "\x1b" not in line and "FAKE ERROR forged\\u001b[31m" in line
    [(_, letter)] = r.xrange(keys.dead)
    assert "a\nFAKE ERROR forged\x1b[31m" in letter[b"reason"].decode()  # (the letter keeps it as it was)
