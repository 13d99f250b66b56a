from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.errors import InvalidEvent
from events.checks import check_batch, check_json
from events.models import parse_event, to_wire, validate_cwd, wire_of

JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
                    max_leaves=6)
EXTRA_KEYS = st.sampled_from(["note", "x", "meta", "tags"])
TEXT = st.text(min_size=1, max_size=8)
TURN = st.integers(1, 50)


def _build(required: dict[str, Any], optional: dict[str, Any], draw: Any) -> dict[str, Any]:
    event = dict(required)
    for key, strategy in optional.items():
        choice = draw(st.sampled_from(["absent", "null", "value"]))
        if choice == "null":
            event[key] = None
        elif choice == "value":
            event[key] = draw(strategy)
    for key in draw(st.lists(EXTRA_KEYS, max_size=2, unique=True)):
        event[key] = draw(JSON)
    return event


@st.composite
def tool_calls(draw: Any) -> dict[str, Any]:
    call: dict[str, Any] = {"id": draw(TEXT), "name": draw(TEXT)}
    if draw(st.booleans()):
        call["arguments"] = draw(st.dictionaries(TEXT, JSON, max_size=2) | st.text(max_size=5))
    if draw(st.booleans()):
        call["extra"] = draw(JSON)
    return call


@st.composite
def events(draw: Any) -> dict[str, Any]:
    """A valid event of any type: optional fields left out, sent as null or set; extra fields."""
    common = {"uuid": st.from_regex(r"\A[!-~]([ -~]{0,40}[!-~])?\Z"), "timestamp": st.just("2026-01-02T03:04:05.000Z")}
    kind = draw(st.sampled_from(["session_meta", "user", "assistant", "tool_result", "turn_end",
                                 "rollback", "compact", "summary"]))
    turn = draw(TURN)
    required: dict[str, Any] = {"type": kind}
    optional: dict[str, Any] = dict(common)
    if kind == "session_meta":
        optional.update(createdAt=st.just("2026-01-02T03:04:05Z"), model=TEXT, parentSessionId=TEXT)
    elif kind == "user":
        required.update(turnId=turn, content=draw(st.text(max_size=5)))
    elif kind == "assistant":
        required.update(turnId=turn)
        optional.update(content=st.text(max_size=5), toolCalls=st.lists(tool_calls(), max_size=2,
                                                                         unique_by=lambda call: call["id"]),
                        usage=st.just({"prompt": 1, "completion": 2, "total": 3}))
    elif kind == "tool_result":
        required.update(turnId=turn, toolCallId=draw(TEXT), toolName=draw(TEXT), output=draw(st.text(max_size=5)))
    elif kind == "turn_end":
        required.update(turnId=turn, model=draw(TEXT))
        optional.update(contextWindow=st.integers(1, 10**6))
    elif kind == "rollback":
        required.update(throughTurnId=turn, reason=draw(st.text(max_size=5)))
    elif kind == "compact":
        required.update(startTurnId=turn, endTurnId=turn)
    else:
        required.update(replaces=draw(st.lists(TEXT, max_size=2)), summaryText=draw(TEXT), lastSummarizedTurnId=turn)
    event = _build(required, optional, draw)
    if event.get("toolCalls", []) is None:  # optional, but null is not valid for it
        del event["toolCalls"]
    if "turnId" in event and draw(st.booleans()):
        event["turn_id"] = event.pop("turnId")  # sent by its Python name
    return event


@settings(max_examples=400, deadline=None)
@given(events())
def test_wire_of_gives_what_to_wire_gives_for_any_valid_event(data: dict[str, Any]) -> None:
    expected = to_wire(parse_event(dict(data)))
    assert wire_of(dict(data), parse_event(dict(data))) == expected


def test_wire_of_fills_the_defaults_a_dump_adds_nested_ones_too() -> None:
    data = {"type": "assistant", "turnId": 1, "toolCalls": [{"id": "c", "name": "read"}]}
    assert wire_of(dict(data), parse_event(dict(data))) == {
        "type": "assistant", "turnId": 1, "content": "", "toolCalls": [{"id": "c", "name": "read", "arguments": ""}]}


def test_wire_of_keeps_nulls_sent_and_leaves_out_optional_fields_not_sent() -> None:
    data = {"type": "turn_end", "turnId": 2, "model": "m", "contextWindow": None, "note": None}
    assert wire_of(dict(data), parse_event(dict(data))) == data


def test_wire_of_renames_a_field_sent_by_its_python_name() -> None:
    data = {"type": "tool_result", "turn_id": 3, "tool_call_id": "c", "toolName": "t", "output": "o"}
    assert wire_of(dict(data), parse_event(dict(data))) == {
        "type": "tool_result", "turnId": 3, "toolCallId": "c", "toolName": "t", "output": "o"}


@pytest.mark.parametrize("uuid, reason", [
    (" a\n", "uuid: holds the control character '\\n' at character 2"),
    ("a\x00b", "uuid: holds the control character '\\x00' at character 1"),
    (" a", "uuid: starts or ends with whitespace"), ("a\u00a0", "uuid: starts or ends with whitespace"),
])
def test_a_uuid_with_control_characters_or_blanks_around_it_is_refused(uuid: str, reason: str) -> None:
    """A uuid is the event's identity, compared as sent: a client trimming it on a retry had its
    event applied twice."""
    with pytest.raises(InvalidEvent) as raised:
        parse_event({"type": "user", "turnId": 1, "content": "x", "uuid": uuid})
    assert str(raised.value) == reason
    for fine in ("a b", "é-1", "x" * 128):
        assert parse_event({"type": "user", "turnId": 1, "content": "x", "uuid": fine}).uuid == fine


def test_a_timestamp_in_utc_with_a_time_is_kept_as_sent() -> None:
    for sent in ("2024-01-01T00:00:00Z", "2024-01-01T00:00:00.123Z", "2024-01-01T05:00:00+00:00"):
        event = parse_event({"type": "user", "turnId": 1, "content": "hi", "timestamp": sent})
        assert to_wire(event)["timestamp"] == sent


def test_a_timestamp_not_in_utc_or_without_a_time_is_refused_naming_the_field() -> None:
    """SPEC §3: every line's timestamp is ISO-8601 UTC; a producer's own is kept, so it must be one."""
    for sent in ("2024-01-01T00:00:00+05:00", "2024-01-01T00:00:00", "2024-01-01", "2024-W01-1", "yesterday"):
        with pytest.raises(InvalidEvent) as caught:
            parse_event({"type": "user", "turnId": 1, "content": "hi", "timestamp": sent})
        assert caught.value.field == "timestamp", sent
        assert "UTC" in str(caught.value), sent


@pytest.mark.parametrize("sent", [
    "2024-01-01T12:00:00+0000", "2024-01-01T12:00:00-00:00", "2024-01-01t12:00:00z", "2024-01-01T12:00:00z",
    "2024-01-01t12:00:00Z", "2024-01-01T12:00Z", "2024-W01-1T12:00:00Z", "20240101T120000Z",
    "2024-01-01 12:00:00Z", "2024-01-01T12:00:00.Z", "２０２４-01-01T12:00:00Z",
])
def test_a_timestamp_in_any_form_but_the_documented_one_is_refused(sent: str) -> None:
    """docs/STREAM_PROTOCOL.md: YYYY-MM-DDTHH:MM:SS, optional fraction, then ``Z`` or ``+00:00``."""
    with pytest.raises(InvalidEvent) as caught:
        parse_event({"type": "user", "turnId": 1, "content": "hi", "timestamp": sent})
    assert str(caught.value).startswith("timestamp: must be an ISO-8601 UTC date and time"), sent


def test_the_fields_missing_beside_the_first_are_named_at_once() -> None:
    """A tool result written from scratch took a round trip per missing field (toolName, then output)."""
    with pytest.raises(InvalidEvent) as caught:
        parse_event({"type": "tool_result", "turnId": 1, "toolCallId": "c1"})
    assert str(caught.value) == "toolName: Field required (and output too)"
    with pytest.raises(InvalidEvent) as caught:  # (those of another object are its own error's)
        parse_event({"type": "assistant", "turnId": 1, "toolCalls": [{"id": "x"}, {}]})
    assert str(caught.value) == "toolCalls[0].name: Field required"


@pytest.mark.parametrize("sent", ["2024-02-30T12:00:00Z", "2024-01-01T24:00:00Z", "2023-02-29T00:00:00.5+00:00",
                                  "2024-01-01T12:00:60Z"])
def test_a_timestamp_in_the_documented_form_that_does_not_exist_is_refused_as_such(sent: str) -> None:
    """Told the form it was already written in ("must be YYYY-MM-DDTHH:MM:SS ..."), a producer looked
    for a mistake in the form."""
    with pytest.raises(InvalidEvent) as caught:
        parse_event({"type": "user", "turnId": 1, "content": "hi", "timestamp": sent})
    assert str(caught.value) == f"timestamp: {sent[:19]} is no date and time that exists (a 30 February, an hour " \
                                "24, a second 60)"


def test_a_timestamp_with_up_to_nanoseconds_is_kept() -> None:
    for sent in ("2024-01-01T00:00:00.1Z", "2024-02-29T23:59:59.123456789+00:00"):
        event = parse_event({"type": "user", "turnId": 1, "content": "hi", "timestamp": sent})
        assert to_wire(event)["timestamp"] == sent


def test_a_session_meta_created_at_is_a_timestamp_too() -> None:
    with pytest.raises(InvalidEvent) as caught:
        parse_event({"type": "session_meta", "createdAt": "not a date"})
    assert caught.value.field == "createdAt"
    assert to_wire(parse_event({"type": "session_meta", "createdAt": "2024-01-01T00:00:00Z"}))["createdAt"] \
        == "2024-01-01T00:00:00Z"


def test_a_compact_whose_range_ends_before_it_starts_is_refused() -> None:
    with pytest.raises(InvalidEvent) as caught:
        parse_event({"type": "compact", "startTurnId": 3, "endTurnId": 1})
    assert str(caught.value) == "endTurnId: must be at least startTurnId (3)"
    assert parse_event({"type": "compact", "startTurnId": 2, "endTurnId": 2})


def test_a_rollback_needs_its_reason() -> None:
    """SPEC §3 lists ``reason`` without a ``?``: a rollback says why."""
    with pytest.raises(InvalidEvent) as caught:
        parse_event({"type": "rollback", "throughTurnId": 2})
    assert caught.value.field == "reason"
    assert to_wire(parse_event({"type": "rollback", "throughTurnId": 2, "reason": ""}))["reason"] == ""


@pytest.mark.parametrize("cwd,reason", [
    ("", "must not be empty: it must be an absolute path"),
    (None, "is required: an absolute path"),
    (7, "must be a string: an absolute path"),
    ("/uni\ud800", "contains a lone surrogate (\\ud800 at character 4): it is not valid Unicode"),
    ("/home/u/x\n\x1b[31mRED", "must not contain a control character ('\\n' at character 9)"),
    ("/a\x85b", "must not contain a control character ('\\x85' at character 2)"),
])
def test_a_bad_cwd_is_refused_saying_why(cwd: object, reason: str) -> None:
    with pytest.raises(InvalidEvent) as caught:
        validate_cwd(cwd, new=True)
    assert str(caught.value) == f"cwd: {reason}"


def test_a_cwd_with_a_control_character_is_refused_coming_in_yet_an_old_sessions_log_stays_reachable(
        tmp_path: Any) -> None:
    from events.log import session_log_path

    with pytest.raises(InvalidEvent, match="control character"):
        validate_cwd("/home/u/my\tproj", new=True)
    assert session_log_path(tmp_path, "/home/u/my\tproj", "s1").name == "s1.jsonl"  # (logged before the rule)


def test_nested_errors_are_named_with_bracket_indexes_and_no_pydantic_prefix() -> None:
    with pytest.raises(InvalidEvent) as caught:
        parse_event({"type": "assistant", "turnId": 1, "toolCalls": [{"id": "c", "name": "n"}, {"id": "d"}]})
    assert caught.value.field == "toolCalls[1].name"
    with pytest.raises(InvalidEvent) as caught:
        parse_event({"type": "user", "turnId": 1, "content": "x", "timestamp": "no"})
    assert "Value error" not in str(caught.value)


def test_two_calls_of_one_message_under_one_id_are_refused_naming_the_second() -> None:
    """Accepted, the view answered one of them only (the other result dropped, still counted), and
    an OpenAI-style API refuses two calls with one id."""
    calls = [{"id": "x", "name": "read_file"}, {"id": "y", "name": "read_file"}, {"id": "x", "name": "run"}]
    with pytest.raises(InvalidEvent) as caught:
        parse_event({"type": "assistant", "turnId": 1, "toolCalls": calls})
    assert caught.value.field == "toolCalls[2].id" and "duplicates toolCalls[0].id ('x')" in caught.value.reason
    parse_event({"type": "assistant", "turnId": 1, "toolCalls": calls[:2]})  # distinct: fine


@pytest.mark.parametrize("value,where,fragment", [
    ({"a": [1, float("nan")]}, "a[1]", "not a finite number"),
    ({"a": {"b": float("inf")}}, "a.b", "not a finite number"),
    ({"a": 2**64}, "a", "64-bit"),
    ({"a": -(2**63) - 1}, "a", "64-bit"),
    ({"a": ["ok", "x\udc80"]}, "a[1]", "lone surrogate"),
    ({"a": {"k\ud800": 1}}, "a", "lone surrogate"),
])
def test_check_json_names_the_first_value_json_cannot_hold(value: Any, where: str, fragment: str) -> None:
    with pytest.raises(InvalidEvent) as caught:
        check_json(value)
    assert caught.value.field == where and fragment in caught.value.reason
    str(caught.value).encode("utf-8")  # the message itself is valid text


def test_check_json_accepts_what_the_log_can_store() -> None:
    check_json({"a": [2**64 - 1, -(2**63), 1.5, "é😀", None, True, {"": []}]})


def test_check_json_of_a_wide_deep_value_holds_memory_for_its_depth_not_its_depth_times_its_items() -> None:
    """The pass that names the bad value kept a path tuple per value: a list of 200 000 numbers 200
    deep, a 1 MB body, held ~2 GB (one body or stream entry took the API or the watcher down)."""
    import tracemalloc

    value: Any = [1] * 200_000 + [2**64]
    for _ in range(200):
        value = [value]
    tracemalloc.start()
    try:
        with pytest.raises(InvalidEvent) as caught:
            check_json(value, ("event",))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(caught.value).startswith("event" + "[0]" * 200 + "[200000]: is an integer outside")
    assert peak < 64 * 2**20, peak


def test_check_batch_refuses_a_repeated_uuid_and_a_turn_going_backwards() -> None:
    with pytest.raises(InvalidEvent) as caught:
        check_batch([{"type": "user", "turnId": 1, "uuid": "u"}, {"type": "summary", "uuid": "u"}])
    assert str(caught.value) == "events[1].uuid: 'u' duplicates events[0]"
    with pytest.raises(InvalidEvent) as caught:
        check_batch([{"type": "turn_end", "turnId": 2}, {"type": "tool_result", "turnId": 2}])
    assert str(caught.value).startswith("events[1].turnId: goes backwards: 2 < currentTurnId 3")


def test_check_batch_of_thousands_of_rollbacks_runs_in_linear_time() -> None:
    """Each rollback copied the batch's visible turns and counted the current turn again: 20 000
    events and 20 000 rollbacks (2 MB, under the body limit) held an API thread 19 s."""
    import time

    batch = [{"type": "user", "turnId": n} for n in range(1, 20_001)]
    batch += [{"type": "rollback", "throughTurnId": 30_000}] * 20_000
    started = time.monotonic()
    check_batch([*batch, {"type": "user", "turnId": 20_000}])
    assert time.monotonic() - started < 5  # (quadratic: ~20 s; linear: tens of milliseconds)
    with pytest.raises(InvalidEvent, match=r"goes backwards: 2 < currentTurnId 3, reached at events\[2\]"):
        check_batch([*batch[:4], {"type": "rollback", "throughTurnId": 4}, {"type": "user", "turnId": 2}])


def test_check_batch_follows_the_current_turn_as_the_log_would() -> None:
    check_batch([{"type": "user", "turnId": 4}, {"type": "assistant", "turnId": 4}, {"type": "turn_end", "turnId": 4},
                 {"type": "user", "turnId": 6}, {"type": "rollback", "throughTurnId": 1},
                 {"type": "user", "turnId": 1}, {"type": "compact", "startTurnId": 1, "endTurnId": 1}])


def test_a_context_window_past_any_models_is_refused() -> None:
    """``2**64 - 1`` was accepted: the session could never trigger a compaction, and its thresholds
    came out of a rounded float in the session's API answer."""
    with pytest.raises(InvalidEvent) as caught:
        parse_event({"type": "turn_end", "turnId": 1, "model": "m", "contextWindow": 2**64 - 1})
    assert str(caught.value) == "contextWindow: Input should be less than or equal to 1000000000"
    assert to_wire(parse_event({"type": "turn_end", "turnId": 1, "model": "m", "contextWindow": 10**9}))[
        "contextWindow"] == 10**9
