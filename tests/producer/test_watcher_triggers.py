"""SPEC §5 thresholds after a turn_end: strictly above 0.9·W -> LLM job, above 0.25·W with candidates -> micro."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import rq
import rq.job

from compactor.keys import Keys
from compactor.queue import parse_job_id, pending_job_id
from compactor.store import SessionStore
from events.config import Settings
from events.models import parse_event, to_wire
from events.tokens import count_tokens, event_tokens
from producer.publisher import Publisher
from producer.watcher import Watcher
from producer.watcher import core as watcher_core
from tests.producer.conftest import CWD, drain, fast_settings, log_lines, turn_end, user

ENCODING = "cl100k_base"  # gpt-4's
WINDOW = 1000
OUTPUT = "a line of file content\n" * 10  # 230 characters of a compactable tool


def tokens(events: list[dict[str, Any]]) -> int:
    return sum(event_tokens(to_wire(parse_event(e)), ENCODING) for e in events)


def padded_user(turn: int, total: int) -> dict[str, Any]:
    """A user event contributing exactly ``total`` tokens (content + 4)."""
    content = "hello" + " hello" * (total - 5)
    assert count_tokens(content, ENCODING) + 4 == total
    return user(turn, content)


def tool_turn(turn: int, tool: str = "read_file") -> list[dict[str, Any]]:
    call = {"id": f"c{turn}", "name": tool, "arguments": {"path": "a.py"}}
    return [
        user(turn, "read it"),
        {"type": "assistant", "turnId": turn, "content": "", "toolCalls": [call]},
        {"type": "tool_result", "turnId": turn, "toolCallId": f"c{turn}", "toolName": tool, "output": OUTPUT},
    ]


def run_session(r: redis.Redis, settings: Settings, events: list[dict[str, Any]], estimate: int) -> str | None:
    """Publish ``events`` then a last turn padded to ``estimate`` tokens; the kind of job enqueued."""
    last = max(e["turnId"] for e in events) + 1 if events else 1
    head = [e for e in events if e["type"] != "turn_end"]
    publisher = Publisher(r, settings)
    if events:
        publisher.publish("s1", CWD, events)
    publisher.publish("s1", CWD, [padded_user(last, estimate - tokens(head)), turn_end(last, window=WINDOW)])
    watcher = Watcher(r, settings, name="w")
    drain(watcher, r, settings)
    state = watcher.store.load("s1")
    assert state is not None and state.prompt_estimate == estimate and state.window == WINDOW
    job_id = pending_job_id(r, settings, "s1")
    if job_id is None:
        return None
    assert job_id in rq.Queue(settings.redis.prefix, connection=r).job_ids
    parsed = parse_job_id(job_id)
    assert parsed is not None and parsed[2] == "s1"
    return parsed[1]


@pytest.mark.parametrize("estimate, kind", [(899, None), (900, None), (901, "llm")])
def test_llm_job_only_strictly_above_ninety_percent(
    r: redis.Redis, fast: Settings, estimate: int, kind: str | None
) -> None:
    assert run_session(r, fast, [], estimate) == kind


@pytest.mark.parametrize("estimate, kind", [(249, None), (250, None), (251, "micro")])
def test_micro_job_only_strictly_above_a_quarter_with_old_candidates(
    r: redis.Redis, fast: Settings, estimate: int, kind: str | None
) -> None:
    assert run_session(r, fast, [*tool_turn(1), turn_end(1, window=WINDOW)], estimate) == kind


def test_no_micro_job_when_the_only_long_output_is_in_the_last_turn(r: redis.Redis, fast: Settings) -> None:
    events = [*tool_turn(1)]
    Publisher(r, fast).publish("s1", CWD, [*events, padded_user(1, 400 - tokens(events)), turn_end(1, WINDOW)])
    drain(Watcher(r, fast, name="w"), r, fast)
    assert pending_job_id(r, fast, "s1") is None


def test_no_micro_job_for_a_tool_that_is_not_compactable(r: redis.Redis, fast: Settings) -> None:
    assert run_session(r, fast, [*tool_turn(1, "ask_user"), turn_end(1, window=WINDOW)], 400) is None


@pytest.mark.parametrize("failures, kind", [(2, "llm"), (3, None), (7, None)])
def test_open_breaker_stops_automatic_llm_jobs(
    r: redis.Redis, fast: Settings, failures: int, kind: str | None
) -> None:
    r.set(Keys().failures("s1"), failures, ex=86_400)
    assert run_session(r, fast, [], 950) == kind


def test_open_breaker_with_a_fallback_model_still_enqueues_the_llm_job_and_the_fallback_writes_it(
    r: redis.Redis, fast: Settings
) -> None:
    """Issue #4: ``context.fallbackModel: extractive`` is used when the breaker is open, so a session
    never overflows for lack of an LLM (the job calls no LLM: SPEC §5's breaker still holds)."""
    from worker.context import WorkerContext
    from worker.runner import CompactionWorker

    fallback = fast.model_copy(update={"context": fast.context.model_copy(update={"fallback_model": "extractive"})})
    r.set(Keys().failures("s1"), 3, ex=86_400)
    # (answers longer than their summary: one of two short turns is not appended)
    answers = [{"type": "assistant", "turnId": turn, "content": text} for turn, text in
               ((1, "The parser reads each line and then validates it. " * 12), (2, "done"))]
    events = [user(1, "first question"), answers[0], turn_end(1, window=WINDOW), user(2, "second"), answers[1],
              turn_end(2, window=WINDOW)]
    assert run_session(r, fallback, events, 950) == "llm"
    CompactionWorker.for_settings(r, fallback, context=WorkerContext.build(fallback, r)).work(burst=True)
    lines = Watcher(r, fallback, name="w").store.log("s1", CWD).read()
    assert lines[-1]["type"] == "summary" and "first question" in lines[-1]["summaryText"]
    assert int(r.get(Keys().failures("s1")) or 0) == 3  # the fallback says nothing of the LLM's health


@pytest.mark.parametrize("model", ["openai/backup", "openai/stub-model"])
def test_open_breaker_with_a_fallback_that_is_a_model_enqueues_no_llm_job(
    r: redis.Redis, fast: Settings, model: str
) -> None:
    """SPEC §5: no automatic LLM job while the breaker is open. A fallback that is a model would
    be called by that job (only ``extractive`` calls no LLM)."""
    fallback = fast.model_copy(update={"context": fast.context.model_copy(update={"fallback_model": model})})
    r.set(Keys().failures("s1"), 3, ex=86_400)
    events = [user(1, "first question"), turn_end(1, window=WINDOW), user(2, "second"), turn_end(2, window=WINDOW)]
    assert run_session(r, fallback, events, 950) is None


def test_open_breaker_still_allows_micro_compaction(r: redis.Redis, fast: Settings) -> None:
    r.set(Keys().failures("s1"), 3, ex=86_400)
    assert run_session(r, fast, [*tool_turn(1), turn_end(1, window=WINDOW)], 950) == "micro"


def test_triggers_while_a_job_is_pending_are_coalesced(r: redis.Redis, fast: Settings) -> None:
    publisher = Publisher(r, fast)
    watcher = Watcher(r, fast, name="w")
    publisher.publish("s1", CWD, [padded_user(1, 950), turn_end(1, window=WINDOW)])
    drain(watcher, r, fast)
    first = pending_job_id(r, fast, "s1")
    publisher.publish("s1", CWD, [user(2), turn_end(2, window=WINDOW)])
    drain(watcher, r, fast)
    assert pending_job_id(r, fast, "s1") == first
    assert rq.Queue(fast.redis.prefix, connection=r).job_ids == [first]
    assert r.get(Keys().retrigger("s1")) is None  # the job, not started, reads turn 2 when it starts
    rq.job.Job.fetch(first, connection=r).set_status(rq.job.JobStatus.STARTED)
    publisher.publish("s1", CWD, [user(3), turn_end(3, window=WINDOW)])
    drain(watcher, r, fast)
    assert r.get(Keys().retrigger("s1")) == b"llm"  # it runs: turn 3 is re-checked after it


def test_only_a_turn_end_triggers(r: redis.Redis, fast: Settings) -> None:
    publisher = Publisher(r, fast)
    watcher = Watcher(r, fast, name="w")
    publisher.publish("s1", CWD, [user(1), turn_end(1, window=WINDOW)])
    publisher.publish("s1", CWD, [padded_user(2, 950)])
    drain(watcher, r, fast)
    assert pending_job_id(r, fast, "s1") is None
    publisher.publish("s1", CWD, [turn_end(2, window=WINDOW)])
    drain(watcher, r, fast)
    job_id = pending_job_id(r, fast, "s1")
    assert job_id is not None and parse_job_id(job_id)[1] == "llm"  # type: ignore[index]


def test_two_triggers_of_a_session_in_one_round_claim_then_coalesce_in_order(
    r: redis.Redis, fast: Settings,
) -> None:
    """A round claims its triggers together, but as if one by one in stream order: the first
    turn_end's micro job is enqueued, the second's LLM trigger is recorded for its re-check."""
    publisher = Publisher(r, fast)
    publisher.publish("s1", CWD, [*tool_turn(1), turn_end(1, window=WINDOW)])
    publisher.publish("s1", CWD, [padded_user(2, 300), turn_end(2, window=WINDOW)])  # over 0.25·W: micro
    publisher.publish("s1", CWD, [padded_user(3, 700), turn_end(3, window=WINDOW)])  # over 0.9·W: LLM
    watcher = Watcher(r, fast, name="w")
    handled = 0
    while handled == 0:  # the first rounds take the leases and sweep the (empty) PELs
        handled = watcher.run_once()
    assert handled == 8  # the three turns in one round
    job_id = pending_job_id(r, fast, "s1")
    assert job_id is not None and parse_job_id(job_id)[1] == "micro"  # type: ignore[index]
    assert rq.Queue(fast.redis.prefix, connection=r).job_ids == [job_id]
    assert r.get(Keys().retrigger("s1")) == b"llm"


def test_a_long_round_enqueues_its_triggers_as_it_goes(
    r: redis.Redis, fast: Settings, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past ``FIRE_EVERY_S`` into a round, the triggers noted so far are claimed and enqueued
    before the next session is applied: a trigger early in a big round does not wait for it."""
    monkeypatch.setattr(watcher_core, "FIRE_EVERY_S", 0.0)
    publisher = Publisher(r, fast)
    for sid in ("s1", "s2", "s3"):
        publisher.publish(sid, CWD, [padded_user(1, 950), turn_end(1, window=WINDOW)])
    watcher = Watcher(r, fast, name="w")
    queued_at_apply: list[int] = []
    apply_session = watcher._apply_session

    def recording(*args: Any, **kwargs: Any) -> None:
        queued_at_apply.append(len(rq.Queue(fast.redis.prefix, connection=r).job_ids))
        apply_session(*args, **kwargs)

    monkeypatch.setattr(watcher, "_apply_session", recording)
    handled = 0
    while handled == 0:
        handled = watcher.run_once()
    assert handled == 6
    assert queued_at_apply == [0, 1, 2]  # each session's job was enqueued before the next was applied
    assert all(pending_job_id(r, fast, sid) is not None for sid in ("s1", "s2", "s3"))


def triggered_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The watcher's INFO (or higher) lines about compaction triggers."""
    return [rec.getMessage() for rec in caplog.records
            if rec.name == watcher_core.__name__ and rec.levelno >= logging.INFO and "compaction" in rec.getMessage()]


def test_the_trigger_line_names_the_kind_enqueued_not_the_kind_called_for(
    r: redis.Redis, fast: Settings, caplog: pytest.LogCaptureFixture,
) -> None:
    """With the breaker open the LLM trigger's claim enqueues a micro job: the line said kind=llm."""
    r.set(Keys().failures("s1"), 3, ex=86_400)
    with caplog.at_level(logging.DEBUG, logger=watcher_core.__name__):
        assert run_session(r, fast, [*tool_turn(1), turn_end(1, window=WINDOW)], 950) == "micro"
    [line] = triggered_lines(caplog)
    assert "kind=micro" in line and f"job={pending_job_id(r, fast, 's1')}" in line


def test_no_info_line_when_the_open_breaker_leaves_nothing_to_enqueue(
    r: redis.Redis, fast: Settings, caplog: pytest.LogCaptureFixture,
) -> None:
    r.set(Keys().failures("s1"), 3, ex=86_400)
    with caplog.at_level(logging.DEBUG, logger=watcher_core.__name__):
        assert run_session(r, fast, [], 950) is None
    assert triggered_lines(caplog) == []


def test_no_info_line_for_a_trigger_coalesced_into_the_pending_job(
    r: redis.Redis, fast: Settings, caplog: pytest.LogCaptureFixture,
) -> None:
    """Every turn_end of a busy session over the threshold coalesces: 2 000 turns gave 673 such lines."""
    publisher = Publisher(r, fast)
    watcher = Watcher(r, fast, name="w")
    publisher.publish("s1", CWD, [padded_user(1, 950), turn_end(1, window=WINDOW)])
    with caplog.at_level(logging.DEBUG, logger=watcher_core.__name__):
        drain(watcher, r, fast)
        [first] = triggered_lines(caplog)
        caplog.clear()
        rq.job.Job.fetch(pending_job_id(r, fast, "s1"), connection=r).set_status(rq.job.JobStatus.STARTED)
        for turn in (2, 3, 4):
            publisher.publish("s1", CWD, [user(turn), turn_end(turn, window=WINDOW)])
        drain(watcher, r, fast)
    assert "kind=llm" in first and triggered_lines(caplog) == []
    assert r.get(Keys().retrigger("s1")) == b"llm"


def _settled(watcher: Watcher, r: redis.Redis, settings: Settings) -> None:
    """Run the watcher for two leases against the restarted server (ticks at least three times;
    a restart's first commands may fail: the loop's retry is done here)."""
    until = None
    deadline = time.monotonic() + 20
    while until is None or time.monotonic() < until:
        assert time.monotonic() < deadline, "the watcher never ran against the restarted Redis"
        try:
            drain(watcher, r, settings)
        except redis.ConnectionError:
            time.sleep(0.05)
            continue
        until = until or time.monotonic() + 2 * settings.watcher.lease_ms / 1000
        time.sleep(0.05)


def test_a_trigger_redis_lost_in_a_restart_is_raised_again_without_another_turn_end(tmp_path: Path) -> None:
    """Redis restarted and lost its last writes (without persistence all of them; with AOF
    ``everysec`` a second or two: seen once in the Redis kill -9 chaos run): the turn_end applied
    just before was in the log and acked, its job's claim and RQ job gone with Redis, and nothing
    asked for that compaction again until the session's next turn_end: a session whose agent
    stopped there stayed over its threshold for good. The watcher notices the restart (another
    run_id) and re-checks the sessions of its recent turn_ends; a restart that lost nothing
    coalesces into the job Redis kept."""
    from compactor.embedded import EmbeddedRedis

    server = EmbeddedRedis(tmp_path / "redis", persist=True).start()
    try:
        r = redis.Redis.from_url(server.url)
        fast = fast_settings(tmp_path / "data", server.url)
        watcher = Watcher(r, fast, name="w")
        Publisher(r, fast).publish("s1", CWD, [padded_user(1, 950), turn_end(1, window=WINDOW)])
        drain(watcher, r, fast)
        first = pending_job_id(r, fast, "s1")
        assert first is not None and parse_job_id(first)[1] == "llm"  # type: ignore[index]
        lines = log_lines(fast, "s1")

        server.kill()  # (AOF: nothing lost)
        server.start()
        _settled(watcher, r, fast)
        assert pending_job_id(r, fast, "s1") == first
        assert rq.Queue(fast.redis.prefix, connection=r).job_ids == [first]

        r.flushall()  # (a restart that lost everything)
        server.kill()
        server.start()
        _settled(watcher, r, fast)
        again = pending_job_id(r, fast, "s1")
        assert again is not None and again != first and parse_job_id(again)[1] == "llm"  # type: ignore[index]
        assert rq.Queue(fast.redis.prefix, connection=r).job_ids == [again]
        state = watcher.store.load("s1")  # (rebuilt from the log, which is as it was)
        assert state is not None and state.prompt_estimate == 950
        assert log_lines(fast, "s1") == lines
        watcher.close()
    finally:
        server.stop()


def test_a_trigger_lost_with_redis_and_the_watcher_that_applied_it_is_raised_by_the_next_owner(
        tmp_path: Path) -> None:
    """A host's crash: Redis comes back from a snapshot taken before turn 3 (its last writes lost:
    turn 3's entries, state save, claim and RQ job), and the watcher that applied turn 3 to the log
    is gone too, so nothing remembers the trigger: the session, over its threshold, got no job
    before its next turn_end and its status kept turn 2's estimate. The watcher that takes the
    shard re-checks its active sessions whose log is ahead of their stored state."""
    from compactor.embedded import EmbeddedRedis

    server = EmbeddedRedis(tmp_path / "redis", persist=False).start()  # (it loads the RDB SAVE writes)
    try:
        r = redis.Redis.from_url(server.url)
        fast = fast_settings(tmp_path / "data", server.url)
        publisher = Publisher(r, fast)
        crashed = Watcher(r, fast, name="crashed")
        publisher.publish("s1", CWD, [user(1), turn_end(1, window=WINDOW), user(2), turn_end(2, window=WINDOW)])
        drain(crashed, r, fast)
        assert pending_job_id(r, fast, "s1") is None
        r.save()  # the snapshot Redis comes back from
        publisher.publish("s1", CWD, [padded_user(3, 950), turn_end(3, window=WINDOW)])
        drain(crashed, r, fast)
        assert pending_job_id(r, fast, "s1") is not None
        lines = log_lines(fast, "s1")
        server.kill()  # (the crashed watcher is never run again)
        server.start()
        assert pending_job_id(r, fast, "s1") is None and SessionStore(r, fast).load("s1").prompt_estimate < 100  # type: ignore[union-attr]

        watcher = Watcher(r, fast, name="next")
        deadline = time.monotonic() + 20
        while pending_job_id(r, fast, "s1") is None:  # (once the crashed watcher's leases ran out)
            assert time.monotonic() < deadline, "no job for the session over its threshold"
            watcher.run_once()
            time.sleep(0.05)
        job_id = pending_job_id(r, fast, "s1")
        assert parse_job_id(job_id)[1] == "llm"  # type: ignore[arg-type,index]
        assert rq.Queue(fast.redis.prefix, connection=r).job_ids == [job_id]
        state = SessionStore(r, fast).load("s1")
        assert state is not None and state.prompt_estimate > 0.9 * WINDOW and state.current_turn_id == 4
        assert log_lines(fast, "s1") == lines
        watcher.close()
    finally:
        server.stop()


def test_a_failing_re_check_stops_neither_the_tick_nor_the_reads(
        r: redis.Redis, fast: Settings, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The re-check of a session whose log is ahead of its state runs inside the tick: an error
    there (a bug) skipped the rest of the tick, and, the re-check being retried at each tick, every
    read after it. It is logged and the watcher goes on."""
    publisher = Publisher(r, fast)
    first = Watcher(r, fast, name="first")
    publisher.publish("s1", CWD, [user(1), turn_end(1, window=WINDOW)])
    drain(first, r, fast)
    first.close()
    r.hset(Keys().session("s1"), "log_size", 10)  # (a state save that did not land)
    real = SessionStore.apply

    def failing(self: SessionStore, session_id: str, cwd: str, events: Any, **kwargs: Any) -> Any:
        if not events:
            raise RuntimeError("a bug in the re-check")
        return real(self, session_id, cwd, events, **kwargs)

    monkeypatch.setattr(SessionStore, "apply", failing)
    publisher.publish("s2", CWD, [user(1), turn_end(1, window=WINDOW)])
    with caplog.at_level(logging.ERROR, logger=watcher_core.__name__):
        drain(Watcher(r, fast, name="next"), r, fast)
    assert [e["type"] for e in log_lines(fast, "s2")] == ["user", "turn_end"]
    assert any("session not re-checked session=s1" in m for m in caplog.messages)
