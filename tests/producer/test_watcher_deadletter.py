"""Every kind of bad entry goes to ``{p}:dead`` with its reason and is acked; good ones still apply."""

from __future__ import annotations

import shutil
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from compactor.keys import Keys
from compactor.store import SessionStore
from compactor.metrics import REGISTRY, reason_kind
from events.config import Settings
from events.errors import InvalidInput
from events.log import SessionLog
from events.state import rebuild
from producer.publisher import Publisher
from producer.watcher import Watcher
from producer.watcher.batch import TRUNCATED_LETTER_VALUE_BYTES
from producer.watcher.entries import Rejected, decode_entry
from tests.producer.conftest import (
    CWD,
    backlog,
    drain,
    fast_settings,
    log_lines,
    turn_end,
    user,
)

GOOD = orjson.dumps(user(1))


def raw(r: redis.Redis, fields: dict[str, bytes | str], session_id: str = "s1", stream: str | None = None) -> str:
    entry_id = r.xadd(stream or Keys().stream_for(session_id), fields)
    return entry_id.decode()


def dead_letters(r: redis.Redis) -> list[dict[bytes, bytes]]:
    return [fields for _, fields in r.xrange(Keys().dead)]


@pytest.fixture
def small(tmp_path: Path, redis_url: str) -> Settings:
    return fast_settings(tmp_path / "data", redis_url, limits={"maxEventBytes": 1024})


@pytest.mark.parametrize("fields, reason", [
    ({"session": "s1", "cwd": CWD, "event": b"{not json"}, "invalid JSON"),
    ({"session": "s1", "cwd": CWD, "event": b"[1, 2]"}, "must be a JSON object"),
    ({"session": "s1", "cwd": CWD, "event": b'{"type": "bogus"}'}, "type: must be one of"),
    ({"session": "s1", "cwd": CWD, "event": b'{"type": "user", "turnId": 0, "content": "x"}'}, "turnId"),
    ({"cwd": CWD, "event": GOOD}, "missing field 'session'"),
    ({"session": "s1", "event": GOOD}, "missing field 'cwd'"),
    ({"session": "s1", "cwd": CWD}, "missing field 'event'"),
    ({"session": "bad id!", "cwd": CWD, "event": GOOD}, "sessionId: must match"),
    ({"session": "s1", "cwd": "relative/dir", "event": GOOD}, "cwd: must be an absolute path"),
    ({"session": "s1", "cwd": CWD, "event": b'{"type":"user","turnId":1,"content":"\xff"}'}, "invalid UTF-8 in field 'event'"),
    ({"session": b"s\xff1", "cwd": CWD, "event": GOOD}, "invalid UTF-8 in field 'session'"),
    ({"session": "s1", "cwd": CWD, "event": orjson.dumps(user(1, "x" * 2000))}, "more than limits.maxEventBytes"),
    ({"session": "s1", "cwd": CWD, "event": orjson.dumps({**user(1), "sessionId": "s2"})}, "sessionId: differs"),
    ({"session": "s1", "cwd": CWD, "event": b'{"type":"user","type":"assistant","turnId":1,"content":"x"}'},
     "event: the key 'type' appears twice in one object (one of its values would be dropped)"),
    ({"session": "s1", "cwd": CWD, "event": b'{"type": "user", "turnId": 1, "content": "a", "con\\u0074ent": "b"}'},
     "event: the key 'content' appears twice"),
    ({"session": "s1", "cwd": CWD, "event": b'{"type":"assistant","turnId":1,"content":"","toolCalls":[{"id":"c",'
                                            b'"name":"read_file","arguments":{"path":"/a","path":"/b"}}]}'},
     "event: the key 'path' appears twice"),
    # orjson read these as a float and as 0.0, silently
    ({"session": "s1", "cwd": CWD, "event": b'{"type":"user","turnId":1,"content":"x","n":123456789012345678901234567890}'},
     "event.n: is an integer outside the 64-bit range"),
    ({"session": "s1", "cwd": CWD, "event": b'{"type":"assistant","turnId":1,"content":"","toolCalls":[{"id":"c",'
                                            b'"name":"calc","arguments":{"eps":[1, 2.5E-400]}}]}'},
     "event.toolCalls[0].arguments.eps[1]: is the number 2.5E-400, too small for a double: it would be stored as 0"),
])
def test_bad_entry_is_dead_lettered_with_its_reason_and_acked(
    r: redis.Redis, small: Settings, fields: dict[str, bytes | str], reason: str
) -> None:
    bad_id = raw(r, fields)
    good = Publisher(r, small).publish("s1", CWD, [user(1), turn_end(1)])
    drain(Watcher(r, small, name="w"), r, small)
    [dead] = dead_letters(r)
    assert reason in dead[b"reason"].decode()
    assert dead[b"id"].decode() == bad_id and dead[b"stream"].decode() == Keys().stream_for("s1")
    for name, value in fields.items():
        assert dead[name.encode()] == (value.encode() if isinstance(value, str) else value)
    assert [line["streamId"] for line in log_lines(small, "s1")] == good
    assert backlog(r, small) == 0


def test_an_entry_refused_for_its_size_is_lettered_with_its_head_only(r: redis.Redis, small: Settings) -> None:
    """Ten 5 MB events over maxEventBytes took 58 MB of Redis in the dead-letter stream (kept
    100 000 letters long): a value no replay could apply keeps its first 64 KiB, and says so."""
    event = orjson.dumps(user(1, "x" * 200_000))
    bad_id = raw(r, {"session": "s1", "cwd": CWD, "event": event})
    ok_id = raw(r, {"session": "s1", "cwd": CWD, "event": b'{"type":"user","turnId":0,"content":"' + b"y" * 900 + b'"}'})
    drain(Watcher(r, small, name="w"), r, small)
    big, replayable = dead_letters(r)
    assert big[b"id"].decode() == bad_id and big[b"event"] == event[:TRUNCATED_LETTER_VALUE_BYTES]
    assert big[b"truncated"] == f"event:{len(event)}".encode() and big[b"session"] == b"s1"
    assert replayable[b"id"].decode() == ok_id and len(replayable[b"event"]) > 900 and b"truncated" not in replayable


def test_an_entry_naming_one_of_its_fields_twice_is_dead_lettered(r: redis.Redis, small: Settings) -> None:
    """``cwd`` given twice: the last was taken silently, the session bound to it; ``event`` twice:
    the first event dropped."""
    stream = Keys().stream_for("s1")
    bad_id = r.execute_command("XADD", stream, "*", "session", "s1", "cwd", CWD, "cwd", "/other/project",
                               "event", GOOD).decode()
    good = Publisher(r, small).publish("s1", CWD, [user(1), turn_end(1)])
    drain(Watcher(r, small, name="w"), r, small)
    [dead] = dead_letters(r)
    assert dead[b"id"].decode() == bad_id
    assert dead[b"reason"].decode() == "field 'cwd' given 2 times (one value would be dropped)"
    assert reason_kind(dead[b"reason"].decode()) == "malformed"
    assert [line["streamId"] for line in log_lines(small, "s1")] == good
    assert not SessionLog(small.data_dir, "/other/project", "s1").exists()


def test_an_event_written_otherwise_than_orjson_writes_it_is_applied(r: redis.Redis, small: Settings) -> None:
    """The check for a key given twice reads again only an event orjson would write otherwise
    (spaces, escapes, another number form): one with none is applied as sent."""
    event = (b'{ "type" : "user", "turnId" : 1, "content" : "caf\\u00e9 \\"x\\"", "n": 1E2, "x": {"a": 1, "b": [{"a": 2}]},'
             b' "small": [1e-300, 4.9e-324, 0e-400, -0.0, 0.000e5, 18446744073709551615, -9223372036854775808] }')
    raw(r, {"session": "s1", "cwd": CWD, "event": event})
    drain(Watcher(r, small, name="w"), r, small)
    assert dead_letters(r) == []
    [line] = log_lines(small, "s1")
    assert (line["content"], line["n"], line["x"]) == ('caf\u00e9 "x"', 100.0, {"a": 1, "b": [{"a": 2}]})
    assert line["small"] == [1e-300, 5e-324, 0.0, 0.0, 0.0, 2**64 - 1, -(2**63)]


def test_an_event_nested_too_deeply_to_write_is_refused_alone(r: redis.Redis, small: Settings) -> None:
    """orjson reads 1 024 levels but writes 254: such an event failed its run's append, and the
    good events around it were dead-lettered with it."""
    publisher = Publisher(r, small)
    before = publisher.publish("s1", CWD, [user(1, "before")])
    bad_id = raw(r, {"session": "s1", "cwd": CWD, "event": orjson.dumps({**user(1), "x": 0}).replace(
        b'"x":0', b'"x":' + b"[" * 300 + b"1" + b"]" * 300)})
    after = publisher.publish("s1", CWD, [user(1, "after"), turn_end(1)])
    drain(Watcher(r, small, name="w"), r, small)
    [dead] = dead_letters(r)
    assert dead[b"id"].decode() == bad_id and b"nested too deeply" in dead[b"reason"]
    assert [line["streamId"] for line in log_lines(small, "s1")] == before + after


def test_an_entry_decoding_fails_on_is_dead_lettered_alone(r: redis.Redis, small: Settings,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A decoder that raised anything but a refusal (an entry id past the year 9999 did) stopped
    the round, retried forever: every shard of the watcher stalled. Now such an entry is a letter."""
    from producer.watcher import entries

    real = entries._json_object

    def failing(event_bytes: bytes) -> Any:
        if b"poison" in event_bytes:
            raise RuntimeError("a bug")
        return real(event_bytes)

    monkeypatch.setattr(entries, "_json_object", failing)
    publisher = Publisher(r, small)
    before = publisher.publish("s1", CWD, [user(1, "before")])
    bad_id = raw(r, {"session": "s1", "cwd": CWD, "event": orjson.dumps(user(1, "poison"))})
    after = publisher.publish("s1", CWD, [user(1, "after"), turn_end(1)])
    drain(Watcher(r, small, name="w"), r, small)
    [dead] = dead_letters(r)
    assert dead[b"id"].decode() == bad_id
    assert dead[b"reason"] == b"event: could not be decoded (RuntimeError: a bug)"
    assert [line["streamId"] for line in log_lines(small, "s1")] == before + after


def test_an_entry_with_thousands_of_fields_is_dead_lettered_without_wedging_its_shard(
    r: redis.Redis, small: Settings
) -> None:
    """The ack script's XADD of the letter would pass every field through Lua's unpack, which fails
    past ~8 000 values: the shard would retry the same batch for ever. The letter keeps 1 000."""
    fields: dict[str, bytes | str] = {"reason": "the producer's own"}  # a name the letter adds
    fields.update({f"x{i}": "y" for i in range(5_000)})  # before ours: they are kept all the same, first
    fields.update({"session": "s1", "cwd": CWD, "event": b"{not json"})
    bad_id = raw(r, fields)
    good = Publisher(r, small).publish("s1", CWD, [user(1), turn_end(1)])
    drain(Watcher(r, small, name="w"), r, small)
    [dead] = dead_letters(r)
    assert dead[b"id"].decode() == bad_id and b"invalid JSON" in dead[b"reason"]
    assert dead[b"event"] == b"{not json" and dead[b"fieldsDropped"] == b"4004"
    assert (dead[b"session"], dead[b"cwd"]) == (b"s1", CWD.encode())  # a letter can be replayed
    [letter] = r.xrange(Keys().dead)
    names = letter[1].keys() if isinstance(letter[1], dict) else []
    assert list(names)[:3] == [b"session", b"cwd", b"event"]
    assert dead[b"entry.reason"] == b"the producer's own" and b"invalid JSON" in dead[b"reason"]
    assert [line["streamId"] for line in log_lines(small, "s1")] == good


def test_turn_id_going_backwards_is_dead_lettered(r: redis.Redis, small: Settings) -> None:
    publisher = Publisher(r, small)
    good = publisher.publish("s1", CWD, [user(1), turn_end(1), user(2)])
    back = publisher.publish("s1", CWD, [user(1, "late")])
    later = publisher.publish("s1", CWD, [turn_end(2)])
    drain(Watcher(r, small, name="w"), r, small)
    [dead] = dead_letters(r)
    assert "goes backwards" in dead[b"reason"].decode() and dead[b"id"].decode() == back[0]
    assert [line["streamId"] for line in log_lines(small, "s1")] == good + later


def test_a_refused_entry_keeps_its_dead_letter_when_the_round_dies_after_the_append(
    r: redis.Redis, small: Settings, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The refused entry's letter is written before its run's append: after a death between the
    append and the ack, the redelivered entry sorts below the last applied one and is acked as a
    duplicate, so a letter left for the ack would never be written."""
    publisher = Publisher(r, small)
    watcher = Watcher(r, small, name="w")
    good = publisher.publish("s1", CWD, [user(1), turn_end(1), user(2)])
    drain(watcher, r, small)
    back, end = publisher.publish("s1", CWD, [user(1, "late"), turn_end(2)])  # one run: refused, then written
    real_ack = watcher.streams.ack_many

    def dies(batches: dict[int, Any], pipeline: Any = None, **kwargs: Any) -> Any:
        if not any(ids for ids, _ in batches.values()):
            return real_ack(batches, pipeline, **kwargs)
        monkeypatch.setattr(watcher.streams, "ack_many", real_ack)
        raise redis.ConnectionError("died before the ack")

    monkeypatch.setattr(watcher.streams, "ack_many", dies)
    with pytest.raises(redis.ConnectionError) as died:
        for _ in range(100):
            watcher.run_once()
    assert [line["streamId"] for line in log_lines(small, "s1")] == [*good, end]  # appended, not acked
    [end_line] = [line for line in log_lines(small, "s1") if line["streamId"] == end]
    assert not r.sismember(Keys().uuids("s1"), end_line["uuid"])  # its state save died with the ack
    watcher._after_error(died.value, 1)  # what the loop does after an error
    drain(watcher, r, small)
    [dead] = dead_letters(r)
    assert dead[b"id"].decode() == back and "goes backwards" in dead[b"reason"].decode()
    assert [line["streamId"] for line in log_lines(small, "s1")] == [*good, end]
    assert backlog(r, small) == 0
    # the dead round's line is indexed (the cached state, ahead of Redis, was saved with the uuids
    # of its own appends only: a re-send of that event was appended again)
    assert r.sismember(Keys().uuids("s1"), end_line["uuid"])
    assert SessionStore(r, small).load("s1") == rebuild("s1", CWD, log_lines(small, "s1"), small.context,
                                                       SessionStore(r, small).log("s1", CWD).size())


def test_a_session_seen_with_another_cwd_is_dead_lettered(r: redis.Redis, small: Settings) -> None:
    publisher = Publisher(r, small)
    watcher = Watcher(r, small, name="w")
    good = publisher.publish("s1", CWD, [user(1)])
    drain(watcher, r, small)
    other = publisher.publish("s1", "/another/project", [user(1), turn_end(1)])
    more = publisher.publish("s1", CWD, [turn_end(1)])
    drain(watcher, r, small)
    reasons = {d[b"id"].decode(): d[b"reason"].decode() for d in dead_letters(r)}
    assert set(reasons) == set(other) and all("bound to cwd" in reason for reason in reasons.values())
    assert [line["streamId"] for line in log_lines(small, "s1")] == good + more
    assert log_lines(small, "s1", "/another/project") == []
    # A fresh watcher (no in-memory state) refuses it too: the binding lives in Redis.
    publisher.publish("s1", "/another/project", [user(2)])
    drain(Watcher(r, small, name="w2"), r, small)
    assert len(dead_letters(r)) == 3


def test_after_redis_lost_its_data_a_round_with_another_cwd_first_does_not_split_the_session(
        r: redis.Redis, small: Settings) -> None:
    """Redis lost its data; then one transaction held an entry of another cwd, then one of the
    session's own: both were applied, to two logs, nothing dead-lettered."""
    publisher = Publisher(r, small)
    watcher = Watcher(r, small, name="w")
    good = publisher.publish("s1", CWD, [{"type": "session_meta", "model": "gpt-4"}, user(1)])
    drain(watcher, r, small)
    r.flushall()
    watcher.run_once()  # (the group recreated)
    pipe = r.pipeline(transaction=True)
    for cwd, event in (("/another/project", user(2, "b")), (CWD, user(2, "a"))):
        pipe.xadd(Keys().stream_for("s1"), {"session": "s1", "cwd": cwd, "event": orjson.dumps(event)})
    other, own = [entry_id.decode() for entry_id in pipe.execute()]
    drain(watcher, r, small)
    assert [line["streamId"] for line in log_lines(small, "s1")] == [*good, own]
    assert not SessionLog(small.data_dir, "/another/project", "s1").path.exists()
    [dead] = dead_letters(r)
    assert dead[b"id"].decode() == other
    assert dead[b"reason"].decode() == f"cwd: session s1 is bound to cwd {CWD!r}, not '/another/project'"


@pytest.mark.parametrize("wrong_first", [True, False])
def test_an_entry_on_another_sessions_shard_is_dead_lettered_not_dropped(
    r: redis.Redis, small: Settings, wrong_first: bool,
) -> None:
    """Stream ids are per stream, so the store's redelivery check (one last applied id per session)
    cannot order a session's entries across two shards: one of them was acked and silently lost.
    (A producer with a signed CRC-32, or with another shard count, puts entries there.)"""
    keys = Keys()
    home = keys.shard_of("s1")
    wrong = (home + 1) % keys.shards
    event: dict[str, bytes | str] = {"session": "s1", "cwd": CWD, "event": orjson.dumps(user(1, "misrouted"))}
    if wrong_first:
        misrouted = raw(r, event, stream=keys.stream(wrong))
    good = Publisher(r, small).publish("s1", CWD, [user(1, "routed")])
    if not wrong_first:
        misrouted = raw(r, event, stream=keys.stream(wrong))
    before = REGISTRY.get_sample_value("compactor_entries_dead_lettered_total", {"reason": "wrong_shard"}) or 0
    drain(Watcher(r, small, name="w"), r, small)
    [dead] = dead_letters(r)
    assert dead[b"id"].decode() == misrouted and dead[b"stream"].decode() == keys.stream(wrong)
    reason = dead[b"reason"].decode()
    assert reason.startswith("session: ") and f"shard {home} " in reason and f"shard {wrong} " in reason
    assert dead[b"event"] == event["event"] and dead[b"session"] == b"s1"
    assert [line["streamId"] for line in log_lines(small, "s1")] == good
    assert REGISTRY.get_sample_value("compactor_entries_dead_lettered_total", {"reason": "wrong_shard"}) == before + 1
    assert backlog(r, small) == 0


def test_decoding_is_deterministic_and_fills_identity() -> None:
    fields = [b"session", b"s1", b"cwd", CWD.encode(), b"event", GOOD]
    first, second = decode_entry(b"1700000000000-5", fields, 1024), decode_entry("1700000000000-5", fields, 1024)
    assert first == second and not isinstance(first, Rejected)
    assert first.event["timestamp"] == "2023-11-14T22:13:20.000Z"
    assert first.event["streamId"] == "1700000000000-5"


def test_a_deleted_pending_entry_is_dead_lettered() -> None:
    decoded = decode_entry(b"1-0", None, 1024)
    assert isinstance(decoded, Rejected) and "deleted" in decoded.reason


def test_a_new_sessions_refused_first_entry_leaves_no_log(r: redis.Redis, small: Settings) -> None:
    """An empty log was left by the refusal, and the session was known (GET /api/sessions: 200,
    a row in ``status``) with nothing of it ever written; its next good entry still applies."""
    far = {"type": "summary", "replaces": [], "summaryText": "s", "lastSummarizedTurnId": 1}  # the store refuses it
    raw(r, {"session": "s1", "cwd": CWD, "event": orjson.dumps(far)})
    watcher = Watcher(r, small, name="w")
    drain(watcher, r, small)
    assert len(dead_letters(r)) == 1
    assert not SessionLog(small.data_dir, CWD, "s1").exists() and not r.exists(Keys().session("s1"))
    good = Publisher(r, small).publish("s1", CWD, [user(1), turn_end(1)])
    drain(watcher, r, small)
    assert [line["streamId"] for line in log_lines(small, "s1")] == good and r.exists(Keys().session("s1"))


@pytest.mark.parametrize("cwd", ["/.compactor-id", "/.redis", "/.compactor-id.17.tmp", "/.compactor-marks"])
def test_a_cwd_encoding_to_a_name_the_service_keeps_is_refused_not_held(
        r: redis.Redis, settings: Settings, cwd: str) -> None:
    """``/.compactor-id`` encodes to the data dir's id file: its session was held back for good
    ("Not a directory", retried every second, its shard never trimmed); ``/.redis`` put logs among
    the embedded Redis's files. Both are refused as the cwd's fault, by the watcher and the API."""
    entry = raw(r, {"session": "s9", "cwd": cwd, "event": GOOD}, session_id="s9")
    drain(Watcher(r, settings, name="w"), r, settings)
    [letter] = dead_letters(r)
    assert letter[b"id"].decode() == entry
    assert "which the service keeps for its own files" in letter[b"reason"].decode()
    assert not r.xpending(Keys().stream_for("s9"), Keys().group)["pending"]
    with pytest.raises(InvalidInput, match="keeps for its own files"):
        Publisher(r, settings).publish("s9", cwd, [user(1)])


def test_entries_redelivered_after_a_crash_in_a_sessions_first_round_are_duplicates_not_letters(
        r: redis.Redis, tmp_path: Path, redis_url: str) -> None:
    """A watcher killed after its appends, before its round's state saves and acks, in the first
    round of a session (no hash, no uuid index yet). The next watcher rebuilt both from the log,
    the index queued with the state save at the round's end: its second run of the session's
    redelivered entries, from the state cached, looked the uuids up in the still empty index, took
    the entries for a lost stream's, and dead-lettered them as duplicate uuids (a false warning too)."""
    settings = fast_settings(tmp_path / "data", redis_url, shards=1)
    keys = Keys(settings.redis.prefix, settings.redis.shards)
    publisher = Publisher(r, settings)
    publisher.publish("s1", CWD, [{"type": "session_meta", "model": "gpt-4"}])
    for n in (1, 2, 3):  # (a run of the session's entries ends at each turn_end)
        publisher.publish("s1", CWD, [user(n), turn_end(n)])

    class Killed(BaseException):
        pass

    def killed(*args: Any, **kwargs: Any) -> Any:
        raise Killed

    first = Watcher(r, settings, name="w1")
    first.streams.ack_many = killed  # type: ignore[method-assign]
    with pytest.raises(Killed):
        for _ in range(50):
            first.run_once()
    assert len(log_lines(settings, "s1")) == 7 and not r.exists(keys.session("s1"))
    r.delete(keys.lease(0))  # (its lease ran out)
    drain(Watcher(r, settings, name="w2"), r, settings)
    assert dead_letters(r) == []
    assert len(log_lines(settings, "s1")) == 7
    assert r.scard(keys.uuids("s1")) == 7


def test_a_pending_entry_past_the_shard_count_deleted_from_its_stream_is_lettered_not_dropped(
        r: redis.Redis) -> None:
    """The sweep looked each pending entry up, skipped one deleted meanwhile (XDEL, a trim) and
    acked it with the others: gone without a letter, a line or a count, where a shard's own
    deleted entry is lettered ``entry has no fields``."""
    from producer.watcher.orphans import letter_orphans

    stream, group = Keys().stream(9), Keys().group
    ids = [r.xadd(stream, {"session": f"s{i}", "cwd": CWD, "event": orjson.dumps(user(1))}).decode()
           for i in range(3)]
    r.xgroup_create(stream, group, id="0-0")
    r.xreadgroup(group, "hand", {stream: ">"})  # all three pending
    r.xdel(stream, ids[0])
    assert letter_orphans(r, Keys(shards=8), "sweeper") == 3
    letters = {d[b"id"].decode(): d[b"reason"].decode() for d in dead_letters(r)}
    assert letters.keys() == set(ids)
    assert letters[ids[0]] == "entry has no fields (deleted from the stream before it was applied)"
    assert r.xpending(stream, group)["pending"] == 0


def test_entries_left_past_a_lowered_shard_count_are_dead_lettered(r: redis.Redis, tmp_path: Path,
                                                                    redis_url: str) -> None:
    """``redis.shards`` 8 -> 4 with a backlog: the entries on ``{p}:events:4..7`` were never read,
    neither applied nor dead-lettered, and no gauge counted them (OPERATIONS says an entry queued
    under the old count is dead-lettered). The watcher now letters them (``wrong_shard``), those an
    agent still publishing under the old count adds too, once each."""
    from producer.watcher.orphans import letter_orphans

    eight = fast_settings(tmp_path / "data", redis_url, shards=8)
    four = fast_settings(tmp_path / "data", redis_url, shards=4)
    sid = next(f"s{i}" for i in range(100) if Keys(shards=8).shard_of(f"s{i}") >= 4)
    old = Publisher(r, eight).publish(sid, CWD, [user(1), turn_end(1)])  # no watcher ran
    new = Publisher(r, four).publish(sid, CWD, [user(2), turn_end(2)])
    before = REGISTRY.get_sample_value("compactor_entries_dead_lettered_total", {"reason": "wrong_shard"}) or 0
    watcher = Watcher(r, four, name="w")
    drain(watcher, r, four)
    assert [line["streamId"] for line in log_lines(four, sid)] == new
    letters = dead_letters(r)
    assert [d[b"id"].decode() for d in letters] == old
    assert all(d[b"reason"].decode().startswith(f"session: belongs to shard {Keys(shards=4).shard_of(sid)} ")
               and d[b"stream"].decode() == Keys(shards=8).stream_for(sid) for d in letters)
    assert REGISTRY.get_sample_value("compactor_entries_dead_lettered_total", {"reason": "wrong_shard"}) == before + 2
    late = Publisher(r, eight).publish(sid, CWD, [user(3)])  # an agent still on the old count
    assert letter_orphans(r, Keys(shards=4), "w2") == 1
    assert letter_orphans(r, Keys(shards=4), "w2") == 0  # once each
    assert [d[b"id"].decode() for d in dead_letters(r)] == [*old, *late]
    # a producer whose CRC-32 is signed (JavaScript's | 0) and whose % keeps the sign writes to
    # a stream below 0: its entries were neither read nor lettered, lost without a word
    def c_shard(sid: str) -> int:  # (crc | 0) % 4 in JavaScript, C or Java: the sign kept
        signed_crc = zlib.crc32(sid.encode()) - (1 << 32)
        return -(-signed_crc % 4)

    signed = next(f"n{i}" for i in range(1000) if zlib.crc32(f"n{i}".encode()) >= 1 << 31 and c_shard(f"n{i}"))
    negative = c_shard(signed)
    wrong = r.xadd(Keys().stream(negative), {"session": signed, "cwd": CWD, "event": orjson.dumps(user(1))}).decode()
    assert letter_orphans(r, Keys(shards=4), "w2") == 1
    assert dead_letters(r)[-1][b"id"].decode() == wrong
    assert dead_letters(r)[-1][b"stream"].decode() == Keys().stream(negative)




def unread_letters(r: redis.Redis) -> list[dict[bytes, bytes]]:
    return [fields for fields in dead_letters(r) if reason_kind(fields[b"reason"].decode()) == "deleted_unread"]


def test_entries_a_producer_trims_before_the_watcher_reads_them_are_dead_lettered_once(
    r: redis.Redis, small: Settings,
) -> None:
    """A producer's ``MAXLEN`` trim while no watcher reads deletes entries nobody read: when a
    watcher takes the shard, their loss is dead-lettered (once) and logged, not silent."""
    shard = Keys().shard_of("s1")
    stream = Keys().stream(shard)
    publisher = Publisher(r, small)
    first = Watcher(r, small, name="w1")
    publisher.publish("s1", CWD, [user(1), turn_end(1)])
    drain(first, r, small)
    read = r.xinfo_groups(stream)[0]["last-delivered-id"]
    first.close()
    publisher.publish("s1", CWD, [user(2), turn_end(2), user(3), turn_end(3)])
    r.xtrim(stream, maxlen=1, approximate=False)  # the producer's trim: 3 unread entries gone
    second = Watcher(r, small, name="w2")
    drain(second, r, small)
    [letter] = unread_letters(r)
    assert (letter[b"stream"], letter[b"after"], letter[b"lost"], letter[b"id"]) == (stream.encode(), read, b"3", b"")
    assert [e["turnId"] for e in log_lines(small, "s1") if e["type"] == "turn_end"] == [1, 3]
    for watcher in second, Watcher(r, small, name="w3"):  # later trims, a takeover: not lettered again
        watcher.streams.trim(shard)
    second.close()
    drain(Watcher(r, small, name="w4"), r, small)
    assert len(unread_letters(r)) == 1


def test_entries_trimmed_before_any_watcher_ran_and_one_deleted_amid_unread_ones_are_dead_lettered(
    r: redis.Redis, small: Settings,
) -> None:
    shard = Keys().shard_of("s1")
    stream = Keys().stream(shard)
    publisher = Publisher(r, small)
    publisher.publish("s1", CWD, [user(1), turn_end(1), user(2)])
    r.xtrim(stream, maxlen=2, approximate=False)
    watcher = Watcher(r, small, name="w1")
    drain(watcher, r, small)
    assert [(f[b"after"], f[b"lost"]) for f in unread_letters(r)] == [(b"0-0", b"1")]
    watcher.close()
    ids = publisher.publish("s1", CWD, [turn_end(2), user(3), turn_end(3)])
    r.xdel(stream, ids[1])  # amid unread ones: no count tells, the highest deleted id does
    drain(Watcher(r, small, name="w2"), r, small)
    assert [(f[b"lost"], f[b"id"]) for f in unread_letters(r)][1:] == [(b"0", ids[1].encode())]


def test_a_loss_read_across_leaves_no_false_letters_and_a_recreated_streams_loss_is_found(r: redis.Redis) -> None:
    """Redis adds 1 to a group's entries-read per entry delivered: a trimmed gap read across between
    two checks left it behind the position for good, and every later trim of the watcher's own
    wrote another letter of a false loss. A new stream under the same key: its loss was missed."""
    from producer.watcher.streams import ShardStreams

    keys = Keys()
    stream, group, consumer = keys.stream(0), keys.group, keys.consumer(0)
    r.set(keys.lease(0), "me")
    streams = ShardStreams(r, keys, "me")

    def add(n: int) -> None:
        for i in range(n):
            r.xadd(stream, {"session": "x", "cwd": CWD, "event": f"{i}"})

    def read_all(count: int | None = None) -> None:
        for _, entries in r.xreadgroup(group, consumer, {stream: ">"}, count=count) or []:
            r.xack(stream, group, *[entry_id for entry_id, _ in entries])

    streams.ensure_group(0)
    add(100)
    read_all(10)
    r.xtrim(stream, maxlen=50, approximate=False)  # 40 unread gone
    read_all()  # read across the gap before any check: not seen
    for _ in range(4):
        add(400)
        read_all()
        streams.trim(0)
        streams.trim(0)
        r.xtrim(stream, minid=r.xinfo_groups(stream)[0]["last-delivered-id"], approximate=False)  # (the
        streams.trim(0)  # watcher's own trims, exact: what its approximate ones come to in time)
    # Redis 7.0 counts a delivery 1 whatever it crossed: caught up, the 40 are found; Valkey 8 sets the
    # counter right as it reads across, and they go unseen. Never a letter of a false loss.
    valkey = r.info("server").get("server_name") == "valkey"
    assert [f[b"lost"] for f in unread_letters(r)] == ([] if valkey else [b"40"])
    r.delete(Keys().dead)
    r.delete(stream)  # a new stream under the same key
    streams.ensure_group(0)
    add(60)
    r.xtrim(stream, maxlen=30, approximate=False)
    streams.trim(0)
    streams.trim(0)
    assert [(f[b"after"], f[b"lost"]) for f in unread_letters(r)] == [(b"0-0", b"30")]
    read_all()
    add(10)
    r.xtrim(stream, maxlen=5, approximate=False)  # 5 unread gone: its own letter, counted alone
    streams.trim(0)
    assert [f[b"lost"] for f in unread_letters(r)] == [b"30", b"5"]


# every server binary on the machine: the embedded Valkey 8 re-estimates a group's counter as it reads
# across deleted entries; Redis 7.0 (a redis-server on PATH) adds 1 per entry delivered
_SERVERS = ["embedded", *(["redis-server"] if shutil.which("redis-server") else [])]


@pytest.fixture(params=_SERVERS)
def any_server(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
               r: redis.Redis) -> Iterator[redis.Redis]:
    if request.param == "embedded":
        yield r
        return
    import compactor.embedded as embedded

    monkeypatch.setattr(embedded, "server_binary", lambda: shutil.which("redis-server"))
    server = embedded.EmbeddedRedis(tmp_path / "redis7", persist=False)
    server.start()
    client = redis.Redis.from_url(server.url)
    try:
        yield client
    finally:
        client.close()
        server.stop()


class _Shard:
    """Shard 0's stream on ``r``, its trims (``ShardStreams.trim``) and a reader standing in for
    the watcher (numbered entries ``n-0``, read and acked)."""

    def __init__(self, r: redis.Redis) -> None:
        from producer.watcher.streams import ShardStreams

        self.r, keys = r, Keys()
        self.stream, self.group, self.consumer = keys.stream(0), keys.group, keys.consumer(0)
        r.set(keys.lease(0), "me")
        self.streams = ShardStreams(r, keys, "me")
        self.streams.ensure_group(0)

    def add(self, *numbers: int) -> None:
        for n in numbers:
            self.r.xadd(self.stream, {"n": n}, id=f"{n}-0")

    def read(self, count: int | None = None) -> None:
        for _, entries in self.r.xreadgroup(self.group, self.consumer, {self.stream: ">"}, count=count) or []:
            self.r.xack(self.stream, self.group, *[entry_id for entry_id, _ in entries])

    def trim(self, times: int = 1) -> None:
        for _ in range(times):
            self.streams.trim(0)


def test_entries_deleted_amid_unread_ones_are_lettered_once_when_the_group_reads_across_them(
    any_server: redis.Redis,
) -> None:
    """Lettered when found (their highest id past the group's position), then read across: Redis 7.0
    added 1 to the group's counter for the entry delivered past them, and once caught up the
    counts rule lettered the same loss a second time, ``after`` the wrong position."""
    shard, r = _Shard(any_server), any_server
    shard.add(1, 2, 3)
    shard.read()
    shard.trim()
    shard.add(*range(4, 11))
    r.xdel(shard.stream, *[f"{i}-0" for i in range(4, 11)])  # 7 deleted before anyone read them
    shard.trim(2)
    assert [(f[b"id"], f[b"after"]) for f in unread_letters(r)] == [(b"10-0", b"3-0")]
    shard.add(11)
    shard.read()  # across the 7
    shard.trim(2)
    shard.add(12, 13)
    r.xtrim(shard.stream, maxlen=1, approximate=False)  # the counter known again: a later loss is found
    shard.trim()
    assert [(f[b"id"], f[b"after"], f[b"lost"]) for f in unread_letters(r)] == [
        (b"10-0", b"3-0", b"0"), (b"", b"11-0", b"1")]


def test_a_trim_of_unread_entries_kept_after_a_lettered_xdel_read_across_is_no_loss(any_server: redis.Redis) -> None:
    """Read across the lettered XDEL, Redis 7.0's counter fell short by it: a producer's trim that kept
    every unread entry was then lettered as a loss of one."""
    shard, r = _Shard(any_server), any_server
    shard.add(1, 2, 3)
    shard.read()
    shard.trim()
    shard.add(*range(4, 11))
    r.xdel(shard.stream, "4-0")
    shard.trim()
    shard.read(count=3)  # 5-7, across the deleted 4
    shard.trim()
    r.xtrim(shard.stream, maxlen=3, approximate=False)  # 8-10 kept: the unread ones, all
    shard.trim()
    shard.read()
    shard.trim()
    assert [(f[b"id"], f[b"after"]) for f in unread_letters(r)] == [(b"4-0", b"3-0")]
    shard.add(11, 12)
    r.xtrim(shard.stream, maxlen=1, approximate=False)  # 11: unread, gone (the counter right again)
    shard.trim()
    assert [(f[b"after"], f[b"lost"]) for f in unread_letters(r)][1:] == [(b"10-0", b"1")]


def test_a_trim_loss_after_a_lettered_xdel_is_lettered_too(any_server: redis.Redis) -> None:
    """The first fix of the double letter made the group's counter unknown once an XDEL was lettered:
    a producer's trim of unread entries before the group caught up was then never lettered."""
    shard, r = _Shard(any_server), any_server
    shard.add(1, 2, 3)
    shard.read()
    shard.add(*range(4, 21))
    r.xdel(shard.stream, "5-0", "6-0")
    shard.trim()
    r.xtrim(shard.stream, maxlen=6, approximate=False)  # 4 and 7-14: unread, gone
    shard.trim()
    assert [(f[b"id"], f[b"after"]) for f in unread_letters(r)] == [(b"6-0", b"3-0"), (b"", b"3-0")]


def test_a_trim_of_read_entries_only_at_the_check_that_settles_a_lettered_xdel_is_no_loss(
        any_server: redis.Redis) -> None:
    """The stream's first entry past the group's position is the next one to read, not a gap, when
    the trim took read entries only: it was lettered as a loss."""
    shard, r = _Shard(any_server), any_server
    shard.add(*range(1, 6))
    shard.read(count=2)
    r.xdel(shard.stream, "3-0")
    shard.trim()
    shard.read()  # 4, 5: across the deleted 3
    shard.add(6)
    r.xtrim(shard.stream, maxlen=1, approximate=False)  # 6 kept: read entries only gone
    shard.trim(2)
    assert [(f[b"id"], f[b"after"]) for f in unread_letters(r)] == [(b"3-0", b"2-0")]
    shard.read()
    shard.add(*range(7, 13))
    r.xdel(shard.stream, "8-0", "9-0")  # two deleted amid unread ones
    shard.trim()
    shard.read(count=2)  # 7, 10: across both
    r.xtrim(shard.stream, minid="11-0", approximate=False)  # read entries only again: 11 is the next unread
    shard.trim(2)
    assert [(f[b"id"], f[b"after"]) for f in unread_letters(r)] == [(b"3-0", b"2-0"), (b"9-0", b"6-0")]


def test_the_watchers_own_trims_and_deletions_of_read_entries_are_not_taken_for_unread_losses(
    r: redis.Redis, small: Settings,
) -> None:
    shard = Keys().shard_of("s1")
    stream = Keys().stream(shard)
    publisher = Publisher(r, small)
    watcher = Watcher(r, small, name="w1")
    ids = publisher.publish("s1", CWD, [user(1), turn_end(1), user(2), turn_end(2)])
    drain(watcher, r, small)
    watcher.streams.trim(shard)
    r.xtrim(stream, minid=ids[1], approximate=False)  # (read already, as the watcher's own trims)
    r.xdel(stream, ids[-1])  # read already
    publisher.publish("s1", CWD, [user(3), turn_end(3)])
    drain(watcher, r, small)
    watcher.close()
    drain(Watcher(r, small, name="w2"), r, small)
    assert r.xinfo_stream(stream)["max-deleted-entry-id"] == ids[-1].encode()
    assert unread_letters(r) == [] and dead_letters(r) == []


def test_the_letter_of_an_entry_repeating_a_field_tens_of_thousands_of_times_is_built_in_linear_time() -> None:
    """Each of the entry's fields was looked for in the list of its ``session``/``cwd``/``event``
    fields: 80 000 ``event`` fields (a 720 KB entry) took minutes to letter, past the shard's lease,
    before the ack: the entry was read again at each takeover and its shard stopped for good."""
    import time

    from producer.watcher.batch import BatchOutcome

    fields = [b"session", b"s1", b"cwd", CWD.encode(), *[b"event", b"{}"] * 80_000, b"x", b"y"]
    started = time.monotonic()
    letter = BatchOutcome("compaction:events:0").letter("1-0", "field 'event' given 80000 times", fields)
    assert time.monotonic() - started < 5  # (quadratic: minutes; linear: milliseconds)
    flat = letter.fields
    names = flat[:-6:2]
    assert names[:3] == [b"session", b"cwd", b"event"] and len(names) == 1_000 + 1  # (and fieldsDropped)
    assert flat[flat.index(b"fieldsDropped") + 1] == str(80_003 - 1_000).encode()
