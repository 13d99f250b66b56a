"""The status page: its JSON routes, and the page itself in a real headless Chromium.

The API runs under uvicorn on 127.0.0.1 (a thread of the test process) against
the test Redis and a log with a real micro compaction; Playwright drives
Debian's ``chromium`` (never a downloaded browser; the fixture apt-installs it when missing).
"""

from __future__ import annotations

import base64
import json
import fcntl
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import redis
import uvicorn
from fastapi.testclient import TestClient

from compactor.keys import Keys
from compactor.store import SessionStore
from events.log import SessionLog
from events.config import Settings
from producer.api import create_app
from tests.support import free_port
from worker.context import WorkerContext

CWD = "/home/dev/project"
BUSY, BROKEN = "sess-busy", "sess-broken"
WORDS = " ".join(f"word{i}" for i in range(300))
CHROMIUM = "chromium"  # Debian's package (playwright's own browser download needs the internet)
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-sync"]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
TOKEN = "s3cret-token"
CHALLENGES = ['Bearer realm="compactor"', 'Basic realm="compactor", charset="UTF-8"']


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def with_token(settings: Settings) -> Settings:
    return settings.model_copy(update={"api": settings.api.model_copy(update={"token": TOKEN})})


def turn(n: int) -> list[dict[str, Any]]:
    call = f"call-{n}"
    return [
        {"type": "user", "turnId": n, "content": f"please do step {n}"},
        {"type": "assistant", "turnId": n, "content": f"working on {n}",
         "toolCalls": [{"id": call, "name": "read_file", "arguments": {"path": f"m{n}.py"}}]},
        {"type": "tool_result", "turnId": n, "toolCallId": call, "toolName": "read_file",
         "output": WORDS},
        {"type": "turn_end", "turnId": n, "model": "gpt-4", "contextWindow": 4000},
    ]


def write_session(r: redis.Redis, settings: Settings, sid: str, turns: int) -> None:
    events: list[dict[str, Any]] = [{"type": "session_meta", "sessionId": sid, "cwd": CWD}]
    for n in range(1, turns + 1):
        events += turn(n)
    write_lines(r, settings, sid, events)


def write_lines(r: redis.Redis, settings: Settings, sid: str, events: list[dict[str, Any]]) -> None:
    """Append ``events`` (a uuid given to those without one) and list the session as active."""
    lines = [{"uuid": f"{sid}-{i}", **e, "timestamp": "2025-01-01T00:00:00.000Z"}
             for i, e in enumerate(events)]
    SessionStore(r, settings).apply(sid, CWD, lines)
    r.zadd(Keys(settings.redis.prefix, settings.redis.shards).sessions, {sid: time.time()})


def write_summarized(r: redis.Redis, settings: Settings, sid: str, turns: int,
                     rollback_through: int | None = None) -> None:
    """Each turn followed by a summary of it that also replaces the summary before (an
    incremental summary, SPEC §5); before the last one, a micro compaction of its turn; then
    a rollback, when asked for."""
    events: list[dict[str, Any]] = [{"type": "session_meta", "sessionId": sid, "cwd": CWD}]
    previous: list[str] = []
    for n in range(1, turns + 1):
        lines = [{**e, "uuid": f"{sid}-t{n}-{i}"} for i, e in enumerate(turn(n))]
        if n == turns:
            lines.append({"type": "compact", "uuid": f"{sid}-c{n}", "startTurnId": n, "endTurnId": n})
        replaces = [e["uuid"] for e in lines if e["type"] in ("user", "assistant", "tool_result")]
        events += [*lines, {"type": "summary", "uuid": f"{sid}-s{n}", "replaces": replaces + previous,
                            "summaryText": f"turns 1-{n} done", "lastSummarizedTurnId": n}]
        previous = [f"{sid}-s{n}"]
    if rollback_through is not None:
        events.append({"type": "rollback", "throughTurnId": rollback_through, "reason": "undo"})
    write_lines(r, settings, sid, events)


def hidden(history: dict[str, Any]) -> list[tuple[str, bool, str | None]]:
    return [(c["kind"], c["visible"], c["hiddenBy"]) for c in history["compactions"]]


@pytest.fixture
def sessions(settings: Settings, r: redis.Redis) -> Settings:
    """Two sessions: one micro-compacted for real, one with its LLM breaker open."""
    write_session(r, settings, BUSY, 3)
    result = WorkerContext.build(settings, r).compactor.micro(BUSY, CWD)
    assert result.did_compress
    write_session(r, settings, BROKEN, 1)
    from worker.failures import FailureCounter

    for _ in range(settings.context.max_failures):  # (as the workers count them)
        FailureCounter(r, settings).record_failure(BROKEN)
    return settings


def test_sessions_route_lists_state_and_last_savings(sessions: Settings, r: redis.Redis) -> None:
    with TestClient(create_app(sessions, r)) as client:
        rows = {row["sessionId"]: row for row in client.get("/api/sessions").json()}
    assert set(rows) == {BUSY, BROKEN}
    busy = rows[BUSY]
    assert busy["lastCompaction"]["kind"] == "micro"
    saved = busy["lastSavings"]
    assert saved["tokensBefore"] - saved["tokensAfter"] == saved["released"] > 0
    assert rows[BROKEN]["breakerOpen"] is True and rows[BROKEN]["lastSavings"] is None


def test_the_savings_column_reads_logs_only_within_a_budget_per_request(
        sessions: Settings, r: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each savings not cached read the session's whole log and built two views of it: 100 sessions
    of 1.2 MB that had all just compacted held the page's refresh 8-12 s. Past a budget per request,
    a row waits for the next refresh."""
    from producer import status_page

    context = WorkerContext.build(sessions, r)
    for n in range(6):
        write_session(r, sessions, f"saved-{n}", 3)
        assert context.compactor.micro(f"saved-{n}", CWD).did_compress
    read_log = status_page.read_log

    def slow_read(*args: Any) -> Any:
        time.sleep(0.2)
        return read_log(*args)

    monkeypatch.setattr(status_page, "read_log", slow_read)
    monkeypatch.setattr(status_page, "SAVINGS_READ_BUDGET_S", 0.15)  # (one log read per request)
    # the most recent session: its compaction's uuid is not in its log (cut back by hand): found
    # missing once, not read again at each refresh, taking the budget of every row after it
    write_session(r, sessions, "cut-back", 3)
    assert context.compactor.micro("cut-back", CWD).did_compress
    path = SessionLog(sessions.data_dir, CWD, "cut-back").path
    [compact] = [json.loads(line) for line in path.read_text().splitlines() if '"compact"' in line]
    path.write_text(path.read_text().replace(compact["uuid"], "0" * len(compact["uuid"])))  # (the same size)
    with TestClient(create_app(sessions, r)) as client:
        started = time.monotonic()
        first = client.get("/api/sessions").json()
        assert time.monotonic() - started < 1.0
        assert sum(row["lastSavings"] is not None for row in first) < 7
        for _ in range(10):
            rows = client.get("/api/sessions").json()
        assert all(row["lastSavings"] is not None for row in rows if row["sessionId"] not in (BROKEN, "cut-back"))


def test_the_sessions_route_reads_redis_in_a_few_round_trips_whatever_the_sessions(
        sessions: Settings, r: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four round trips per session (state, failures, claim, activity): ``?limit=1000`` took ~0.5 s
    of the API on each refresh of the page."""
    from redis.connection import AbstractConnection as Connection

    for n in range(20):
        write_session(r, sessions, f"many-{n}", 1)
    with TestClient(create_app(sessions, r)) as client:
        client.get("/api/sessions")  # the savings cached, as on every refresh after the first
        sent = []
        real = Connection.send_packed_command
        monkeypatch.setattr(Connection, "send_packed_command",
                            lambda self, *args, **kwargs: (sent.append(1), real(self, *args, **kwargs))[1])
        rows = client.get("/api/sessions").json()
    assert len(rows) == 22 and len(sent) <= 4, len(sent)
    assert {row["sessionId"]: row["breakerOpen"] for row in rows}[BROKEN] is True


def test_a_session_whose_log_is_gone_is_not_listed(sessions: Settings, r: redis.Redis) -> None:
    """Its log deleted (or ``dataDir`` changed): it was listed with its old numbers, while
    ``GET /api/sessions/{id}`` answered 404 (SPEC §7: no log file, unknown)."""
    SessionStore(r, sessions).log(BROKEN, CWD).path.unlink()
    with TestClient(create_app(sessions, r)) as client:
        rows = client.get("/api/sessions").json()
        alone = client.get(f"/api/sessions/{BROKEN}", params={"cwd": CWD})
    assert [row["sessionId"] for row in rows] == [BUSY] and alone.status_code == 404


def test_a_session_whose_log_is_gone_leaves_its_place_to_the_next(sessions: Settings, r: redis.Redis) -> None:
    """``?limit=1`` answered ``[]`` when the most recent session's log was gone, while the
    overview counted the others: the page said "the 0 most recently active of 2"."""
    keys = Keys(sessions.redis.prefix, sessions.redis.shards)
    r.zadd(keys.sessions, {BUSY: time.time() - 60, BROKEN: time.time()})
    SessionStore(r, sessions).log(BROKEN, CWD).path.unlink()
    with TestClient(create_app(sessions, r)) as client:
        assert [row["sessionId"] for row in client.get("/api/sessions", params={"limit": 1}).json()] == [BUSY]


def test_the_list_and_the_session_route_agree_on_a_log_changed_outside_the_state(
        sessions: Settings, r: redis.Redis) -> None:
    """A log cut back by hand (or restored, or with a tail a crashed writer left): the session
    route rebuilt its state from the log, the list showed the stored one (849 against 748)."""
    path = SessionStore(r, sessions).log(BUSY, CWD).path
    path.write_bytes(b"".join(path.read_bytes().splitlines(keepends=True)[:6]))
    with TestClient(create_app(sessions, r)) as client:
        alone = client.get(f"/api/sessions/{BUSY}", params={"cwd": CWD}).json()
        [listed] = [row for row in client.get("/api/sessions").json() if row["sessionId"] == BUSY]
    fields = ("promptEstimate", "currentTurnId", "lastCompaction")
    assert {f: listed[f] for f in fields} == {f: alone[f] for f in fields}
    assert alone["currentTurnId"] == 2 and alone["lastCompaction"] is None


def test_a_session_whose_state_redis_lost_is_listed_from_its_log(sessions: Settings, r: redis.Redis) -> None:
    """Its state dropped (evicted, or deleted by hand after a repair of its log, as the README says)
    while its log stays: it was left out of the list and counted "without a log", while
    ``GET /api/sessions/{id}`` rebuilt it from the log and answered 200. Listed now as that route
    shows it, the state not stored by the list (a read is no write); left out when two logs of
    that id, under two cwds, could each be it."""
    keys = Keys(sessions.redis.prefix, sessions.redis.shards)
    with TestClient(create_app(sessions, r)) as client:
        [before] = [row for row in client.get("/api/sessions").json() if row["sessionId"] == BUSY]
        r.delete(keys.session(BUSY))
        [listed] = [row for row in client.get("/api/sessions").json() if row["sessionId"] == BUSY]
        assert not r.exists(keys.session(BUSY))
        alone = client.get(f"/api/sessions/{BUSY}", params={"cwd": CWD}).json()
        other = "/home/dev/other"
        r.delete(keys.session(BUSY))
        SessionStore(r, sessions).log(BUSY, other).append([{"type": "session_meta", "sessionId": BUSY, "cwd": other,
                                                             "uuid": "u-other", "timestamp": "2025-01-01T00:00:00.000Z"}])
        ambiguous = [row["sessionId"] for row in client.get("/api/sessions").json()]
    fields = ("cwd", "promptEstimate", "currentTurnId", "lastCompaction", "contextWindow")
    assert {f: listed[f] for f in fields} == {f: alone[f] for f in fields} == {f: before[f] for f in fields}
    assert listed["lastActivity"] == before["lastActivity"]
    assert BUSY not in ambiguous and BROKEN in ambiguous


def test_rebuilding_sessions_without_a_state_stops_at_the_pages_budget(
        sessions: Settings, r: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rebuilds are not stored: with Redis evicting idle sessions' states, every refresh rebuilt
    every such log again (100 logs of 1.2 MB: seconds). Past ``UNSTORED_BUDGET_S`` the rest are
    left out, as before."""
    from producer import api_sessions

    keys = Keys(sessions.redis.prefix, sessions.redis.shards)
    r.delete(keys.session(BUSY), keys.session(BROKEN))
    with TestClient(create_app(sessions, r)) as client:
        assert {row["sessionId"] for row in client.get("/api/sessions").json()} == {BUSY, BROKEN}
        monkeypatch.setattr(api_sessions, "UNSTORED_BUDGET_S", 0.0)
        assert client.get("/api/sessions").json() == []


def test_reading_a_session_after_a_settings_change_leaves_its_last_activity(
        sessions: Settings, r: redis.Redis) -> None:
    """After an operator changed a context setting, reading a session rebuilt its state from the
    log and stored it as a write does: every listed session became active "now", the list's order
    scrambled and the 7-day retention restarted."""
    keys = Keys(sessions.redis.prefix, sessions.redis.shards)
    busy, broken = float(int(time.time()) - 2_000), float(int(time.time()) - 1_000)  # (within the idle TTL)
    r.zadd(keys.sessions, {BUSY: busy, BROKEN: broken})
    r.expire(keys.session(BUSY), 1_000)  # (the state ages as it did: a read is no write)
    changed = sessions.model_copy(update={"context": sessions.context.model_copy(
        update={"micro_compact_keep_chars": sessions.context.micro_compact_keep_chars + 1})})
    with TestClient(create_app(changed, r)) as client:
        rows = client.get("/api/sessions").json()
        assert client.get(f"/api/sessions/{BUSY}", params={"cwd": CWD}).status_code == 200
    assert [(row["sessionId"], row["lastActivity"]) for row in rows] == [(BROKEN, broken), (BUSY, busy)]
    assert r.zscore(keys.sessions, BUSY) == busy and r.zscore(keys.sessions, BROKEN) == broken
    stored = SessionStore(r, changed).load(BUSY)
    assert stored is not None and stored.settings == changed.context.state_fingerprint  # rebuilt and stored
    assert 0 < r.ttl(keys.session(BUSY)) <= 1_000 and 0 < r.ttl(keys.uuids(BUSY)) <= 1_000


def test_elisions_are_matched_to_their_messages_when_turns_reuse_a_call_id() -> None:
    """Agents that number calls per turn reuse ``call_0``: looked up by call id, every tool message
    got the last output's lengths (75 characters, "-33 hidden"), the short one not elided too."""
    from events.config import ContextSettings
    from producer.status_page import context_with_elisions
    from tests.events.builders import assistant, call, compact, result, turn_end, user

    ctx = ContextSettings()
    events: list[dict[str, Any]] = []
    for turn in range(1, 5):
        output = f"turn {turn} " + "x" * (5_000 + turn)
        events += [user(turn, f"q{turn}"), assistant(turn, "", [call("call_0")]), result(turn, "call_0", output),
                   turn_end(turn)]
    events += [user(5, "q5"), assistant(5, "", [call("call_0")]), result(5, "call_0", "short " * 12), turn_end(5),
               compact(1, 4)]
    context = context_with_elisions(events, ctx)
    tools = [i for i, m in enumerate(context.messages) if m["role"] == "tool"]
    assert [cut.message_index for cut in context.elided] == tools[:4]
    assert [cut.original_chars for cut in context.elided] == [5_007 + t for t in range(1, 5)]
    for cut in context.elided:
        assert f"[{cut.hidden_chars} characters elided]" in context.messages[cut.message_index]["content"]


def test_history_route_has_tokens_before_after_and_elisions(sessions: Settings,
                                                           r: redis.Redis) -> None:
    with TestClient(create_app(sessions, r)) as client:
        body = client.get(f"/api/sessions/{BUSY}/history", params={"cwd": CWD}).json()
        missing = client.get("/api/sessions/nope/history", params={"cwd": CWD})
        bad = client.get(f"/api/sessions/{BUSY}/history", params={"cwd": "relative"})
    [compaction] = body["compactions"]
    assert compaction["kind"] == "micro" and compaction["visible"] is True
    assert compaction["tokensBefore"] > compaction["tokensAfter"]
    assert (compaction["startTurnId"], compaction["endTurnId"]) == (1, 2)
    context = body["context"]
    assert {e["toolCallId"] for e in context["elided"]} == {"call-1", "call-2"}
    assert all(e["shownChars"] < e["originalChars"] for e in context["elided"])
    for cut in context["elided"]:  # the badge's count is the marker's
        message = context["messages"][cut["messageIndex"]]
        assert message["tool_call_id"] == cut["toolCallId"]
        assert f"[{cut['hiddenChars']} characters elided]" in message["content"]
    assert context["promptEstimate"] == compaction["tokensAfter"]
    assert missing.status_code == 404 and bad.status_code == 400


def test_history_keeps_one_body_per_session_and_is_404_under_another_cwd(
        settings: Settings, r: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """A body was kept per size the log ever had (~2 MB each for a 1M-token session: the API grew
    by that every turn); and another cwd was a 400 naming the session's own, where the other
    session routes answer 404."""
    from producer import status_page

    # (not reused once the log grew: a first history that loaded the token encoding took long enough
    # for its reuse to outlast the second request, on a loaded machine)
    monkeypatch.setattr(status_page, "HISTORY_REUSE_FACTOR", 0)
    write_session(r, settings, "sess-grow", 2)
    with TestClient(create_app(settings, r)) as client:
        first = client.get("/api/sessions/sess-grow/history", params={"cwd": CWD}).json()
        write_lines(r, settings, "sess-grow", [{"uuid": f"t3-{i}", **e} for i, e in enumerate(turn(3))])
        second = client.get("/api/sessions/sess-grow/history", params={"cwd": CWD}).json()
        elsewhere = client.get("/api/sessions/sess-grow/history", params={"cwd": "/somewhere/else"})
        kept = list(client.app.state.history_cache.items.values())  # type: ignore[attr-defined]
    assert second["context"]["currentTurnId"] == first["context"]["currentTurnId"] + 1
    assert len(kept) == 1 and kept[0][1].model_dump(by_alias=True) == second
    assert elsewhere.status_code == 404 and CWD not in elsewhere.text


def test_a_history_slow_to_compute_is_reused_for_a_while_after_the_log_grew(
        settings: Settings, r: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """The history of a 167 MB log took 18 s of CPU, and a page open on the active session asked for
    it every 3 s: one API core per open tab. Once the log grew, a history is reused for ten times
    as long as it took to compute, then computed again."""
    from producer import status_page

    write_session(r, settings, "sess-slow", 2)
    monkeypatch.setattr(status_page, "HISTORY_REUSE_FACTOR", 10**6)  # (as for a history that took long)
    with TestClient(create_app(settings, r)) as client:
        first = client.get("/api/sessions/sess-slow/history", params={"cwd": CWD}).json()
        write_lines(r, settings, "sess-slow", [{"uuid": f"t3-{i}", **e} for i, e in enumerate(turn(3))])
        reused = client.get("/api/sessions/sess-slow/history", params={"cwd": CWD}).json()
        monkeypatch.setattr(status_page, "HISTORY_REUSE_FACTOR", 0)
        client.app.state.history_cache.items.clear()  # type: ignore[attr-defined]
        fresh = client.get("/api/sessions/sess-slow/history", params={"cwd": CWD}).json()
    assert reused == first
    assert fresh["context"]["currentTurnId"] == first["context"]["currentTurnId"] + 1


def test_history_says_a_summary_a_later_summary_replaced_was_replaced(settings: Settings,
                                                                      r: redis.Redis) -> None:
    """No rollback was ever sent: the first summary is out of the view because the second
    folded it in, and the history says so (it used to read as undone by a rollback)."""
    write_summarized(r, settings, "sess-sums", 2)
    with TestClient(create_app(settings, r)) as client:
        body = client.get("/api/sessions/sess-sums/history", params={"cwd": CWD}).json()
    assert hidden(body) == [("llm", False, "summary"), ("micro", True, None), ("llm", True, None)]


def test_history_says_a_rollback_undid_what_it_undid(settings: Settings, r: redis.Redis) -> None:
    """The rollback through turn 3 undoes the third summary and the compaction of turn 3; the
    second summary is shown again, and the first stays replaced by it."""
    write_summarized(r, settings, "sess-undo", 3, rollback_through=3)
    with TestClient(create_app(settings, r)) as client:
        body = client.get("/api/sessions/sess-undo/history", params={"cwd": CWD}).json()
    assert hidden(body) == [("llm", False, "summary"), ("llm", True, None),
                            ("micro", False, "rollback"), ("llm", False, "rollback")]


def test_the_page_and_its_routes_need_the_token_as_bearer_or_basic(sessions: Settings,
                                                                    r: redis.Redis) -> None:
    """Only /healthz is open; the token passes as Bearer or as the Basic password of any user,
    and every 401 challenges both schemes (a browser then shows its own login prompt)."""
    with TestClient(create_app(with_token(sessions), r)) as client:
        for path in ("/", "/static/status.js", "/api/overview", "/api/sessions",
                     f"/api/sessions/{BUSY}/history?cwd={CWD}"):
            for refused in ({}, basic("ops", "wrong"), basic("", TOKEN + "x"),
                            {"Authorization": f"Basic {TOKEN}"}):
                answer = client.get(path, headers=refused)
                assert answer.status_code == 401, (path, refused)
                assert answer.json()["error"]["code"] == "unauthorized"
                assert answer.headers.get_list("www-authenticate") == CHALLENGES
            for accepted in ({"Authorization": f"Bearer {TOKEN}"}, basic("ops", TOKEN),
                             basic("", TOKEN)):
                assert client.get(path, headers=accepted).status_code == 200, (path, accepted)
        assert client.get("/healthz").status_code == 200


# -- in a real browser ----------------------------------------------------------------------



@pytest.fixture
def serve_api(r: redis.Redis) -> Iterator[Any]:
    """A function that serves ``create_app(settings)`` with uvicorn; the base URL."""
    servers: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(settings: Settings) -> str:
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(create_app(settings, r), host="127.0.0.1",
                                               port=port, log_level="warning", lifespan="off"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        servers.append((server, thread))
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        return f"http://127.0.0.1:{port}"

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="session")
def chromium() -> str:
    """The chromium executable; installed with apt-get when missing and this runs as root
    (so the README's test command works on a fresh Debian machine), else a failure saying how."""
    found = shutil.which(CHROMIUM)
    said = ""
    if found is None and shutil.which("apt-get") and os.geteuid() == 0:
        # one installer at a time: both xdist workers came here on a fresh machine, and the second's
        # apt-get failed on dpkg's lock while the first installed (its tests errored, CI failed)
        with open(Path(tempfile.gettempdir()) / "compactor-tests-chromium.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            found = shutil.which(CHROMIUM)
            env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
            wait = ["-o", "DPkg::Lock::Timeout=600"]  # (another program's apt run: waited for)
            for command in ([] if found else (["apt-get", *wait, "update", "-qq"],
                                              ["apt-get", *wait, "install", "-y", "-qq", CHROMIUM])):
                done = subprocess.run(command, env=env, check=False, capture_output=True, text=True, timeout=900)
                said = done.stderr.strip()[-500:] if done.returncode else said
            found = shutil.which(CHROMIUM)
    if found is None:
        pytest.fail(f"the status-page tests drive {CHROMIUM} headless: install it (apt-get install {CHROMIUM})"
                    + (f"; apt-get said: {said}" if said else ""))
    return found


@pytest.fixture
def browser(chromium: str) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        instance = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        yield instance
        instance.close()


@pytest.mark.slow
def test_page_shows_sessions_bars_history_and_elisions(sessions: Settings, serve_api: Any,
                                                       browser: Any) -> None:
    base = serve_api(sessions)
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.goto(base + "/")
    page.wait_for_selector(f'#sessions tr[data-session="{BUSY}"]')
    assert page.locator("#sessions tbody tr").count() == 2
    busy = page.locator(f'#sessions tr[data-session="{BUSY}"]')
    bar = busy.locator(".bar")
    assert bar.get_attribute("data-level") in ("ok", "micro")
    assert 0 < float(bar.get_attribute("data-fill") or 0) < 90
    assert bar.locator(".mark").count() == 2
    assert "micro" in busy.inner_text()
    assert busy.locator("td.saved").inner_text().strip() != ""
    broken = page.locator(f'#sessions tr[data-session="{BROKEN}"]')
    assert broken.locator(".badge.open").inner_text() == "breaker open"
    assert page.locator('[data-card="sessions"] .value').inner_text() == "2"
    assert page.locator('[data-card="breakers"] .value').inner_text() == "1"
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "status-page.png"), full_page=True)

    busy.locator("a").first.click()
    page.wait_for_selector("#history tbody tr")
    row = page.locator("#history tbody tr").first
    assert row.get_attribute("data-kind") == "micro"
    before = int(row.locator(".before").inner_text().replace(",", ""))
    after = int(row.locator(".after").inner_text().replace(",", ""))
    assert before > after
    elided = page.locator("#messages li.elided")
    assert elided.count() == 2
    assert "characters hidden" in elided.first.locator(".badge").inner_text()
    assert "characters elided" in elided.first.locator("pre").inner_text()
    page.screenshot(path=str(ARTIFACTS / "status-session.png"), full_page=True)


@pytest.mark.slow
def test_page_shows_a_session_held_back_in_the_totals_its_row_and_its_page(
        sessions: Settings, serve_api: Any, browser: Any, r: redis.Redis) -> None:
    from compactor.held import HOLD

    keys = Keys(sessions.redis.prefix, sessions.redis.shards)
    r.set(keys.lease(keys.shard_of(BUSY)), "w:1")  # the watcher holding the session's shard
    r.register_script(HOLD)(keys=[keys.held], args=[BUSY, 120, 150, "No space left on device", "w:1",
                                                    keys.shard_of(BUSY)])
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.goto(serve_api(sessions) + "/")
    page.wait_for_selector(f'#sessions tr[data-session="{BUSY}"]')
    assert page.locator('[data-card="held"] .value').inner_text() == "1"
    assert page.locator('[data-card="held"]').get_attribute("class") == "card alert"
    assert page.locator('[data-card="held"]').get_attribute("title") == f"{BUSY}: No space left on device (2 min ago)"
    badge = page.locator(f'#sessions tr[data-session="{BUSY}"] [data-held]')
    assert badge.inner_text() == "held back"
    assert badge.get_attribute("title") == "No space left on device (first failed 2 min ago)"
    assert page.locator(f'#sessions tr[data-session="{BROKEN}"] [data-held]').count() == 0
    page.locator(f'#sessions tr[data-session="{BUSY}"] a').first.click()
    page.wait_for_selector('#session-state [data-card="held"]')
    card = page.locator('#session-state [data-card="held"]')
    assert card.locator(".value").inner_text() == "No space left on device"
    assert card.locator(".label").inner_text() == "held back: first failed 2 min ago"


@pytest.mark.slow
def test_legend_gives_the_configured_thresholds_where_the_ticks_are(sessions: Settings,
                                                                     serve_api: Any,
                                                                     browser: Any) -> None:
    context = sessions.context.model_copy(update={"micro_compact_threshold": 0.4,
                                                  "compaction_threshold": 0.85})
    base = serve_api(sessions.model_copy(update={"context": context}))
    assert httpx.get(base + "/api/overview").json()["thresholds"] == {"micro": 0.4, "llm": 0.85}
    page = browser.new_page()
    page.goto(base + "/")
    page.wait_for_selector(f'#sessions tr[data-session="{BUSY}"]')
    legend = " ".join(page.locator(".legend").inner_text().replace("\xa0", " ").split())
    assert "over micro (40 %)" in legend and "over LLM (85 %)" in legend, legend
    bar = page.locator(f'#sessions tr[data-session="{BUSY}"] .bar')  # a 4000-token window
    # (set through the CSSOM: the page's policy refuses style attributes, and the ticks stayed at 0)
    assert bar.locator(".micro-mark").evaluate("e => e.style.left") == "40%"
    assert bar.locator(".llm-mark").evaluate("e => e.style.left") == "85%"


@pytest.mark.slow
def test_session_page_tells_replaced_by_a_summary_from_undone_by_a_rollback(
    settings: Settings, r: redis.Redis, serve_api: Any, browser: Any,
) -> None:
    write_summarized(r, settings, "sess-undo", 3, rollback_through=3)
    page = browser.new_page()
    page.goto(serve_api(settings) + f"/#/session/sess-undo?cwd={quote(CWD, safe='')}")
    page.wait_for_selector("#history tbody tr")
    notes = [text.strip() for text in page.locator("#history tbody td:last-child").all_inner_texts()]
    assert notes == ["undone by a rollback", "undone by a rollback", "",  # newest first
                     "replaced by a later summary"]


@pytest.mark.slow
def test_page_refreshes_by_itself(sessions: Settings, serve_api: Any, browser: Any,
                                  r: redis.Redis) -> None:
    page = browser.new_page()
    page.goto(serve_api(sessions) + "/")
    page.wait_for_selector("#sessions tbody tr")
    write_session(r, sessions, "sess-new", 1)
    page.wait_for_selector('#sessions tr[data-session="sess-new"]', timeout=10_000)
    assert page.locator("#sessions tbody tr").count() == 3


@pytest.mark.slow
def test_page_says_when_it_lists_only_the_most_recent_sessions(sessions: Settings, serve_api: Any,
                                                               browser: Any, r: redis.Redis) -> None:
    write_session(r, sessions, "sess-new", 1)  # the most recently active of three
    base = serve_api(sessions)
    page = browser.new_page()
    page.goto(base + "/")
    page.wait_for_selector("#sessions tbody tr")
    assert page.locator("#sessions tbody tr").count() == 3
    assert page.locator("#sessions-shown").is_hidden()

    page.goto(base + "/?limit=2")
    page.wait_for_selector("#sessions-shown:not([hidden])")
    rows = page.locator("#sessions tbody tr")
    assert rows.count() == 2 and rows.first.get_attribute("data-session") == "sess-new"
    assert page.locator("#sessions-shown").inner_text().startswith(
        "Showing the 2 most recently active of 3 sessions")

    page.goto(base + "/?limit=0")  # the API's bound, said on the page
    page.wait_for_selector("#error:not([hidden])")
    assert page.locator("#error").inner_text().startswith("400:")

    # a session whose log is gone is not listed, and no ?limit would list it: it said "list more"
    SessionStore(r, sessions).log(BROKEN, CWD).path.unlink()
    for path in ("/", "/?limit=3"):
        page.goto(base + path)
        page.wait_for_selector("#sessions-shown:not([hidden])")
        assert page.locator("#sessions tbody tr").count() == 2
        assert page.locator("#sessions-shown").inner_text() == "1 more session(s) without a log are not listed."


def test_the_page_knows_the_apis_default_limit() -> None:
    """The page tells "more to list" from "more without a log" by the limit it asked for."""
    from producer.status_page import DEFAULT_SESSIONS_LISTED, STATIC_DIR

    assert f'data-default-limit="{DEFAULT_SESSIONS_LISTED}"' in (STATIC_DIR / "index.html").read_text()


@pytest.mark.slow
def test_browser_logs_in_with_basic_and_its_fetches_carry_it(sessions: Settings, serve_api: Any,
                                                            browser: Any) -> None:
    base = serve_api(with_token(sessions))
    assert httpx.get(base + "/").status_code == 401
    page = browser.new_page(http_credentials={"username": "ops", "password": TOKEN})
    fetched: list[Any] = []  # all_headers(): what went on the wire, Chromium's auth included
    page.on("requestfinished", lambda req: fetched.append(req) if "/api/" in req.url else None)
    page.goto(base + "/")
    page.wait_for_selector(f'#sessions tr[data-session="{BUSY}"]')
    assert page.locator("#error").is_hidden()
    sent = [req.all_headers().get("authorization", "") for req in fetched]
    assert sent and all(header.startswith("Basic ") for header in sent), sent
    page.route("**/api/**", lambda route: route.fulfill(  # the token changed under the page
        status=401, json={"error": {"code": "unauthorized", "message": "no"}}))
    page.wait_for_selector("#error:has-text('token refused: reload the page to enter it again')",
                           timeout=10_000)

    refused = browser.new_page(http_credentials={"username": "ops", "password": "wrong"})
    response = refused.goto(base + "/")
    assert response.status == 401
    assert refused.locator("#sessions").count() == 0


@pytest.mark.slow
def test_page_survives_a_cut_link_credentials_in_its_url_and_a_late_overview(
        sessions: Settings, serve_api: Any, browser: Any) -> None:
    """A cut link (``%`` at its end) stopped the page at "loading…" for good; a page opened as
    ``http://me:TOKEN@host/`` had fetch refuse every relative path; and an overview answered late
    was drawn over the session page opened meanwhile."""
    base = serve_api(with_token(sessions))
    host = base.removeprefix("http://")
    page = browser.new_page()
    page.goto(f"http://me:{TOKEN}@{host}/#/session/{BUSY}?cwd=%2Fhome%2Fdev%2Fproject%")
    page.wait_for_selector("#error:not([hidden])")
    assert "cut or mangled" in page.locator("#error").inner_text()
    page.goto(f"http://me:{TOKEN}@{host}/")  # (credentials in the URL: the fetches still work)
    page.wait_for_selector(f'#sessions tr[data-session="{BUSY}"]')

    def late(route: Any) -> None:
        time.sleep(1.5)
        route.continue_()

    page.route("**/api/overview", late)
    page.evaluate("refresh()")  # an overview on its way, late
    page.evaluate(f"location.hash = '#/session/{BUSY}?cwd=' + encodeURIComponent('{CWD}')")
    page.wait_for_selector("#session-page:not([hidden])")
    time.sleep(2.5)  # the late overview has come back
    assert page.locator("#session-page").is_visible() and page.locator("#overview-page").is_hidden()


@pytest.mark.slow
def test_page_keeps_a_selection_wraps_long_text_shows_bidi_controls_and_times_out_a_hung_api(
        sessions: Settings, serve_api: Any, browser: Any, r: redis.Redis) -> None:
    """Each refresh drew the page again, and the text an operator was selecting to copy was gone
    within 3 s; a 200-character cwd pushed every row's numbers off the screen; a cwd holding a
    right-to-left override read backwards ("/dl/\u202eevil" as "/dl/live"); and a fetch the API
    never answered stopped the polling with no word, the page showing old data as current."""
    long_cwd = "/home/dev/" + "x" * 200
    SessionStore(r, sessions).apply("sess-long", long_cwd, [
        {"uuid": "l-1", "type": "user", "turnId": 1, "content": "hi", "timestamp": "2025-01-01T00:00:00Z"}])
    SessionStore(r, sessions).apply("sess-bidi", "/dl/\u202eevil\u202c", [
        {"uuid": "b-1", "type": "user", "turnId": 1, "content": "hi", "timestamp": "2025-01-01T00:00:00Z"}])
    keys = Keys(sessions.redis.prefix, sessions.redis.shards)
    r.zadd(keys.sessions, {"sess-long": time.time(), "sess-bidi": time.time()})
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.goto(serve_api(sessions) + "/")
    page.wait_for_selector('#sessions tr[data-session="sess-bidi"]')
    assert page.locator('#sessions tr[data-session="sess-bidi"] .muted').inner_text() == \
        "/dl/\u27e8U+202E\u27e9evil\u27e8U+202C\u27e9"
    assert page.evaluate("document.documentElement.scrollWidth") <= 1400
    page.evaluate("""() => { const cell = document.querySelector('#sessions tr[data-session="sess-long"] .muted');
                             window.getSelection().selectAllChildren(cell); }""")
    time.sleep(2 * 3 + 1)  # two refreshes
    assert page.evaluate("window.getSelection().toString()") == long_cwd
    assert page.locator("#updated").inner_text() == "not redrawn while text is selected"
    page.evaluate("window.getSelection().removeAllRanges()")
    deadline = time.monotonic() + 10
    while not page.locator("#updated").inner_text().startswith("updated"):  # (the policy refuses wait_for_function)
        assert time.monotonic() < deadline
        time.sleep(0.2)
    page.route("**/api/overview", lambda route: None)  # never answered
    page.wait_for_selector("#error:not([hidden])", timeout=20_000)
    assert page.locator("#error").inner_text() == "no answer from the API within 10 s"
    # a 200 whose body never ends: the timeout cut the body's read, which was taken for no JSON and
    # drawn: "Cannot read properties of null (reading 'counters')"
    with socket.socket() as stalled:
        stalled.bind(("127.0.0.1", 0))
        stalled.listen()
        held: list[socket.socket] = []

        def answer_in_part() -> None:
            connection, _ = stalled.accept()
            held.append(connection)
            connection.recv(65536)
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")

        threading.Thread(target=answer_in_part, daemon=True).start()
        page.unroute("**/api/overview")
        port = stalled.getsockname()[1]
        page.route("**/api/overview", lambda route: route.continue_(url=f"http://127.0.0.1:{port}/api/overview"))
        page.evaluate("document.querySelector('#error').hidden = true")
        page.wait_for_selector("#error:not([hidden])", timeout=20_000)
        assert page.locator("#error").inner_text() == "no answer from the API within 10 s"
        for connection in held:
            connection.close()


def test_the_pages_files_are_checked_again_at_every_load(sessions: Settings, serve_api: Any) -> None:
    """With no Cache-Control, a browser kept status.js a tenth of its age (a day for a file ten
    days old) and ran an upgraded page against the old script."""
    base = serve_api(sessions)
    for name in ("status.js", "status.css"):
        response = httpx.get(f"{base}/static/{name}")
        assert response.status_code == 200 and response.headers["cache-control"] == "no-cache"
        again = httpx.get(f"{base}/static/{name}", headers={"If-None-Match": response.headers["etag"]})
        assert again.status_code == 304 and again.headers["cache-control"] == "no-cache"


def test_the_page_forbids_framing_inline_code_and_sniffing(sessions: Settings, serve_api: Any) -> None:
    """No policy, no framing rule: another site could show the page in an invisible frame, and a
    transcript answered as JSON could be sniffed as something else."""
    base = serve_api(sessions)
    page = httpx.get(base + "/")
    policy = page.headers["content-security-policy"]
    assert "frame-ancestors 'none'" in policy and "script-src 'self'" in policy and "unsafe-inline" not in policy
    for response in (page, httpx.get(base + "/static/status.js"), httpx.get(base + "/api/overview"),
                     httpx.get(base + "/api/sessions/none?cwd=/x"), httpx.post(base + "/api/jobs/x")):
        assert response.headers["x-content-type-options"] == "nosniff", response.url
        assert response.headers["x-frame-options"] == "DENY" and response.headers["referrer-policy"] == "no-referrer"
