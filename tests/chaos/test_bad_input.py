"""Bad input, generated: stream entries and HTTP bodies that are wrong in every way hypothesis finds.

Complements tests/producer/test_watcher_deadletter.py (one hand-written case per
reason) with generated ones: wrong types, huge strings, deep nesting, invalid
UTF-8, NUL bytes, path traversal in session ids and cwds, absurd turn ids.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from compactor.keys import Keys
from events.config import Settings
from events.errors import InvalidInput
from events.log import session_log_path
from events.models import validate_cwd, validate_session_id
from producer.api import create_app
from producer.publisher import Publisher
from producer.watcher import Watcher
from tests.chaos.conftest import backlog, scaled

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(300)]

MAX_EVENT_BYTES = 16 * 1024
MAX_BODY_BYTES = 64 * 1024
EXAMPLES = scaled(150)
HYPOTHESIS = hsettings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                       suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                              HealthCheck.data_too_large, HealthCheck.large_base_example])


@pytest.fixture
def jail(tmp_path: Path) -> Iterator[Path]:
    """The data dir sits in ``jail``; the test fails if anything appears beside it or outside."""
    data = tmp_path / "jail" / "data"
    data.mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    before = _tree(tmp_path)
    yield data
    after = _tree(tmp_path)
    stray = sorted(p for p in after - before if not p.startswith(str(data) + os.sep))
    assert stray == [], f"written outside the data dir: {stray[:10]}"
    assert list((tmp_path / "outside").iterdir()) == []


def _tree(root: Path) -> set[str]:
    return {os.path.join(d, f) for d, dirs, files in os.walk(root) for f in files + dirs}


def _traversals(tmp: Path) -> list[str]:
    target = str(tmp / "outside")
    return [f"/{'../' * 12}{target.lstrip('/')}", "/..", "/../..", "..", "../x", "/a/../../..",
            target, "\\..\\..\\x", "C:\\..\\..", "c:/../x", "/ok/\x00/x", "/" + "a" * 5000, "/ " * 10,
            "//", "/./.", "/:" * 40]


SESSION_IDS = st.one_of(
    st.sampled_from(["s1", "s2", "A-b_c", "a" * 128]),
    st.sampled_from(["", "..", "../../etc/passwd", "a/b", "a\\b", "a\x00b", "-lead", "a" * 129, "é", "a.b",
                     "a b", "a\nb", "con", "/abs"]),
    st.text(max_size=140),
)
JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                      st.floats(allow_nan=False), st.text(max_size=50))
JSON_VALUE = st.recursive(JSON_LEAF, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)), max_leaves=30)
ABSURD_TURNS = st.one_of(st.sampled_from([0, -1, 2**31, 2**63, 2**64 + 1, 10**30, True, False, "1", 1.5, None, [], {}]),
                         st.integers())
EVENT_TYPES = ["user", "assistant", "tool_result", "turn_end", "session_meta", "rollback", "compact", "summary",
               "bogus", "", None, 1]


@st.composite
def near_valid_events(draw: st.DrawFn) -> dict[str, Any]:
    """An event that is almost right: a real type with one field wrong, missing, huge or nested deep."""
    event: dict[str, Any] = {"type": draw(st.sampled_from(EVENT_TYPES)), "turnId": draw(ABSURD_TURNS),
                             "content": draw(st.one_of(st.text(max_size=200), JSON_VALUE))}
    extra = draw(st.sampled_from(["none", "huge", "deep", "nul", "fields", "identity"]))
    if extra == "huge":
        event["content"] = "x" * draw(st.sampled_from([MAX_EVENT_BYTES - 200, MAX_EVENT_BYTES + 1, 200_000]))
    elif extra == "deep":
        nested: Any = "leaf"
        for _ in range(draw(st.sampled_from([20, 200]))):  # deeper ones are built as bytes below
            nested = {"a": nested}
        event["arguments"] = nested
    elif extra == "nul":
        event["content"] = "before\x00after"
        event["uuid"] = draw(st.sampled_from(["u\x00", "../../u", "x" * 200, ""]))
    elif extra == "fields":
        event.update(draw(st.dictionaries(st.sampled_from(
            ["toolCalls", "toolCallId", "toolName", "output", "model", "contextWindow", "replaces",
             "summaryText", "lastSummarizedTurnId", "throughTurnId", "startTurnId", "endTurnId", "timestamp",
             "tokenCount", "streamId"]), JSON_VALUE, max_size=5)))
    elif extra == "identity":
        event["sessionId"] = draw(SESSION_IDS)
        event["cwd"] = draw(st.text(max_size=30))
    return event


def _dumps(value: Any) -> bytes:
    """JSON as a producer in any language might send it (big ints too; lone surrogates as raw bytes)."""
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")


def _event_bytes(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["near", "json", "raw", "invalid-utf8", "nul", "deep-array", "deep-object"]))
    if kind == "near":
        return _dumps(draw(near_valid_events()))
    if kind == "json":
        return _dumps(draw(JSON_VALUE))
    if kind == "raw":
        return draw(st.binary(max_size=300))
    if kind == "invalid-utf8":
        return b'{"type": "user", "turnId": 1, "content": "\xff\xfe' + draw(st.binary(max_size=20)) + b'"}'
    if kind == "nul":
        return b'{"type": "user", "turnId": 1, "content": "a\x00b"}'
    if kind == "deep-object":
        depth = draw(st.sampled_from([1_000, 5_000]))
        nested = b'{"a": ' * depth + b"1" + b"}" * depth
        return b'{"type": "user", "turnId": 1, "content": "x", "extra": ' + nested + b"}"
    return b"[" * 100_000 + b"]" * 100_000


@st.composite
def stream_entries(draw: st.DrawFn, tmp: Path) -> dict[bytes, bytes]:
    fields: dict[bytes, bytes] = {}
    if draw(st.integers(0, 3)) == 0:  # well formed: a valid session, an absolute (maybe traversing) cwd
        cwd = draw(st.sampled_from(["/home/dev/app"] + [t for t in _traversals(tmp) if t.startswith("/")]))
        event = {"type": "user", "turnId": draw(st.integers(1, 10**9)), "content": draw(st.text(max_size=30))}
        return {b"session": f"ok{draw(st.integers(0, 30))}".encode(), b"cwd": cwd.encode(), b"event": _dumps(event)}
    sid = draw(SESSION_IDS)
    fields[b"session"] = draw(st.sampled_from([sid.encode("utf-8", "surrogatepass"), b"\xff\xfe", b"s\x00"]))
    cwd = draw(st.one_of(st.sampled_from(["/home/dev/app", "/Users/Foo/my app"] + _traversals(tmp)),
                         st.text(max_size=60)))
    fields[b"cwd"] = draw(st.sampled_from([cwd.encode("utf-8", "surrogatepass"), b"/x/\xff"]))
    fields[b"event"] = _event_bytes(draw)
    for name in draw(st.sets(st.sampled_from([b"session", b"cwd", b"event"]), max_size=1)):
        del fields[name]  # sometimes a required field is missing
    return fields


def _valid_place(fields: dict[bytes, bytes], data_dir: Path) -> Path | None:
    """The log path the entry may land in (None when session or cwd is invalid)."""
    try:
        sid, cwd = fields[b"session"].decode(), fields[b"cwd"].decode()
        validate_session_id(sid)
        validate_cwd(cwd)
        return session_log_path(data_dir, cwd, sid)
    except (KeyError, UnicodeDecodeError, InvalidInput):
        return None


def test_generated_stream_entries_are_applied_or_dead_lettered_with_a_reason(
    r: redis.Redis, redis_url: str, tmp_path: Path, jail: Path,
) -> None:
    """Invariant: every generated entry is either appended to the log of a valid (session, cwd)
    inside the data dir, or copied to ``{p}:dead`` with a non-empty reason and its entry id, and
    acked; the watcher never raises; nothing is written outside the data dir."""
    settings = Settings.model_validate({
        "dataDir": str(jail), "redis": {"url": redis_url, "shards": 2},
        "limits": {"maxEventBytes": MAX_EVENT_BYTES},
        "watcher": {"leaseMs": 10_000, "blockMs": 1, "claimIdleMs": 1000}})
    keys = Keys(settings.redis.prefix, settings.redis.shards)
    watcher = Watcher(r, settings, name="fuzz")
    watcher.run_once()
    outcome = {"applied": 0, "dead": 0}

    @HYPOTHESIS
    @given(entry=stream_entries(tmp_path))
    def check(entry: dict[bytes, bytes]) -> None:
        sid = entry.get(b"session", b"s1").decode("utf-8", "replace")
        stream = keys.stream_for(sid)
        entry_id = r.xadd(stream, entry).decode()  # type: ignore[arg-type]
        while backlog(r, settings):
            watcher.run_once()
        dead = [f for _, f in r.xrevrange(keys.dead, count=3) if f.get(b"id") == entry_id.encode()]
        place = _valid_place(entry, jail)
        if dead:
            assert dead[0][b"reason"].strip(), "dead letter without a reason"
            outcome["dead"] += 1
            return
        assert place is not None, f"an entry with an invalid session/cwd was not dead-lettered: {entry!r:.200}"
        assert place.is_file() and entry_id.encode() in place.read_bytes(), "neither applied nor dead-lettered"
        assert str(place).startswith(str(jail) + os.sep)
        outcome["applied"] += 1

    check()
    watcher.close()
    assert outcome["dead"] > EXAMPLES // 2 and outcome["applied"] > 0, outcome
    print(f"generated entries: {outcome}")


def test_a_duplicate_uuid_in_a_session_is_dead_lettered(r: redis.Redis, settings: Settings, jail: Path) -> None:
    """Invariant (SPEC §3: ``uuid`` unique within the session): a second event with a uuid the
    session's log already holds is dead-lettered with a reason, and the log keeps one line per uuid."""
    settings = settings.model_copy(update={"data_dir": jail})
    publisher = Publisher(r, settings)
    # two calls: one call with a uuid twice is refused by the publisher itself (events.checks)
    publisher.publish("dup", "/home/dev/app", [{"type": "user", "turnId": 1, "content": "first", "uuid": "same-uuid"}])
    publisher.publish("dup", "/home/dev/app", [
        {"type": "assistant", "turnId": 1, "content": "second", "uuid": "same-uuid"}])
    watcher = Watcher(r, settings, name="dup")
    watcher.run_once()
    while backlog(r, settings):
        watcher.run_once()
    watcher.close()
    raw = session_log_path(jail, "/home/dev/app", "dup").read_bytes()
    lines = [orjson.loads(line) for line in raw.splitlines()]
    assert [line["uuid"] for line in lines].count("same-uuid") == 1
    dead = [fields for _, fields in r.xrange(Keys().dead)]
    assert len(dead) == 1 and b"uuid" in dead[0][b"reason"]


# -- HTTP ----------------------------------------------------------------------------------------


@pytest.fixture
def api(r: redis.Redis, redis_url: str, jail: Path) -> Iterator[TestClient]:
    settings = Settings.model_validate({
        "dataDir": str(jail), "redis": {"url": redis_url},
        "limits": {"maxEventBytes": MAX_EVENT_BYTES, "maxBodyBytes": MAX_BODY_BYTES},
        "api": {"jobWaitSeconds": 0.2}})
    with TestClient(create_app(settings, redis=r), raise_server_exceptions=True) as client:
        yield client


def _is_error_body(answer: Any) -> bool:
    body = answer.json()
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and bool(error.get("code")) and bool(str(error.get("message", "")).strip())


@st.composite
def http_requests(draw: st.DrawFn, tmp: Path) -> tuple[str, str, dict[str, Any], bytes | None]:
    """(method, path, query, raw body): the session id, cwd and body all possibly wrong."""
    sid = draw(st.one_of(SESSION_IDS, st.sampled_from(["..", "%2e%2e", "..%2f..%2fetc", "%00"])))
    from urllib.parse import quote

    path_sid = quote(sid.encode("utf-8", "surrogatepass"), safe="") or "%20"
    cwd = draw(st.one_of(st.sampled_from(["/home/dev/app"] + _traversals(tmp)), st.text(max_size=40)))
    route = draw(st.sampled_from(["events", "compact", "context", "session"]))
    if route in ("context", "session"):
        suffix = "/context" if route == "context" else ""
        return "GET", f"/api/sessions/{path_sid}{suffix}", {"cwd": cwd}, None
    kind = draw(st.sampled_from(["events", "wrong-json", "raw", "huge", "deep"]))
    if kind == "events":
        body = _dumps({"cwd": draw(st.one_of(st.just(cwd), JSON_VALUE)),
                             "events": draw(st.one_of(st.lists(near_valid_events(), max_size=3), JSON_VALUE))})
    elif kind == "wrong-json":
        body = _dumps(draw(JSON_VALUE))
    elif kind == "raw":
        body = draw(st.sampled_from([b"\xff\xfe{", b"{\"cwd\": \"/a\x00\"}", b"", b"{" * 10_000]))
    elif kind == "huge":
        body = b'{"cwd": "/home/dev/app", "events": [{"type": "user", "turnId": 1, "content": "' + \
            b"x" * MAX_BODY_BYTES + b'"}]}'
    else:
        body = b'{"cwd": "/home/dev/app", "events": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"
    return "POST", f"/api/sessions/{path_sid}/{route}", {"wait": "false"}, body


def test_generated_http_requests_get_a_4xx_with_a_reason_or_succeed_and_never_a_5xx(
    api: TestClient, tmp_path: Path, jail: Path,
) -> None:
    """Invariant: every generated request is answered 2xx or 4xx (never 5xx, never a crash); a 4xx
    carries ``{"error": {"code", "message"}}``; a 2xx on a POST needs a valid session id and
    cwd; nothing is written outside the data dir (the ``jail`` fixture checks)."""
    seen: dict[int, int] = {}

    @HYPOTHESIS
    @given(request=http_requests(tmp_path))
    def check(request: tuple[str, str, dict[str, Any], bytes | None]) -> None:
        method, path, query, body = request
        headers = {"content-type": "application/json"} if body is not None else {}
        answer = api.request(method, path, params=query, content=body, headers=headers)
        seen[answer.status_code] = seen.get(answer.status_code, 0) + 1
        assert answer.status_code < 500, (path, answer.text[:300])
        if answer.status_code >= 400:
            assert _is_error_body(answer), (path, answer.text[:300])

    check()
    assert any(400 <= code < 500 for code in seen), seen
    print(f"generated HTTP requests by status: {dict(sorted(seen.items()))}")
