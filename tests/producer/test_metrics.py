"""/metrics across an ingest + compaction scenario: real Redis, the watcher, in-process workers.

Process counters are global to the test process, so every check is a delta
between two scrapes of the API's ``/metrics``.
"""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from compactor.keys import Keys
from compactor.metrics import reason_kind
from compactor.queue import enqueue_compaction
from compactor.serve import metrics_dir
from events.config import Settings
from producer import api as api_module
from producer.api import create_app, make_redis
from producer.publisher import Publisher
from producer.watcher import Watcher
from compactor.llm_stub import STUB_MODEL, LLMStub
from tests.producer.conftest import CWD, drain, fast_settings
from tests.support import free_port
from worker import context as worker_context
from worker.context import WorkerContext
from worker.runner import CompactionWorker

SID = "metrics-1"
LONG = " ".join(f"word{i}" for i in range(300))

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(client: TestClient, headers: dict[str, str] | None = None) -> Samples:
    response = client.get("/metrics", headers=headers)
    assert response.status_code == 200
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def turn(n: int) -> list[dict[str, Any]]:
    call = f"c{n}"
    return [
        {"type": "user", "turnId": n, "content": f"step {n}"},
        {"type": "assistant", "turnId": n, "content": "reading",
         "toolCalls": [{"id": call, "name": "read_file", "arguments": {"path": f"f{n}"}}]},
        {"type": "tool_result", "turnId": n, "toolCallId": call, "toolName": "read_file",
         "output": LONG},
        {"type": "turn_end", "turnId": n, "model": STUB_MODEL, "contextWindow": 4000},
    ]


@pytest.fixture
def stub(monkeypatch: pytest.MonkeyPatch) -> Iterator[LLMStub]:
    with LLMStub() as server:
        monkeypatch.setenv("OPENAI_API_BASE", server.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-stub")
        yield server


@pytest.fixture
def msettings(tmp_path: Path, redis_url: str) -> Settings:
    base = fast_settings(tmp_path / "data", redis_url)
    return base.model_copy(update={"context": base.context.model_copy(update={
        "compaction_model": STUB_MODEL, "llm_timeout_seconds": 5.0})})


@pytest.fixture
def api(msettings: Settings, r: redis.Redis) -> Iterator[TestClient]:
    with TestClient(create_app(msettings, r)) as client:
        yield client


def run_jobs(r: redis.Redis, settings: Settings) -> None:
    worker = CompactionWorker.for_settings(r, settings,
                                           context=WorkerContext.build(settings, r))
    worker.work(burst=True)
    worker_context.clear()


def test_lines_are_counted_once_appended_not_at_the_rounds_end(msettings: Settings, r: redis.Redis,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The watcher counted a round's lines (up to ``batchSize`` entries a shard) after its last
    session: killed mid-round, the lines it had appended were never counted (their redelivery is a
    duplicate), 1 666 of 3 060 in a helper's run."""
    from compactor.metrics import REGISTRY

    keys = Keys(msettings.redis.prefix, msettings.redis.shards)
    first, second = [sid for sid in (f"m{i}" for i in range(200)) if keys.shard_of(sid) == keys.shard_of("m0")][:2]
    for sid in (first, second):
        Publisher(r, msettings).publish(sid, CWD, [{"type": "session_meta", "model": STUB_MODEL}, *turn(1)])
    watcher = Watcher(r, msettings)
    apply, seen = watcher.store.apply, dict[str, float]()

    def counting_apply(session_id: str, *args: Any, **kwargs: Any) -> Any:
        # (the first call's: a round redone after a lease lost on a loaded machine calls it again)
        seen.setdefault(session_id, REGISTRY.get_sample_value("compactor_events_ingested_total",
                                                              {"type": "session_meta"}) or 0)
        return apply(session_id, *args, **kwargs)

    monkeypatch.setattr(watcher.store, "apply", counting_apply)
    drain(watcher, r, msettings)
    watcher.close()
    assert seen.keys() == {first, second}
    assert seen[second] == seen[first] + 1  # the first session's line counted before the second's turn


def test_ingest_dead_letters_and_stream_lag(api: TestClient, msettings: Settings,
                                            r: redis.Redis) -> None:
    keys = Keys(msettings.redis.prefix, msettings.redis.shards)
    shard = str(keys.shard_of(SID))
    before = scrape(api)
    Publisher(r, msettings).publish(SID, CWD, [{"type": "session_meta", "model": STUB_MODEL},
                                               *turn(1), *turn(2)])
    r.xadd(keys.stream_for(SID), {"session": SID, "cwd": CWD, "event": "{not json"})
    r.xadd(keys.stream_for(SID), {"session": SID, "cwd": CWD,
                                  "event": '{"type": "user", "turnId": 1, "content": "late"}'})
    time.sleep(0.05)
    queued = scrape(api)
    assert value(queued, "compactor_stream_backlog_entries", shard=shard) == 11
    assert value(queued, "compactor_stream_oldest_unapplied_seconds", shard=shard) >= 0.04
    assert value(queued, "compactor_stream_pending_entries", shard=shard) == 0

    watcher = Watcher(r, msettings)
    drain(watcher, r, msettings)
    watcher.close()
    after = scrape(api)
    assert delta(before, after, "compactor_events_ingested_total", type="user") == 2
    assert delta(before, after, "compactor_events_ingested_total", type="tool_result") == 2
    assert delta(before, after, "compactor_events_ingested_total", type="session_meta") == 1
    assert delta(before, after, "compactor_entries_dead_lettered_total", reason="malformed") == 1
    assert delta(before, after, "compactor_entries_dead_lettered_total", reason="turn_order") == 1
    assert value(after, "compactor_stream_backlog_entries", shard=shard) == 0
    assert value(after, "compactor_stream_oldest_unapplied_seconds", shard=shard) == 0
    assert value(after, "compactor_sessions") == 1
    assert value(after, "compactor_dead_letters") == 2
    assert delta(before, after, "compactor_jobs_enqueued_total", kind="micro", forced="false") == 1


def test_a_backlog_redis_cannot_tell_the_lag_of_is_counted_without_reading_its_entries(
        msettings: Settings, r: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry deleted amid unread ones leaves XINFO's lag null: the scrape then counted them with
    XRANGE, moving up to 100 000 whole entries per shard (0.7 s a scrape for 50 000 of 2 kB)."""
    from producer.api_metrics import StreamLagCollector

    keys = Keys(msettings.redis.prefix, msettings.redis.shards)
    stream = keys.stream(0)
    r.xgroup_create(stream, keys.group, id="0", mkstream=True)
    ids = [r.xadd(stream, {"session": "x", "cwd": CWD, "event": "e" * 2000}) for _ in range(300)]
    r.xreadgroup(keys.group, keys.consumer(0), {stream: ">"}, count=10)  # 10 pending
    r.xdel(stream, ids[100])
    assert r.xinfo_groups(stream)[0]["lag"] is None
    read: list[Any] = []
    xrange = r.xrange
    monkeypatch.setattr(r, "xrange", lambda *args, **kwargs: read.append(kwargs.get("count")) or xrange(*args, **kwargs))
    backlog, pending, age = StreamLagCollector(r, msettings).shard_lag(0, int(time.time() * 1000))
    assert (backlog, pending) == (299, 10) and age >= 0  # (an upper bound: every entry kept)
    assert all(count == 1 for count in read), read


def test_a_forced_request_is_coalesced_only_when_it_joins_the_forced_job_waiting(
        api: TestClient, msettings: Settings, r: redis.Redis, stub: LLMStub) -> None:
    """The first forced request behind a pending job gets a job of its own (enqueued once that one
    ends): it was counted coalesced *and* enqueued, one request twice."""
    Publisher(r, msettings).publish(SID, CWD, [{"type": "session_meta", "model": STUB_MODEL},
                                               *turn(1), *turn(2), *turn(3)])
    watcher = Watcher(r, msettings)
    drain(watcher, r, msettings)  # leaves a job pending
    watcher.close()
    before = scrape(api)
    own = enqueue_compaction(r, msettings, SID, CWD, "llm", forced=True)
    assert enqueue_compaction(r, msettings, SID, CWD, "llm", forced=True) == own  # joins it
    queued = scrape(api)
    assert delta(before, queued, "compactor_jobs_coalesced_total", kind="forced") == 1
    run_jobs(r, msettings)
    after = scrape(api)
    assert delta(before, after, "compactor_jobs_enqueued_total", kind="llm", forced="true") == 1
    assert delta(before, after, "compactor_jobs_coalesced_total", kind="forced") == 1


def test_jobs_llm_calls_and_breaker(api: TestClient, msettings: Settings, r: redis.Redis,
                                    stub: LLMStub) -> None:
    Publisher(r, msettings).publish(SID, CWD, [{"type": "session_meta", "model": STUB_MODEL},
                                               *turn(1), *turn(2), *turn(3)])
    watcher = Watcher(r, msettings)
    drain(watcher, r, msettings)
    watcher.close()
    before = scrape(api)
    assert enqueue_compaction(r, msettings, SID, CWD, "micro") is None  # one already pending
    run_jobs(r, msettings)
    micro = scrape(api)
    assert delta(before, micro, "compactor_jobs_coalesced_total", kind="micro") == 1
    assert delta(before, micro, "compactor_jobs_succeeded_total",
                 kind="micro", outcome="compressed") == 1
    assert delta(before, micro, "compactor_job_seconds_count", kind="micro") == 1
    assert delta(before, micro, "compactor_tokens_released_total", kind="micro") > 0

    stub.status = 500
    for _ in range(msettings.context.max_failures):
        enqueue_compaction(r, msettings, SID, CWD, "llm", forced=True)
        run_jobs(r, msettings)
    failing = scrape(api)
    assert delta(micro, failing, "compactor_jobs_failed_total",
                 kind="llm", outcome="llm_transient") == 3
    assert delta(micro, failing, "compactor_llm_call_seconds_count", outcome="error") == 3
    assert delta(micro, failing, "compactor_breaker_opens_total") == 1
    assert value(failing, "compactor_breakers_open") == 1
    assert value(failing, "compactor_sessions_failing") == 1

    stub.status = 200
    calls = len(stub.requests)
    enqueue_compaction(r, msettings, SID, CWD, "llm", forced=True)
    run_jobs(r, msettings)
    healed = scrape(api)
    assert delta(failing, healed, "compactor_jobs_succeeded_total",
                 kind="llm", outcome="compressed") == 1
    assert delta(failing, healed, "compactor_llm_call_seconds_count",
                 outcome="ok") == len(stub.requests) - calls >= 1
    assert delta(failing, healed, "compactor_tokens_released_total", kind="llm") > 0
    assert value(healed, "compactor_breakers_open") == 0
    assert delta(micro, healed, "compactor_jobs_enqueued_total", kind="llm", forced="true") == 4


def test_breaker_gauges_read_the_failing_index_not_the_whole_keyspace(
        api: TestClient, msettings: Settings, r: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """A SCAN of ``{p}:failures:*`` walked every key of the Redis (RQ's, other deployments') on each
    scrape and each overview: 1 s at 1.5 M keys. The workers index the failing sessions."""
    from producer import api_metrics
    from worker.failures import FailureCounter

    keys = Keys(msettings.redis.prefix)
    r.set(keys.failures("earlier"), msettings.context.max_failures, ex=3600)  # (an earlier version's: not indexed)
    r.set(keys.failures("stuck"), msettings.context.max_failures)  # (set by hand, no TTL: open for good)
    assert value(scrape(api), "compactor_breakers_open") == 2  # indexed once, by one SCAN
    time.sleep(1.1)  # (a counter with no TTL was scored to expire at once)
    counter = FailureCounter(r, msettings)
    for _ in range(msettings.context.max_failures):
        counter.record_failure("open")
    counter.record_failure("failing")
    counter.record_failure("healed")
    counter.reset("healed")
    counter.record_failure("expired")
    r.delete(keys.failures("expired"))  # (its TTL ran out)
    monkeypatch.setattr(r, "scan_iter", lambda *a, **k: pytest.fail("the keyspace was scanned"))
    samples = scrape(api)
    assert value(samples, "compactor_breakers_open") == 3 and value(samples, "compactor_sessions_failing") == 4
    overview = api.get("/api/overview").json()
    assert (overview["breakersOpen"], overview["sessionsFailing"], overview["breakersTruncated"]) == (3, 4, False)
    r.delete(keys.failures("stuck"))  # (by hand: its index entry, kept for good, goes with it)
    assert value(scrape(api), "compactor_breakers_open") == 2
    assert r.zscore(keys.failing, "stuck") is None
    monkeypatch.setattr(api_metrics, "MAX_BREAKER_KEYS", 1)
    assert api.get("/api/overview").json()["breakersTruncated"] is True


def test_a_failure_counted_while_the_gauges_prune_their_index_stays_indexed(
        msettings: Settings, r: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """The count read a counter gone (a success had reset it), a failure was counted and indexed
    again, then the count took it out of the index: an open breaker left the gauges for a day."""
    from producer.api_metrics import BreakerCollector
    from worker.failures import FailureCounter

    counter, collector = FailureCounter(r, msettings), BreakerCollector(r, msettings)
    counter.record_failure("racy")
    collector.count()  # (indexes earlier counters once: none)
    r.delete(Keys(msettings.redis.prefix).failures("racy"))  # (reset, but still in the index)
    mget = r.mget

    def then_a_failure(keys: Any) -> Any:
        values = mget(keys)
        counter.record_failure("racy")
        return values

    monkeypatch.setattr(r, "mget", then_a_failure)
    collector.count()
    monkeypatch.undo()
    assert collector.count() == (0, 1, False)


def test_overview_reports_counters_and_backlog(api: TestClient, msettings: Settings,
                                               r: redis.Redis) -> None:
    first = api.get("/api/overview").json()
    Publisher(r, msettings).publish(SID, CWD, turn(1))
    assert api.get("/api/overview").json()["streamBacklog"] == 4
    watcher = Watcher(r, msettings)
    drain(watcher, r, msettings)
    watcher.close()
    body = api.get("/api/overview").json()
    assert body["streamBacklog"] == 0 and body["sessions"] == 1
    assert body["counters"]["eventsIngested"] - first["counters"]["eventsIngested"] == 4


def test_the_overview_ages_the_backlog_by_redis_clock(api: TestClient, msettings: Settings, r: redis.Redis,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The entry ids carry Redis's time; the page aged them by the API host's clock, so a host
    an hour ahead showed an hour-old backlog (the lag gauge already used Redis's TIME)."""
    import producer.status_page as status_page

    Publisher(r, msettings).publish(SID, CWD, turn(1))
    real = time.time
    monkeypatch.setattr(status_page.time, "time", lambda: real() + 3600)  # this host's clock an hour ahead
    assert api.get("/api/overview").json()["oldestUnappliedSeconds"] < 60


def test_a_scrape_serves_only_the_documented_families(api: TestClient) -> None:
    """Outside the multiprocess mode prometheus_client added a ``*_created`` gauge per counter
    and histogram, series OPERATIONS.md does not list."""
    api.get("/healthz")
    text = api.get("/metrics").text
    assert "compactor_http_requests_total" in text
    assert "_created" not in text


def test_static_files_count_under_one_route_template(api: TestClient) -> None:
    """The status page's script and style sheet (and a file that is not there) count under
    their mount's template, not as unmatched, nor one label per file."""
    before = scrape(api)
    for path in ("/static/status.css", "/static/status.js", "/static/missing.js"):
        api.get(path)
    after = scrape(api)
    served = {"method": "GET", "route": "/static/{path}"}
    assert delta(before, after, "compactor_http_requests_total", **served, status="200") == 2
    assert delta(before, after, "compactor_http_requests_total", **served, status="404") == 1
    assert delta(before, after, "compactor_http_request_seconds_count", **served) == 3
    assert {dict(labels).get("route") for name, labels in after
            if name == "compactor_http_requests_total"} == {"/static/{path}", "/metrics"}


def test_requests_refused_before_routing_count_under_their_route(msettings: Settings, r: redis.Redis) -> None:
    """A 401 (and a 413 on the declared length) is answered before FastAPI routes the request;
    it counted as ``route="unmatched"``, so an operator could not tell which route was refused."""
    secured = msettings.model_copy(update={"api": msettings.api.model_copy(update={"token": "s3cret"})})
    with TestClient(create_app(secured, r)) as client:
        auth = {"Authorization": "Bearer s3cret"}
        before = scrape(client, auth)
        client.get("/api/sessions/s1")
        client.post("/api/sessions/s1/events", content=b"[]")
        client.put("/api/sessions/s1/events")  # the path's route, for another method
        client.get("/nowhere")
        for n in range(3):  # any method the client makes up: one label value, not a series each
            client.request(f"X{n}", "/api/sessions/s1")
        client.post("/api/sessions/s1/events", headers={**auth, "Content-Length": str(10**9)})
        for docs in ("/openapi.json", "/docs", "/redoc"):  # FastAPI's own routes (they answer 200)
            client.get(docs, headers=auth)
        after = scrape(client, auth)
    counted = functools.partial(delta, before, after, "compactor_http_requests_total")
    assert counted(method="GET", route="/api/sessions/{session_id}", status="401") == 1
    assert counted(method="POST", route="/api/sessions/{session_id}/events", status="401") == 1
    assert counted(method="PUT", route="/api/sessions/{session_id}/events", status="401") == 1
    assert counted(method="GET", route="unmatched", status="401") == 1
    assert counted(method="other", route="/api/sessions/{session_id}", status="401") == 3
    assert not [labels for (name, labels) in after if name == "compactor_http_requests_total"
                and dict(labels)["method"].startswith("X")]
    assert counted(method="POST", route="/api/sessions/{session_id}/events", status="413") == 1
    for docs in ("/openapi.json", "/docs", "/redoc"):
        assert counted(method="GET", route=docs, status="200") == 1, docs


def _settings_for(msettings: Settings, url: str) -> Settings:
    return msettings.model_copy(update={"redis": msettings.redis.model_copy(update={"url": url})})


def test_scrape_without_redis_still_answers(msettings: Settings) -> None:
    settings = _settings_for(msettings, f"redis://127.0.0.1:{free_port()}")  # refused
    with TestClient(create_app(settings, make_redis(settings))) as client:
        samples = scrape(client)
    assert value(samples, "compactor_redis_up") == 0
    assert ("compactor_breakers_open", ()) not in samples


@pytest.fixture
def silent_redis() -> Iterator[str]:
    """The URL of a server that accepts connections and never answers (a hung Redis)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        held: list[socket.socket] = []
        stop = threading.Event()

        def accept() -> None:
            server.settimeout(0.05)
            while not stop.is_set():
                try:
                    held.append(server.accept()[0])
                except TimeoutError:
                    continue

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        yield f"redis://127.0.0.1:{server.getsockname()[1]}"
        stop.set()
        thread.join()
        for connection in held:
            connection.close()


def test_a_scrape_waits_for_a_hung_redis_once_not_once_per_gauge(
    msettings: Settings, silent_redis: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    timeout_s = 0.5
    monkeypatch.setattr(api_module, "REDIS_SOCKET_TIMEOUT_S", timeout_s)
    settings = _settings_for(msettings, silent_redis)
    app = create_app(settings, make_redis(settings))
    with TestClient(app) as client:
        started = time.monotonic()
        samples = scrape(client)
        took = time.monotonic() - started
    assert value(samples, "compactor_redis_up") == 0
    assert ("compactor_stream_backlog_entries", (("shard", "0"),)) not in samples
    # one socket timeout (the queue's gauge), not three (+ stream lag, + breakers: >= 3 * timeout_s)
    assert timeout_s <= took < 2.5 * timeout_s


@pytest.mark.parametrize(("reason", "kind"), [
    ("invalid JSON in field 'event': unexpected character", "malformed"),
    ("missing field 'cwd'", "malformed"),
    ("event: the key 'type' appears twice in one object (one of its values would be dropped)", "malformed"),
    ("event is 5000000 bytes, more than limits.maxEventBytes (4194304)", "too_large"),
    ("turnId: goes backwards: 1 < currentTurnId 3", "turn_order"),
    ("lastSummarizedTurnId: is past the session's turns: 1000000 > 1, the last turn that is over (currentTurnId "
     "2: a summary covers turns that are over, not one still running)", "turn_order"),
    ("endTurnId: is past the session's turns: 9 > 3, the last turn that is over (currentTurnId 4: a compact "
     "covers turns that are over, not one still running)", "turn_order"),
    ("cwd: session s is bound to cwd '/a', not '/b'", "cwd_conflict"),
    ("cwd: session s is logged under another cwd (/data/b/sessions/s.jsonl; no session_meta records which), "
     "not '/a'", "cwd_conflict"),
    ("uuid: 'u-1' duplicates an event already in this session", "duplicate_uuid"),
    ("sessionId: must match ^[A-Za-z0-9]...", "identity"),
    ("session: belongs to shard 3 (crc32(utf8(sessionId)) % 8), which differs from the entry's shard 4 "
     "(read from compaction:events:4)", "wrong_shard"),
    ("turnId: Input should be a valid integer", "invalid_event"),
    # the producer's data quoted in a reason never decides its kind
    ("uuid: 'this goes backwards' duplicates an event already in this session", "duplicate_uuid"),
    ("uuid: 'u' duplicates events[0] (see maxEventBytes, missing field)", "invalid_event"),
    ("type: must be one of user, assistant, ..., not 'missing field'", "invalid_event"),
    ("cwd: session s is bound to cwd '/goes backwards/maxEventBytes'", "cwd_conflict"),
    ("event: must be a JSON object", "malformed"),
    ("entry has no fields (deleted from the stream before it was applied)", "malformed"),
    ("streamId: 1-0 is not in the log, and later entries of the session were applied (taken from the "
     "watchers' group by another reader?): out of order, not written", "out_of_order"),
])
def test_dead_letter_reasons_fall_into_few_kinds(reason: str, kind: str) -> None:
    assert reason_kind(reason) == kind


MULTIPROC_INC = """
from compactor import metrics
metrics.EVENTS_INGESTED.labels("user").inc(3)
metrics.JOB_SECONDS.labels("micro").observe(0.2)
"""
MULTIPROC_SCRAPE = """
import sys, redis
from fastapi.testclient import TestClient
from events.config import Settings
from producer.api import create_app
settings = Settings.model_validate({"dataDir": sys.argv[1], "redis": {"url": sys.argv[2]}})
with TestClient(create_app(settings, redis.Redis.from_url(sys.argv[2])), base_url="http://127.0.0.1") as client:
    client.get("/healthz")
    print(client.get("/metrics").text)
"""


def test_multiprocess_mode_aggregates_every_process(tmp_path: Path, redis_url: str) -> None:
    shared = metrics_dir(tmp_path)  # as compactor serve prepares it for its children
    (shared / "counter_999999.db").write_bytes(b"stale")  # left by an earlier run
    shared = metrics_dir(tmp_path)
    assert not (shared / "counter_999999.db").exists()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(shared)}
    for _ in range(2):
        subprocess.run([sys.executable, "-c", MULTIPROC_INC], env=env, check=True, timeout=60)
    # a process killed as it created its file: left empty, or cut (every scrape, and the overview, a 500)
    (shared / "counter_vm-999998.db").write_bytes(b"")
    (shared / "histogram_vm-999998.db").write_bytes(b"\xff\x00\x00\x00\x00\x00\x00\x00\x10")
    samples = _scraped(tmp_path, redis_url, env)
    assert value(samples, "compactor_events_ingested_total", type="user") == 6
    assert value(samples, "compactor_job_seconds_count", kind="micro") == 2
    assert value(samples, "compactor_http_requests_total",
                 method="GET", route="/healthz", status="200") == 1
    assert value(samples, "compactor_redis_up") == 1


ON_A_FULL_DISK = """
import errno, fcntl, os, sys
real = os.posix_fallocate
def refused(fd, offset, length):  # (the shared directory's disk full, or one with no fallocate)
    if os.readlink(f"/proc/self/fd/{fd}").startswith(sys.argv[1]):
        if sys.argv[2] == "APPEND":  # (glibc's emulation, where the file system has none: not through O_APPEND)
            if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_APPEND:
                raise OSError(errno.EBADF, os.strerror(errno.EBADF))
        else:
            raise OSError(getattr(errno, sys.argv[2]), os.strerror(getattr(errno, sys.argv[2])))
    return real(fd, offset, length)
os.posix_fallocate = refused
from compactor import metrics
metrics.init_series()
metrics.EVENTS_INGESTED.labels("user").inc(3)
for n in range(3_000):  # (past the file's first 64 KB: it grows)
    metrics.DEAD_LETTERED.labels(f"reason-{n}").inc()
print(metrics.EVENTS_INGESTED.labels("user")._value.get())
"""


def test_a_process_metrics_files_take_their_disk_blocks_before_they_are_written(tmp_path: Path) -> None:
    """They were sparse, written through a mapping: on a full disk the first write to a page with no
    block behind it killed the process (SIGBUS: the API at its first new route, then each child
    serve restarted, and serve gave up). Allocated, or kept in memory when there is no room."""
    shared = metrics_dir(tmp_path)
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(shared)}
    subprocess.run([sys.executable, "-c", MULTIPROC_INC], env=env, check=True, timeout=60)
    files = list(shared.glob("*.db"))
    assert files and all(os.stat(f).st_blocks * 512 >= 65_536 for f in files), [
        (f.name, os.stat(f).st_blocks) for f in files]
    full = tmp_path / "full"
    full.mkdir()
    in_memory = set(Path("/dev/shm").glob("compactor-metrics-*"))
    done = subprocess.run([sys.executable, "-c", ON_A_FULL_DISK, str(full), "ENOSPC"], capture_output=True,
                          text=True, env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(full)}, timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, "3.0"), done.stderr
    assert "this process's metrics are not in a scrape" in done.stderr
    assert list(full.iterdir()) == []  # (no empty file left for a scrape to fail on)
    assert set(Path("/dev/shm").glob("compactor-metrics-*")) == in_memory  # (unlinked, grown as such)
    # a file system with no fallocate (ext2, NFSv3): glibc writes the blocks, but refuses an O_APPEND
    # descriptor (EBADF for every series past the first 64 KB); a libc with no fallback (musl): sparse
    for mode in ("APPEND", "EOPNOTSUPP"):
        bare = tmp_path / mode
        bare.mkdir()
        done = subprocess.run([sys.executable, "-c", ON_A_FULL_DISK, str(bare), mode], capture_output=True,
                              text=True, env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(bare)}, timeout=60)
        assert (done.returncode, done.stdout.strip()) == (0, "3.0"), done.stderr
        grown = max(bare.iterdir(), key=lambda f: os.stat(f).st_size)
        assert os.stat(grown).st_size > 65_536 and "not in a scrape" not in done.stderr
        if mode == "APPEND":
            assert os.stat(grown).st_blocks * 512 >= os.stat(grown).st_size


def test_a_stack_starting_on_a_shared_directory_keeps_the_files_of_live_processes(
        tmp_path: Path, redis_url: str) -> None:
    """Two ``serve`` with one exported PROMETHEUS_MULTIPROC_DIR: the second one's start deleted the
    first one's files under its running processes, whose counters then stayed at 0 for good; and
    then the files of the first one's dead processes (a restarted child), whose counts are part of
    its totals: its counters went backwards. While a process of this host writes there, nothing
    is removed; with none, the dead ones' files are."""
    from compactor.metrics import HOST

    shared = metrics_dir(tmp_path)
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(shared)}
    running = subprocess.Popen([sys.executable, "-c", AS_RUNNING], env=env, text=True,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert running.stdout is not None and running.stdout.readline() == "started\n"
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()
        (shared / f"counter_{HOST}-{gone.pid}.db").write_bytes((shared / f"counter_{HOST}-{running.pid}.db")
                                                               .read_bytes())  # a dead child's counts
        for name in ("counter_123.db", "counter_other-host-7.db"):
            (shared / name).write_bytes(b"")
        metrics_dir(tmp_path)  # the second stack starts
        assert sorted(p.name for p in shared.glob("*.db")) == sorted(
            ["counter_123.db", "counter_other-host-7.db", f"counter_{HOST}-{gone.pid}.db",
             *(f"{kind}_{HOST}-{running.pid}.db" for kind in ("counter", "histogram"))])
        running.communicate("go\n", timeout=60)
    finally:
        running.kill()
    for name in ("counter_123.db", "counter_other-host-7.db"):
        (shared / name).unlink()  # (not metrics files)
    assert value(_scraped(tmp_path, redis_url, env), "compactor_events_ingested_total", type="user") == 3
    (shared / "counter_other-host-7.db").write_bytes(b"")
    (shared / f"counter_my_{HOST}-7.db").write_bytes(b"")  # (host my_vm's, for vm's: removed as its own)
    metrics_dir(tmp_path)  # a stack starting with none of this host's processes left: theirs are removed
    assert sorted(p.name for p in shared.glob("*.db")) == sorted(["counter_other-host-7.db", f"counter_my_{HOST}-7.db"])


def test_a_pid_reused_by_another_process_does_not_keep_dead_processes_files(tmp_path: Path) -> None:
    """Cleanup stopped for good when any dead process's pid had been taken by another process."""
    from compactor.metrics import HOST

    shared = metrics_dir(tmp_path)
    reused = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for pid in (reused.pid, 4_999_999):
            path = shared / f"counter_{HOST}-{pid}.db"
            path.write_bytes(b"")
            os.utime(path, (time.time() - 3600, time.time() - 3600))  # written before that process started
        metrics_dir(tmp_path)
        assert list(shared.glob("*.db")) == []
    finally:
        reused.kill()
        reused.wait()


AS_RUNNING = """
import sys
from compactor import metrics
ingested = metrics.EVENTS_INGESTED.labels("user")
metrics.JOB_SECONDS.labels("micro")
print("started", flush=True)
sys.stdin.readline()
ingested.inc(3)
"""


def test_a_missing_multiprocess_directory_is_created(tmp_path: Path) -> None:
    """Every command died with a FileNotFoundError traceback at its first metric."""
    missing = tmp_path / "not" / "yet"
    done = subprocess.run([sys.executable, "-c", AS_RUNNING], env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(
        missing)}, input="go\n", text=True, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert any(p.name.startswith("counter_") for p in missing.glob("*.db"))


def test_a_multiprocess_directory_that_cannot_be_made_leaves_each_process_its_own_metrics(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    done = subprocess.run([sys.executable, "-c", AS_RUNNING], input="go\n", text=True, capture_output=True,
                          env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "file" / "metrics")},
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert "cannot be used (Not a directory): metrics are per process" in done.stderr


def _scraped(tmp_path: Path, redis_url: str, env: dict[str, str]) -> Samples:
    """The samples a fresh API process's /metrics gives over the shared directory."""
    out = subprocess.run([sys.executable, "-c", MULTIPROC_SCRAPE, str(tmp_path / "d"), redis_url],
                         env=env, check=True, timeout=60, capture_output=True, text=True).stdout
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(out) for s in family.samples}


AS_PID_1 = """
import os, socket, sys
socket.gethostname = lambda: sys.argv[1]  # a container: its own host name, its process pid 1
os.getpid = lambda: 1
from compactor import metrics
ingested = metrics.EVENTS_INGESTED.labels("user")  # the process's files are open from here on
print("started", flush=True)
sys.stdin.readline()
ingested.inc(3)
metrics.JOB_SECONDS.labels("micro").observe(0.2)
"""


def test_containers_sharing_the_directory_each_as_pid_1_keep_their_counts(
        tmp_path: Path, redis_url: str) -> None:
    """docker compose: the watcher, worker and api containers share PROMETHEUS_MULTIPROC_DIR
    and each runs its process as pid 1; files named by pid alone were one file for all, in
    which each process overwrote the others' values."""
    shared = metrics_dir(tmp_path)
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(shared)}
    containers = [subprocess.Popen([sys.executable, "-c", AS_PID_1, host], env=env, text=True,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                  for host in ("watcher-c1", "worker-c2")]
    for process in containers:  # both running before either counts
        assert process.stdout is not None and process.stdout.readline() == "started\n"
    for process in containers:
        process.communicate("go\n", timeout=60)
        assert process.returncode == 0
    samples = _scraped(tmp_path, redis_url, env)
    assert value(samples, "compactor_events_ingested_total", type="user") == 6
    assert value(samples, "compactor_job_seconds_count", kind="micro") == 2


FRESH_SCRAPE = """
import sys
from fastapi.testclient import TestClient
import redis
from events.config import Settings
from producer.api import create_app
settings = Settings.model_validate({"dataDir": sys.argv[1], "redis": {"url": sys.argv[2]}})
with TestClient(create_app(settings, redis=redis.Redis.from_url(sys.argv[2])), base_url="http://127.0.0.1") as client:
    print(client.get("/metrics").text)
"""


def test_every_counter_series_of_a_fixed_label_set_is_there_at_zero_from_the_start(
        tmp_path: Path, redis_url: str) -> None:
    """A labelled series appeared at its first increment, and Prometheus takes a series first seen
    at 1 for no increase: the first job failure or dead letter of each kind after a start never
    fired OPERATIONS' alerts (``rate(compactor_jobs_failed_total[10m]) > 0``)."""
    env = {key: value for key, value in os.environ.items() if key != "PROMETHEUS_MULTIPROC_DIR"}
    out = subprocess.run([sys.executable, "-c", FRESH_SCRAPE, str(tmp_path / "d"), redis_url], env=env,
                         check=True, timeout=60, capture_output=True, text=True).stdout
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(out) for s in family.samples}
    for name, labels in [("compactor_jobs_failed_total", {"kind": "llm", "outcome": "llm_transient"}),
                         ("compactor_jobs_failed_total", {"kind": "micro", "outcome": "abandoned"}),
                         ("compactor_jobs_succeeded_total", {"kind": "micro", "outcome": "compressed"}),
                         ("compactor_entries_dead_lettered_total", {"reason": "turn_order"}),
                         ("compactor_jobs_enqueued_total", {"kind": "llm", "forced": "true"}),
                         ("compactor_jobs_coalesced_total", {"kind": "forced"}),
                         ("compactor_events_ingested_total", {"type": "user"}),
                         ("compactor_tokens_released_total", {"kind": "llm"}),
                         # the histograms too (a dashboard of them said "no data" until the first call)
                         ("compactor_job_seconds_count", {"kind": "micro"}),
                         ("compactor_llm_call_seconds_count", {"outcome": "error"})]:
        assert samples.get((name, tuple(sorted(labels.items())))) == 0, (name, labels)


def test_a_producer_importing_the_publisher_leaves_no_metrics_file_in_the_shared_directory(tmp_path: Path) -> None:
    shared = metrics_dir(tmp_path)
    subprocess.run([sys.executable, "-c", "import producer.publisher"], check=True, timeout=60,
                   env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(shared)})
    assert list(shared.iterdir()) == []
