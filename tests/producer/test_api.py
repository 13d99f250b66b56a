"""The HTTP API against a real Redis: every route, every error code, auth on and off."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from rq.job import Job

from compactor.keys import Keys
from compactor.queue import compaction_queue, release_pending
from compactor.store import SessionStore
from events.config import Settings
from events.errors import InvalidEvent, LogWriteFailed
from events.log import SessionLog
from events.checks import check_batch
from producer.api import UNAPPLIED_SCAN, create_app, get_settings
from compactor.llm_stub import STUB_MODEL, LLMStub
from worker import context as worker_context
from worker.context import WorkerContext
from worker.runner import CompactionWorker

CWD = "/home/dev/project"
SID = "sess-1"
LONG = "x" * 400
WORDS = " ".join(f"word{i}" for i in range(300))


def with_context(settings: Settings, **context: Any) -> Settings:
    return settings.model_copy(update={"context": settings.context.model_copy(update=context)})


def with_api(settings: Settings, **api: Any) -> Settings:
    return settings.model_copy(update={"api": settings.api.model_copy(update=api)})


def turn(n: int, window: int = 4000) -> list[dict[str, Any]]:
    call = f"call-{n}"
    return [
        {"type": "user", "turnId": n, "content": f"please do step {n}"},
        {"type": "assistant", "turnId": n, "content": f"working on {n}",
         "toolCalls": [{"id": call, "name": "run_tests", "arguments": {"path": f"m{n}.py"}}]},
        {"type": "tool_result", "turnId": n, "toolCallId": call, "toolName": "run_tests",
         "output": WORDS},
        {"type": "turn_end", "turnId": n, "model": "gpt-4", "contextWindow": window},
    ]


def write_session(r: redis.Redis, settings: Settings, turns: int, sid: str = SID) -> None:
    """Complete turns written the way the watcher writes them (uuid and timestamp filled)."""
    events: list[dict[str, Any]] = [{"type": "session_meta", "sessionId": sid, "cwd": CWD}]
    for n in range(1, turns + 1):
        events += turn(n)
    lines = [{**e, "uuid": f"{sid}-{i}", "timestamp": "2025-01-01T00:00:00.000Z"}
             for i, e in enumerate(events)]
    SessionStore(r, settings).apply(sid, CWD, lines)


def post_while_working(test_client: TestClient, r: redis.Redis, settings: Settings,
                       path: str, body: dict[str, Any]) -> Any:
    """POST from a thread while a worker runs the job it enqueues here (RQ needs the main thread)."""
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.update(response=test_client.post(path, json=body)))
    thread.start()
    queue = compaction_queue(r, settings)
    deadline = time.monotonic() + 10
    while queue.count == 0 and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    run_jobs(r, settings)
    thread.join(30)
    return box["response"]


def run_jobs(r: redis.Redis, settings: Settings) -> None:
    """Every queued compaction job, in this process, with a real RQ worker (the service's: RQ's
    plain ``SimpleWorker`` stops a minute late with redis-py 8, see ``CompactionWorker.unsubscribe``)."""
    try:
        CompactionWorker.for_settings(r, settings, context=WorkerContext.build(settings, r)).work(burst=True)
    finally:
        worker_context.clear()


@pytest.fixture
def api_settings(settings: Settings) -> Settings:
    return with_context(with_api(settings, job_wait_seconds=20.0), compaction_model="extractive")


@pytest.fixture
def client(api_settings: Settings, r: redis.Redis) -> Iterator[TestClient]:
    with TestClient(create_app(api_settings, redis=r)) as test_client:
        yield test_client


def error_of(response: Any) -> dict[str, str]:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message"}
    return dict(body["error"])


# -- /healthz, /metrics, OpenAPI -------------------------------------------------------------

def test_healthz_is_ok_when_redis_answers(client: TestClient) -> None:
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "redis": "ok"}


def test_healthz_is_503_when_redis_is_down(api_settings: Settings, tmp_path: Any) -> None:
    dead = redis.Redis.from_url(f"unix://{tmp_path}/nothing.sock")
    with TestClient(create_app(api_settings, redis=dead)) as test_client:
        response = test_client.get("/healthz")
    assert response.status_code == 503
    assert error_of(response)["code"] == "redis_unavailable"
    assert response.headers["Retry-After"] == "1"  # (a client's backoff had nothing to go by)


def test_metrics_exposes_http_and_queue_gauges(client: TestClient) -> None:
    client.get("/healthz")
    text = client.get("/metrics").text
    assert 'compactor_http_requests_total{method="GET",route="/healthz",status="200"} 1.0' in text
    assert "compactor_queue_jobs 0.0" in text
    assert "compactor_redis_up 1.0" in text


def test_openapi_schema_lists_every_route_with_camelcase_models(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    assert {"/api/sessions/{session_id}/compact", "/api/sessions/{session_id}/events",
            "/api/sessions/{session_id}/context", "/api/sessions/{session_id}",
            "/api/jobs/{job_id}", "/healthz", "/metrics"} <= set(schema["paths"])
    session = schema["components"]["schemas"]["SessionBody"]["properties"]
    assert {"sessionId", "promptEstimate", "contextWindow", "microThreshold",
            "compactionThreshold", "breakerOpen", "pendingJob", "lastCompaction"} <= set(session)
    compact = schema["paths"]["/api/sessions/{session_id}/compact"]["post"]["responses"]
    assert {"200", "202", "404", "500", "502", "503"} <= set(compact)
    declared = {path: set(schema["paths"][path]["get"]["responses"]) for path in (
        "/api/sessions/{session_id}/context", "/api/sessions/{session_id}", "/api/sessions/{session_id}/history",
        "/api/overview", "/api/sessions")}
    assert declared["/api/sessions/{session_id}/context"] >= {"404", "500"}  # what each answers (OPERATIONS)
    assert declared["/api/sessions/{session_id}"] >= {"404", "500", "503"}
    assert declared["/api/sessions/{session_id}/history"] >= {"404", "500"}
    assert declared["/api/overview"] >= {"503"} and declared["/api/sessions"] >= {"503"}
    assert set(schema["paths"]["/api/sessions/{session_id}/events"]["post"]["responses"]) >= {"413", "500", "503"}
    assert "created" in schema["components"]["schemas"]["JobBody"]["properties"]["status"]["description"]


def test_a_corrupt_log_is_a_json_500_naming_the_line(api_settings: Settings, r: redis.Redis) -> None:
    """It was a plain-text ``Internal Server Error``, the cause only in the API's log."""
    write_session(r, api_settings, 2)
    log = SessionLog(api_settings.data_dir, CWD, SID)
    lines = log.path.read_bytes().splitlines(keepends=True)
    log.path.write_bytes(b"".join([*lines[:3], b'{"type":"user","turnId":2,"cont\n', *lines[3:]]))
    with TestClient(create_app(api_settings, redis=r), raise_server_exceptions=False) as test_client:
        for path in (f"/api/sessions/{SID}?cwd={CWD}", f"/api/sessions/{SID}/context?cwd={CWD}"):
            response = test_client.get(path)
            assert response.status_code == 500, path
            error = error_of(response)
            assert error["code"] == "log_unreadable" and "line 4 " in error["message"], error
        # a forced compaction's job fails on the same line: the same answer, not a 502 for an LLM failure
        response = post_while_working(test_client, r, api_settings, f"/api/sessions/{SID}/compact", {"cwd": CWD})
        assert response.status_code == 500
        error = error_of(response)
        assert error["code"] == "log_unreadable" and "line 4 " in error["message"], error
        assert response.headers["X-Compactor-Job-Id"] in error["message"]


def test_events_for_a_session_whose_log_path_cannot_be_read_are_a_500_naming_it(
    api_settings: Settings, client: TestClient,
) -> None:
    """The log's path a directory (or unreadable): the look for the session's binding in its
    session_meta raised IsADirectoryError, answered ``internal_error`` with no path nor reason."""
    log = SessionLog(api_settings.data_dir, CWD, "dirlog")
    log.path.mkdir(parents=True)
    response = client.post("/api/sessions/dirlog/events", json={"cwd": CWD, "events": [turn(1)[0]]})
    assert response.status_code == 500
    error = error_of(response)
    assert error["code"] == "log_unreadable", error
    assert str(log.path) in error["message"] and "Is a directory" in error["message"], error
    # the reads answer the same, not a 404 "no session" (the append's 500 said why)
    for response in (client.get("/api/sessions/dirlog/context", params={"cwd": CWD}),
                     client.get("/api/sessions/dirlog/history", params={"cwd": CWD}),
                     client.post("/api/sessions/dirlog/compact", json={"cwd": CWD})):
        assert response.status_code == 500, (response.request.url, response.text)
        assert error_of(response)["code"] == "log_unreadable" and "Is a directory" in error_of(response)["message"]


def test_a_redis_that_refuses_writes_is_a_json_503(api_settings: Settings, r: redis.Redis) -> None:
    """A Redis whose disk is full answers MISCONF to every write: the API answered a plain-text
    500. (Refusing writes for want of replicas is a refusal of the same kind, and can be asked for.)"""
    r.config_set("min-replicas-to-write", 1)
    try:
        with TestClient(create_app(api_settings, redis=r), raise_server_exceptions=False) as test_client:
            response = test_client.post(f"/api/sessions/{SID}/events", json={"cwd": CWD, "events": turn(1)})
    finally:
        r.config_set("min-replicas-to-write", 0)
    assert response.status_code == 503
    error = error_of(response)
    assert error["code"] == "redis_unavailable" and "NOREPLICAS" in error["message"], error


def test_healthz_and_health_are_unhealthy_while_redis_refuses_writes(api_settings: Settings, r: redis.Redis,
                                                                     tmp_path: Any) -> None:
    """PING answered while Redis refused every write (OOM under noeviction; here, for want of
    replicas): /healthz said 200 and ``compactor health --check`` 0 while every POST was a 503."""
    from typer.testing import CliRunner

    from compactor.cli import app as cli

    config = tmp_path / "c.yaml"
    config.write_text(f"redis: {{url: {api_settings.redis.url!r}}}\n")
    with TestClient(create_app(api_settings, redis=r), raise_server_exceptions=False) as test_client:
        assert test_client.get("/healthz").status_code == 200
        assert CliRunner().invoke(cli, ["health", "--check", "--config", str(config)]).exit_code == 0
        r.config_set("min-replicas-to-write", 1)
        try:
            refused = test_client.get("/healthz")
            checked = CliRunner().invoke(cli, ["health", "--check", "--config", str(config)])
        finally:
            r.config_set("min-replicas-to-write", 0)
    assert refused.status_code == 503 and error_of(refused)["code"] == "redis_unavailable"
    assert checked.exit_code == 1


def test_a_redis_error_that_is_no_refusal_to_serve_is_a_500_not_a_503(api_settings: Settings, r: redis.Redis) -> None:
    """WRONGTYPE (a key of ours holding something else) is a bug to look into, not an outage to retry."""
    r.set(f"compaction:session:{SID}", "not a hash")
    with TestClient(create_app(api_settings, redis=r), raise_server_exceptions=False) as test_client:
        response = test_client.post(f"/api/sessions/{SID}/events", json={"cwd": CWD, "events": turn(1)})
    assert response.status_code == 500
    assert error_of(response)["code"] == "internal_error"


@pytest.mark.parametrize("taken", ["-@transaction", "~compaction:*"])
def test_a_permission_the_acl_takes_away_is_a_500_naming_it(api_settings: Settings, r: redis.Redis,
                                                             taken: str) -> None:
    """A Redis ACL changed under a running API (a command or RQ's keys refused): the answer was
    "internal error (NoPermissionError)"; it names the refusal and what the user needs."""
    write_session(r, api_settings, 1)
    rules = ["~*", "&*", "+@all", taken] if taken.startswith("-") else [taken, "&*", "+@all"]
    r.acl_setuser("apiuser", enabled=True, reset=True, passwords=["+pw"])
    r.execute_command("ACL", "SETUSER", "apiuser", *rules)
    limited = redis.Redis.from_url(api_settings.redis.url, username="apiuser", password="pw")
    try:
        with TestClient(create_app(api_settings, redis=limited), raise_server_exceptions=False) as test_client:
            posted = test_client.post(f"/api/sessions/{SID}/events", json={"cwd": CWD, "events": turn(2)})
            forced = test_client.post(f"/api/sessions/{SID}/compact", json={"cwd": CWD})
    finally:
        limited.close()
        r.acl_deluser("apiuser")
    for response in (posted, forced) if taken.startswith("-") else (forced,):
        assert response.status_code == 500, response.text
        error = error_of(response)
        assert error["code"] == "redis_permission", error
        assert "permission" in error["message"] and "~compaction:* ~rq:*" in error["message"], error


def test_a_failed_append_is_its_own_500(api_settings: Settings, r: redis.Redis,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from events.errors import LogWriteFailed

    write_session(r, api_settings, 1)

    def full(*_: Any) -> None:
        raise LogWriteFailed("append to x.jsonl failed: [Errno 28] No space left on device")

    monkeypatch.setattr(SessionStore, "load", full)
    with TestClient(create_app(api_settings, redis=r), raise_server_exceptions=False) as test_client:
        response = test_client.get(f"/api/sessions/{SID}?cwd={CWD}")
    assert response.status_code == 500
    assert error_of(response) == {"code": "log_write_failed",
                                  "message": "append to x.jsonl failed: [Errno 28] No space left on device"}


def test_an_unexpected_error_keeps_the_error_shape(api_settings: Settings, r: redis.Redis,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    write_session(r, api_settings, 1)
    monkeypatch.setattr(SessionStore, "load", lambda *_: 1 / 0)
    with TestClient(create_app(api_settings, redis=r), raise_server_exceptions=False) as test_client:
        response = test_client.get(f"/api/sessions/{SID}?cwd={CWD}")
    assert response.status_code == 500
    assert error_of(response) == {"code": "internal_error",
                                  "message": "internal error (ZeroDivisionError); the API's log has the details"}


# -- auth ---------------------------------------------------------------------------------

@pytest.fixture
def secured(api_settings: Settings, r: redis.Redis) -> Iterator[TestClient]:
    app = create_app(with_api(api_settings, token="s3cret"), redis=r)
    with TestClient(app) as test_client:
        yield test_client


@pytest.mark.parametrize("header", [None, "Bearer wrong", "Basic s3cret", "s3cret"])
def test_token_required_on_api_routes(secured: TestClient, header: str | None) -> None:
    headers = {"Authorization": header} if header else {}
    for method, path in [("GET", f"/api/sessions/{SID}?cwd={CWD}"), ("GET", "/metrics"),
                         ("GET", "/api/jobs/abc"), ("POST", f"/api/sessions/{SID}/events")]:
        response = secured.request(method, path, headers=headers, content=b"{not json")
        assert response.status_code == 401, path
        assert error_of(response)["code"] == "unauthorized"
        assert response.headers.get_list("www-authenticate") == [
            'Bearer realm="compactor"', 'Basic realm="compactor", charset="UTF-8"']


def test_right_token_passes_and_healthz_needs_none(secured: TestClient) -> None:
    assert secured.get("/healthz").status_code == 200
    ok = secured.get("/api/jobs/abc", headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 404  # past auth: the job does not exist
    schema = secured.get("/openapi.json", headers={"Authorization": "Bearer s3cret"}).json()
    assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"


def test_an_authorization_or_host_header_given_twice_is_refused(secured: TestClient, client: TestClient) -> None:
    """The last of two Authorization headers was read: a wrong token then the right one passed
    (a proxy checking the first would have refused it)."""
    for pair in (["Bearer wrong", "Bearer s3cret"], ["Bearer s3cret", "Bearer s3cret"]):
        response = secured.get("/api/jobs/abc", headers=[("Authorization", value) for value in pair])
        assert response.status_code == 400, pair
        assert error_of(response)["message"] == "Authorization: is given more than once: send it once"
    hosts = client.get("/api/jobs/abc", headers=[("Host", "evil.example"), ("Host", "127.0.0.1")])
    assert hosts.status_code == 400 and error_of(hosts)["message"].startswith("Host: is given more than once")
    assert secured.get("/healthz", headers=[("Authorization", "a"), ("Authorization", "b")]).status_code == 200


def test_no_token_configured_means_no_auth(client: TestClient) -> None:
    assert client.get("/api/jobs/abc").status_code == 404


# -- POST /events ------------------------------------------------------------------------

def test_events_are_validated_then_published_in_order(client: TestClient, r: redis.Redis,
                                                      api_settings: Settings) -> None:
    response = client.post(f"/api/sessions/{SID}/events", json={"cwd": CWD, "events": turn(1)})
    assert response.status_code == 202
    body = response.json()
    assert body["accepted"] == 4 and len(body["streamIds"]) == 4
    entries = r.xrange(Keys().stream_for(SID))
    assert [e[1][b"session"] for e in entries] == [SID.encode()] * 4
    assert [json.loads(e[1][b"event"])["type"] for e in entries] == [
        "user", "assistant", "tool_result", "turn_end"]


def test_bad_event_names_index_and_field_and_publishes_nothing(client: TestClient,
                                                               r: redis.Redis) -> None:
    events = turn(1)
    events[2] = {**events[2], "turnId": "two"}
    response = client.post(f"/api/sessions/{SID}/events", json={"cwd": CWD, "events": events})
    assert response.status_code == 400
    assert error_of(response)["message"].startswith("events[2].turnId:")
    assert r.xlen(Keys().stream_for(SID)) == 0


def test_event_for_another_session_is_400(client: TestClient, r: redis.Redis) -> None:
    events = [{"type": "session_meta", "sessionId": "someone-else"}, *turn(1)]
    response = client.post(f"/api/sessions/{SID}/events", json={"cwd": CWD, "events": events})
    assert response.status_code == 400
    assert error_of(response)["message"].startswith("events[0].sessionId")
    assert r.xlen(Keys().stream_for(SID)) == 0


@pytest.mark.parametrize("sid,cwd,fragment", [
    ("bad.id", CWD, "sessionId"), ("a b", CWD, "sessionId"), ("-bad", CWD, "sessionId"), (SID, "relative/dir", "cwd"),
    (SID, "/..", "cwd"),  # absolute, but it encodes to no usable directory name
    (SID, "/home/me/a\tb", "cwd: must not contain a control character"),  # (a 202, then dead-lettered)
])
def test_bad_session_id_or_cwd_is_400(client: TestClient, sid: str, cwd: str,
                                      fragment: str) -> None:
    response = client.post(f"/api/sessions/{sid}/events", json={"cwd": cwd, "events": turn(1)})
    assert response.status_code == 400
    assert error_of(response)["message"].startswith(fragment)


@pytest.mark.parametrize("path,field", [
    (f"/api/sessions/{SID}%2Fcontext?cwd={CWD}", "sessionId"),  # routed to s1's context: a 200 of another shape
    ("/api/sessions/a%2fb?cwd=/w", "sessionId"),  # a bare 404 "Not Found"
    ("/api/sessions/a%5Cb/compact", "sessionId"),
    ("/api/jobs/x%2Fy", "jobId"),
])
def test_an_encoded_slash_in_an_id_is_400_not_another_route(client: TestClient, path: str, field: str) -> None:
    client.post(f"/api/sessions/{SID}/events", json={"cwd": CWD, "events": turn(1)})
    response = client.post(path, json={"cwd": "/w"}) if path.endswith("/compact") else client.get(path)
    assert response.status_code == 400, response.text
    assert error_of(response)["message"].startswith(f"{field}: holds an encoded '/'")


@pytest.mark.parametrize("method,path,field", [
    ("GET", f"/api/sessions//context?cwd={CWD}", "sessionId"),  # a bare 404 "Not Found": an unknown route?
    ("GET", f"/api/sessions/?cwd={CWD}", "sessionId"),
    ("POST", "/api/sessions//events", "sessionId"),
    ("GET", "/api/jobs/", "jobId"),
])
def test_an_empty_id_in_the_path_is_400_naming_it(client: TestClient, method: str, path: str, field: str) -> None:
    response = client.request(method, path, json={"cwd": CWD, "events": turn(1)} if method == "POST" else None)
    assert response.status_code == 400, response.text
    assert error_of(response)["message"].startswith(f"{field}: is empty")


@pytest.mark.parametrize("job_id", ["-abc", "_x", ".x"])
def test_a_job_id_not_starting_with_a_letter_or_digit_is_400_saying_so(client: TestClient, job_id: str) -> None:
    """The message listed the characters allowed, all of which ``..`` is made of."""
    response = client.get(f"/api/jobs/{job_id}")
    assert response.status_code == 400, response.text
    assert error_of(response)["message"].endswith("starting with a letter or digit")


@pytest.mark.parametrize("query,message", [
    ("cwd=/w/%ff", "cwd: is not valid UTF-8"),  # was a 404 for cwd "/w/\ufffd"
    ("cwd=/w/%ED%A0%80", "cwd: is not valid UTF-8"),  # an encoded surrogate
    (f"cwd={CWD}&%ff=1", "query: a parameter's name is not valid UTF-8"),
])
def test_a_query_value_that_is_not_utf8_is_400_naming_it(client: TestClient, query: str, message: str) -> None:
    response = client.get(f"/api/sessions/{SID}/context?{query}")
    assert response.status_code == 400, response.text
    assert error_of(response)["message"].startswith(message)
    fine = client.get(f"/api/sessions/{SID}/context?cwd={CWD}&x=%C3%A9+%20")  # UTF-8 passes (no watcher: no log)
    assert fine.status_code == 404 and error_of(fine)["code"] == "not_found", fine.text


def test_invalid_json_and_missing_fields_are_400(client: TestClient) -> None:
    bad_json = client.post(f"/api/sessions/{SID}/events", content=b"{nope",
                           headers={"Content-Type": "application/json"})
    assert bad_json.status_code == 400 and "JSON" in error_of(bad_json)["message"]
    missing = client.post(f"/api/sessions/{SID}/events", json={"events": []})
    assert missing.status_code == 400 and error_of(missing)["message"].startswith("cwd")
    for body in (b"", b"[]"):  # no object at all: the body is named
        whole = client.post(f"/api/sessions/{SID}/events", content=body, headers={"Content-Type": "application/json"})
        assert whole.status_code == 400 and error_of(whole)["message"].startswith("body: "), body


@pytest.fixture
def small(api_settings: Settings, r: redis.Redis) -> Iterator[TestClient]:
    limits = api_settings.limits.model_copy(update={"max_body_bytes": 2048, "max_event_bytes": 1024})
    with TestClient(create_app(api_settings.model_copy(update={"limits": limits}), redis=r)) as c:
        yield c


def test_declared_body_over_limit_is_413(small: TestClient, r: redis.Redis) -> None:
    events = [{"type": "user", "turnId": 1, "content": "y" * 900}] * 3
    response = small.post(f"/api/sessions/{SID}/events", json={"cwd": CWD, "events": events})
    assert response.status_code == 413
    assert error_of(response)["code"] == "payload_too_large"
    assert r.xlen(Keys().stream_for(SID)) == 0


def test_streamed_body_over_limit_is_413(small: TestClient) -> None:
    chunks = [b'{"cwd": "/w", "events": [', b'"' + b"z" * 1500 + b'",', b'"' + b"z" * 1500 + b'"]}']
    response = small.post(f"/api/sessions/{SID}/events", content=iter(chunks),
                          headers={"Content-Type": "application/json"})
    assert "content-length" not in {k.lower() for k in response.request.headers}
    assert response.status_code == 413


def test_one_event_over_max_event_bytes_is_400_naming_it_and_publishes_nothing(small: TestClient,
                                                                              r: redis.Redis) -> None:
    events = [{"type": "user", "turnId": 1, "content": "ok"}, {"type": "user", "turnId": 1, "content": "y" * 1500}]
    response = small.post(f"/api/sessions/{SID}/events", json={"cwd": CWD, "events": events})
    assert response.status_code == 400  # SPEC §7: 413 is for the body over limits.maxBodyBytes only
    assert error_of(response)["message"].startswith("events[1].event: ")
    assert "limits.maxEventBytes" in error_of(response)["message"]
    assert r.xlen(Keys().stream_for(SID)) == 0


# -- GET context / session ---------------------------------------------------------------

def test_context_of_a_hand_written_log(client: TestClient, api_settings: Settings) -> None:
    log = SessionLog(api_settings.data_dir, CWD, SID)
    log.append([{"type": "user", "uuid": "u1", "timestamp": "2025-01-01T00:00:00Z",
                 "turnId": 1, "content": "hello world"}])
    response = client.get(f"/api/sessions/{SID}/context", params={"cwd": CWD})
    assert response.status_code == 200
    assert response.json() == {"messages": [{"role": "user", "content": "hello world"}],
                               "promptEstimate": 6, "currentTurnId": 1}


def test_context_needs_no_redis(api_settings: Settings, tmp_path: Any) -> None:
    SessionLog(api_settings.data_dir, CWD, SID).append(
        [{"type": "session_meta", "uuid": "m", "timestamp": "2025-01-01T00:00:00Z"}])
    dead = redis.Redis.from_url(f"unix://{tmp_path}/nothing.sock")
    with TestClient(create_app(api_settings, redis=dead)) as test_client:
        response = test_client.get(f"/api/sessions/{SID}/context", params={"cwd": CWD})
    assert response.status_code == 200
    assert response.json() == {"messages": [], "promptEstimate": 0, "currentTurnId": 1}


def test_unknown_session_is_404_and_bad_cwd_400(client: TestClient) -> None:
    for path in (f"/api/sessions/{SID}/context", f"/api/sessions/{SID}"):
        missing = client.get(path, params={"cwd": CWD})
        assert missing.status_code == 404 and error_of(missing)["code"] == "not_found"
        assert client.get(path, params={"cwd": "rel"}).status_code == 400
        assert client.get(path).status_code == 400  # cwd is required


def test_session_reports_state_thresholds_breaker_and_jobs(client: TestClient, r: redis.Redis,
                                                           api_settings: Settings) -> None:
    write_session(r, api_settings, 2)
    keys = Keys()
    r.set(keys.failures(SID), 3)
    r.set(keys.job(SID), "123-micro-sess-1")
    body = client.get(f"/api/sessions/{SID}", params={"cwd": CWD}).json()
    assert body["sessionId"] == SID and body["cwd"] == CWD
    assert body["contextWindow"] == 4000 and body["currentTurnId"] == 3
    assert body["microThreshold"] == 1000 and body["compactionThreshold"] == 3600
    assert body["failures"] == 3 and body["breakerOpen"] is True
    assert body["pendingJob"] == {"jobId": "123-micro-sess-1", "status": None}
    assert body["promptEstimate"] > 0 and body["lastCompaction"] is None


def test_session_state_is_rebuilt_from_the_log_when_redis_lost_it(
        client: TestClient, r: redis.Redis, api_settings: Settings) -> None:
    write_session(r, api_settings, 2)
    before = client.get(f"/api/sessions/{SID}", params={"cwd": CWD}).json()
    r.flushall()
    after = client.get(f"/api/sessions/{SID}", params={"cwd": CWD}).json()
    assert after == {**before, "failures": 0, "breakerOpen": False}
    assert before["failures"] == 0


def test_redis_down_is_503_with_error_body(api_settings: Settings, tmp_path: Any,
                                           r: redis.Redis) -> None:
    write_session(r, api_settings, 1)
    dead = redis.Redis.from_url(f"unix://{tmp_path}/nothing.sock")
    with TestClient(create_app(api_settings, redis=dead)) as test_client:
        response = test_client.get(f"/api/sessions/{SID}", params={"cwd": CWD})
        context = test_client.get(f"/api/sessions/{SID}/context", params={"cwd": CWD})
        waited = test_client.get(f"/api/sessions/{SID}/context", params={"cwd": CWD, "after": "1-0"})
        # an unknown session (no log) is SPEC §7's 404 with Redis down too, as /context says: a 503
        # invites a retry that could only ever end in the 404
        unknown = [test_client.get("/api/sessions/nobody", params={"cwd": CWD}),
                   test_client.post("/api/sessions/nobody/compact", json={"cwd": CWD}),
                   test_client.get("/api/sessions/nobody/context", params={"cwd": CWD})]
    assert [answer.status_code for answer in unknown] == [404, 404, 404], [answer.text for answer in unknown]
    assert context.status_code == 200 and waited.status_code == 503  # the log alone, unless asked to wait
    assert response.status_code == 503
    assert error_of(response)["code"] == "redis_unavailable"


def test_settings_come_from_an_overridable_dependency(api_settings: Settings,
                                                      r: redis.Redis, tmp_path: Any) -> None:
    app = create_app(api_settings, redis=r)
    other = api_settings.model_copy(update={"data_dir": tmp_path / "other"})
    SessionLog(other.data_dir, CWD, SID).append(
        [{"type": "user", "uuid": "u", "timestamp": "2025-01-01T00:00:00Z", "turnId": 1,
          "content": "hi"}])
    app.dependency_overrides[get_settings] = lambda: other
    with TestClient(app) as test_client:
        assert test_client.get(f"/api/sessions/{SID}/context",
                               params={"cwd": CWD}).status_code == 200


def test_reads_under_another_spelling_of_the_cwd_are_refused_as_writes_are(
        client: TestClient, r: redis.Redis, api_settings: Settings) -> None:
    """``/tmp/PROJ`` and ``/tmp/proj/`` find the log of ``/tmp/proj``: the session and history routes
    answered 200 and echoed that spelling as the session's cwd, while posting events or a
    compaction under it is a 400. ``/context`` reads the log alone (no cwd in its body)."""
    write_session(r, api_settings, 2)
    for other in (CWD + "/", CWD.upper()):
        for path in (f"/api/sessions/{SID}", f"/api/sessions/{SID}/history"):
            response = client.get(path, params={"cwd": other})
            assert response.status_code == 400, (path, response.text)
            assert error_of(response)["message"] == f"cwd: session {SID} is bound to cwd {CWD!r}, not {other!r}"
    assert client.get(f"/api/sessions/{SID}", params={"cwd": CWD}).json()["cwd"] == CWD
    assert client.get(f"/api/sessions/{SID}/history", params={"cwd": CWD}).json()["cwd"] == CWD
    gone = redis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.5)
    with TestClient(create_app(api_settings, redis=gone)) as without_redis:  # the history reads the log alone
        answer = without_redis.get(f"/api/sessions/{SID}/history", params={"cwd": CWD})
        assert answer.status_code == 200 and answer.json()["cwd"] == CWD


def test_after_redis_lost_a_session_its_log_keeps_the_cwd_binding(
        client: TestClient, r: redis.Redis, api_settings: Settings) -> None:
    """With the session's hash gone (a Redis restarted without persistence), the first request
    under another spelling of the cwd rebuilt the state under that spelling: the session was
    then bound to ``/home/dev/project/`` for good, and its agent's own events were refused and
    dead-lettered. The log's ``session_meta`` records the cwd, and a rebuild keeps to it."""
    write_session(r, api_settings, 2)
    log = SessionLog(api_settings.data_dir, CWD, SID)
    before = log.path.read_bytes()
    keys = Keys(api_settings.redis.prefix, api_settings.redis.shards)
    for other in (CWD + "/", CWD.upper()):
        r.delete(keys.session(SID), keys.uuids(SID))
        message = f"cwd: session {SID} is bound to cwd {CWD!r}, not {other!r}"
        for method, path, kwargs in (
            ("post", f"/api/sessions/{SID}/compact", {"json": {"cwd": other}}),
            ("post", f"/api/sessions/{SID}/events",
             {"json": {"cwd": other, "events": [{"type": "user", "turnId": 3, "content": "x"}]}}),
            ("get", f"/api/sessions/{SID}", {"params": {"cwd": other}}),
            ("get", f"/api/sessions/{SID}/history", {"params": {"cwd": other}}),
        ):
            response = getattr(client, method)(path, **kwargs)
            assert response.status_code == 400, (path, response.text)
            assert error_of(response)["message"] == message, path
        with pytest.raises(InvalidEvent, match="is bound to cwd"):  # the watcher's and the workers' way in
            SessionStore(r, api_settings).apply(SID, other, [{"type": "user", "turnId": 3, "content": "x"}])
        assert r.hget(keys.session(SID), "cwd") is None
    assert log.path.read_bytes() == before
    assert client.get(f"/api/sessions/{SID}", params={"cwd": CWD}).json()["cwd"] == CWD  # rebuilt as it was
    assert r.hget(keys.session(SID), "cwd") in (None, CWD.encode())
    response = client.post(f"/api/sessions/{SID}/compact?wait=false", json={"cwd": CWD})
    assert response.status_code == 202


# -- compaction and jobs -----------------------------------------------------------------

def test_compact_without_wait_is_202_then_job_finishes(client: TestClient, r: redis.Redis,
                                                       api_settings: Settings) -> None:
    write_session(r, api_settings, 3)
    response = client.post(f"/api/sessions/{SID}/compact?wait=false", json={"cwd": CWD})
    assert response.status_code == 202
    job_id = response.json()["jobId"]
    assert client.get(f"/api/jobs/{job_id}").json()["status"] == "queued"
    run_jobs(r, api_settings)
    job = client.get(f"/api/jobs/{job_id}").json()
    assert job["status"] == "finished"
    assert job["result"]["didCompress"] is True and job["result"]["released"] > 0
    assert "error" not in job


def test_an_unknown_body_field_or_a_repeated_query_parameter_is_a_400_naming_it(
        client: TestClient, r: redis.Redis, api_settings: Settings) -> None:
    """``wait`` sent in the body was ignored (the call waited), a body's ``sessionId`` that
    contradicted the path too, and ``?cwd=/a&cwd=/b`` read the last value silently."""
    write_session(r, api_settings, 3)
    for path, body, message in (
        (f"/api/sessions/{SID}/compact", {"cwd": CWD, "wait": False},
         "wait: unknown field (wait goes in the query string: ?wait=false)"),
        (f"/api/sessions/{SID}/events", {"cwd": CWD, "events": [], "sessionId": "other"},
         "sessionId: unknown field"),
    ):
        response = client.post(path, json=body)
        assert response.status_code == 400, response.text
        assert error_of(response) == {"code": "bad_request", "message": message}
    for path in (f"/api/sessions/{SID}?cwd=/elsewhere&cwd={CWD}", f"/api/sessions/{SID}/context?cwd={CWD}&cwd={CWD}",
                 "/api/sessions?limit=1&limit=2", f"/api/jobs/abc?x=1&x=2", "/?limit=1&limit=2",
                 f"/api/sessions/{SID}/compact?wait=false&wait=true"):
        method = client.post if path.startswith(f"/api/sessions/{SID}/compact") else client.get
        response = method(path, json={"cwd": CWD}) if method is client.post else method(path)
        assert response.status_code == 400, (path, response.text)
        assert error_of(response)["message"].endswith("times in the query string; give it once"), path
    assert not r.exists(Keys(api_settings.redis.prefix, api_settings.redis.shards).job(SID))  # nothing queued
    assert client.get(f"/api/sessions/{SID}", params={"cwd": CWD}).status_code == 200


def test_a_path_with_a_trailing_slash_is_a_404_in_the_error_shape_not_a_redirect(
        client: TestClient, r: redis.Redis, api_settings: Settings) -> None:
    """``/api/sessions/s/`` answered a bodyless 307 to an absolute ``http://`` URL (FastAPI's
    redirect_slashes): no ``{"error"}`` body, and the wrong scheme behind a TLS proxy."""
    write_session(r, api_settings, 1)
    for method, path, kwargs in (("get", f"/api/sessions/{SID}/", {"params": {"cwd": CWD}}),
                                 ("post", f"/api/sessions/{SID}/compact/", {"json": {"cwd": CWD}}),
                                 ("get", "/healthz/", {})):
        response = getattr(client, method)(path, follow_redirects=False, **kwargs)
        assert response.status_code == 404, (path, response.status_code, response.headers)
        assert error_of(response)["code"] == "not_found", path
    assert not r.exists(Keys(api_settings.redis.prefix, api_settings.redis.shards).job(SID))  # nothing queued


def test_a_job_of_another_queue_or_function_is_no_job_of_ours(
        client: TestClient, r: redis.Redis, api_settings: Settings) -> None:
    """RQ's job keys are shared by every queue and application on the Redis: a job of another
    deployment (its error shown) or another application (a result that is no CompressResult:
    a 500) was answered as if it were a compaction job."""
    from rq import Queue

    other = Queue("some-other-app", connection=r)
    other.enqueue(len, "abc", job_id="foreign-len")
    ours = Queue(api_settings.redis.prefix, connection=r)  # our queue, another function
    ours.enqueue(len, "abcd", job_id="ours-len")
    CompactionWorker([other, ours], connection=r, settings=api_settings).work(burst=True)
    for job_id in ("foreign-len", "ours-len"):
        response = client.get(f"/api/jobs/{job_id}")
        assert response.status_code == 404, response.text
        assert "no compaction job of this deployment" in error_of(response)["message"]
    write_session(r, api_settings, 3)  # while our own job is answered
    job_id = client.post(f"/api/sessions/{SID}/compact?wait=false", json={"cwd": CWD}).json()["jobId"]
    assert client.get(f"/api/jobs/{job_id}").json()["status"] == "queued"


def test_compact_waits_for_the_job_and_returns_compress_result(
        client: TestClient, r: redis.Redis, api_settings: Settings) -> None:
    write_session(r, api_settings, 3)
    before = client.get(f"/api/sessions/{SID}", params={"cwd": CWD}).json()["promptEstimate"]
    response = post_while_working(client, r, api_settings, f"/api/sessions/{SID}/compact",
                                  {"cwd": CWD})
    assert response.status_code == 200
    result = response.json()
    assert set(result) == {"didCompress", "released", "promptEstimate"}
    assert result["didCompress"] is True
    assert result["promptEstimate"] == before - result["released"]
    context = client.get(f"/api/sessions/{SID}/context", params={"cwd": CWD}).json()
    assert context["promptEstimate"] == result["promptEstimate"]
    assert context["messages"][0]["name"] == "compacted_history"


def test_compact_after_a_new_sessions_first_events_waits_for_them_not_404(
        client: TestClient, r: redis.Redis, api_settings: Settings) -> None:
    """Events POSTed, then a compaction at once: the watcher had not written the new session's log
    yet, and the compaction was a 404 "no session" (1 in 10 runs against a live stack). With
    ``after`` (the last stream id the events POST answered) it waits for the watcher first; with
    ``wait=false`` too, it answers at once (it waited up to ``jobWaitSeconds``, then answered 404
    for a session whose events were still in its shard): the job waits for them."""
    import threading

    from producer.watcher import Watcher
    from tests.producer.conftest import drain

    ids = client.post(f"/api/sessions/{SID}/events", json={"cwd": CWD, "events": turn(1) + turn(2) + turn(3)}).json()
    early = client.post(f"/api/sessions/{SID}/compact?wait=false", json={"cwd": CWD})
    assert early.status_code == 404  # without ``after``: as before, the log is not there yet
    started = time.monotonic()
    response = client.post(f"/api/sessions/{SID}/compact?wait=false", json={"cwd": CWD, "after": ids["streamIds"][-1]})
    assert response.status_code == 202 and time.monotonic() - started < 5, response.text
    job = Job.fetch(response.json()["jobId"], connection=r)
    assert job.kwargs == {"forced": True, "after": ids["streamIds"][-1]}
    watcher = Watcher(r, api_settings, name="w")
    drain(watcher, r, api_settings)
    run_jobs(r, api_settings)
    assert client.get(f"/api/jobs/{job.id}").json()["result"]["didCompress"] is True
    bad = client.post(f"/api/sessions/{SID}/compact", json={"cwd": CWD, "after": "12"})
    assert bad.status_code == 400 and error_of(bad)["message"].startswith("after: '12' is not a stream entry id")
    other = "s-later"  # waiting (wait=true): for the watcher, then for the job (no worker here: a 202)
    ids = client.post(f"/api/sessions/{other}/events", json={"cwd": CWD, "events": turn(1)}).json()
    later = threading.Timer(0.5, drain, args=(watcher, r, api_settings))
    later.start()
    try:
        with TestClient(create_app(with_api(api_settings, job_wait_seconds=3.0), redis=r)) as short:
            waited = short.post(f"/api/sessions/{other}/compact", json={"cwd": CWD, "after": ids["streamIds"][-1]})
    finally:
        later.join(30)
        watcher.close()
    assert waited.status_code == 202, waited.text


def test_compact_after_an_entry_that_never_settles_answers_within_job_wait_seconds(
        r: redis.Redis, api_settings: Settings) -> None:
    """The wait for ``after`` and the wait for the job each took jobWaitSeconds: the request was
    answered past twice the time clients size their timeouts by."""
    write_session(r, api_settings, 2)
    with TestClient(create_app(with_api(api_settings, job_wait_seconds=2.0), redis=r)) as short:
        [waiting] = short.post(f"/api/sessions/{SID}/events", json={"cwd": CWD, "events": [
            {"type": "user", "turnId": 3, "content": "no watcher applies it"}]}).json()["streamIds"]
        started = time.monotonic()
        answer = short.post(f"/api/sessions/{SID}/compact", json={"cwd": CWD, "after": waiting})
        assert answer.status_code == 202 and time.monotonic() - started < 3.5, answer.text


def test_a_log_another_process_keeps_locked_is_read_without_the_lock(
        client: TestClient, r: redis.Redis, api_settings: Settings) -> None:
    """A state to rebuild (its log grew past it) was rebuilt under the log's lock: a stopped process
    holding that lock held the request as long (and the session list, for a state of other settings)."""
    import fcntl
    import threading

    write_session(r, api_settings, 2)
    path = SessionLog(api_settings.data_dir, CWD, SID).path
    with open(path, "a") as f:  # (written by hand: the stored state is behind the log)
        f.write(json.dumps({"type": "user", "uuid": "hand-1", "timestamp": "2026-12-03T00:00:00Z", "turnId": 3,
                            "content": "hello world"}) + "\n")
    holder = os.open(path, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)  # another open file: another process, as flock sees it
    once = threading.Lock()

    def release() -> None:
        if once.acquire(blocking=False):
            os.close(holder)

    safety = threading.Timer(10, release)  # (the code before: the request waited until this)
    safety.start()
    try:
        started = time.monotonic()
        body = client.get(f"/api/sessions/{SID}", params={"cwd": CWD}).json()
        assert time.monotonic() - started < 5 and safety.is_alive()
    finally:
        safety.cancel()
        release()
    assert body["currentTurnId"] == 3
    assert body["promptEstimate"] == client.get(f"/api/sessions/{SID}/context", params={"cwd": CWD}).json()[
        "promptEstimate"]


def test_compact_with_nothing_to_summarize_does_not_compress(
        client: TestClient, r: redis.Redis, api_settings: Settings) -> None:
    write_session(r, api_settings, 1)
    response = post_while_working(client, r, api_settings, f"/api/sessions/{SID}/compact",
                                  {"cwd": CWD})
    assert response.status_code == 200
    assert response.json()["didCompress"] is False and response.json()["released"] == 0


def test_compact_whose_llm_fails_is_502(r: redis.Redis, api_settings: Settings,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    settings = with_context(api_settings, compaction_model=STUB_MODEL, llm_timeout_seconds=5.0)
    write_session(r, settings, 3)
    with LLMStub() as stub, TestClient(create_app(settings, redis=r)) as test_client:
        monkeypatch.setenv("OPENAI_API_BASE", stub.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-stub")
        stub.reply = "I will not summarize."
        response = post_while_working(test_client, r, settings, f"/api/sessions/{SID}/compact",
                                      {"cwd": CWD})
    assert response.status_code == 502
    assert error_of(response)["code"] == "compaction_failed"
    assert response.headers["X-Compactor-Job-Id"] in error_of(response)["message"]
    assert "summary" in error_of(response)["message"].lower()
    assert "events.errors" not in error_of(response)["message"]  # (the CLI's wording: no module path)
    assert int(r.get(Keys().failures(SID)) or 0) == 1


def compact_in_a_thread(test_client: TestClient, r: redis.Redis,
                        settings: Settings) -> tuple[threading.Thread, dict[str, Any], str]:
    """A forced compaction POSTed from a thread (its answer in the dict's ``response`` once joined),
    returned once its job is queued, with the job's id."""
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.update(
        response=test_client.post(f"/api/sessions/{SID}/compact", json={"cwd": CWD})))
    thread.start()
    queue = compaction_queue(r, settings)
    deadline = time.monotonic() + 10
    while queue.count == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    [job_id] = queue.job_ids
    return thread, box, job_id


def test_compact_whose_worker_died_is_500_job_abandoned(client: TestClient, r: redis.Redis,
                                                        api_settings: Settings) -> None:
    """A forced compaction whose worker was killed answered 502 ``compaction_failed``, SPEC §7's
    status for an LLM call that failed, though no LLM call had failed."""
    from rq.job import Job
    from rq.job_lifecycle import record_job_failure

    write_session(r, api_settings, 3)
    queue = compaction_queue(r, api_settings)
    thread, box, job_id = compact_in_a_thread(client, r, api_settings)
    job = Job.fetch(job_id, connection=r)
    queue.remove(job)
    with r.pipeline() as pipe:  # as RQ's cleanup of the started registry records a dead worker's job
        record_job_failure(job, "Moved to FailedJobRegistry, due to AbandonedJobError, at 2026-12-02", pipe)
        pipe.execute()
    thread.join(30)
    response = box["response"]
    assert response.status_code == 500 and error_of(response)["code"] == "job_abandoned"
    assert response.headers["X-Compactor-Job-Id"] == job_id and "AbandonedJobError" in error_of(response)["message"]


@pytest.mark.parametrize("fallback,shown", [("extractive", "extractive"),
                                             ("openai/\u6a21\u578b%", "openai/%E6%A8%A1%E5%9E%8B%25")])
def test_compact_answered_by_the_fallback_says_which_llm_failure_it_answered_for(
        r: redis.Redis, api_settings: Settings, monkeypatch: pytest.MonkeyPatch, fallback: str, shown: str) -> None:
    """A fallback named past Latin-1: the header carried its name raw, Starlette writes header
    values as Latin-1, and the compaction, appended, was answered 500 without its job id."""
    from compactor.llm_stub import StubResponse

    settings = with_context(api_settings, compaction_model=STUB_MODEL, llm_timeout_seconds=5.0,
                            fallback_model=fallback)
    write_session(r, settings, 3)
    with LLMStub() as stub, TestClient(create_app(settings, redis=r)) as test_client:
        monkeypatch.setenv("OPENAI_API_BASE", stub.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-stub")
        stub.script(StubResponse(status=429))  # the compaction model's call; a fallback LLM's is answered
        response = post_while_working(test_client, r, settings, f"/api/sessions/{SID}/compact",
                                      {"cwd": CWD})
        assert response.status_code == 200
        assert set(response.json()) == {"didCompress", "released", "promptEstimate"}  # SPEC's CompressResult
        assert response.json()["didCompress"] is True
        assert response.headers["X-Compactor-LLM-Error"] == f"transient; fallback={shown}"
        job = test_client.get(f"/api/jobs/{response.headers['X-Compactor-Job-Id']}").json()
    assert job["status"] == "finished" and job["result"] == response.json()
    assert job["llmError"]["kind"] == "transient" and job["llmError"]["fallback"] == fallback  # (the JSON as is)
    assert job["llmError"]["model"] == STUB_MODEL and "error" not in job
    called = [] if fallback == "extractive" else [fallback.removeprefix("openai/")]
    assert [request.body["model"] for request in stub.requests] == ["stub-model", *called]


def test_compact_times_out_into_202(r: redis.Redis, api_settings: Settings) -> None:
    settings = with_api(api_settings, job_wait_seconds=0.3)
    write_session(r, settings, 3)
    with TestClient(create_app(settings, redis=r)) as test_client:
        response = test_client.post(f"/api/sessions/{SID}/compact", json={"cwd": CWD})
        assert response.status_code == 202
        job = test_client.get(f"/api/jobs/{response.json()['jobId']}").json()
    assert job == {"jobId": response.json()["jobId"], "status": "queued"}


def test_compact_of_unknown_session_is_404_and_enqueues_nothing(client: TestClient,
                                                                r: redis.Redis,
                                                                api_settings: Settings) -> None:
    response = client.post(f"/api/sessions/{SID}/compact", json={"cwd": CWD})
    assert response.status_code == 404
    assert compaction_queue(r, api_settings).count == 0


def test_compact_of_session_with_only_meta_is_known(client: TestClient, r: redis.Redis,
                                                    api_settings: Settings) -> None:
    SessionStore(r, api_settings).apply(SID, CWD, [{"type": "session_meta", "sessionId": SID}])
    response = client.post(f"/api/sessions/{SID}/compact?wait=false", json={"cwd": CWD})
    assert response.status_code == 202


def test_compact_of_a_session_with_the_longest_id_is_followed_to_its_end(
        client: TestClient, r: redis.Redis, api_settings: Settings) -> None:
    """A job id is ``{20 digits}-{kind}-{sessionId}``: a session id of 104 characters or more (SPEC
    allows 128) made one longer than the 128 the job routes took, so its forced compaction was a
    400 and its job could not be read."""
    sid = "b" * 128
    write_session(r, api_settings, 3, sid=sid)
    response = client.post(f"/api/sessions/{sid}/compact?wait=false", json={"cwd": CWD})
    assert response.status_code == 202, response.text
    job_id = response.json()["jobId"]
    assert client.get(f"/api/jobs/{job_id}").json()["status"] == "queued"
    run_jobs(r, api_settings)
    assert client.get(f"/api/jobs/{job_id}").json()["result"]["didCompress"] is True
    waited = post_while_working(client, r, api_settings, f"/api/sessions/{sid}/compact", {"cwd": CWD})
    assert waited.status_code == 200, waited.text


def test_job_routes_validate_ids(client: TestClient) -> None:
    assert client.get("/api/jobs/nope").status_code == 404
    assert error_of(client.get("/api/jobs/nope"))["code"] == "not_found"
    assert client.get("/api/jobs/-x").status_code == 400
    assert client.get(f"/api/jobs/{'1' * 161}").status_code == 400


# -- bad input, named -----------------------------------------------------------------------

def post_raw(test_client: TestClient, path: str, body: str | bytes,
             content_type: str | None = "application/json") -> Any:
    headers = {"Content-Type": content_type} if content_type else {}
    return test_client.post(path, content=body.encode() if isinstance(body, str) else body, headers=headers)


@pytest.mark.parametrize("route,body", [
    ("events", r'{"cwd": "/uni\ud800", "events": [{"type": "user", "turnId": 1, "content": "x"}]}'),
    ("compact", r'{"cwd": "/a\ud800"}'),
])
def test_a_cwd_with_a_lone_surrogate_is_400_naming_cwd(client: TestClient, r: redis.Redis,
                                                       route: str, body: str) -> None:
    response = post_raw(client, f"/api/sessions/{SID}/{route}", body)
    assert response.status_code == 400
    assert error_of(response)["message"].startswith("cwd: ")
    assert "surrogate" in error_of(response)["message"]
    assert r.xlen(Keys().stream_for(SID)) == 0


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_a_number_json_cannot_hold_is_400_naming_the_field_not_stored_as_null(
        client: TestClient, r: redis.Redis, value: str) -> None:
    body = '{"cwd": "/uni", "events": [{"type": "user", "turnId": 1, "content": "ok", "x": %s}]}' % value
    response = post_raw(client, f"/api/sessions/{SID}/events", body)
    assert response.status_code == 400
    message = error_of(response)["message"]
    assert message.startswith("events[0].x: ") and "finite" in message and "JSON" in message
    assert r.xlen(Keys().stream_for(SID)) == 0


@pytest.mark.parametrize(("value", "path"), [("1e-400", "events[0].x"), ("[0.5, -7.2E-999]", "events[0].x[1]")])
def test_a_nonzero_number_a_double_holds_only_as_0_is_400_naming_the_field(
        client: TestClient, r: redis.Redis, value: str, path: str) -> None:
    """JSON's 1e-400 was read as 0.0 and stored so, silently."""
    body = '{"cwd": "/uni", "events": [{"type": "user", "turnId": 1, "content": "ok", "x": %s}]}' % value
    response = post_raw(client, f"/api/sessions/{SID}/events", body)
    assert response.status_code == 400
    message = error_of(response)["message"]
    assert message.startswith(f"{path}: is the number ") and "too small for a double" in message, message
    assert r.xlen(Keys().stream_for(SID)) == 0


@pytest.mark.parametrize(("body", "key", "where"), [
    ('{"cwd": "/a", "cwd": "/b", "events": [{"type": "user", "turnId": 1, "content": "x"}]}', "cwd", "body"),
    ('{"cwd": "/uni", "events": [{"type": "user", "turnId": 1, "content": "x"}, '
     '{"type": "user", "turnId": 1, "content": "x", "content": "y"}]}', "content", "events[1]"),
    ('{"cwd": "/uni", "events": [{"type": "assistant", "turnId": 1, "toolCalls": '
     '[{"id": "c", "name": "n", "arguments": {"a": 1, "a": 2}}]}]}', "a", "events[0].toolCalls[0].arguments"),
    ('{"cwd": "/uni", "events": [{"type": "assistant", "turnId": 1, "turnId": 1, "toolCalls": '  # the first met
     '[{"id": "c", "name": "n", "arguments": {"a": 1, "a": 2}}]}]}', "a", "events[0].toolCalls[0].arguments"),
    ('{"cwd": "/uni", "events": [{"x": {"k": 1, "k": 2}, "x": 3}, {"k": 1, "k": 2}]}', "k",  # in a dropped value
     "events[0].x"),
])
def test_a_key_repeated_in_one_object_is_400_naming_where(client: TestClient, r: redis.Redis, body: str, key: str,
                                                         where: str) -> None:
    """JSON lets a key repeat; the last value won, the other was dropped without a word. The 400
    said ``body`` at any depth, where every other one names the event and field."""
    response = post_raw(client, f"/api/sessions/{SID}/events", body)
    assert response.status_code == 400
    assert error_of(response)["message"] == (f"{where}: the key {key!r} appears twice in one object (one of its "
                                             "values would be dropped)")
    assert r.xlen(Keys().stream_for(SID)) == 0


def test_a_repeated_key_among_many_is_found_in_linear_time(client: TestClient) -> None:
    """Finding it counted every key once per key: one object of 20 000 keys took 5 s on the event
    loop (40 000: 29 s), every other request, /healthz too, waiting behind it."""
    keys = ",".join(f'"k{i}": 0' for i in range(20_000))
    body = f'{{"cwd": "/a", "events": [{{"type": "user", "turnId": 1, "content": "x", "meta": {{{keys}, "k0": 1}}}}]}}'
    started = time.monotonic()
    response = post_raw(client, f"/api/sessions/{SID}/events", body)
    assert time.monotonic() - started < 2.0
    assert error_of(response)["message"].startswith("events[0].meta: the key 'k0' appears twice")


def test_an_integer_beyond_64_bits_is_400_naming_its_field(client: TestClient, r: redis.Redis) -> None:
    events = [{"type": "turn_end", "turnId": 1, "model": "m", "contextWindow": 10**20}]
    response = client.post(f"/api/sessions/{SID}/events", json={"cwd": CWD, "events": events})
    assert response.status_code == 400
    assert error_of(response)["message"].startswith("events[0].contextWindow: ")
    assert "64" in error_of(response)["message"]
    assert r.xlen(Keys().stream_for(SID)) == 0


def test_after_redis_lost_a_sessions_state_a_turn_going_backwards_is_still_a_400(
        client: TestClient, r: redis.Redis, api_settings: Settings) -> None:
    """With no state in Redis (lost, or its 7-day idle TTL ran out) only summaries and compacts
    were checked: the event was a 202, then the watcher's dead letter. The log tells the turn."""
    write_session(r, api_settings, 3)  # currentTurnId 4
    keys = Keys(api_settings.redis.prefix, api_settings.redis.shards)
    r.delete(keys.session(SID), keys.uuids(SID))
    path = f"/api/sessions/{SID}/events"
    response = client.post(path, json={"cwd": CWD, "events": [{"type": "user", "turnId": 2, "content": "back"}]})
    assert response.status_code == 400, response.text
    assert error_of(response)["message"] == "events[0].turnId: goes backwards: 2 < currentTurnId 4"
    assert r.xlen(keys.stream_for(SID)) == 0 and not r.exists(keys.session(SID))  # (nothing stored by the check)
    rolled = [{"type": "rollback", "throughTurnId": 2, "reason": "r"}, {"type": "user", "turnId": 1, "content": "x"}]
    response = client.post(path, json={"cwd": CWD, "events": rolled})
    assert error_of(response)["message"] == "events[1].turnId: goes backwards: 1 < currentTurnId 2"
    fine = client.post(path, json={"cwd": CWD, "events": [{"type": "user", "turnId": 4, "content": "on"}]})
    assert fine.status_code == 202, fine.text


def test_a_turn_going_backwards_against_the_session_is_400_when_nothing_can_change_its_turn(
        client: TestClient, r: redis.Redis, api_settings: Settings) -> None:
    """Such an event was answered 202 (published) and then dead-lettered by the watcher: the client
    took it for stored. It is refused when the stored state is the session's as the watcher will
    see it; while an entry of the session waits in its shard (a rollback may lower the turn), it
    is still published, for the watcher to decide."""
    write_session(r, api_settings, 3)  # currentTurnId 4
    path, stream = f"/api/sessions/{SID}/events", Keys().stream_for(SID)
    back = [{"type": "user", "turnId": 2, "content": "back"}]
    response = client.post(path, json={"cwd": CWD, "events": back})
    assert response.status_code == 400
    assert error_of(response)["message"] == "events[0].turnId: goes backwards: 2 < currentTurnId 4"
    assert r.xlen(stream) == 0
    other = [{"type": "user", "turnId": 1, "content": "another session's"}]
    neighbour = next(f"other-{n}" for n in range(100) if Keys().shard_of(f"other-{n}") == Keys().shard_of(SID))
    assert client.post(f"/api/sessions/{neighbour}/events", json={"cwd": CWD, "events": other}).status_code == 202
    assert r.xlen(stream) == 1
    assert client.post(path, json={"cwd": CWD, "events": back}).status_code == 400  # (another's entry waits)
    rollback = [{"type": "rollback", "throughTurnId": 2, "reason": "undo"}]
    assert client.post(path, json={"cwd": CWD, "events": rollback}).status_code == 202
    again = [{"type": "user", "turnId": 2, "content": "again"}]
    assert client.post(path, json={"cwd": CWD, "events": again}).status_code == 202  # the rollback waits
    group = Keys().group
    r.xgroup_create(stream, group, id="0")
    r.xreadgroup(group, "shard-0", {stream: ">"})  # delivered, not acked: not applied yet
    assert client.post(path, json={"cwd": CWD, "events": again}).status_code == 202
    r.xreadgroup(group, "shard-0", {stream: ">"})
    r.xack(stream, group, *[entry_id for entry_id, _ in r.xrange(stream)])  # (as if applied)
    assert client.post(path, json={"cwd": CWD, "events": back}).status_code == 400
    assert client.post(path, json={"cwd": CWD, "events": rollback + again}).status_code == 202  # its own rollback
    with SessionStore(r, api_settings).log(SID, CWD).path.open("ab") as log:  # a line the state has not seen
        log.write(b'{"type":"user","turnId":4,"content":"x","uuid":"late"}\n')
    assert client.post(path, json={"cwd": CWD, "events": back}).status_code == 202  # the state lags its log


@pytest.mark.parametrize(("events", "message"), [
    ([{"type": "rollback", "throughTurnId": 3, "reason": "undo"}, {"type": "user", "turnId": 2, "content": "x"}],
     "events[1].turnId: goes backwards: 2 < currentTurnId 3"),
    ([{"type": "rollback", "throughTurnId": 3, "reason": "undo"},
      {"type": "summary", "replaces": [], "summaryText": "s", "lastSummarizedTurnId": 3}],
     "events[1].lastSummarizedTurnId: is past the session's turns: 3 > 2"),
    ([{"type": "rollback", "throughTurnId": 3, "reason": "undo"}, {"type": "user", "turnId": 3, "content": "x"}],
     None),
])
def test_a_batch_holding_a_rollback_is_checked_past_it(
        client: TestClient, r: redis.Redis, api_settings: Settings, events: list[dict[str, Any]],
        message: str | None) -> None:
    """``[rollback 3, user 2]`` on a settled session was a 202: the rollback applied (it cannot be
    undone), the user event dead-lettered, the client told "accepted"."""
    write_session(r, api_settings, 4)  # currentTurnId 5
    response = client.post(f"/api/sessions/{SID}/events", json={"cwd": CWD, "events": events})
    if message is None:
        assert response.status_code == 202, response.text
        return
    assert response.status_code == 400, response.text
    assert error_of(response)["message"].startswith(message), error_of(response)
    assert r.xlen(Keys().stream_for(SID)) == 0


def test_the_check_past_a_rollback_counts_no_token(
        client: TestClient, r: redis.Redis, api_settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dry run stamped every event of the batch: a 4 MB output cost seconds of tiktoken on a
    request, though no refusal depends on a token count."""
    import compactor.store

    write_session(r, api_settings, 4)

    def counted(*_: Any) -> None:
        raise AssertionError("tokens counted")

    monkeypatch.setattr(compactor.store, "_stamped", counted)
    big = {"type": "tool_result", "turnId": 3, "toolCallId": "c", "toolName": "read_file", "output": "." * 100_000}
    events = [{"type": "rollback", "throughTurnId": 3, "reason": "undo"}, big,
              {"type": "user", "turnId": 2, "content": "x"}]
    response = client.post(f"/api/sessions/{SID}/events", json={"cwd": CWD, "events": events})
    assert response.status_code == 400, response.text
    assert error_of(response)["message"].startswith("events[2].turnId: goes backwards: 2 < currentTurnId 3")


def test_a_turn_going_backwards_is_400_while_what_waits_can_only_raise_the_turn(
        client: TestClient, r: redis.Redis, api_settings: Settings) -> None:
    """An agent's two batches sent faster than the watcher applied them: the second, holding an
    event of an earlier turn, was a 202 (the first still waited), then half applied: its event
    of turn 2 dead-lettered, the rest logged. Without a rollback waiting (in the stream, or in the
    log's lines past the state) the turn only rises: it goes backwards whatever is applied first."""
    write_session(r, api_settings, 3)  # currentTurnId 4
    path = f"/api/sessions/{SID}/events"
    first = [*turn(4), {"type": "user", "turnId": 5, "content": "next"}]
    assert client.post(path, json={"cwd": CWD, "events": first}).status_code == 202  # (waits in the stream)
    second = [{"type": "assistant", "turnId": 2, "content": "late"}, {"type": "user", "turnId": 6, "content": "on"}]
    response = client.post(path, json={"cwd": CWD, "events": second})
    assert response.status_code == 400, response.text
    assert error_of(response)["message"] == "events[0].turnId: goes backwards: 2 < currentTurnId 4"
    assert r.xlen(Keys().stream_for(SID)) == len(first)
    # ... past the batch's own rollback too ([rollback 3, user 2]: 2 < 3 whatever waits applies first)
    rolled = [{"type": "rollback", "throughTurnId": 3, "reason": "undo"}, {"type": "user", "turnId": 2, "content": "x"}]
    response = client.post(path, json={"cwd": CWD, "events": rolled})
    assert response.status_code == 400, response.text
    assert error_of(response)["message"].startswith("events[1].turnId: goes backwards: 2 < currentTurnId")
    r.delete(Keys().stream_for(SID))
    with SessionStore(r, api_settings).log(SID, CWD).path.open("ab") as log:  # a line the state has not seen
        log.write(b'{"type":"rollback","throughTurnId":1,"reason":"undo","uuid":"late-rollback"}\n')
    assert client.post(path, json={"cwd": CWD, "events": second}).status_code == 202  # (it may lower the turn)


def test_a_new_sessions_batch_with_another_cwd_than_its_first_waiting_one_is_400(
        client: TestClient, r: redis.Redis) -> None:
    """A new session's first batch still in the stream (no state, no log yet): a second batch sent
    with another cwd was a 202, then the watcher's dead letter (bound to the first's cwd)."""
    path = "/api/sessions/fresh/events"
    assert client.post(path, json={"cwd": "/qa", "events": turn(1)}).status_code == 202
    response = client.post(path, json={"cwd": "/qb", "events": turn(2)})
    assert response.status_code == 400, response.text
    assert error_of(response)["message"] == "cwd: session fresh is bound to cwd '/qa', not '/qb'"
    assert client.post(path, json={"cwd": "/qa", "events": turn(2)}).status_code == 202
    # a first batch the watcher dead-lettered whole (applied: none waits) binds nothing
    r.delete(Keys().stream_for("fresh"))  # (as if read and acked, dead-lettered)
    assert client.post(path, json={"cwd": "/qb", "events": turn(1)}).status_code == 202
    # ... and when the shard's backlog is too long to look through, the watcher decides: a 400 for the
    # right cwd of a session none of whose entries waits depended on other sessions' traffic
    lagging = "/api/sessions/lagging/events"
    assert client.post(lagging, json={"cwd": "/qa", "events": turn(1)}).status_code == 202
    stream = Keys().stream_for("lagging")
    r.delete(stream)  # (dead-lettered whole)
    for i in range(UNAPPLIED_SCAN):
        r.xadd(stream, {"session": f"other-{i}", "cwd": "/x", "event": "{}"})
    assert client.post(lagging, json={"cwd": "/qb", "events": turn(1)}).status_code == 202
    # an entry the watcher will dead-letter binds nothing: a producer's raw XADD of junk
    r.xadd(Keys().stream_for("junk"), {"session": "junk", "cwd": "/typo", "event": "{not json"})
    assert client.post("/api/sessions/junk/events", json={"cwd": "/qb", "events": turn(1)}).status_code == 202


def test_on_a_settled_session_the_api_refuses_a_batch_iff_the_watcher_would_refuse_part_of_it(
        client: TestClient, r: redis.Redis, api_settings: Settings) -> None:
    """On a session whose state is its log's, the API's 400 and the watcher's dead letters agree,
    rollbacks, compacts and summaries in the batch included: a 400 naming an event the watcher
    would refuse, or a 202 when it would refuse none."""
    store = SessionStore(r, api_settings)
    sessions = iter(range(10**6))

    @hsettings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(batches())
    def check(batch: list[dict[str, Any]]) -> None:
        n = next(sessions)
        batch = [dict(event, uuid=f"u{index}") for index, event in enumerate(batch)]  # (a uuid twice: its own test)
        posted, applied = f"api-{n}", f"store-{n}"
        write_session(r, api_settings, 3, posted)
        write_session(r, api_settings, 3, applied)
        response = client.post(f"/api/sessions/{posted}/events", json={"cwd": CWD, "events": batch})
        r.delete(*Keys().all_streams())  # nothing of the session waits in its shard for the next example
        stamped = [dict(event, timestamp="2025-01-01T00:00:00Z") for event in batch]
        rejected = {id(event) for event, _ in store.apply(applied, CWD, stamped).rejected}
        refused = [index for index, event in enumerate(stamped) if id(event) in rejected]
        if not refused:
            assert response.status_code == 202, (batch, response.text)
        else:  # (the batch's own faults are looked for first: the API may name a later one)
            assert response.status_code == 400, (batch, refused)
            named = int(error_of(response)["message"].partition("]")[0].removeprefix("events["))
            assert named in refused, (batch, refused, response.text)

    check()


@pytest.mark.parametrize(("path", "query", "takes"), [
    (f"/api/sessions/{SID}/compact", "timeout=1", "it takes wait"),
    (f"/api/sessions/{SID}/events", "wait=false", "it takes none"),
])
def test_a_post_with_a_query_parameter_it_does_not_take_is_400(
        client: TestClient, r: redis.Redis, api_settings: Settings, path: str, query: str, takes: str) -> None:
    """``?timeout=1`` on a forced compaction was dropped silently: the call waited jobWaitSeconds."""
    write_session(r, api_settings, 2)
    body = {"cwd": CWD} if path.endswith("compact") else {"cwd": CWD, "events": turn(3)}
    response = client.post(f"{path}?{query}", json=body)
    assert response.status_code == 400, response.text
    name = query.partition("=")[0]
    assert error_of(response)["message"] == f"{name}: unknown query parameter ({takes})"
    assert r.xlen(Keys().stream_for(SID)) == 0 and compaction_queue(r, api_settings).count == 0
    assert client.get(f"/api/sessions/{SID}?cwd={CWD}&_=12345").status_code == 200  # (a GET's cache-buster)


def test_a_uuid_twice_in_one_batch_is_400_naming_both_and_publishes_nothing(
        client: TestClient, r: redis.Redis) -> None:
    events = [{"type": "user", "turnId": 1, "content": "a", "uuid": "u-1"},
              {"type": "user", "turnId": 1, "content": "b", "uuid": "u-1"}]
    response = client.post(f"/api/sessions/{SID}/events", json={"cwd": CWD, "events": events})
    assert response.status_code == 400
    assert error_of(response)["message"].startswith("events[1].uuid: ")
    assert "duplicates events[0]" in error_of(response)["message"]
    assert r.xlen(Keys().stream_for(SID)) == 0


def test_a_turn_going_backwards_within_one_batch_is_400_and_publishes_nothing(
        client: TestClient, r: redis.Redis) -> None:
    events = [*turn(1), *turn(2), {"type": "user", "turnId": 1, "content": "late"}]
    response = client.post(f"/api/sessions/{SID}/events", json={"cwd": CWD, "events": events})
    assert response.status_code == 400
    message = error_of(response)["message"]
    assert message.startswith("events[8].turnId: goes backwards") and "3" in message
    assert r.xlen(Keys().stream_for(SID)) == 0


def test_a_batch_the_watcher_would_apply_whole_is_accepted(client: TestClient, r: redis.Redis) -> None:
    """No false alarm: turns may repeat and skip ahead, and a rollback lets a turn run again."""
    events = [*turn(1), {"type": "user", "turnId": 2, "content": "again"}, *turn(2),
              {"type": "rollback", "throughTurnId": 2, "reason": "undo"}, *turn(2),
              {"type": "compact", "startTurnId": 1, "endTurnId": 1}, *turn(5)]
    response = client.post(f"/api/sessions/{SID}/events", json={"cwd": CWD, "events": events})
    assert response.status_code == 202, response.text
    assert r.xlen(Keys().stream_for(SID)) == len(events)


@st.composite
def batches(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Turn-scoped events, rollbacks, compacts and summaries in any order; uuids from a small pool."""
    batch = []
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["user", "assistant", "tool_result", "turn_end", "rollback", "compact", "summary"]))
        turn = draw(st.integers(1, 5))
        event: dict[str, Any] = {"type": kind, "uuid": draw(st.sampled_from(["a", "b", "c", "d", "e", "f", "g"]))}
        if kind == "rollback":
            event.update(throughTurnId=turn, reason="undo")
        elif kind == "compact":
            event.update(startTurnId=1, endTurnId=turn)
        elif kind == "summary":
            event.update(replaces=[], summaryText="s", lastSummarizedTurnId=turn)
        elif kind == "tool_result":
            event.update(turnId=turn, toolCallId="c", toolName="t", output="o")
        elif kind == "turn_end":
            event.update(turnId=turn, model="gpt-4")
        else:
            event.update(turnId=turn, content="x")
        batch.append(event)
    return batch


def test_the_batch_check_refuses_what_the_store_would_first_refuse(r: redis.Redis, api_settings: Settings) -> None:
    """``check_batch`` (what the API refuses with a 400) and ``compactor.store`` (what the watcher
    dead-letters) agree on a new session: the same first bad event, or none."""
    store = SessionStore(r, api_settings)
    sessions = iter(range(10**6))

    @hsettings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(batches())
    def check(batch: list[dict[str, Any]]) -> None:
        try:
            check_batch(batch, new_session=True)
            refused = None
        except InvalidEvent as e:
            refused = e.index
        sid, first = f"agree-{next(sessions)}", None
        for index, event in enumerate(batch):  # one by one, as a watcher batch of one entry each
            if store.apply(sid, CWD, [dict(event, timestamp="2025-01-01T00:00:00Z")]).rejected:
                first = index
                break
        assert refused == first, batch

    check()


def test_a_summary_past_the_sessions_turns_is_400(client: TestClient, r: redis.Redis,
                                                   api_settings: Settings) -> None:
    write_session(r, api_settings, 3)
    far = {"type": "summary", "replaces": [], "summaryText": "x", "lastSummarizedTurnId": 1_000_000}
    response = client.post(f"/api/sessions/{SID}/events", json={"cwd": CWD, "events": [far]})
    assert response.status_code == 400, response.text
    assert error_of(response)["message"] == (
        "events[0].lastSummarizedTurnId: is past the session's turns: 1000000 > 3, the last turn that is over "
        "(currentTurnId 4: a summary covers turns that are over, not one still running)")
    running = [{"type": "user", "turnId": 4, "content": "more"}, {**far, "lastSummarizedTurnId": 4}]
    response = client.post(f"/api/sessions/{SID}/events", json={"cwd": CWD, "events": running})
    assert response.status_code == 400, response.text  # (turn 4 still running: its later events never summarized)
    assert error_of(response)["message"].startswith("events[1].lastSummarizedTurnId: is past the session's turns: "
                                                    "4 > 3, the last turn that is over (currentTurnId 4")
    batch = [running[0], {"type": "turn_end", "turnId": 4, "model": "gpt-4"}, running[1]]
    assert client.post(f"/api/sessions/{SID}/events", json={"cwd": CWD, "events": batch}).status_code == 202


def test_a_summary_as_a_new_sessions_first_event_is_400_unless_its_entries_wait(
        client: TestClient, r: redis.Redis, api_settings: Settings) -> None:
    """It was a 202, then the watcher's dead letter: nothing came before it, certainly, when the
    session has no log and none of its entries waits in its shard."""
    far = {"type": "summary", "replaces": [], "summaryText": "x", "lastSummarizedTurnId": 1}
    response = client.post(f"/api/sessions/{SID}/events", json={"cwd": CWD, "events": [far]})
    assert response.status_code == 400, response.text
    assert error_of(response)["message"] == (
        "events[0].lastSummarizedTurnId: is past the session's turns: 1 > 0, the last turn that is over "
        "(currentTurnId 1: a summary covers turns that are over, not one still running)")
    assert r.xlen(Keys().stream_for(SID)) == 0
    first = client.post(f"/api/sessions/{SID}/events", json={"cwd": CWD, "events": turn(1)})
    assert first.status_code == 202  # published, not yet applied (no watcher runs here): not certain
    assert client.post(f"/api/sessions/{SID}/events", json={"cwd": CWD, "events": [far]}).status_code == 202


def test_an_event_the_session_has_already_is_not_published_again_and_another_cwd_is_400(
        client: TestClient, r: redis.Redis, api_settings: Settings) -> None:
    """A retry (events whose uuids the session has) was a 400 'duplicates an event already in this
    session': an agent that takes a 4xx for its own mistake dropped or alarmed on a write that had
    succeeded. Now only the new events are published; the others' indexes are in duplicates."""
    write_session(r, api_settings, 1)  # uuids sess-1-0 .. sess-1-4, bound to CWD
    path = f"/api/sessions/{SID}/events"
    again = [{"type": "user", "turnId": 1, "content": "please do step 1", "uuid": f"{SID}-1"},
             {"type": "user", "turnId": 2, "content": "a", "uuid": "new-1"}]
    # the new events are checked as before, and a bad one is named at its index in the batch sent
    backwards = [again[0], {"type": "user", "turnId": 1, "content": "b"}]
    refused = client.post(path, json={"cwd": CWD, "events": backwards})
    assert refused.status_code == 400 and error_of(refused)["message"].startswith("events[1].turnId: goes backwards")
    response = client.post(path, json={"cwd": CWD, "events": again})
    assert response.status_code == 202, response.text
    body = response.json()
    assert (body["accepted"], body["duplicates"], len(body["streamIds"])) == (1, [0], 1)
    [(_, fields)] = r.xrange(Keys().stream_for(SID))
    assert json.loads(fields[b"event"])["uuid"] == "new-1"
    replay = client.post(path, json={"cwd": CWD, "events": again[:1]}).json()
    assert replay == {"accepted": 0, "streamIds": [], "duplicates": [0]}
    elsewhere = client.post(path, json={"cwd": "/somewhere/else", "events": turn(2)})
    assert elsewhere.status_code == 400
    assert error_of(elsewhere)["message"].startswith("cwd: ") and CWD in error_of(elsewhere)["message"]
    assert r.xlen(Keys().stream_for(SID)) == 1


def test_after_redis_lost_a_session_a_retry_of_logged_events_is_a_duplicate(
        client: TestClient, r: redis.Redis, api_settings: Settings) -> None:
    """With the session's hash and uuid index gone (Redis restarted without its data, or the
    state's idle TTL ran out), a retry of events already in the log was a 202 "accepted", and the
    watcher then dead-lettered each as a duplicate uuid. The log is searched for the batch's uuids
    instead: the retry is in ``duplicates``, nothing is published, and the log is not locked."""
    write_session(r, api_settings, 2)  # uuids sess-1-0 .. sess-1-8
    path = f"/api/sessions/{SID}/events"
    again = [{"type": "user", "turnId": 2, "content": "please do step 2", "uuid": f"{SID}-5"},
             {"type": "user", "turnId": 3, "content": "next", "uuid": "new-3"}]
    keys = Keys(api_settings.redis.prefix, api_settings.redis.shards)
    r.delete(keys.session(SID), keys.uuids(SID))
    log = SessionLog(api_settings.data_dir, CWD, SID)
    with log.lock():  # (a watcher rebuilding the session's state from a long log holds it)
        replay = client.post(path, json={"cwd": CWD, "events": again[:1]})
    assert replay.status_code == 202 and replay.json() == {"accepted": 0, "streamIds": [], "duplicates": [0]}
    assert not r.exists(Keys().stream_for(SID))
    body = client.post(path, json={"cwd": CWD, "events": again}).json()
    assert (body["accepted"], body["duplicates"]) == (1, [0])
    [(_, fields)] = r.xrange(Keys().stream_for(SID))
    assert json.loads(fields[b"event"])["uuid"] == "new-3"


def test_events_sent_again_after_the_log_was_restored_from_an_older_copy_are_not_duplicates(
        client: TestClient, r: redis.Redis, api_settings: Settings) -> None:
    """The stored uuid index still held the uuids of the lines the restore took away: the events
    sent again were answered duplicates (202, accepted 0) and never applied, where the Python
    publisher's were (the watcher rebuilds the state of a log that shrank)."""
    from producer.watcher import Watcher
    from tests.producer.conftest import drain

    path = f"/api/sessions/{SID}/events"
    first = [{"type": "session_meta", "model": "gpt-4"}, *turn(1)]
    second = [{**event, "uuid": f"t2-{index}"} for index, event in enumerate(turn(2))]
    watcher = Watcher(r, api_settings, name="w")
    assert client.post(path, json={"cwd": CWD, "events": first}).status_code == 202
    drain(watcher, r, api_settings)
    log = SessionLog(api_settings.data_dir, CWD, SID)
    backup = log.path.read_bytes()
    assert client.post(path, json={"cwd": CWD, "events": second}).json()["accepted"] == 4
    drain(watcher, r, api_settings)
    log.path.write_bytes(backup)  # restored from the copy taken before turn 2
    r.delete(Keys(api_settings.redis.prefix, api_settings.redis.shards).sent(SID))  # (past its 10 minutes)
    again = client.post(path, json={"cwd": CWD, "events": second}).json()
    assert (again["accepted"], again["duplicates"]) == (4, [])
    drain(watcher, r, api_settings)
    assert [e["uuid"] for e in log.read()][-4:] == [f"t2-{index}" for index in range(4)]
    replay = client.post(path, json={"cwd": CWD, "events": second}).json()  # applied now: duplicates again
    assert (replay["accepted"], replay["duplicates"]) == (0, [0, 1, 2, 3])


def test_a_batch_sent_again_under_its_idempotency_key_is_applied_once(
        client: TestClient, r: redis.Redis, api_settings: Settings) -> None:
    """Without uuids of its own an agent's retry (after a lost reply, or a 503 whose batch had been
    written) was applied twice: each send got new random uuids."""
    from producer.watcher import Watcher
    from tests.producer.conftest import drain

    path = f"/api/sessions/{SID}/events"
    batch = {"cwd": CWD, "events": [{"type": "session_meta", "model": "gpt-4"}, *turn(1)]}
    key = {"Idempotency-Key": "agent-7/req-1"}
    assert client.post(path, json=batch, headers=key).json()["accepted"] == 5
    in_flight = client.post(path, json=batch, headers=key).json()  # not applied yet: not published again
    assert (in_flight["accepted"], in_flight["duplicates"]) == (0, [0, 1, 2, 3, 4])  # (was published, then
    # dead-lettered: the log right, but a dead letter per retried event, which the dead-letter alert saw)
    watcher = Watcher(r, api_settings, name="w")
    drain(watcher, r, api_settings)
    after = client.post(path, json=batch, headers=key).json()  # applied: nothing published
    assert (after["accepted"], after["duplicates"]) == (0, [0, 1, 2, 3, 4])
    other = client.post(path, json={"cwd": CWD, "events": turn(2)}, headers={"Idempotency-Key": "agent-7/req-2"})
    assert other.json()["accepted"] == 4  # another key: other uuids
    drain(watcher, r, api_settings)
    watcher.close()
    assert r.xlen(Keys().dead) == 0
    lines = SessionLog(api_settings.data_dir, CWD, SID).read()
    assert [(line["type"], line.get("turnId")) for line in lines] == [
        ("session_meta", None), *[(e["type"], 1) for e in turn(1)], *[(e["type"], 2) for e in turn(2)]]
    published = r.xlen(Keys().stream(Keys().shard_of(SID)))
    for bad in (b"", b"has space", b"x" * 256, b"caf\xe9"):
        response = client.post(path, json=batch, headers={"Idempotency-Key": bad})
        assert response.status_code == 400, bad
        assert error_of(response)["message"].startswith("Idempotency-Key: must be 1 to 255 printable ASCII")
    # given twice (FastAPI reads the first): the same batch resent with the other key was published again
    twice = client.post(path, json={"cwd": CWD, "events": turn(3)},
                        headers=[("Idempotency-Key", "agent-7/req-3"), ("Idempotency-Key", "agent-7/req-4")])
    assert twice.status_code == 400
    assert error_of(twice)["message"] == "Idempotency-Key: given 2 times; give it once"
    assert r.xlen(Keys().stream(Keys().shard_of(SID))) == published


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_body_not_sent_as_json_is_400_saying_the_content_type(client: TestClient,
                                                                content_type: str | None) -> None:
    response = post_raw(client, f"/api/sessions/{SID}/events", '{"cwd": "/uni", "events": []}', content_type)
    assert response.status_code == 400
    assert "application/json" in error_of(response)["message"]


def test_json_with_a_charset_or_a_json_suffix_type_is_read(client: TestClient) -> None:
    for content_type in ("application/json; charset=utf-8", "application/vnd.api+json"):
        response = post_raw(client, f"/api/sessions/{SID}/events", '{"cwd": "/uni", "events": []}', content_type)
        assert response.status_code == 202, (content_type, response.text)


def test_a_body_that_is_not_utf8_is_400_saying_so(client: TestClient) -> None:
    response = post_raw(client, f"/api/sessions/{SID}/events", b'{"cwd": "/uni\xff", "events": []}')
    assert response.status_code == 400
    message = error_of(response)["message"]
    assert message.startswith("body: ") and "UTF-8" in message and "0xff at offset 13" in message


def test_an_empty_cwd_is_400_saying_it_must_be_an_absolute_path(client: TestClient) -> None:
    response = client.post(f"/api/sessions/{SID}/events", json={"cwd": "", "events": []})
    assert response.status_code == 400
    assert error_of(response)["message"] == "cwd: must not be empty: it must be an absolute path"


def test_nested_fields_are_named_with_bracket_indexes(client: TestClient) -> None:
    events = [{"type": "assistant", "turnId": 1, "toolCalls": [{"id": "c"}]}]
    response = client.post(f"/api/sessions/{SID}/events", json={"cwd": CWD, "events": events})
    assert response.status_code == 400
    assert error_of(response)["message"].startswith("events[0].toolCalls[0].name: ")


def test_tool_call_arguments_of_another_type_say_what_they_may_be(client: TestClient) -> None:
    events = [{"type": "assistant", "turnId": 1, "toolCalls": [{"id": "c", "name": "n", "arguments": [1, 2]}]}]
    response = client.post(f"/api/sessions/{SID}/events", json={"cwd": CWD, "events": events})
    assert response.status_code == 400
    assert error_of(response)["message"] == (
        "events[0].toolCalls[0].arguments: must be an object or a string (its JSON text, kept as sent)")


def test_a_non_ascii_token_matches_as_bearer_and_as_basic(api_settings: Settings, r: redis.Redis) -> None:
    import base64

    app = create_app(with_api(api_settings, token="pässwörd"), redis=r)
    basic = base64.b64encode("any:pässwörd".encode()).decode()
    with TestClient(app) as test_client:
        for header in ("Bearer pässwörd".encode(), f"Basic {basic}".encode()):
            response = test_client.get("/api/jobs/abc", headers={"Authorization": header})
            assert response.status_code == 404, header  # past auth: the job does not exist
        wrong = test_client.get("/api/jobs/abc", headers={"Authorization": "Bearer passwörd".encode()})
        assert wrong.status_code == 401


def test_head_answers_like_get_on_every_get_route(client: TestClient) -> None:
    """Only /healthz took HEAD: a session, a job, /metrics and the status page answered 405 (RFC
    9110: a general-purpose server supports GET and HEAD)."""
    client.post(f"/api/sessions/{SID}/events", json={"cwd": CWD, "events": turn(1)})
    for path in ("/healthz", f"/api/sessions/{SID}/context?cwd={CWD}", "/api/jobs/none", "/metrics", "/"):
        got, head = client.get(path), client.head(path)
        assert (head.status_code, head.content) == (got.status_code, b""), path
        assert head.headers["content-type"] == got.headers["content-type"], path
        assert int(head.headers["content-length"]) == len(got.content) or path == "/metrics", path
    assert client.head(f"/api/sessions/{SID}/events").status_code == 405  # a POST route: no GET to answer as
    for path in ("/healthz", "/api/jobs/none"):  # a 405's Allow names HEAD beside GET (it said GET alone)
        refused = client.request("OPTIONS", path)
        assert (refused.status_code, refused.headers["allow"]) == (405, "GET, HEAD"), path
    assert client.delete(f"/api/sessions/{SID}/events").headers["allow"] == "POST"


def test_openapi_declares_the_errors_the_routes_return_and_no_422(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    paths = schema["paths"]
    for path, operations in paths.items():
        for method, operation in operations.items():
            assert "422" not in operation["responses"], (method, path)
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    error_ref = {"$ref": "#/components/schemas/ErrorBody"}
    events = paths["/api/sessions/{session_id}/events"]["post"]["responses"]
    assert {"202", "400", "401", "413", "503"} <= set(events)
    assert events["400"]["content"]["application/json"]["schema"] == error_ref
    assert "404" not in events
    context = paths["/api/sessions/{session_id}/context"]["get"]["responses"]
    assert {"200", "400", "401", "404", "503"} <= set(context)  # 503 with ?after= only: works with Redis down
    assert {"200", "401"} <= set(paths["/metrics"]["get"]["responses"])
    assert set(paths["/healthz"]["get"]["responses"]) == {"200", "503"}


def test_a_state_derived_under_other_settings_is_reported_as_the_new_ones_derive_it(
        api_settings: Settings, r: redis.Redis) -> None:
    """The operator made ``run_tests`` compactable and restarted: ``GET /api/sessions/{id}`` and the
    status list kept the old estimate (the outputs of the compacted turns not elided) until the
    session's next event, an idle session for good, while ``/context`` showed the new one."""
    write_session(r, api_settings, 3)
    SessionStore(r, api_settings).apply(SID, CWD, [{"type": "compact", "uuid": "c", "startTurnId": 1, "endTurnId": 2,
                                                    "timestamp": "2025-01-01T00:00:00.000Z"}])
    old = SessionStore(r, api_settings).load(SID).prompt_estimate  # type: ignore[union-attr]
    r.zadd(Keys().sessions, {SID: time.time()})
    changed = with_context(api_settings, compactable_tools=(*api_settings.context.compactable_tools, "run_tests"))
    with TestClient(create_app(changed, redis=r)) as client:
        context = client.get(f"/api/sessions/{SID}/context", params={"cwd": CWD}).json()["promptEstimate"]
        rows = client.get("/api/sessions").json()
        one = client.get(f"/api/sessions/{SID}", params={"cwd": CWD}).json()["promptEstimate"]
    assert context < old
    assert [row["promptEstimate"] for row in rows if row["sessionId"] == SID] == [context] and one == context
    assert SessionStore(r, changed).load(SID).prompt_estimate == context  # type: ignore[union-attr]  # stored


def test_a_session_whose_log_this_api_may_not_write_is_reported_from_its_log(
        api_settings: Settings, r: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """With Redis holding no state of the session, its route rebuilt it under the log's lock, which
    opens the log to write: a read-only log (chattr +i, a mount) was a 500 log_write_failed."""
    write_session(r, api_settings, 3)
    estimate = SessionStore(r, api_settings).load(SID).prompt_estimate  # type: ignore[union-attr]
    r.delete(Keys().session(SID))

    def read_only(self: SessionLog) -> None:
        raise LogWriteFailed(f"{self.path}: cannot open: [Errno 1] Operation not permitted")

    monkeypatch.setattr(SessionLog, "_acquire", read_only)
    with TestClient(create_app(api_settings, redis=r)) as client:
        one = client.get(f"/api/sessions/{SID}", params={"cwd": CWD})
        other = client.get(f"/api/sessions/{SID}", params={"cwd": "/elsewhere"})
    assert one.status_code == 200 and one.json()["promptEstimate"] == estimate, one.text
    assert other.status_code == 404


@pytest.mark.parametrize("encoding", ["gzip", "br", "deflate"])
def test_a_compressed_body_is_400_saying_the_encoding_is_not_supported(client: TestClient, encoding: str) -> None:
    """A gzip body was read as JSON text: 'body: is not valid UTF-8: byte 0x8b', which says nothing
    of the cause."""
    import gzip

    body = gzip.compress(b'{"cwd": "/uni", "events": []}')
    response = client.post(f"/api/sessions/{SID}/events", content=body,
                           headers={"Content-Type": "application/json", "Content-Encoding": encoding})
    assert response.status_code == 400
    assert error_of(response)["message"] == (
        f"body: Content-Encoding '{encoding}' is not supported: send the JSON uncompressed")
    plain = client.post(f"/api/sessions/{SID}/events", json={"cwd": "/uni", "events": []},
                        headers={"Content-Encoding": "identity"})
    assert plain.status_code == 202


def test_dead_letters_route_pages_filters_and_bounds_its_scan(client: TestClient, r: redis.Redis,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A 202 said published, not applied: an agent had no way over HTTP to learn that the watcher
    refused an event, or why (the letters were readable only with XRANGE {p}:dead)."""
    from compactor import dead_letters

    monkeypatch.setattr(dead_letters, "READ_CHUNK", 3)  # pages of 3 letters: the paging is exercised
    dead = Keys().dead
    for i in range(10):
        sid = "mine" if i in (1, 7) else f"other-{i}"
        r.xadd(dead, {"session": sid, "cwd": CWD, "event": "x" * (3_000 if i == 7 else 10), "reason": f"r{i}",
                      "id": f"1-{i}", "stream": "compaction:events:0", "custom": "kept"})
    body = client.get("/api/dead-letters", params={"limit": 4}).json()
    assert [d["reason"] for d in body["letters"]] == ["r9", "r8", "r7", "r6"]
    assert (body["total"], body["complete"]) == (10, True)
    mine = client.get("/api/dead-letters", params={"session": "mine"}).json()
    assert [(d["reason"], d["entryId"], d["eventChars"], len(d["event"])) for d in mine["letters"]] == [
        ("r7", "1-7", 3_000, 2_000), ("r1", "1-1", 10, 10)]
    assert mine["letters"][0]["extra"] == {"custom": "kept"} and mine["scanned"] == 10
    monkeypatch.setattr(dead_letters, "MAX_SCANNED", 5)
    bounded = client.get("/api/dead-letters", params={"session": "mine"}).json()
    assert [d["reason"] for d in bounded["letters"]] == ["r7"]
    assert (bounded["scanned"], bounded["complete"]) == (5, False)
    monkeypatch.setattr(dead_letters, "MAX_SCANNED", 10_000)
    monkeypatch.setattr(dead_letters, "MAX_SCANNED_BYTES", 3_000)  # letters keep events up to maxEventBytes
    by_bytes = client.get("/api/dead-letters", params={"session": "mine"}).json()
    assert [d["reason"] for d in by_bytes["letters"]] == ["r7"]  # its 3 000-byte event ends the scan
    assert (by_bytes["scanned"], by_bytes["complete"]) == (3, False)
    assert client.get("/api/dead-letters", params={"limit": 0}).status_code == 400


def test_context_after_a_stream_id_waits_for_the_watcher_to_apply_it(
        client: TestClient, r: redis.Redis, api_settings: Settings) -> None:
    """Read right after a 202, the context missed the events just posted (the watcher applies them
    within milliseconds, but after the 202): the agent's next prompt lacked its own last turn."""
    from producer.watcher import Watcher
    from producer.watcher.core import warm_up

    warm_up()  # (litellm's import, ~6 s on a slow VM when this test runs alone: past the wait's 5 s)
    path = f"/api/sessions/{SID}"
    ids = client.post(f"{path}/events", json={"cwd": CWD, "events": turn(1)}).json()["streamIds"]
    watcher = Watcher(r, api_settings, name="w")
    stop = threading.Event()
    thread = threading.Thread(target=lambda: (time.sleep(0.3), watcher.run(stop)))
    thread.start()
    try:
        started = time.monotonic()
        body = client.get(f"{path}/context", params={"cwd": CWD, "after": ids[-1]}).json()
        assert body["applied"] is True and 0.3 <= time.monotonic() - started < 5
        assert [m["role"] for m in body["messages"]] == ["user", "assistant", "tool"]
        # an event the watcher refuses is settled too: the wait ends, the view is without it
        late = client.post(f"{path}/events", json={"cwd": CWD, "events": [
            {"type": "user", "turnId": 2, "content": "next"},
            {"type": "turn_end", "turnId": 2, "model": "gpt-4"}]}).json()["streamIds"]
        r.xadd(Keys().stream_for(SID), {"session": SID, "cwd": CWD, "event": b'{"type": "user", "turnId": 0}'})
        refused = r.xrevrange(Keys().stream_for(SID), count=1)[0][0].decode()
        body = client.get(f"{path}/context", params={"cwd": CWD, "after": refused}).json()
        assert body["applied"] is True and body["messages"][-1]["content"] == "next"
        assert late[-1] < refused
    finally:
        stop.set()
        thread.join(10)
    pending = client.post(f"{path}/events", json={"cwd": CWD, "events": turn(3)}).json()["streamIds"]
    body = client.get(f"{path}/context", params={"cwd": CWD, "after": pending[-1], "timeout": 0.2}).json()
    assert body["applied"] is False and body["messages"][-1]["content"] == "next"  # no watcher: not yet
    assert "applied" not in client.get(f"{path}/context", params={"cwd": CWD}).json()  # SPEC §7's fields
    # (past 64 bits: waited its whole timeout, then false; digits of other scripts, which ``\d`` and
    # ``int`` take, were sent to Redis as written: a 500)
    for wrong in ("12", f"{2**64}-0", f"1-{2**64}", "\u0661-\u0660", "\U0001d7cf-0"):
        bad = client.get(f"{path}/context", params={"cwd": CWD, "after": wrong})
        assert bad.status_code == 400
        assert error_of(bad)["message"].startswith(f"after: '{wrong}' is not a stream entry id")
    # past the newest entry ever added to the stream: none of that id can come (Redis lost it, or it
    # was never published), and nothing of it waits: it was waited for, the whole timeout (a forced
    # compaction's: 300 s); a real id after Redis lost the stream is one (its event maybe in the log)
    started = time.monotonic()
    top = client.get(f"{path}/context", params={"cwd": CWD, "after": f"{2**64 - 1}-0", "timeout": 5})
    assert top.status_code == 200 and top.json()["applied"] is True and time.monotonic() - started < 2
    r.delete(Keys().stream_for(SID))
    r.xgroup_create(Keys().stream_for(SID), Keys().group, id="0", mkstream=True)  # (as a new watcher does)
    started = time.monotonic()
    lost = client.get(f"{path}/context", params={"cwd": CWD, "after": pending[-1], "timeout": 5}).json()
    assert lost["applied"] is True and time.monotonic() - started < 2
    assert lost["messages"][-1]["content"] == "next"


def test_context_after_the_first_events_of_a_new_session_is_an_empty_view_until_applied(
        client: TestClient, r: redis.Redis, api_settings: Settings) -> None:
    """Read with ``after`` before the watcher applied a new session's first events, the context
    was a 404 "no session": an agent could not tell "not applied yet" (``applied: false``) from an
    unknown session. Once its only entry is dead-lettered the session is unknown: 404."""
    from producer.watcher import Watcher
    from tests.producer.conftest import drain

    path = "/api/sessions/fresh"
    ids = client.post(f"{path}/events", json={"cwd": CWD, "events": turn(1)}).json()["streamIds"]
    waited = client.get(f"{path}/context", params={"cwd": CWD, "after": ids[-1], "timeout": 0.2})
    assert waited.status_code == 200, waited.text
    assert waited.json() == {"messages": [], "promptEstimate": 0, "currentTurnId": 1, "applied": False}
    assert client.get(f"{path}/context", params={"cwd": CWD}).status_code == 404  # no wait: the log alone
    for sid in ("never", "fresh"):  # no entry of its own waits: unknown, whatever the wait said
        cwd = CWD if sid == "never" else "/somewhere/else"
        unknown = client.get(f"/api/sessions/{sid}/context", params={"cwd": cwd, "after": ids[-1], "timeout": 0})
        assert unknown.status_code == 404, unknown.text
    r.xadd(Keys().stream_for("ghost"), {"session": "ghost", "cwd": CWD, "event": b'{"type": "user", "turnId": 0}'})
    refused = r.xrevrange(Keys().stream_for("ghost"), count=1)[0][0].decode()
    watcher = Watcher(r, api_settings, name="w")
    drain(watcher, r, api_settings)
    watcher.close()
    gone = client.get("/api/sessions/ghost/context", params={"cwd": CWD, "after": refused, "timeout": 1})
    assert gone.status_code == 404 and error_of(gone)["code"] == "not_found"
    applied = client.get(f"{path}/context", params={"cwd": CWD, "after": ids[-1], "timeout": 1}).json()
    assert applied["applied"] is True and len(applied["messages"]) == 3


def test_a_session_asked_for_under_another_cwd_is_400_naming_its_own(client: TestClient, r: redis.Redis,
                                                                     api_settings: Settings) -> None:
    """POST .../events said 'bound to cwd ...', while GET and compact said 404 'no session' for the
    same mistake (the log is looked for under the cwd given)."""
    write_session(r, api_settings, 1)
    for response in (client.get(f"/api/sessions/{SID}", params={"cwd": "/elsewhere"}),
                     client.post(f"/api/sessions/{SID}/compact", json={"cwd": "/elsewhere"})):
        assert response.status_code == 400, response.text
        assert error_of(response)["message"] == f"cwd: session {SID} is bound to cwd {CWD!r}, not '/elsewhere'"
    assert client.get("/api/sessions/nobody", params={"cwd": "/elsewhere"}).status_code == 404
    assert client.post("/api/sessions/nobody/compact", json={"cwd": "/elsewhere"}).status_code == 404


def test_openapi_describes_each_event_type_of_post_events(client: TestClient) -> None:
    """The events were 'object' with any properties: a client generated from the schema knew none
    of SPEC §3's types or their required fields."""
    schema = client.get("/openapi.json").json()
    items = schema["components"]["schemas"]["EventsRequest"]["properties"]["events"]["items"]
    mapping = items["discriminator"]["mapping"]
    assert items["discriminator"]["propertyName"] == "type"
    assert set(mapping) == {"session_meta", "user", "assistant", "tool_result", "turn_end", "rollback", "compact",
                            "summary"}
    components = schema["components"]["schemas"]
    for ref in mapping.values():
        assert ref.removeprefix("#/components/schemas/") in components, ref
    turn_end = components[mapping["turn_end"].removeprefix("#/components/schemas/")]
    assert {"type", "turnId", "model"} <= set(turn_end["required"])
    assert {"toolCallId", "toolName", "output"} <= set(components["ToolResultEvent"]["properties"])
    post = schema["paths"]["/api/sessions/{session_id}/events"]["post"]
    [key] = [param for param in post["parameters"] if param["name"] == "Idempotency-Key"]
    assert (key["in"], key["schema"]["maxLength"], key["schema"]["pattern"]) == ("header", 255, "^[!-~]+$")
    assert "Retry-After" in post["responses"]["503"]["headers"]  # as every 503 says


def test_a_body_invalid_after_a_repeated_key_says_where_it_is_invalid(client: TestClient) -> None:
    response = post_raw(client, f"/api/sessions/{SID}/events", '{"cwd": "/a", "cwd": "/b", "events": [}')
    assert response.status_code == 400
    assert error_of(response)["message"].startswith("body: is not valid JSON: Expecting value at line 1, column")


def test_waits_for_the_watcher_hold_no_thread_of_the_api(client: TestClient, r: redis.Redis,
                                                          api_settings: Settings) -> None:
    """Each wait slept in one of the API's 40 threads: 40 waits (a held-back session makes each run
    its whole timeout) left /healthz and every other route waiting with them."""
    from concurrent.futures import ThreadPoolExecutor

    write_session(r, api_settings, 1)
    [waited] = client.post(f"/api/sessions/{SID}/events", json={"cwd": CWD, "events": [
        {"type": "user", "turnId": 2, "content": "x"}]}).json()["streamIds"]  # no watcher: never applied
    params = {"cwd": CWD, "after": waited, "timeout": 3}
    with ThreadPoolExecutor(45) as pool:
        waits = [pool.submit(client.get, f"/api/sessions/{SID}/context", params=params) for _ in range(45)]
        time.sleep(0.5)
        started = time.monotonic()
        assert client.get("/healthz").status_code == 200
        assert client.get(f"/api/sessions/{SID}", params={"cwd": CWD}).status_code == 200
        assert time.monotonic() - started < 1.5
        assert all(w.result().json()["applied"] is False for w in waits)


def test_two_sends_of_one_batch_at_once_publish_it_once(client: TestClient, r: redis.Redis,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The look for uuids sent before came before the transaction: two identical requests that both
    looked before either published both published (the watcher then dead-lettered one copy)."""
    from producer import publisher as publisher_module

    monkeypatch.setattr(publisher_module, "SENT_KEPT", 3)
    path = f"/api/sessions/{SID}/events"
    batch = {"cwd": CWD, "events": [{"type": "user", "turnId": 1, "content": f"m{i}"} for i in range(5)]}
    first = client.post(path, json=batch, headers={"Idempotency-Key": "k1"}).json()
    second = client.post(path, json=batch, headers={"Idempotency-Key": "k1"}).json()
    assert (first["accepted"], second["accepted"], len(second["duplicates"])) == (5, 2, 3)  # 3 uuids kept
    assert r.xlen(Keys().stream_for(SID)) == 7 and r.zcard(Keys().sent(SID)) == 3


def test_a_batch_over_the_remembered_uuids_adds_only_its_newest_ones(client: TestClient, r: redis.Redis,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the batch's last SENT_KEPT uuids are added to the sent set: all of a batch's uuids were
    added, then trimmed to SENT_KEPT, those of equal score by their order as strings (94 000 held
    Redis, /healthz with it, 0.17 s, for uuids dropped at once); a retry of the batch now finds its
    last events sent, whatever their uuids."""
    from producer import publisher as publisher_module

    monkeypatch.setattr(publisher_module, "SENT_KEPT", 3)
    added: list[int] = []
    zadd = redis.client.Pipeline.zadd

    def counted(self: Any, name: Any, mapping: Any, *args: Any, **kwargs: Any) -> Any:
        added.append(len(mapping))
        return zadd(self, name, mapping, *args, **kwargs)

    monkeypatch.setattr(redis.client.Pipeline, "zadd", counted)
    path = f"/api/sessions/{SID}/events"
    batch = {"cwd": CWD, "events": [{"type": "user", "turnId": 1, "content": f"m{i}"} for i in range(8)]}
    for key in ("k1", "k2", "k3"):  # (three sets of derived uuids: their order as strings differs)
        first = client.post(path, json=batch, headers={"Idempotency-Key": key}).json()
        again = client.post(path, json=batch, headers={"Idempotency-Key": key}).json()
        assert (first["accepted"], again["accepted"], again["duplicates"]) == (8, 5, [5, 6, 7])
    assert added == [3, 3] * 3 and r.zcard(Keys().sent(SID)) == 3


def test_dead_letters_are_read_no_more_at_once_than_the_byte_bound_allows(r: redis.Redis,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """20 letters at a time, each keeping an event up to maxEventBytes (4 MiB): one reply of 80 MB
    was five times the 16 MiB the scan was bounded by."""
    from compactor import dead_letters

    for i in range(10):
        r.xadd(Keys().dead, {"session": "s", "event": "x" * 10, "reason": f"r{i}"})
    counts: list[int] = []
    xrevrange = r.xrevrange

    def counted(*args: Any, **kwargs: Any) -> Any:
        counts.append(kwargs["count"])
        return xrevrange(*args, **kwargs)

    monkeypatch.setattr(r, "xrevrange", counted)
    monkeypatch.setattr(dead_letters, "MAX_SCANNED_BYTES", 3_000)
    found = dead_letters.read_dead_letters(r, Keys(), session="nobody", letter_bytes=1_000)
    assert counts[0] == 3 and max(counts) <= 3 and found.scanned == 10 and found.complete


def test_an_event_with_a_null_uuid_gets_one_like_an_event_without(client: TestClient, r: redis.Redis) -> None:
    """A null uuid was kept as null: the API's look for the uuids it had sent failed on it (a 500)."""
    response = client.post(f"/api/sessions/{SID}/events", json={"cwd": CWD, "events": [
        {"type": "user", "turnId": 1, "content": "x", "uuid": None}]}, headers={"Idempotency-Key": "k"})
    assert response.status_code == 202, response.text
    [(_, fields)] = r.xrange(Keys().stream_for(SID))
    assert isinstance(json.loads(fields[b"event"])["uuid"], str)


def test_a_forced_compaction_of_an_unknown_session_holds_no_other_request_up_while_redis_is_slow(
        client: TestClient, r: redis.Redis, api_settings: Settings) -> None:
    """The 404's look at Redis ran on the event loop: while Redis was slow every other request
    waited behind it, the context (which needs no Redis) too."""
    write_session(r, api_settings, 1)
    answers: dict[str, Any] = {}

    def compact_unknown() -> None:
        answers["compact"] = client.post("/api/sessions/nosuch/compact", json={"cwd": CWD})

    r.execute_command("CLIENT", "PAUSE", 1500, "ALL")
    try:
        thread = threading.Thread(target=compact_unknown)
        thread.start()
        time.sleep(0.3)  # (the POST waits for Redis)
        started = time.monotonic()
        context = client.get(f"/api/sessions/{SID}/context", params={"cwd": CWD})
        took = time.monotonic() - started
        thread.join(10)
    finally:
        r.execute_command("CLIENT", "UNPAUSE")
    assert context.status_code == 200 and took < 0.8, took
    assert answers["compact"].status_code == 404


def test_a_forced_compaction_whose_job_redis_lost_is_a_500_job_lost_not_a_404(
        r: redis.Redis, api_settings: Settings) -> None:
    """Redis lost the job while the request waited for it (a restart without persistence, FLUSHDB):
    the answer was a 404 "no job ...", an unknown session to its client, for a compaction that
    could still run. Gone for the whole wait: 500 ``job_lost``; back within it (a worker running
    it writes it back as it ends): answered as usual."""
    write_session(r, api_settings, 3)
    with TestClient(create_app(with_api(api_settings, job_wait_seconds=1.5), redis=r)) as short:
        for comes_back in (True, False):  # (the lost one last: it keeps the session's RQ rate limit)
            queue = compaction_queue(r, api_settings)
            thread, box, job_id = compact_in_a_thread(short, r, api_settings)
            saved = r.hgetall(Job.key_for(job_id))
            r.delete(Job.key_for(job_id))
            if comes_back:
                time.sleep(0.5)
                r.hset(Job.key_for(job_id), mapping=saved)  # type: ignore[arg-type]
                run_jobs(r, api_settings)
            thread.join(30)
            response = box["response"]
            if comes_back:
                assert response.status_code == 200, response.text
                assert response.json()["didCompress"] is True
            else:
                assert response.status_code == 500, response.text
                assert error_of(response)["code"] == "job_lost"
                assert error_of(response)["message"].startswith(f"Redis lost compaction job {job_id} while it was "
                                                                "waited for")
                assert response.headers["X-Compactor-Job-Id"] == job_id
                queue.remove(job_id)
                release_pending(r, api_settings, SID, job_id)  # (its claim: stale only after the grace)


def test_a_forced_compactions_wait_outlasts_a_redis_outage(monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis unreachable while the API waited for the job: a 503 at once, while the job went on (a
    client sending the request again paid a second LLM call). Waited out as ``compactor compact``
    does; past the deadline (or the API stopping) the job is answered as still queued: a 202
    with its id, not a 503 that named none."""
    import anyio

    from producer import api_jobs
    from producer.api_models import JobBody

    calls: list[float] = []

    def flaky(client: Any, job_id: str, queue: str) -> JobBody:
        calls.append(time.monotonic())
        if len(calls) <= 3:
            raise redis.ConnectionError("Connection refused")
        return JobBody(job_id=job_id, status="finished")

    monkeypatch.setattr(api_jobs, "job_body", flaky)
    body = anyio.run(api_jobs.wait_for_job_async, None, "j", "q", 10.0)
    assert body.status == "finished" and len(calls) == 4
    calls.clear()
    monkeypatch.setattr(api_jobs, "job_body", lambda *args: (_ for _ in ()).throw(redis.ConnectionError("down")))
    body = anyio.run(api_jobs.wait_for_job_async, None, "j", "q", 0.3)
    assert body.job_id == "j" and body.status == "queued" and body.result is None and body.error is None


def test_an_unexpected_error_answers_with_the_security_headers_too(api_settings: Settings, r: redis.Redis) -> None:
    """Starlette answers an unhandled error outside the middleware adding them: the 500 had none."""
    app = create_app(api_settings, redis=r)

    def broken() -> None:
        raise RuntimeError("a bug")

    app.add_api_route("/api/broken", broken)
    with TestClient(app, raise_server_exceptions=False) as client:
        response = client.get("/api/broken")
    assert response.status_code == 500 and error_of(response)["code"] == "internal_error"
    assert response.headers["x-content-type-options"] == "nosniff" and response.headers["x-frame-options"] == "DENY"
    assert response.headers.get_list("x-frame-options") == ["DENY"]


def test_sessions_idle_past_their_state_ttl_are_neither_listed_nor_counted(
        api_settings: Settings, r: redis.Redis) -> None:
    """After a week with no write at all, the active sessions' index still held every session
    whose state had expired (only a writer's save pruned it): the list showed none of them while
    the overview and ``compactor_sessions`` counted them all."""
    from compactor.store import STATE_IDLE_TTL_S

    write_session(r, api_settings, 2)
    write_session(r, api_settings, 1, sid="other")
    keys = Keys()
    r.delete(keys.session(SID), keys.uuids(SID))  # its state expired, as its TTL makes it a week after
    r.zadd(keys.sessions, {SID: time.time() - STATE_IDLE_TTL_S - 60})  # its last write
    with TestClient(create_app(api_settings, redis=r)) as client:
        rows = client.get("/api/sessions").json()
        overview = client.get("/api/overview").json()
        metrics = client.get("/metrics").text
        one = client.get(f"/api/sessions/{SID}", params={"cwd": CWD})  # (its log is still there)
    assert [row["sessionId"] for row in rows] == ["other"]
    assert overview["sessions"] == 1 and "compactor_sessions 1.0" in metrics
    assert one.status_code == 200 and one.json()["currentTurnId"] == 3
    assert r.zrange(keys.sessions, 0, -1) == [b"other"]
