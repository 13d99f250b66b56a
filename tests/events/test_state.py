from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from events import config
from events.config import ContextSettings
from events.state import SessionState, decide, fold, rebuild, rebuild_with_view, state_after_summary, stored_state
from events.tokens import event_tokens, stamp, stamped_tokens
from events.view import build_view, extend_view, llm_pass, micro_candidates
from tests.events.builders import (
    assistant,
    call,
    compact,
    meta,
    result,
    rollback,
    simple_turn,
    summary,
    turn_end,
    user,
)

CTX = ContextSettings()
LONG = "L" * 500


def _fold_all(events: list[dict[str, Any]], ctx: ContextSettings = CTX) -> tuple[SessionState, int]:
    """Fold one by one as the store does: rebuild from the prefix when fold says so."""
    state = SessionState.empty("s1", "/w", ctx)
    rebuilds = 0
    for index, event in enumerate(events):
        if not fold(state, event, ctx):
            state = rebuild("s1", "/w", events[: index + 1], ctx, log_size=0)
            rebuilds += 1
    return state, rebuilds


# -- the hash -----------------------------------------------------------------------


def test_to_hash_and_from_hash_round_trip_including_bytes_and_none() -> None:
    state = SessionState(
        session_id="s1", cwd="/w x", model="gpt-4o", encoding="o200k_base", window=128_000,
        current_turn_id=7, max_turn=6, last_ended_turn=6, prompt_estimate=12_345,
        min_candidate_turn=2, log_size=99, events=40, last_stream_id="1-0",
        last_compaction={"kind": "llm", "uuid": "u", "timestamp": "t"}, compacted_through=3,
    )
    data = state.to_hash()
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in data.items())
    assert SessionState.from_hash(data) == state
    assert SessionState.from_hash({k.encode(): v.encode() for k, v in data.items()}) == state
    empty = SessionState.empty("s2", "/w", CTX)
    assert empty.to_hash()["model"] == "" and SessionState.from_hash(empty.to_hash()) == empty


@pytest.mark.parametrize(("field", "value"), [("min_candidate_turn", "1.0"), ("prompt_estimate", "x"),
                                              ("last_compaction", "{not json")])
def test_a_stored_state_with_an_unreadable_field_reads_as_none_so_the_log_rebuilds_it(
        field: str, value: str, caplog: pytest.LogCaptureFixture) -> None:
    """A stored ``min_candidate_turn`` of ``1.0`` failed every ``compactor status`` with a bare
    ValueError and held the session's events in the watcher."""
    data = SessionState.empty("s1", "/w", CTX).to_hash() | {field: value}
    with pytest.raises(ValueError, match=f"^{field}: "):
        SessionState.from_hash(data)
    assert stored_state(data, "s1") is None
    assert f"session=s1 unreadable, rebuilt from its log: {field}: " in caplog.text
    assert stored_state({}, "s1") is None
    assert stored_state(SessionState.empty("s1", "/w", CTX).to_hash(), "s1") == SessionState.empty("s1", "/w", CTX)


@pytest.mark.parametrize("turn", ["1", None, 1.0, True])
def test_a_long_tool_result_whose_turn_is_not_an_integer_is_no_micro_candidate(turn: Any) -> None:
    """A hand-edited ``turnId`` reads as turn 0 (DESIGN), which no compact can cover: as a
    candidate its raw value crashed the state's rebuild (``'<' not supported between 'int' and
    'str'``, the session's events held in the watcher) or was stored as ``1.0``."""
    events = [*simple_turn(1, "q1", LONG), *simple_turn(2, "q2", LONG), *simple_turn(3, "q3")]
    events[2]["turnId"] = turn
    state = rebuild("s1", "/w", events, CTX, log_size=0)
    assert state.min_candidate_turn == 2 and type(state.min_candidate_turn) is int
    view = build_view(events, CTX)
    assert [e["turnId"] for e in micro_candidates(events, CTX, view=view)] == [2]
    assert view.min_candidate_turn == 2
    folded, _ = _fold_all(events)
    assert folded.min_candidate_turn == 2
    # and, no compact covering it, it is shown whole (it was shown elided once it was no candidate)
    assert view.elided == {} and LONG in [m["content"] for m in view.messages]


# -- fold -----------------------------------------------------------------------------


@pytest.mark.parametrize("event", [rollback(1), compact(1, 1), summary([], "S", 1)])
def test_fold_asks_for_a_rebuild_on_events_that_change_the_past(event: dict[str, Any]) -> None:
    state = SessionState.empty("s1", "/w", CTX)
    assert fold(state, event, CTX) is False


def test_a_turn_end_changing_the_encoding_needs_a_rebuild_but_a_same_encoding_one_does_not() -> None:
    state = SessionState.empty("s1", "/w", CTX)
    assert fold(state, user(1, "hello world"), CTX)
    assert state.prompt_estimate == 6
    assert fold(state, turn_end(1, "gpt-4", contextWindow=8000), CTX)  # cl100k_base, as before
    assert (state.model, state.window, state.current_turn_id) == ("gpt-4", 8000, 2)
    assert fold(state, turn_end(2, "gpt-4o"), CTX) is False  # o200k_base


def test_an_event_in_a_compacted_turn_needs_a_rebuild() -> None:
    events = [*simple_turn(1, output=LONG), *simple_turn(2), *simple_turn(3), compact(1, 1)]
    state = rebuild("s1", "/w", events, CTX, log_size=0)
    assert fold(state, result(1, "late", LONG), CTX) is False
    assert fold(state, user(2, "late but not compacted"), CTX) is True


def test_fold_tracks_lines_and_stream_ids() -> None:
    state = SessionState.empty("s1", "/w", CTX)
    fold(state, {**user(1), "streamId": "5-0"}, CTX)
    fold(state, assistant(1), CTX)
    assert (state.events, state.last_stream_id) == (2, "5-0")


def test_the_window_is_the_turn_ends_then_litellms_then_the_default() -> None:
    ctx = ContextSettings(default_context_window=50_000)
    assert rebuild("s1", "/w", [turn_end(1, "gpt-4o", contextWindow=9000)], ctx, 0).window == 9000
    assert rebuild("s1", "/w", [turn_end(1, "gpt-4o")], ctx, 0).window == 128_000
    assert rebuild("s1", "/w", [turn_end(1, "my-private-model")], ctx, 0).window == 50_000
    assert rebuild("s1", "/w", [meta("gpt-4o")], ctx, 0).window == 128_000
    assert rebuild("s1", "/w", [], ctx, 0).window == 50_000


def test_rebuild_records_the_last_compaction_and_the_log_size() -> None:
    events = [*simple_turn(1, output=LONG), *simple_turn(2), *simple_turn(3), compact(1, 1)]
    state = rebuild("s1", "/w", events, CTX, log_size=1234)
    assert state.last_compaction == {"kind": "micro", "uuid": events[-1]["uuid"], "timestamp": None}
    assert (state.log_size, state.events, state.compacted_through, state.min_candidate_turn) == (1234, 16, 1, 0)


# -- decide ---------------------------------------------------------------------------


def _state(estimate: int, min_candidate: int, current: int = 5, window: int = 1000) -> SessionState:
    return SessionState(session_id="s1", cwd="/w", window=window, current_turn_id=current,
                        last_ended_turn=current - 1, prompt_estimate=estimate, min_candidate_turn=min_candidate)


def test_decide_llm_over_the_compaction_threshold_when_the_breaker_is_closed() -> None:
    assert decide(_state(901, 0), CTX, breaker_open=False) == "llm"
    assert decide(_state(900, 0), CTX, breaker_open=False) is None  # strictly greater


def test_decide_micro_over_its_threshold_only_with_an_old_candidate() -> None:
    assert decide(_state(251, 3), CTX, breaker_open=False) == "micro"
    assert decide(_state(250, 3), CTX, breaker_open=False) is None
    assert decide(_state(251, 4), CTX, breaker_open=False) is None  # turn T itself is too recent
    assert decide(_state(251, 0), CTX, breaker_open=False) is None


@pytest.mark.parametrize(("micro", "llm", "window"), [(0.35, 0.7, 180), (0.3, 0.7, 90)])
def test_an_estimate_equal_to_a_threshold_as_written_does_not_pass_it(micro: float, llm: float, window: int) -> None:
    """0.7 × 90 is 62.99… in floats: an estimate of 63 passed a threshold it equals (SPEC §5: E > t·W)."""
    ctx = ContextSettings(micro_compact_threshold=micro, compaction_threshold=llm)
    at_llm, at_micro = round(llm * window), round(micro * window)
    assert decide(_state(at_llm, 0, window=window), ctx, breaker_open=False) is None
    assert decide(_state(at_llm + 1, 0, window=window), ctx, breaker_open=False) == "llm"
    assert decide(_state(at_micro, 2, window=window), ctx, breaker_open=False) is None
    assert decide(_state(at_micro + 1, 2, window=window), ctx, breaker_open=False) == "micro"
    assert (ctx.micro_limit(window), ctx.compaction_limit(window)) == (at_micro, at_llm)
    assert ContextSettings().compaction_limit(1001) == 900  # (900.9: the whole tokens under it)


def test_an_open_breaker_falls_back_to_micro_or_nothing() -> None:
    assert decide(_state(950, 2), CTX, breaker_open=True) == "micro"
    assert decide(_state(950, 0), CTX, breaker_open=True) is None


# -- incremental == from scratch ----------------------------------------------------------

MODELS = ("gpt-4", "gpt-4o", "gpt-3.5-turbo", "unknown-model")
TOOLS = ("read_file", "Execute_Command", "ask_user", "web_search")
texts = st.text(alphabet="ab <|>é\n{}", max_size=30)


@st.composite
def logs(draw: st.DrawFn) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    if draw(st.booleans()):
        events.append(meta(draw(st.sampled_from(MODELS))))
    turn = 0
    for _ in range(draw(st.integers(0, 6))):
        turn += draw(st.integers(1, 2))
        events.append(user(turn, draw(texts)))
        for _ in range(draw(st.integers(0, 2))):
            cid = f"c{len(events)}"
            args = draw(st.one_of(st.just({"path": "a"}), texts))
            events.append(assistant(turn, draw(texts), [call(cid, draw(st.sampled_from(TOOLS)), args)]))
            if draw(st.booleans()):
                size = draw(st.sampled_from([5, 120, 121, 300]))
                events.append(result(draw(st.sampled_from([turn, 1])), cid, "x" * size, draw(st.sampled_from(TOOLS))))
        if draw(st.booleans()):
            events.append(turn_end(turn, draw(st.sampled_from(MODELS)), **(
                {"contextWindow": 4096} if draw(st.booleans()) else {})))
        if draw(st.integers(0, 9)) == 0:
            events.append(user(max(1, turn - 1), "backwards"))
        if turn >= 3 and draw(st.integers(0, 2)) == 0:
            events.append(compact(1, turn - 2))
        if turn >= 3 and draw(st.integers(0, 7)) == 0:
            done = [e["uuid"] for e in events if e.get("turnId") == 1 and e["type"] != "turn_end"]
            events.append(summary(done, draw(texts), 1))
        if turn >= 2 and draw(st.integers(0, 7)) == 0:
            events.append(rollback(draw(st.integers(1, turn))))
    if draw(st.booleans()):
        encoding = draw(st.sampled_from(["cl100k_base", "o200k_base"]))
        events = [stamp(e, encoding) for e in events]
    return events


@given(events=logs())
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_folding_event_by_event_equals_rebuilding_from_scratch(events: list[dict[str, Any]]) -> None:
    folded, _ = _fold_all(events)
    scratch = rebuild("s1", "/w", events, CTX, log_size=0)
    view = build_view(events, CTX)
    assert folded == scratch
    assert (folded.prompt_estimate, folded.current_turn_id, folded.min_candidate_turn) == (
        view.prompt_estimate, view.current_turn_id, view.min_candidate_turn)


def test_a_long_ordinary_log_folds_without_any_rebuild() -> None:
    events = [e for t in range(1, 40) for e in simple_turn(t, output=LONG)]
    folded, rebuilds = _fold_all(events)
    assert rebuilds == 0
    assert folded == rebuild("s1", "/w", events, CTX, log_size=0)
    assert folded.min_candidate_turn == 1 and folded.current_turn_id == 40


@given(events=logs())
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_view_without_messages_equals_the_full_view_but_the_messages(events: list[dict[str, Any]]) -> None:
    full = build_view(events, CTX)
    lean = build_view(events, CTX, messages=False)
    assert lean.messages == []
    for name in ("prompt_estimate", "current_turn_id", "model", "encoding", "summary", "visible", "last_ended_turn",
                 "max_turn", "context_window", "candidates", "compacted", "elided"):
        assert getattr(lean, name) == getattr(full, name), name
    state, view = rebuild_with_view("s1", "/w", events, CTX, 7)
    assert state == rebuild("s1", "/w", events, CTX, 7) and view == lean


@given(events=logs(), start=st.integers(0, 8), length=st.integers(-1, 8), as_worker=st.booleans())
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_extending_a_view_with_a_compact_equals_building_it(
    events: list[dict[str, Any]], start: int, length: int, as_worker: bool,
) -> None:
    view = build_view(events, CTX, messages=False)
    turns = [c["turnId"] for c in view.candidates]
    if as_worker and turns:  # as the micro step does: the range of the candidates' turns
        start, length = min(turns), max(turns) - min(turns)
    appended = [compact(start, start + length)]
    assert extend_view(view, appended, CTX) == build_view(events + appended, CTX, messages=False)


@given(events=logs(), start=st.integers(0, 8), length=st.integers(-1, 8), as_worker=st.booleans())
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_view_given_its_estimate_extends_to_the_state_a_rebuild_gives(
    events: list[dict[str, Any]], start: int, length: int, as_worker: bool,
) -> None:
    """The micro job's view counts nothing (its estimate is the stored state's); the state
    after its compact is the rebuild's all the same, the new elisions counted on top."""
    known = rebuild("s1", "/w", events, CTX, 0).prompt_estimate
    lean = build_view(events, CTX, messages=False, estimate=known)
    full = build_view(events, CTX, messages=False)
    for name in ("prompt_estimate", "current_turn_id", "model", "encoding", "summary", "visible", "last_ended_turn",
                 "max_turn", "context_window", "candidates", "compacted"):
        assert getattr(lean, name) == getattr(full, name), name
    turns = [c["turnId"] for c in lean.candidates]
    if as_worker and turns:
        start, length = min(turns), max(turns) - min(turns)
    appended = [compact(start, start + length)]
    extended = extend_view(lean, appended, CTX)
    assert extended is not None
    assert rebuild_with_view("s1", "/w", events + appended, CTX, 9, extended)[0] == rebuild(
        "s1", "/w", events + appended, CTX, 9)


def test_a_view_with_messages_cannot_be_given_an_estimate() -> None:
    with pytest.raises(ValueError, match="estimate"):
        build_view(simple_turn(1), CTX, estimate=5)


def test_extending_a_view_with_other_lines_is_left_to_a_full_build() -> None:
    view = build_view(simple_turn(1, "q"), CTX, messages=False)
    assert extend_view(view, [rollback(1)], CTX) is None
    assert extend_view(view, [compact(1, 1), compact(1, 1)], CTX) is None
    assert extend_view(view, [summary([], "s", 1)], CTX) is None


def _worker_compact(view: Any) -> dict[str, Any] | None:
    """The compact an LLM job's micro step makes of ``view`` (None without old candidates)."""
    turns = [c["turnId"] for c in view.candidates if c["turnId"] < view.current_turn_id - 1]
    return compact(min(turns), max(turns)) if turns else None


def _render(event: dict[str, Any]) -> str:
    return orjson.dumps(event, option=orjson.OPT_SORT_KEYS).decode()


def _targets_after(events: list[dict[str, Any]], ctx: ContextSettings) -> tuple[Any, int, int, list[dict[str, Any]]]:
    """SPEC §5's targets read off the full view of ``events``: (the previous summary, the end
    turn, the turn after which they start, each target with its output as shown)."""
    view = build_view(events, ctx, messages=False)
    end = view.current_turn_id - ctx.keep_recent_turns - 1
    previous = view.summary
    start = previous.get("lastSummarizedTurnId") if previous is not None else 0
    start = start if type(start) is int else 0
    targets = []
    for position, event in enumerate(view.visible):
        turn = event.get("turnId") if type(event.get("turnId")) is int else 0
        if end > start and event.get("type") in ("user", "assistant", "tool_result") and start < turn <= end:
            shown = view.elided.get(position)
            targets.append(event if shown is None else {**event, "output": shown[0]})
    return previous, end, start, targets


@given(events=logs(), data=st.data(), keep=st.integers(0, 3), micro=st.booleans())
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_an_llm_pass_gives_the_targets_and_the_state_a_rebuild_gives_after_the_append(
    events: list[dict[str, Any]], data: st.DataObject, keep: int, micro: bool,
) -> None:
    events = [dict(e) for e in events]
    for event in events:  # some lines without a uuid, and now and then one reused (SPEC §3 broken)
        if data.draw(st.integers(0, 5)) == 0:
            event.pop("uuid", None)
    uuids = [e["uuid"] for e in events if "uuid" in e]
    if uuids and data.draw(st.integers(0, 2)) == 0:
        data.draw(st.sampled_from(events))["uuid"] = data.draw(st.sampled_from(uuids))
    ctx = ContextSettings(keep_recent_turns=keep)
    reading = llm_pass(events, ctx, micro=micro, render=_render, block_tokens=6)

    view = build_view(events, ctx, messages=False)
    pending = _worker_compact(view) if micro else None
    assert reading.compact_turns == (None if pending is None else (pending["startTurnId"], pending["endTurnId"]))
    previous, end, start, expected = _targets_after(events + ([] if pending is None else [pending]), ctx)
    got = reading.targets
    assert (got.previous_summary, got.end_turn, got.start_after) == (previous, end, start)
    assert len(got.events) == len(expected)
    for shown, want in zip(got.events, expected):
        if any(want is e for e in events):  # shown as logged
            assert shown is want
            continue
        # elided (by a compact in the log or the pending one): the text as shown, an estimated stamp
        original = next(e for e in events if e.get("output") is not None and e.items() >= {
            k: v for k, v in want.items() if k != "output"}.items())
        assert {k: v for k, v in shown.items() if k not in ("tokenCount", "tokenEncoding")} == {
            k: v for k, v in want.items() if k not in ("tokenCount", "tokenEncoding")}
        assert shown["tokenEncoding"] == view.encoding
        stamp_before = stamped_tokens(original, view.encoding)
        assert shown["tokenCount"] == -(-stamp_before * len(shown["output"]) // len(original["output"])) + 4
    assert reading.blocks == [_render(e) for e in got.events]
    assert reading.target_tokens == sum(stamped_tokens(e, view.encoding) + 6 for e in got.events)
    if not got.events:
        return
    replaces = [e["uuid"] for e in got.events if isinstance(e.get("uuid"), str)]
    # every visible summary is replaced, the latest (``previous``) last: the context keeps one
    folded = [e for e in view.visible if e.get("type") == "summary" and e is not previous
              and isinstance(e.get("uuid"), str)] + [previous]  # (one without a uuid cannot be replaced)
    assert got.previous_summaries == ([] if previous is None else folded)
    replaces += [e["uuid"] for e in got.previous_summaries if isinstance(e.get("uuid"), str)]
    assert reading.replaces == replaces
    new_summary = stamp(summary(replaces, data.draw(texts), end), view.encoding)
    appended = ([] if pending is None else [pending]) + [new_summary]
    before = rebuild("s1", "/w", events, ctx, log_size=3)
    after = state_after_summary(before, reading, appended, ctx, log_size=9)
    if reading.exact:
        assert after == rebuild("s1", "/w", events + appended, ctx, log_size=9)
    else:  # a line that stays visible shares a replaced uuid: it is hidden too, only a rebuild knows
        stays = [e for e in view.visible if not any(e is t for t in got.events + got.previous_summaries)
                 and e.get("type") not in ("rollback", "session_meta")]
        assert any(e.get("uuid") in set(replaces) for e in stays)


def test_an_llm_pass_is_not_exact_when_a_line_that_stays_shares_a_replaced_uuid() -> None:
    events = simple_turn(1) + simple_turn(2) + simple_turn(3)
    events[10] = {**events[10], "uuid": events[0]["uuid"]}  # turn 3's user reuses turn 1's uuid
    reading = llm_pass(events, CTX, micro=False, render=_render)
    assert events[0]["uuid"] in reading.replaces and not reading.exact
    appended = [stamp(summary(reading.replaces, "s", reading.targets.end_turn), reading.encoding)]
    guessed = state_after_summary(rebuild("s1", "/w", events, CTX, 1), reading, appended, CTX, 2)
    assert guessed != rebuild("s1", "/w", events + appended, CTX, 2)  # the reused line is hidden too
    events[10] = {**events[10], "uuid": "fresh"}
    assert llm_pass(events, CTX, micro=False, render=_render).exact


def test_the_state_fingerprint_names_the_settings_a_state_depends_on_and_only_those() -> None:
    base = ContextSettings()
    fingerprint = base.state_fingerprint
    for change in ({"micro_compact_min_chars": 121}, {"micro_compact_keep_chars": 41},
                   {"default_context_window": 64_000}, {"compactable_tools": ("read_file",)}):
        assert ContextSettings(**change).state_fingerprint != fingerprint, change  # type: ignore[arg-type]
        assert base.model_copy(update=change).state_fingerprint != fingerprint, change  # a copy is not stale
    for change in ({"keep_recent_turns": 3}, {"compaction_threshold": 0.8}, {"compaction_model": "x"},
                   {"compactable_tools": tuple(reversed([t.upper() for t in base.compactable_tools]))}):
        assert ContextSettings(**change).state_fingerprint == fingerprint, change  # type: ignore[arg-type]
    narrowed = base.model_copy(update={"compactable_tools": ("grep",)})
    assert narrowed.is_compactable("GREP") and not narrowed.is_compactable("read_file")


def test_a_state_derived_by_an_earlier_version_is_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    current = ContextSettings().state_fingerprint
    monkeypatch.setattr(config, "STATE_DERIVATION", config.STATE_DERIVATION - 1)
    config._fingerprint.cache_clear()
    try:
        assert ContextSettings().state_fingerprint != current
    finally:
        config._fingerprint.cache_clear()


def test_every_state_records_the_settings_it_was_derived_under() -> None:
    ctx = ContextSettings(micro_compact_keep_chars=7)
    events = [e for t in range(1, 4) for e in simple_turn(t, output=LONG)]
    assert SessionState.empty("s1", "/w", ctx).settings == ctx.state_fingerprint
    assert rebuild("s1", "/w", events, ctx, 0).settings == ctx.state_fingerprint
    state = rebuild("s1", "/w", events, ctx, 0)
    assert SessionState.from_hash(state.to_hash()) == state


def test_an_llm_pass_folds_in_every_visible_summary_it_can_replace() -> None:
    """A producer's summary beside the worker's: the new summary replaces both (each job replaced
    the latest alone, the other stayed for good); one without a uuid cannot be replaced, so it is
    not folded in (folded, it came back in every summary after, once more each time)."""
    older, bare = summary([], "older", 1), {**summary([], "bare", 1), "uuid": None}
    latest = summary([], "latest", 2)
    events = [*simple_turn(1), older, bare, *simple_turn(2), latest, *simple_turn(3), *simple_turn(4),
              *simple_turn(5)]
    reading = llm_pass(events, ContextSettings(keep_recent_turns=1), micro=False, render=_render)
    assert reading.targets.previous_summaries == [older, latest]
    assert reading.replaces[-2:] == [older["uuid"], latest["uuid"]]


# What a state's derivation computes, digested, per STATE_DERIVATION: token counts of texts that
# took fixes (long runs of blanks, short texts counted by their own cache, special-token text, other
# scripts) in both encodings, and the estimate of a log whose outputs sit at the elision's edges.
# A run of blanks counted a piece at a time changed a count by one and STATE_DERIVATION stayed: the
# states an earlier version stored were trusted as they were (an upgrade audit found the estimate
# off by one against a rebuild). A change to what this digests fails here until STATE_DERIVATION
# is bumped and the new digest recorded beside it.
DERIVATION_DIGESTS = {3: "bd7589e276716c77"}


def _derivation_digest() -> str:
    import hashlib

    from events.tokens import count_tokens

    texts = ["", "hello world", "x" * 64, "x" * 65, "start" + " " * 8_200 + "end", "\t\n " * 7_000 + "y",
             "caf\u00e9 \u4e2d\u6587 \U0001f600 \u0645\u0631\u062d\u0628\u0627", "<|endoftext|> <|fim_prefix|> x",
             "def f(x):\n    return x * 2\n\n" * 40]
    counts = [count_tokens(text, encoding) for encoding in ("cl100k_base", "o200k_base") for text in texts]
    events: list[dict[str, Any]] = [{"type": "session_meta", "sessionId": "d", "cwd": "/w", "model": "gpt-4o"}]
    for turn, size in enumerate((119, 120, 121, 181, 999, 10_001), 1):
        output = "".join(chr(97 + (i * 7 + turn) % 26) for i in range(size))
        events += [{"type": "user", "turnId": turn, "content": f"step {turn}"},
                   {"type": "assistant", "turnId": turn, "content": "",
                    "toolCalls": [{"id": f"c{turn}", "name": "read_file", "arguments": {"path": f"f{turn}"}}]},
                   {"type": "tool_result", "turnId": turn, "toolCallId": f"c{turn}", "toolName": "read_file",
                    "output": output},
                   {"type": "turn_end", "turnId": turn, "model": "gpt-4o", "contextWindow": 128_000}]
    # (the settings the fingerprint names, given: a change of a default is no change of the derivation)
    ctx = ContextSettings(micro_compact_min_chars=120, micro_compact_keep_chars=40, default_context_window=128_000,
                          compactable_tools=("read_file",))
    estimates = [rebuild("d", "/w", events, ctx, 0).prompt_estimate]
    events.append({"type": "compact", "startTurnId": 1, "endTurnId": 5, "uuid": "k"})
    estimates.append(rebuild("d", "/w", events, ctx, 0).prompt_estimate)
    estimates.append(rebuild("d", "/w", events, ctx.model_copy(update={"micro_compact_keep_chars": 7}), 0)
                     .prompt_estimate)
    return hashlib.sha256(repr((counts, estimates)).encode()).hexdigest()[:16]


def test_a_change_in_what_a_state_derives_bumps_state_derivation() -> None:
    assert DERIVATION_DIGESTS.get(config.STATE_DERIVATION) == _derivation_digest(), (
        "what a state's derivation computes changed: bump STATE_DERIVATION (events/config.py) so that stored "
        "states are rebuilt, and record the new digest in DERIVATION_DIGESTS")
