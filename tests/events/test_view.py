from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compactor.bench.view import run as run_bench
from events.config import ContextSettings
from events.state import rebuild
from events.tokens import count_tokens, event_tokens, stamp
from events.view import (
    LlmPass,
    build_view,
    current_turn_id,
    elide,
    elision_marker,
    llm_pass,
    micro_candidates,
    session_model,
    undone_by_rollback,
)
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
ENC = "cl100k_base"


def _users(messages: list[dict]) -> list[str]:
    return [m["content"] for m in messages if m["role"] == "user"]


# -- rollback -------------------------------------------------------------------


def _three_turns() -> list[dict]:
    return [e for t in (1, 2, 3) for e in simple_turn(t, f"question {t}")]


def test_rollback_through_turn_one_hides_every_user_message() -> None:
    view = build_view([*_three_turns(), rollback(1)], CTX)
    assert _users(view.messages) == []
    assert view.messages == [] and view.prompt_estimate == 0
    assert view.current_turn_id == 1


def test_rollback_through_turn_two_keeps_only_turn_one() -> None:
    view = build_view([*_three_turns(), rollback(2)], CTX)
    assert _users(view.messages) == ["question 1"]
    assert {e.get("turnId") for e in view.visible if "turnId" in e} == {1}
    assert view.current_turn_id == 2


@pytest.mark.parametrize("through", ["2", 2.0, None, True])
def test_a_rollback_whose_through_turn_is_not_an_integer_hides_nothing(through: Any) -> None:
    """A hand-edited ``"throughTurnId": "2"`` read as 0 and hid every turn of the session."""
    marker = rollback(2)
    marker["throughTurnId"] = through
    turns = _three_turns()
    view = build_view([*turns, marker], CTX)
    assert view.messages == build_view(turns, CTX).messages and len(_users(view.messages)) == 3
    assert undone_by_rollback([*turns, compact(2, 2), marker]) == set()


def test_events_after_a_rollback_are_unaffected() -> None:
    events = [*_three_turns(), rollback(2), *simple_turn(2, "redo 2")]
    view = build_view(events, CTX)
    assert _users(view.messages) == ["question 1", "redo 2"]
    assert view.current_turn_id == 3


def test_rollback_hides_a_compact_and_a_summary_covering_a_rolled_back_turn() -> None:
    turns = [simple_turn(t, f"q{t}", LONG) for t in (1, 2, 3)]
    replaced = [e["uuid"] for e in turns[0] if e["type"] != "turn_end"]
    events = [*turns[0], *turns[1], *turns[2], compact(1, 2), summary(replaced, "S", 1), rollback(2)]
    view = build_view(events, CTX)
    # the compact covered turn 2 (hidden), the summary only turn 1 (kept)
    assert view.compacted == ()
    assert view.summary is not None and view.messages[0]["content"] == "S"
    assert _users(view.messages) == []


# -- summaries ------------------------------------------------------------------


def test_a_summary_hides_what_it_replaces_and_is_shown_first() -> None:
    t1, t2 = simple_turn(1, "q1"), simple_turn(2, "q2")
    replaced = [e["uuid"] for e in t1 if e["type"] != "turn_end"]
    s = summary(replaced, "SUMMARY ONE", 1)
    view = build_view([*t1, *t2, s], CTX)
    assert view.messages[0] == {"role": "system", "name": "compacted_history", "content": "SUMMARY ONE"}
    assert _users(view.messages) == ["q2"]
    assert view.summary == s
    expected = sum(event_tokens(e, ENC) for e in [s, *t2])
    assert view.prompt_estimate == expected


def test_a_later_summary_replacing_an_earlier_one_leaves_exactly_one() -> None:
    t1, t2, t3 = simple_turn(1, "q1"), simple_turn(2, "q2"), simple_turn(3, "q3")
    first = summary([e["uuid"] for e in t1], "FIRST", 1)
    second = summary([*(e["uuid"] for e in t2), first["uuid"]], "SECOND", 2)
    view = build_view([*t1, *t2, first, *t3, second], CTX)
    systems = [m for m in view.messages if m["role"] == "system"]
    assert [m["content"] for m in systems] == ["SECOND"]
    assert _users(view.messages) == ["q3"]
    assert view.summary == second


def test_rolling_back_the_later_summary_shows_the_earlier_one_again() -> None:
    t1, t2, t3 = simple_turn(1, "q1"), simple_turn(2, "q2"), simple_turn(3, "q3")
    first = summary([e["uuid"] for e in t1], "FIRST", 1)
    second = summary([*(e["uuid"] for e in t2), first["uuid"]], "SECOND", 2)
    view = build_view([*t1, *t2, first, *t3, second, rollback(2)], CTX)
    assert [m["content"] for m in view.messages if m["role"] == "system"] == ["FIRST"]
    assert _users(view.messages) == []


# -- micro elision ----------------------------------------------------------------


def _tool_turn(turn: int, output: str, tool: str) -> list[dict]:
    return simple_turn(turn, f"q{turn}", output, tool)


def _tool_contents(view_messages: list[dict]) -> list[str]:
    return [m["content"] for m in view_messages if m["role"] == "tool"]


def test_elision_applies_only_to_compactable_tools_case_insensitively_over_the_minimum() -> None:
    exactly = "e" * CTX.micro_compact_min_chars
    over = "o" * (CTX.micro_compact_min_chars + 1)
    events = [
        *_tool_turn(1, LONG, "Read_File"),
        *_tool_turn(2, LONG, "ask_user"),
        *_tool_turn(3, exactly, "read_file"),
        *_tool_turn(4, over, "EXECUTE_COMMAND"),
        *_tool_turn(5, LONG, "read_file"),  # not in the compacted range
        compact(1, 4),
    ]
    shown = _tool_contents(build_view(events, CTX).messages)
    assert "characters elided" in shown[0] and len(shown[0]) < len(LONG)
    assert shown[1] == LONG
    assert shown[2] == exactly
    assert "characters elided" in shown[3] and len(shown[3]) < len(over)
    assert shown[4] == LONG


def test_elided_output_keeps_head_and_tail_and_names_the_omitted_count() -> None:
    output = "HEAD" + "m" * 1000 + "TAIL"
    shown = elide(output, 40)
    assert shown.startswith(output[:40]) and shown.endswith(output[-40:])
    assert re.search(r"\[(\d+) characters elided\]", shown).group(1) == str(len(output) - 80)  # type: ignore[union-attr]


@given(output=st.text(min_size=CTX.micro_compact_min_chars + 1, max_size=600), keep=st.integers(0, 400))
@settings(max_examples=300)
def test_elided_text_is_always_strictly_shorter(output: str, keep: int) -> None:
    shown = elide(output, keep)
    assert len(shown) < len(output)
    kept = int(re.search(r"\[(\d+) characters elided\]", shown).group(1))  # type: ignore[union-attr]
    head = (len(output) - kept) // 2
    assert shown.startswith(output[:head]) and shown.endswith(output[len(output) - head:])


def _elide_by_definition(output: str, keep_chars: int) -> str:
    """``elide`` by its definition, by search: head and tail of the most characters, up to
    ``keep_chars``, that leave the result strictly shorter (SPEC §8), else the output whole."""
    length = len(output)
    for keep in range(min(keep_chars, length // 2), -1, -1):
        shown = output[:keep] + elision_marker(length - 2 * keep) + output[length - keep:]
        if len(shown) < length:
            return shown
    return output


def test_an_output_too_short_for_both_halves_keeps_all_it_can() -> None:
    # 40 + 40 kept of 107 characters leaves 27 elided: a 26-character marker, 106 in all (< 107)
    output = "".join(chr(97 + i % 26) for i in range(107))
    shown = elide(output, 40)
    assert shown == output[:40] + elision_marker(27) + output[-40:]
    assert len(shown) == 106
    for length in range(1, 700):  # every length, against the search, for keeps around the switch-over
        for keep in (0, 1, 40, 46, 47, 100, 330):
            assert elide("q" * length, keep) == _elide_by_definition("q" * length, keep), (length, keep)


@given(output=st.text(max_size=300) | st.integers(0, 20_000).map(lambda n: "y" * n), keep=st.integers(0, 400))
@settings(max_examples=400)
def test_elide_equals_its_definition(output: str, keep: int) -> None:
    shown = elide(output, keep)
    assert shown == _elide_by_definition(output, keep)
    assert (shown is output) == (len(shown) == len(output))


@given(min_chars=st.integers(1, 200), keep=st.integers(0, 200), size=st.integers(0, 400))
@settings(max_examples=200)
def test_an_elided_tool_result_in_a_view_is_never_longer(min_chars: int, keep: int, size: int) -> None:
    ctx = ContextSettings(micro_compact_min_chars=min_chars, micro_compact_keep_chars=keep)
    output = "x" * size
    view = build_view([*_tool_turn(1, output, "read_file"), compact(1, 1)], ctx)
    assert len(_tool_contents(view.messages)[0]) <= size


@pytest.mark.parametrize("size", [20, 26, 27, 40])
def test_an_output_too_short_to_elide_is_no_candidate_whatever_the_minimum(size: int) -> None:
    """DESIGN: an output of 26 characters or fewer is shown whole and is no candidate. Under
    ``microCompactMinChars: 10`` one of 20 was a candidate: the state's trigger fired and the micro
    job appended a compact that changed nothing, reported as a compaction."""
    ctx = ContextSettings(micro_compact_min_chars=10)
    events = [*_tool_turn(1, "x" * size, "read_file"), *simple_turn(2)]
    elidable = size >= 27
    assert bool(micro_candidates(events, ctx)) is elidable
    assert (rebuild("s", "/p", events, ctx, 0).min_candidate_turn == 1) is elidable
    assert (llm_pass(events, ctx, micro=True, render=str).compact_turns is not None) is elidable


def test_prompt_estimate_counts_the_elided_output_as_shown() -> None:
    t1 = _tool_turn(1, LONG, "read_file")
    view = build_view([*t1, compact(1, 1)], CTX)
    shown = _tool_contents(view.messages)[0]
    expected = sum(event_tokens(e, ENC) for e in t1 if e["type"] != "tool_result")
    expected += count_tokens(shown, ENC) + count_tokens("read_file", ENC) + 4
    assert view.prompt_estimate == expected
    assert view.prompt_estimate < build_view(t1, CTX).prompt_estimate


def test_prompt_estimate_reuses_matching_stamps() -> None:
    forged = {**user(1, "hello world"), "tokenCount": 1000, "tokenEncoding": ENC}
    assert build_view([forged], CTX).prompt_estimate == 1000
    other = {**forged, "tokenEncoding": "o200k_base"}
    assert build_view([other], CTX).prompt_estimate == 6
    assert build_view([stamp(user(1, "hello world"), ENC)], CTX).prompt_estimate == 6


# -- messages -------------------------------------------------------------------------


def test_messages_are_openai_chat_messages() -> None:
    events = [
        user(1, "read it"),
        assistant(1, "", [call("c1", "read_file", {"path": "a.py"}), call("c2", "fetch_url", '{"u":1}')]),
        result(1, "c1", "A", "read_file"),
        result(1, "c2", "B", "fetch_url"),
        assistant(1, "done"),
        turn_end(1),
    ]
    assert build_view(events, CTX).messages == [
        {"role": "user", "content": "read it"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path":"a.py"}'}},
            {"id": "c2", "type": "function", "function": {"name": "fetch_url", "arguments": '{"u":1}'}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "name": "read_file", "content": "A"},
        {"role": "tool", "tool_call_id": "c2", "name": "fetch_url", "content": "B"},
        {"role": "assistant", "content": "done"},
    ]


def test_an_assistant_with_an_unanswered_tool_call_is_dropped_with_its_answered_results() -> None:
    events = [
        user(1, "go"),
        assistant(1, "calling", [call("c1"), call("c2")]),
        result(1, "c1", "only one answered"),
        result(1, "orphan", "no call for this"),
        assistant(1, "end"),
    ]
    view = build_view(events, CTX)
    assert view.messages == [{"role": "user", "content": "go"}, {"role": "assistant", "content": "end"}]
    # promptEstimate is computed before pairing: dropped messages still count
    assert view.prompt_estimate == sum(event_tokens(e, ENC) for e in events)


@pytest.mark.parametrize("bad", [["c1"], {"a": 1}, 1])
def test_a_call_id_or_tool_call_id_that_is_not_a_string_pairs_nothing(bad: Any) -> None:
    """Hand-edited ids: a list or object raised TypeError (unhashable) in every view, and an
    int paired with an int. Only string ids pair (an LLM's tool_call_id is a string)."""
    answered = [user(1, "go"), assistant(1, "calling", [call("c1")]), result(1, "c1", "A"), assistant(1, "end")]
    kept = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "end"}]
    bad_result = [dict(e) for e in answered]
    bad_result[2]["toolCallId"] = bad
    bad_call = [dict(e) for e in answered]
    bad_call[1]["toolCalls"] = [call(bad), call("c2")]
    both = [dict(e) for e in bad_result]
    both[1]["toolCalls"] = [call(bad)]  # the call and its result carry the same odd id
    for events in (bad_result, bad_call, both):
        view = build_view(events, CTX)
        assert view.messages == kept
        assert view.prompt_estimate == sum(event_tokens(e, ENC) for e in events)


def test_a_tool_result_before_its_call_does_not_answer_it() -> None:
    events = [user(1), result(1, "c1", "early"), assistant(1, "", [call("c1")])]
    assert build_view(events, CTX).messages == [{"role": "user", "content": "hi"}]


def test_a_stray_result_ahead_of_a_call_does_not_hide_the_answer_after_it() -> None:
    events = [user(1), result(1, "c1", "early"), assistant(1, "a", [call("c1")]), result(1, "c1", "late")]
    messages = build_view(events, CTX).messages
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert _tool_contents(messages) == ["late"]


def test_a_call_id_reused_by_a_later_assistant_is_answered_by_the_result_after_it() -> None:
    events = [user(1), assistant(1, "a1", [call("c1")]), result(1, "c1", "r1"),
              assistant(1, "a2", [call("c1")]), result(1, "c1", "r2")]
    messages = build_view(events, CTX).messages
    assert [(m["role"], m["content"]) for m in messages] == [
        ("user", "hi"), ("assistant", "a1"), ("tool", "r1"), ("assistant", "a2"), ("tool", "r2")]


def test_a_call_left_unanswered_does_not_take_the_answer_to_the_next_call_of_its_id() -> None:
    """An interrupted turn's call (no result) took the result of the next turn's call of the same id
    (providers reuse ids): that call was dropped, and its answer followed a user message in the chat."""
    events = [user(1, "read t1"), assistant(1, "", [call("call_0")]), user(2, "read t2"),
              assistant(2, "", [call("call_0")]), result(2, "call_0", "contents of t2"), assistant(2, "done")]
    messages = build_view(events, CTX).messages
    assert [(m["role"], m["content"]) for m in messages] == [
        ("user", "read t1\n\nread t2"), ("assistant", ""), ("tool", "contents of t2"), ("assistant", "done")]
    assert messages[1]["tool_calls"][0]["id"] == "call_0"
    # parallel calls of one id in two assistants before their answers: the later call takes them
    events = [user(1), assistant(1, "a1", [call("c1")]), assistant(1, "a2", [call("c1")]),
              result(1, "c1", "r1"), result(1, "c1", "r2")]
    assert [(m["role"], m["content"]) for m in build_view(events, CTX).messages] == [
        ("user", "hi"), ("assistant", "a2"), ("tool", "r1")]


def test_an_answer_taken_by_a_dropped_assistant_is_free_for_nobody_before_it() -> None:
    """An assistant dropped for another unanswered call takes no answer; its result answers nothing else."""
    events = [user(1), assistant(1, "a1", [call("c1"), call("c2")]), result(1, "c1", "r1"),
              assistant(1, "a2", [call("c1")]), result(1, "c1", "r2")]
    messages = build_view(events, CTX).messages
    assert [(m["role"], m["content"]) for m in messages] == [("user", "hi"), ("assistant", "a2"), ("tool", "r2")]


def test_a_duplicate_tool_result_is_dropped() -> None:
    events = [assistant(1, "", [call("c1")]), result(1, "c1", "first"), result(1, "c1", "second")]
    assert _tool_contents(build_view(events, CTX).messages) == ["first"]


def test_adjacent_same_role_messages_are_merged_with_a_blank_line() -> None:
    events = [
        user(1, "one"), user(1, "two"),
        assistant(1, "a"), assistant(1, "b"),
        assistant(1, "c", [call("c1")]), result(1, "c1", "r"),
        assistant(1, "d", [call("c2")]), result(1, "c2", "r2"),
        assistant(1, "e"), assistant(1, "f"),
    ]
    messages = build_view(events, CTX).messages
    assert [(m["role"], m["content"]) for m in messages] == [
        ("user", "one\n\ntwo"), ("assistant", "a\n\nb"), ("assistant", "c"), ("tool", "r"),
        ("assistant", "d"), ("tool", "r2"), ("assistant", "e\n\nf"),
    ]


def test_summaries_are_not_merged_and_the_log_is_not_mutated() -> None:
    s1, s2 = summary([], "S1", 1), summary([], "S2", 1)
    events = [s1, user(2, "x"), s2, user(2, "y")]
    copy = [dict(e) for e in events]
    messages = build_view(events, CTX).messages
    assert [m["content"] for m in messages] == ["S1", "S2", "x\n\ny"]
    assert events == copy


# -- turns and model --------------------------------------------------------------------


def test_current_turn_id() -> None:
    assert current_turn_id([]) == 1
    assert current_turn_id([meta("gpt-4o")]) == 1
    assert current_turn_id([user(1)]) == 1
    assert current_turn_id([user(1), turn_end(1)]) == 2
    assert current_turn_id([*simple_turn(1), *simple_turn(3), user(5)]) == 5
    assert current_turn_id([*simple_turn(1), *simple_turn(2), rollback(2)]) == 2


def test_session_model_prefers_the_latest_visible_turn_end() -> None:
    assert session_model([]) is None
    assert session_model([meta("gpt-4o")]) == "gpt-4o"
    assert session_model([meta("gpt-4o"), turn_end(1, "gpt-4"), turn_end(2, "o1")]) == "o1"
    assert session_model([meta("gpt-4o"), turn_end(1, "gpt-4"), turn_end(2, "o1"), rollback(2)]) == "gpt-4"
    assert session_model([meta("gpt-4o"), turn_end(1, "gpt-4"), rollback(1)]) == "gpt-4o"
    view = build_view([meta("x"), user(1, "hello world"), turn_end(1, "gpt-4o")], CTX)
    assert (view.model, view.encoding) == ("gpt-4o", "o200k_base")


# -- candidates and targets -------------------------------------------------------------


def test_micro_candidates_are_old_uncompacted_visible_long_compactable_outputs() -> None:
    events = [
        *_tool_turn(1, LONG, "read_file"),  # compacted below
        *_tool_turn(2, LONG, "read_file"),  # candidate
        *_tool_turn(3, LONG, "ask_user"),  # not compactable
        *_tool_turn(4, "short", "read_file"),  # too short
        *_tool_turn(5, LONG, "web_search"),  # candidate
        *_tool_turn(6, LONG, "read_file"),  # turn T: too recent
        compact(1, 1),
    ]
    assert [e["turnId"] for e in micro_candidates(events, CTX)] == [2, 5]
    assert [e["turnId"] for e in micro_candidates(events, CTX, current_turn_id=6)] == [2]
    assert build_view(events, CTX).min_candidate_turn == 2


def test_micro_candidates_skip_summarized_and_rolled_back_outputs() -> None:
    t1, t2, t3 = (_tool_turn(t, LONG, "read_file") for t in (1, 2, 3))
    s = summary([e["uuid"] for e in t1], "S", 1)
    assert [e["turnId"] for e in micro_candidates([*t1, *t2, *t3, s], CTX)] == [2]  # t1 summarized; turns < 3
    t4 = _tool_turn(4, LONG, "read_file")
    assert [e["turnId"] for e in micro_candidates([*t1, *t2, *t3, s, *t4], CTX)] == [2, 3]
    assert micro_candidates([*t1, *t2, *t3, s, *t4, rollback(3)], CTX) == []  # only turn 1 is < 2


def _pass(events: list[dict[str, Any]], ctx: ContextSettings = CTX, *, micro: bool = False) -> LlmPass:
    return llm_pass(events, ctx, micro=micro, render=lambda e: f"{e['type']}:{e.get('output', '')}")


def test_llm_targets_cover_turns_after_the_previous_summary_up_to_end_turn() -> None:
    turns = [_tool_turn(t, LONG, "read_file") for t in (1, 2, 3, 4)]
    s = summary([e["uuid"] for e in turns[0] if e["type"] != "turn_end"], "S", 1)
    events = [*turns[0], *turns[1], s, *turns[2], *turns[3], compact(2, 2)]
    reading = _pass(events)
    targets = reading.targets
    assert targets.previous_summary == s
    assert (targets.start_after, targets.end_turn) == (1, 3)  # currentTurnId 5, keep 1
    assert {e["turnId"] for e in targets.events} == {2, 3}
    assert {e["type"] for e in targets.events} == {"user", "assistant", "tool_result"}
    outputs = {e["turnId"]: e["output"] for e in targets.events if e["type"] == "tool_result"}
    assert "characters elided" in outputs[2] and outputs[3] == LONG
    assert turns[1][2]["output"] == LONG  # the log's dict is untouched
    assert reading.blocks == [f"{e['type']}:{e.get('output', '')}" for e in targets.events]
    assert reading.replaces == [e["uuid"] for e in targets.events] + [s["uuid"]]
    assert reading.compact_turns is None  # no micro step asked for


def test_llm_targets_with_the_micro_step_show_its_candidates_elided() -> None:
    turns = [_tool_turn(t, LONG, "read_file") for t in (1, 2, 3, 4)]
    events = [e for turn in turns for e in turn]
    reading = _pass(events, micro=True)
    assert reading.compact_turns == (1, 3)  # the candidates before currentTurnId - 1 = 4
    outputs = [e["output"] for e in reading.targets.events if e["type"] == "tool_result"]
    assert len(outputs) == 3 and all("characters elided" in o for o in outputs)
    assert reading.kept_min_candidate_turn == 4  # turn 4's stays a candidate: not before 5 - 1
    assert _pass(events).compact_turns is None


def test_llm_targets_are_empty_when_only_the_kept_turn_exists() -> None:
    targets = _pass(simple_turn(1)).targets
    assert targets.end_turn == 0 and targets.events == [] and targets.previous_summary is None


# -- performance --------------------------------------------------------------------------


def test_view_bench_quick_reports_times() -> None:
    result_ = run_bench(quick=True)
    assert result_["view_s"] > 0 and result_["baseline_s"] > 0
    assert result_["ratio"] == pytest.approx(result_["view_s"] / result_["baseline_s"], rel=0.01)


def test_a_summary_that_replaces_a_compact_undoes_its_elision() -> None:
    """SPEC §4: summaries (step 2) hide what they replace before compacts mark turns (step 3)."""
    events = [*_tool_turn(1, "x" * 500, "read_file"), *simple_turn(2, "q2")]
    marker = compact(1, 1)
    elided = build_view([*events, marker], CTX)
    assert len(_tool_contents(elided.messages)[0]) < 500
    undone = build_view([*events, marker, summary([marker["uuid"]], "S", 0)], CTX)
    assert _tool_contents(undone.messages)[0] == "x" * 500
    assert undone.compacted == ()
    assert [c["turnId"] for c in undone.candidates] == [1]


@pytest.mark.parametrize("bad", [[1], {"a": 1}, 7])
def test_a_hand_edited_uuid_that_is_not_a_string_reads_as_no_uuid(bad: Any) -> None:
    """A list or object as a uuid (a hand-edited log) made the view and the LLM job's pass raise
    TypeError (unhashable); a summary's ``replaces`` can only name string uuids, so such a line
    reads as one with no uuid, wherever it stands: before, as or after a summary, or a compact."""
    turns = [_tool_turn(t, LONG, "read_file") for t in range(1, 6)]
    s = summary([e["uuid"] for e in turns[0] if e["type"] != "turn_end"] + [[1], {"a": 1}], "S", 1)
    events = [*turns[0], *turns[1], s, *turns[2], compact(2, 3), *turns[3], *turns[4]]
    for edited_at in (4, 8, 13, 14, 18):  # a user before the summary, the summary, the compact, later lines
        edited = [dict(e) for e in events]
        edited[edited_at]["uuid"] = bad
        without = [dict(e) for e in events]
        del without[edited_at]["uuid"]
        view, expected = build_view(edited, CTX), build_view(without, CTX)
        assert view.messages == expected.messages and view.prompt_estimate == expected.prompt_estimate
        reading, expected_reading = _pass(edited, micro=True), _pass(without, micro=True)
        assert reading.blocks == expected_reading.blocks and reading.exact == expected_reading.exact
        assert reading.replaces == expected_reading.replaces


def test_each_compacted_output_is_tokenized_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    # a micro job, a rebuild and the API build the view again and again: the elided outputs are
    # the same texts each time, and counting them dominated a micro job on a compacted log
    from events import tokens

    real = tokens.get_encoding(ENC)
    encoded: list[str] = []

    class Recording:
        def encode_ordinary(self, text: str) -> list[int]:
            encoded.append(text)
            return real.encode_ordinary(text)

    monkeypatch.setattr(tokens, "get_encoding", lambda name: Recording())
    tokens.forget_shown_counts()
    events = [*_tool_turn(1, LONG, "read_file"), *_tool_turn(2, LONG + "2", "read_file"), compact(1, 2)]
    first = build_view(events, CTX, messages=False)
    elided = [text for text in encoded if "characters elided" in text]
    assert len(elided) == 2
    encoded.clear()
    again = build_view(events, CTX)
    assert again.prompt_estimate == first.prompt_estimate
    assert not [text for text in encoded if "characters elided" in text]
    assert _tool_contents(again.messages) == elided


@pytest.mark.parametrize("calls", [7, "c1", {"id": "c1", "name": "read_file", "arguments": {}}, [7, "x"], [None]])
def test_an_assistant_whose_tool_calls_hold_no_object_is_a_plain_message_everywhere(calls: Any) -> None:
    """A hand-edited line's ``toolCalls: 7`` failed the view (a traceback from ``compactor context``)
    and every LLM job of the session (the transcript and the extractive summary), no failure ever
    counted; an object or strings gave ``tool_calls: []``, which a chat API refuses. The estimate
    counted only the objects of a list already."""
    from worker.extractive import extractive_summary
    from worker.summarize import render_event, validate_summary_text

    odd = {**assistant(1, "looked around"), "toolCalls": calls}
    events = [user(1, "find the bug"), odd, turn_end(1), user(2, "next"), turn_end(2)]
    view = build_view(events, CTX)
    assert view.messages[1] == {"role": "assistant", "content": "looked around"}
    assert view.prompt_estimate == build_view([user(1, "find the bug"), assistant(1, "looked around"), turn_end(1),
                                               user(2, "next"), turn_end(2)], CTX).prompt_estimate
    assert render_event(odd) == "[assistant]\nlooked around"
    reading = llm_pass(events, CTX, micro=False, render=render_event)
    assert reading.targets.events and "[assistant]\nlooked around" in "\n".join(map(render_event, reading.targets.events))
    validate_summary_text(extractive_summary(reading.targets.events, None))


def test_a_turn_of_thousands_of_adjacent_messages_is_merged_in_linear_time() -> None:
    """Each message merged copied the run's text so far: 4 000 user messages of 4 KB in one turn
    (an agent logging each streamed chunk) took 7 s a view, 8 000 took 95 s, for every context
    request and the status page's history (and no job can summarize the current turn)."""
    import time

    from events.view import MERGE_SEPARATOR, _merge

    chunks = [{"role": "user", "content": f"{n:05d}" + "x" * 4_000} for n in range(8_000)]
    started = time.monotonic()
    [merged] = _merge([*chunks])
    assert time.monotonic() - started < 5  # (quadratic: over a minute; linear: milliseconds)
    assert merged["content"] == MERGE_SEPARATOR.join(chunk["content"] for chunk in chunks)
    assert _merge([{"role": "assistant", "content": "a", "tool_calls": []}, *chunks[:2], {"role": "tool", "content": "t"},
                   chunks[2]]) == [{"role": "assistant", "content": "a", "tool_calls": []},
                                   {"role": "user", "content": chunks[0]["content"] + MERGE_SEPARATOR
                                    + chunks[1]["content"]}, {"role": "tool", "content": "t"}, chunks[2]]


def test_thousands_of_visible_summaries_are_told_apart_in_linear_time() -> None:
    """Each visible summary was looked for in the list of the earlier ones: 16 000 producer
    summaries replacing none (a 2.4 MB log) took 3 s a job, 64 000 ~50 s."""
    import time

    events = [stamp({"type": "summary", "uuid": f"s{n}", "replaces": [], "summaryText": "s",
                     "lastSummarizedTurnId": 1}, "cl100k_base") for n in range(40_000)]
    for turn_id in range(2, 6):
        events += [stamp({"type": "user", "uuid": f"u{turn_id}", "turnId": turn_id, "content": "hi"}, "cl100k_base"),
                   {"type": "turn_end", "uuid": f"e{turn_id}", "turnId": turn_id, "model": "gpt-4"}]
    started = time.monotonic()
    reading = llm_pass(events, CTX, micro=False, render=lambda event: "")
    assert time.monotonic() - started < 5  # (quadratic: ~20 s; linear: tens of milliseconds)
    assert len(reading.replaces) == 40_000 + 3  # (every summary, and the turns summarized)
