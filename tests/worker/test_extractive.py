"""worker.extractive: the offline 10-section summary."""

from __future__ import annotations

from worker.extractive import extractive_summary
from worker.summarize import (
    SECTION_TITLES,
    extract_summary,
    split_sections,
    validate_summary_text,
)

EVENTS = [
    {"type": "user", "turnId": 1, "content": "Fix the failing test in tests/test_app.py\nthanks"},
    {"type": "assistant", "turnId": 1, "content": "I chose pytest -x because it stops early.",
     "toolCalls": [{"id": "c1", "name": "execute_command", "arguments": {"cmd": "pytest src/app/main.py"}}]},
    {"type": "tool_result", "turnId": 1, "toolCallId": "c1", "toolName": "execute_command",
     "output": "collected 3\nE   AssertionError: expected 2\nFAILED tests/test_app.py::test_add"},
    {"type": "user", "turnId": 2, "content": "### Pending Tasks\n</summary> TODO: also update README.md"},
    {"type": "assistant", "turnId": 2, "content": "Updated the assertion; tests pass now."},
]


def test_output_passes_the_same_validation_as_llm_replies() -> None:
    text = extractive_summary(EVENTS, None)
    validate_summary_text(text)
    assert extract_summary(f"<summary>\n{text}\n</summary>") == text
    assert list(split_sections(text)) == list(SECTION_TITLES)


def test_every_user_message_is_kept_verbatim_in_order() -> None:
    text = extractive_summary(EVENTS, None)
    section = split_sections(text)["All User Messages"]
    assert EVENTS[0]["content"] in section and EVENTS[3]["content"] in section  # byte for byte
    assert section.index("Fix the failing") < section.index("### Pending Tasks")
    assert "also update" not in split_sections(text)["Current Work"]  # its heading line stayed inside


def test_a_user_message_with_backtick_fences_and_headings_cannot_break_out() -> None:
    tricky = "```\n### Current Work\n````\nstill mine\n~~~"
    text = extractive_summary([{"type": "user", "turnId": 1, "content": tricky}], None)
    validate_summary_text(text)
    assert tricky in split_sections(text)["All User Messages"]
    assert split_sections(text)["Current Work"] == "None."


def test_paths_without_extensions_path_arguments_and_crash_lines_are_extracted() -> None:
    events = [
        {"type": "user", "turnId": 1, "content": "see ~/project/bin/run and the Makefile"},
        {"type": "assistant", "turnId": 1, "content": "",
         "toolCalls": [{"id": "c1", "name": "read_file", "arguments": {"path": "/etc/hosts"}},
                       {"id": "c2", "name": "edit_file", "arguments": '{"file_path": "src/app"}'}]},
        {"type": "tool_result", "turnId": 1, "toolCallId": "c1", "toolName": "read_file",
         "output": "127.0.0.1 localhost\nSegmentation fault (core dumped)"},
    ]
    sections = split_sections(extractive_summary(events, None))
    for path in ("~/project/bin/run", "Makefile", "/etc/hosts", "src/app"):
        assert f"- {path}\n" in sections["Files and Code Sections"] + "\n", path
    assert "Segmentation fault (core dumped)" in sections["Errors and Fixes"]
    assert "localhost" not in sections["Errors and Fixes"]


def test_files_errors_and_current_work_are_extracted() -> None:
    sections = split_sections(extractive_summary(EVENTS, None))
    for path in ("tests/test_app.py", "src/app/main.py", "README.md"):
        assert path in sections["Files and Code Sections"]
    assert "AssertionError: expected 2" in sections["Errors and Fixes"]
    assert "Updated the assertion; tests pass now." in sections["Current Work"]
    assert "because it stops early" in sections["Decision Rationale"]
    assert "also update README.md" in sections["Pending Tasks"]


def test_it_is_deterministic_and_carries_the_previous_summary_forward() -> None:
    first = extractive_summary(EVENTS[:3], None)
    assert first == extractive_summary(EVENTS[:3], None)
    second = extractive_summary(EVENTS[3:], first)
    validate_summary_text(second)
    sections = split_sections(second)
    assert "Fix the failing test" in sections["Primary Request"]
    assert "Fix the failing test" in sections["All User Messages"]
    assert "also update README.md" in sections["All User Messages"]
    assert "src/app/main.py" in sections["Files and Code Sections"]


def test_empty_targets_still_give_a_valid_summary() -> None:
    validate_summary_text(extractive_summary([], None))
