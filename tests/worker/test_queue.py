"""compactor.queue: one job per session, coalesced triggers, forced jobs waiting their turn, RQ rate limits."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
import redis
from rq.job import Job, JobStatus

import compactor.queue as queue_module
from compactor.keys import Keys
from compactor.queue import (
    FORCED_TRIGGER,
    STALE_CLAIM_GRACE_S,
    Trigger,
    claim_is_stale,
    compaction_queue,
    enqueue_compaction,
    new_job_id,
    parse_job_id,
    pending_job_id,
    promote_forced,
    queue_unqueued_claim,
    rate_limit_for,
    redis_now,
    release_pending,
    sessions_to_look_at,
    settle_trigger,
    trigger_compactions,
)
from compactor.store import SessionStore
from events.config import Settings
from events.errors import InvalidInput
from tests.worker.conftest import CWD


def started(r: redis.Redis, job_id: str | None) -> str:
    """Mark a queued job as a worker does when it starts it (RQ status ``started``)."""
    assert job_id is not None
    Job.fetch(job_id, connection=r).set_status(JobStatus.STARTED)
    return job_id


def forced_waiting(r: redis.Redis, settings: Settings) -> tuple[str, str]:
    """Session s1's automatic job holding the claim and a forced job waiting behind it: their ids."""
    auto = enqueue_compaction(r, settings, "s1", CWD, "micro")
    forced = enqueue_compaction(r, settings, "s1", CWD, "llm", forced=True)
    assert auto and forced
    return auto, forced


def test_second_automatic_trigger_is_coalesced_and_recorded(r: redis.Redis, settings: Settings) -> None:
    first = enqueue_compaction(r, settings, "s1", CWD, "micro")
    second = enqueue_compaction(r, settings, "s1", CWD, "llm")
    assert first is not None and second is None
    assert pending_job_id(r, settings, "s1") == first
    assert r.get(Keys().retrigger("s1")) == b"llm"  # (a micro job does not answer an LLM trigger)
    assert compaction_queue(r, settings).count == 1


@pytest.mark.parametrize("kinds", [("llm", "llm"), ("llm", "micro"), ("micro", "micro")])
def test_a_trigger_is_answered_by_the_pending_job_until_it_starts(
    r: redis.Redis, settings: Settings, kinds: tuple[str, str],
) -> None:
    """A job not started yet reads the log, the trigger's turn in it, when it starts: recorded, the
    trigger made its re-check queue the same job again (after an LLM failure: a second call with
    the same input, a second failure counted). Once the job runs, a trigger is recorded."""
    first = enqueue_compaction(r, settings, "s1", CWD, kinds[0])
    assert enqueue_compaction(r, settings, "s1", CWD, kinds[1]) is None
    assert r.get(Keys().retrigger("s1")) is None
    started(r, first)
    assert enqueue_compaction(r, settings, "s1", CWD, kinds[1]) is None
    assert r.get(Keys().retrigger("s1")) == kinds[1].encode()
    assert pending_job_id(r, settings, "s1") == first and compaction_queue(r, settings).count == 1


def test_llm_trigger_is_not_downgraded_by_a_later_micro_trigger(r: redis.Redis, settings: Settings) -> None:
    started(r, enqueue_compaction(r, settings, "s1", CWD, "micro"))
    enqueue_compaction(r, settings, "s1", CWD, "llm")
    enqueue_compaction(r, settings, "s1", CWD, "micro")
    assert r.get(Keys().retrigger("s1")) == b"llm"


def test_sessions_do_not_coalesce_with_each_other(r: redis.Redis, settings: Settings) -> None:
    assert enqueue_compaction(r, settings, "s1", CWD, "llm")
    assert enqueue_compaction(r, settings, "s2", CWD, "llm")
    assert compaction_queue(r, settings).count == 2


def test_release_frees_the_claim_and_hands_back_the_trigger(r: redis.Redis, settings: Settings) -> None:
    first = started(r, enqueue_compaction(r, settings, "s1", CWD, "micro"))
    enqueue_compaction(r, settings, "s1", CWD, "micro")
    assert release_pending(r, settings, "s1", first) == "micro"
    assert pending_job_id(r, settings, "s1") is None
    assert r.get(Keys().retrigger("s1")) == b"micro"  # kept until the re-check settles it
    assert r.zscore(Keys().claims, "s1") is not None
    assert enqueue_compaction(r, settings, "s1", CWD, "micro") is not None
    assert r.get(Keys().retrigger("s1")) is None  # the new job answers it


def test_settling_a_trigger_forgets_it_only_when_no_job_owns_the_session(
    r: redis.Redis, settings: Settings,
) -> None:
    first = enqueue_compaction(r, settings, "s1", CWD, "micro")
    assert first is not None
    enqueue_compaction(r, settings, "s1", CWD, "llm")
    settle_trigger(r, settings, "s1")  # a job still owns it: the trigger is that job's
    assert r.get(Keys().retrigger("s1")) == b"llm"
    release_pending(r, settings, "s1", first)
    settle_trigger(r, settings, "s1")
    assert r.get(Keys().retrigger("s1")) is None
    assert r.zscore(Keys().claims, "s1") is None


def test_release_by_another_job_keeps_the_claim(r: redis.Redis, settings: Settings) -> None:
    first = enqueue_compaction(r, settings, "s1", CWD, "micro")
    enqueue_compaction(r, settings, "s1", CWD, "llm")
    assert release_pending(r, settings, "s1", "00000000000000000001-llm-s1") is None
    assert pending_job_id(r, settings, "s1") == first
    assert r.get(Keys().retrigger("s1")) == b"llm"


def test_a_forced_request_claims_a_session_with_no_pending_job(r: redis.Redis, settings: Settings) -> None:
    forced = enqueue_compaction(r, settings, "s1", CWD, "llm", forced=True)
    assert forced is not None and pending_job_id(r, settings, "s1") == forced
    job = Job.fetch(forced, connection=r)
    assert job.get_status() == JobStatus.QUEUED and compaction_queue(r, settings).job_ids == [forced]
    assert job.kwargs == {"forced": True} and job.args == ("s1", CWD)
    assert job.func_name == "worker.jobs.llm_compact"
    assert job.timeout == settings.worker.job_timeout_seconds


def test_a_forced_request_under_another_spelling_of_the_cwd_is_refused_before_any_job(
    r: redis.Redis, settings: Settings,
) -> None:
    SessionStore(r, settings).apply("s1", CWD, [{"type": "user", "turnId": 1, "content": "hi"}])
    with pytest.raises(InvalidInput) as refused:  # the same log file, but the session is bound to CWD
        enqueue_compaction(r, settings, "s1", CWD + "/", "llm", forced=True)
    assert refused.value.field == "cwd" and repr(CWD) in str(refused.value)
    assert pending_job_id(r, settings, "s1") is None and compaction_queue(r, settings).count == 0
    assert enqueue_compaction(r, settings, "s1", CWD, "llm", forced=True) is not None


def test_a_forced_request_waits_for_the_pending_job_and_the_next_one_joins_it(
    r: redis.Redis, settings: Settings,
) -> None:
    """SPEC §5: at most one job per session queued or running, forced ones included."""
    auto = enqueue_compaction(r, settings, "s1", CWD, "llm")
    first = enqueue_compaction(r, settings, "s1", CWD, "llm", forced=True)
    second = enqueue_compaction(r, settings, "s1", CWD, "llm", forced=True)
    assert first is not None and second == first  # one forced job answers both requests
    assert Job.fetch(first, connection=r).get_status() == JobStatus.CREATED  # waitable, not queued
    assert compaction_queue(r, settings).job_ids == [auto] and pending_job_id(r, settings, "s1") == auto
    assert r.get(Keys().retrigger("s1")) == f"{FORCED_TRIGGER}{first}".encode()
    assert enqueue_compaction(r, settings, "s1", CWD, "micro") is None  # an automatic trigger meanwhile
    assert r.get(Keys().retrigger("s1")) == f"{FORCED_TRIGGER}{first}".encode()  # does not replace it
    assert len(r.keys("rq:job:*")) == 2  # the joining request's own job was not kept


def test_a_forced_job_is_queued_waiting_for_the_latest_entry_of_the_requests_it_answers(
    r: redis.Redis, settings: Settings,
) -> None:
    """A request that joined the forced job waiting had its ``after`` dropped: the job waited for the
    first request's alone. The latest is set in the job's arguments as it is queued (a worker of an
    older version runs it as it is: an ``after`` of ``""`` failed every forced job there)."""
    auto = enqueue_compaction(r, settings, "s1", CWD, "micro")
    first = enqueue_compaction(r, settings, "s1", CWD, "llm", forced=True, after="5-0")
    assert enqueue_compaction(r, settings, "s1", CWD, "llm", forced=True, after="10-2") == first
    assert enqueue_compaction(r, settings, "s1", CWD, "llm", forced=True, after="9-0") == first
    assert enqueue_compaction(r, settings, "s1", CWD, "llm", forced=True) == first
    assert auto and first and Job.fetch(first, connection=r).kwargs == {"forced": True, "after": "5-0"}
    release_pending(r, settings, "s1", auto)  # the claim free, the forced job not queued yet
    assert enqueue_compaction(r, settings, "s1", CWD, "llm", forced=True, after="7-0") == first  # claims for it
    assert Job.fetch(first, connection=r).kwargs == {"forced": True, "after": "10-2"}
    second = enqueue_compaction(r, settings, "s1", CWD, "llm", forced=True, after="11-0")  # waits behind it
    assert enqueue_compaction(r, settings, "s1", CWD, "llm", forced=True, after="12-0") == second
    assert Job.fetch(first, connection=r).kwargs["after"] == "10-2"  # not the queued one's: the waiting one's
    release_pending(r, settings, "s1", first)
    assert second and promote_forced(r, settings, "s1", second)
    assert Job.fetch(second, connection=r).kwargs == {"forced": True, "after": "12-0"}
    release_pending(r, settings, "s1", second)
    third = enqueue_compaction(r, settings, "s1", CWD, "llm", forced=True)  # nothing joined: none waited for
    assert third and Job.fetch(third, connection=r).kwargs == {"forced": True}


def test_a_waiting_forced_job_keeps_waiting_behind_a_job_that_took_the_free_claim_first(
    r: redis.Redis, settings: Settings,
) -> None:
    auto, forced = forced_waiting(r, settings)
    assert release_pending(r, settings, "s1", auto) == f"{FORCED_TRIGGER}{forced}"
    other = enqueue_compaction(r, settings, "s1", CWD, "llm")  # a watcher trigger wins the race
    assert other is not None and pending_job_id(r, settings, "s1") == other
    assert r.get(Keys().retrigger("s1")) == f"{FORCED_TRIGGER}{forced}".encode()  # not cleared
    assert promote_forced(r, settings, "s1", forced) is False
    assert release_pending(r, settings, "s1", other) == f"{FORCED_TRIGGER}{forced}"
    assert promote_forced(r, settings, "s1", forced) is True
    assert pending_job_id(r, settings, "s1") == forced and r.get(Keys().retrigger("s1")) is None
    assert Job.fetch(forced, connection=r).get_status() in (JobStatus.QUEUED, JobStatus.RATE_LIMITED)  # handed to RQ


def test_a_waiting_forced_job_a_request_queued_is_not_queued_again_by_its_promotion(
    r: redis.Redis, settings: Settings, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The ending job's promotion of the forced job its release handed back, late: a forced request
    came between the two, claimed for the waiting job and queued it. Claimed again, it was queued
    twice (RQ runs a job queued twice twice), and once it had run, queued once more."""
    queued: list[str] = []
    enqueued = queue_module._enqueued
    monkeypatch.setattr(queue_module, "_enqueued", lambda sid, job_id, forced: (queued.append(job_id),
                                                                               enqueued(sid, job_id, forced)))
    auto, forced = forced_waiting(r, settings)
    assert release_pending(r, settings, "s1", auto) == f"{FORCED_TRIGGER}{forced}"
    assert enqueue_compaction(r, settings, "s1", CWD, "llm", forced=True) == forced  # a request claims for it
    assert queued == [auto, forced]
    assert promote_forced(r, settings, "s1", forced) is False  # the ending job's promotion, late
    assert queued == [auto, forced] and pending_job_id(r, settings, "s1") == forced
    Job.fetch(forced, connection=r).set_status(JobStatus.FINISHED)  # it ran
    release_pending(r, settings, "s1", forced)
    assert promote_forced(r, settings, "s1", forced) is False  # once it ran: not again
    assert queued == [auto, forced] and pending_job_id(r, settings, "s1") is None


def test_a_waiting_forced_job_gone_from_redis_is_dropped_and_the_request_queues_its_own(
    r: redis.Redis, settings: Settings,
) -> None:
    """Its RQ record gone (evicted, deleted by hand), the waiting forced job's enqueue failed and
    its trigger was put back: every later forced request and promotion of the session failed."""
    auto, forced = forced_waiting(r, settings)
    r.delete(Job.key_for(forced))
    release_pending(r, settings, "s1", auto)
    request = enqueue_compaction(r, settings, "s1", CWD, "llm", forced=True)
    assert request is not None and request != forced
    assert pending_job_id(r, settings, "s1") == request and r.get(Keys().retrigger("s1")) is None
    assert Job.fetch(request, connection=r).get_status() in (JobStatus.QUEUED, JobStatus.RATE_LIMITED)


def enqueue_failing(monkeypatch: pytest.MonkeyPatch, *, landed: bool) -> None:
    """Every forced job's enqueue (its transaction) fails with a connection reset: before it is
    sent, or (``landed``) after Redis ran it, its reply lost."""
    from rq import Queue

    enqueue = Queue._enqueue_rate_limited_job

    def failing(self: Queue, job: Job, pipeline: Any = None, **kwargs: Any) -> Job:
        queued = enqueue(self, job, pipeline=pipeline, **kwargs)
        execute = pipeline.execute

        def reset(*args: Any, **kwargs: Any) -> Any:
            if landed:
                execute(*args, **kwargs)
            raise redis.ConnectionError("Connection reset by peer")

        pipeline.execute = reset
        return queued

    monkeypatch.setattr(Queue, "_enqueue_rate_limited_job", failing)


def test_a_request_joining_a_waiting_forced_job_leaves_no_job_of_its_own_when_the_enqueue_fails(
    r: redis.Redis, settings: Settings, monkeypatch: pytest.MonkeyPatch,
) -> None:
    auto, forced = forced_waiting(r, settings)
    release_pending(r, settings, "s1", auto)
    enqueue_failing(monkeypatch, landed=False)
    with pytest.raises(redis.ConnectionError):
        enqueue_compaction(r, settings, "s1", CWD, "llm", forced=True)  # joins the waiting one, which fails
    assert sorted(key.decode() for key in r.keys("rq:job:*")) == sorted([Job.key_for(auto), Job.key_for(forced)])
    # left claimed, still ``created``: the worker janitor queues it past the grace (not put back to wait: one
    # whose enqueue had landed, its reply lost, was queued again by the next promotion)
    assert pending_job_id(r, settings, "s1") == forced and r.get(Keys().retrigger("s1")) is None
    monkeypatch.undo()
    assert queue_unqueued_claim(r, settings, "s1", forced, redis_now(r) + STALE_CLAIM_GRACE_S + 1)
    assert Job.fetch(forced, connection=r).get_status() in (JobStatus.QUEUED, JobStatus.RATE_LIMITED)


def test_a_request_while_the_claim_is_held_does_not_join_a_waiting_forced_job_gone_from_redis(
    r: redis.Redis, settings: Settings,
) -> None:
    """Joined, the request waited for a job that could never run, and was answered job_lost."""
    auto, forced = forced_waiting(r, settings)
    r.delete(Job.key_for(forced))
    request = enqueue_compaction(r, settings, "s1", CWD, "llm", forced=True)
    assert request is not None and request != forced
    assert r.get(Keys().retrigger("s1")) == f"{FORCED_TRIGGER}{request}".encode()  # it waits in its place
    assert Job.fetch(request, connection=r).get_status() == JobStatus.CREATED
    release_pending(r, settings, "s1", auto)
    assert promote_forced(r, settings, "s1", request) is True


def test_a_forced_job_whose_enqueue_landed_with_its_reply_lost_is_not_put_back_to_wait(
    r: redis.Redis, settings: Settings, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The enqueue raised after it landed (its reply lost): put back as the waiting trigger, a
    promotion queued it a second time, and RQ ran it twice."""
    enqueue_failing(monkeypatch, landed=True)
    forced = enqueue_compaction(r, settings, "s1", CWD, "llm", forced=True)  # the request gets its job
    assert forced is not None and pending_job_id(r, settings, "s1") == forced
    assert r.get(Keys().retrigger("s1")) is None
    assert promote_forced(r, settings, "s1", forced) is False
    # the status read that tells it fails too: the claim stays the job's, nothing is put back to wait
    monkeypatch.setattr(queue_module, "_queued_all_the_same", lambda client, job_id: False)
    answered = enqueue_compaction(r, settings, "s2", CWD, "llm", forced=True)  # (its job: left to the janitor)
    [second] = [job_id for job_id in compaction_queue(r, settings).job_ids if job_id.endswith("-s2")]
    assert answered == second
    assert pending_job_id(r, settings, "s2") == second and r.get(Keys().retrigger("s2")) is None
    assert promote_forced(r, settings, "s2", second) is False
    assert not queue_unqueued_claim(r, settings, "s2", second, redis_now(r) + STALE_CLAIM_GRACE_S + 1)


def test_a_forced_request_whose_claim_script_fails_leaves_no_job_behind(
    r: redis.Redis, settings: Settings, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its job, saved before the script, stayed ``created`` with no TTL, named by nothing, for good."""
    def timed_out(*args: Any, **kwargs: Any) -> tuple[str, str]:
        raise redis.TimeoutError("Timeout reading from socket")

    monkeypatch.setattr(queue_module, "_force", timed_out)
    with pytest.raises(redis.TimeoutError):
        enqueue_compaction(r, settings, "s1", CWD, "llm", forced=True)
    assert r.keys("rq:job:*") == []


def test_a_request_whose_second_claim_script_fails_leaves_no_job_behind(
    r: redis.Redis, settings: Settings, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The waiting job it claimed for gone before its enqueue, the request claims for its own job:
    that second script failing left its own job ``created`` with no TTL, named by nothing."""
    auto, forced = forced_waiting(r, settings)
    release_pending(r, settings, "s1", auto)
    real, calls = queue_module._force, []

    def force(*args: Any, **kwargs: Any) -> tuple[str, str]:
        calls.append(args[3])
        if len(calls) == 1:
            claimed = real(*args, **kwargs)  # claims the waiting job for this request
            r.delete(Job.key_for(forced))  # gone before its enqueue
            return claimed
        raise redis.TimeoutError("Timeout reading from socket")

    monkeypatch.setattr(queue_module, "_force", force)
    with pytest.raises(redis.TimeoutError):
        enqueue_compaction(r, settings, "s1", CWD, "llm", forced=True)
    assert len(calls) == 2 and not r.exists(Job.key_for(calls[1]))


def test_jobs_of_one_session_are_serialised_by_the_rate_limit(r: redis.Redis, settings: Settings) -> None:
    queue = compaction_queue(r, settings)
    ids = [queue.enqueue_call("worker.jobs.llm_compact", args=("s1", CWD), job_id=new_job_id("s1", "llm"),
                              rate_limit=rate_limit_for(settings, "s1")).id for _ in range(3)]
    statuses = [Job.fetch(i, connection=r).get_status() for i in ids]
    assert statuses == [JobStatus.QUEUED, JobStatus.RATE_LIMITED, JobStatus.RATE_LIMITED]
    assert compaction_queue(r, settings).job_ids == [ids[0]]


def test_job_ids_sort_in_enqueue_order_and_name_their_session() -> None:
    ids = [new_job_id("sess-1_a", "llm") for _ in range(100)]
    assert ids == sorted(ids) and len(set(ids)) == 100
    stamp, kind, session = parse_job_id(ids[0]) or (0, "", "")
    assert kind == "llm" and session == "sess-1_a" and abs(stamp / 1e9 - time.time()) < 5
    assert parse_job_id("not-a-job") is None


def test_claim_of_an_ended_job_is_stale_and_replaced(r: redis.Redis, settings: Settings) -> None:
    first = enqueue_compaction(r, settings, "s1", CWD, "micro")
    assert first is not None
    r.hset(Job.key_for(first), "status", "failed")  # its worker died without releasing
    second = enqueue_compaction(r, settings, "s1", CWD, "micro")
    assert second is not None and second != first
    assert pending_job_id(r, settings, "s1") == second


def test_claim_without_a_job_is_kept_during_the_grace_period(r: redis.Redis, settings: Settings) -> None:
    r.set(Keys().job("s1"), new_job_id("s1", "llm"))  # an enqueuer between claim and enqueue
    assert enqueue_compaction(r, settings, "s1", CWD, "llm") is None
    r.set(Keys().job("s1"), "00000000000000000001-llm-s1")  # long ago: it crashed
    assert enqueue_compaction(r, settings, "s1", CWD, "llm") is not None


def test_a_trigger_whose_claim_script_ran_twice_gets_its_job_queued_not_coalesced(
    r: redis.Redis, settings: Settings,
) -> None:
    """redis-py resends a script whose reply was lost: run again, the trigger's claim (landed the
    first time) was a live claim, so the trigger was 'pending' behind its own job, which was never
    queued: the session waited for the janitor (past the 30 s grace) for its compaction."""
    job = new_job_id("s1", "llm")
    assert queue_module._claim(r, settings, "s1", job, "llm") == job  # (its reply lost)
    assert queue_module._claim(r, settings, "s1", job, "llm") == job  # resent: claimed, to be queued
    assert r.get(Keys().retrigger("s1")) is None
    # ... the breaker open, the job renamed to the breaker's kind: the same
    r.set(Keys().failures("s2"), settings.context.max_failures)
    job = new_job_id("s2", "llm")
    renamed = queue_module._claim(r, settings, "s2", job, "llm", "micro")
    assert renamed is not None and queue_module._kind_of(renamed) == "micro"
    r.delete(Keys().failures("s2"))  # (a success in between: the resend's breaker check says closed)
    assert queue_module._claim(r, settings, "s2", job, "llm", "micro") == renamed
    # another job's live claim still coalesces
    assert queue_module._claim(r, settings, "s2", new_job_id("s2", "llm"), "llm", "micro") is None


def test_a_deferred_trigger_moves_only_while_no_job_claims_the_session(r: redis.Redis, settings: Settings) -> None:
    """A session whose log is corrupt is looked at again in 10 minutes; a job that claimed it
    meanwhile keeps its claim's age (the janitor's watch on it), not moved 10 minutes ahead."""
    now = redis_now(r)
    r.set(Keys().retrigger("s1"), "llm")
    r.zadd(Keys().claims, {"s1": now - 100})
    queue_module.defer_trigger(r, settings, "s1", 600)
    assert r.zscore(Keys().claims, "s1") > now + 590  # type: ignore[operator]
    r.zadd(Keys().claims, {"s1": now - 100})
    r.set(Keys().job("s1"), new_job_id("s1", "llm"))
    queue_module.defer_trigger(r, settings, "s1", 600)
    assert r.zscore(Keys().claims, "s1") == now - 100
    queue_module.defer_trigger(r, settings, "s2", 600)  # (no trigger: one recorded, for the janitor after the repair)
    assert r.zscore(Keys().claims, "s2") > now + 590 and r.get(Keys().retrigger("s2")) == b"micro"  # type: ignore[operator]


@pytest.mark.parametrize("skew_s", [-60.0, 3600.0])
def test_job_ids_are_stamped_in_redis_s_time_whatever_the_host_s_clock(
        r: redis.Redis, settings: Settings, monkeypatch: pytest.MonkeyPatch, skew_s: float) -> None:
    """Claims are aged by Redis's clock against the stamp in their job id: a host a minute behind
    Redis minted claims that looked dead at once (another trigger replaced one before its job was
    queued: two jobs), one an hour ahead kept a dead claim for an hour."""
    real = time.time_ns
    monkeypatch.setattr(time, "time_ns", lambda: real() + int(skew_s * 1e9))
    monkeypatch.setattr(queue_module, "_clock_synced_at", None)  # (a new process on that host)
    monkeypatch.setattr(queue_module, "_clock_offset_ns", queue_module._clock_offset_ns)  # (restored after)
    monkeypatch.setattr(queue_module, "_enqueue_claimed", lambda *args: args[-1])  # claimed, not queued yet
    first = enqueue_compaction(r, settings, "s1", CWD, "llm")
    assert first is not None
    seconds, micros = r.time()
    assert abs(parse_job_id(first)[0] / 1e9 - (int(seconds) + int(micros) / 1e6)) < 5  # type: ignore[index]
    assert enqueue_compaction(r, settings, "s1", CWD, "llm") is None  # its claim holds: coalesced


@pytest.mark.parametrize("skew_s", [-3600.0, 3600.0])
def test_the_janitor_ages_claims_by_redis_s_clock_not_the_worker_s(
        r: redis.Redis, settings: Settings, monkeypatch: pytest.MonkeyPatch, skew_s: float) -> None:
    """The claims are scored by Redis's TIME; the janitor compared them with the worker's clock: a
    worker an hour behind Redis found no dead claim for an hour (one ahead freed live ones)."""
    r.set(Keys().job("old"), "00000000000000000001-llm-old")  # a claim whose job never came, long ago
    r.zadd(Keys().claims, {"old": float(r.time()[0]) - 120, "new": float(r.time()[0])})
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + skew_s)
    monkeypatch.setattr(time, "time_ns", lambda: int((real() + skew_s) * 1e9))
    assert [sid for sid, _ in sessions_to_look_at(r, settings, STALE_CLAIM_GRACE_S)] == ["old"]
    seconds, micros = r.time()
    redis_ns = (int(seconds) * 1_000_000 + int(micros)) * 1000
    minted = lambda age_s: f"{redis_ns - int(age_s * 1e9):020d}-llm-old"  # noqa: E731 - stamped by Redis's clock
    assert claim_is_stale(r, minted(STALE_CLAIM_GRACE_S + 10)) is True
    assert claim_is_stale(r, minted(STALE_CLAIM_GRACE_S - 10)) is False


def test_failed_enqueue_releases_the_claim(r: redis.Redis, settings: Settings) -> None:
    bad = Settings.model_validate({**settings.model_dump(by_alias=True), "worker": {"jobTimeoutSeconds": 5}})
    r.set("rq:rl:compaction:s1", "not a hash")  # makes RQ's rate-limit registration fail
    try:
        enqueue_compaction(r, bad, "s1", CWD, "micro")
    except redis.ResponseError:
        pass
    else:
        raise AssertionError("the enqueue should have failed")
    assert pending_job_id(r, settings, "s1") is None


def test_triggers_of_several_sessions_are_claimed_together_and_each_gets_its_answer(
    r: redis.Redis, settings: Settings,
) -> None:
    pending = enqueue_compaction(r, settings, "busy", CWD, "micro")
    r.set(Keys().failures("broken"), 5)
    r.set(Keys().failures("hopeless"), 5)
    triggers = [
        Trigger("fresh", CWD, "llm", breaker_open_kind=None),
        Trigger("busy", CWD, "llm"),
        Trigger("broken", CWD, "llm", breaker_open_kind="micro"),
        Trigger("hopeless", CWD, "llm", breaker_open_kind=None),
    ]
    fresh, busy, broken, hopeless = trigger_compactions(r, settings, triggers)
    assert fresh is not None and parse_job_id(fresh)[1:] == ("llm", "fresh")  # type: ignore[index]
    assert busy is None and pending_job_id(r, settings, "busy") == pending
    assert r.get(Keys().retrigger("busy")) == b"llm"  # coalesced, recorded
    assert broken is not None and parse_job_id(broken)[1:] == ("micro", "broken")  # type: ignore[index]
    assert Job.fetch(broken, connection=r).func_name == "worker.jobs.micro_compact"
    assert hopeless is None and pending_job_id(r, settings, "hopeless") is None
    assert set(compaction_queue(r, settings).job_ids) == {pending, fresh, broken}


def test_jobs_enqueued_together_keep_the_per_session_rate_limit(r: redis.Redis, settings: Settings) -> None:
    """Claimed jobs of a round go to RQ in one transaction, through RQ's own rate-limited
    enqueue: a session whose slot is held (here by a job enqueued past the claim, as one
    left by a crashed enqueuer could be) gets its automatic job rate-limited."""
    holder = compaction_queue(r, settings).enqueue_call(
        "worker.jobs.llm_compact", args=("s1", CWD), job_id=new_job_id("s1", "llm"),
        rate_limit=rate_limit_for(settings, "s1")).id
    ids = trigger_compactions(r, settings, [Trigger("s1", CWD, "micro"), Trigger("s2", CWD, "micro")])
    assert all(ids)
    statuses = [Job.fetch(job_id, connection=r).get_status() for job_id in (holder, *ids)]  # type: ignore[arg-type]
    assert statuses == [JobStatus.QUEUED, JobStatus.RATE_LIMITED, JobStatus.QUEUED]
    assert compaction_queue(r, settings).job_ids == [holder, ids[1]]


def test_settling_a_session_never_drops_a_waiting_forced_job(r: redis.Redis, settings: Settings) -> None:
    """A re-check that ends with no claim settles the recorded trigger, but not ``forced:{id}``:
    only the forced job's own claim clears it (else its caller would wait for a job never queued)."""
    r.set(Keys().retrigger("s1"), f"{FORCED_TRIGGER}some-job")
    settle_trigger(r, settings, "s1")
    assert r.get(Keys().retrigger("s1")) == f"{FORCED_TRIGGER}some-job".encode()
    r.set(Keys().retrigger("s1"), "llm")
    settle_trigger(r, settings, "s1")
    assert r.get(Keys().retrigger("s1")) is None


@pytest.mark.parametrize("ended", [False, True], ids=["still-queued", "ran-already"])
def test_a_stalled_forced_enqueue_overtaken_by_the_janitor_does_not_queue_the_job_again(
    r: redis.Redis, settings: Settings, ended: bool,
) -> None:
    """A request (or promotion) that stalled past the grace between its claim and its enqueue
    (SIGSTOP, a frozen container): the janitor queued the claimed job meanwhile, and the request,
    resumed, queued it again: RQ ran it twice (a second LLM call, the first result overwritten)."""
    queue = compaction_queue(r, settings)
    forced = queue_module.new_job_id("s1", "llm")
    queue.create_job(**queue_module._job_spec(settings, "s1", CWD, forced, True), status=JobStatus.CREATED).save()
    outcome, claimed = queue_module._force(r, settings, "s1", forced)
    assert (outcome, claimed) == ("claimed", forced)  # ... and its enqueuer stalls here
    assert queue_unqueued_claim(r, settings, "s1", forced, redis_now(r) + STALE_CLAIM_GRACE_S + 1)
    assert queue.job_ids == [forced]
    if ended:  # a worker ran it meanwhile
        queue.remove(forced)
        r.hset(Job.key_for(forced), "status", JobStatus.FINISHED.value)
    queue_module._enqueue_forced(r, settings, "s1", forced)  # the enqueuer resumes
    assert queue.job_ids == ([] if ended else [forced])
    assert Job.fetch(forced, connection=r).get_status() == (JobStatus.FINISHED if ended else JobStatus.QUEUED)


def test_a_request_that_joined_the_waiting_forced_job_is_answered_when_its_own_jobs_delete_fails(
    r: redis.Redis, settings: Settings, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The join landed, then the delete of the request's own job (unused) failed: the request was
    answered 503, though the job it joined would answer it."""
    _, forced = forced_waiting(r, settings)

    def reset(self: Job, *args: Any, **kwargs: Any) -> None:
        raise redis.ConnectionError("Connection reset by peer")

    monkeypatch.setattr(Job, "delete", reset)
    assert enqueue_compaction(r, settings, "s1", CWD, "llm", forced=True) == forced


def test_a_forced_enqueue_whose_exec_reply_was_lost_counts_it_queued(
    r: redis.Redis, settings: Settings, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """redis-py says an EXEC whose reply was lost (a socket timeout while Redis stalled) as a
    WatchError: the loop looked again, found the job queued (by its own EXEC) and took it for
    another's: not counted, and logged as queued by another."""
    from rq import Queue

    enqueue = Queue._enqueue_rate_limited_job

    def reply_lost(self: Queue, job: Job, pipeline: Any = None, **kwargs: Any) -> Job:
        queued = enqueue(self, job, pipeline=pipeline, **kwargs)
        execute = pipeline.execute

        def lost(*args: Any, **kwargs: Any) -> Any:
            execute(*args, **kwargs)
            raise redis.WatchError("A TimeoutError occurred while watching one or more keys")  # (as redis-py does)

        pipeline.execute = lost
        return queued

    monkeypatch.setattr(Queue, "_enqueue_rate_limited_job", reply_lost)
    counted: list[str] = []
    monkeypatch.setattr(queue_module, "_enqueued", lambda sid, job_id, forced: counted.append(job_id))
    forced = enqueue_compaction(r, settings, "s1", CWD, "llm", forced=True)
    assert counted == [forced] and compaction_queue(r, settings).job_ids == [forced]


def test_a_forced_request_whose_own_enqueue_fails_is_answered_with_its_job_for_the_janitor(
    r: redis.Redis, settings: Settings, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its job saved and claimed, the enqueue refused: the request was a 503, though the janitor
    queues the claimed job past the grace; sent again, its second job waited behind the first (two
    compactions). It is answered with the job that will run."""
    enqueue_failing(monkeypatch, landed=False)
    forced = enqueue_compaction(r, settings, "s1", CWD, "llm", forced=True)
    assert forced is not None and pending_job_id(r, settings, "s1") == forced
    assert Job.fetch(forced, connection=r).get_status() == JobStatus.CREATED and compaction_queue(r, settings).count == 0
    monkeypatch.undo()
    assert queue_unqueued_claim(r, settings, "s1", forced, redis_now(r) + STALE_CLAIM_GRACE_S + 1)
    assert compaction_queue(r, settings).job_ids == [forced]


def test_a_forced_request_whose_claim_script_ran_twice_is_queued_not_left_waiting_for_itself(
    r: redis.Redis, settings: Settings,
) -> None:
    """redis-py resends a script whose reply was lost: run again, the request's claim (landed the
    first time) named its own job, not stale, so it waited for itself, unqueued until the janitor
    (30-38 s on an idle session), and the promotion then claimed it once it had ended."""
    queue = compaction_queue(r, settings)
    forced = queue_module.new_job_id("s1", "llm")
    queue.create_job(**queue_module._job_spec(settings, "s1", CWD, forced, True), status=JobStatus.CREATED).save()
    assert queue_module._force(r, settings, "s1", forced)[0] == "claimed"  # (its reply lost)
    assert queue_module._force(r, settings, "s1", forced) == ("claimed", forced)  # resent
    assert r.get(Keys().retrigger("s1")) is None and pending_job_id(r, settings, "s1") == forced
    queue_module._enqueue_forced(r, settings, "s1", forced)
    assert queue.job_ids == [forced]


def test_rqs_stop_job_and_kill_horse_commands_are_said_to_stop_nothing(
        r: redis.Redis, wsettings: Settings, caplog: pytest.LogCaptureFixture) -> None:
    """The worker runs its jobs in its own process (no work horse): rq's stop-job was silent (the job
    ran on to its end) and kill-horse said "Worker is not working" in the middle of a job."""
    import json

    from worker.runner import CompactionWorker

    worker = CompactionWorker.for_settings(r, wsettings)
    with caplog.at_level(logging.INFO):
        for command in ("stop-job", "kill-horse"):
            worker.handle_payload({"data": json.dumps({"command": command, "job_id": "j1"}).encode()})
    said = [m.getMessage() for m in caplog.records if m.levelno == logging.WARNING]
    assert [m.split(": ")[1].split(" command")[0] for m in said] == ["rq's stop-job", "rq's kill-horse"], said
    assert all("command for job j1 stops nothing here" in m and "no job runs" in m for m in said), said
    assert not any("Worker is not working" in m.getMessage() for m in caplog.records)
