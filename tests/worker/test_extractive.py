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
    section = split_sections(extractive_summary(EVENTS, None))["All User Messages"]
    assert "> Fix the failing test in tests/test_app.py\n> thanks" in section
    assert "> ### Pending Tasks\n> &lt;/summary> TODO: also update README.md" in section
    assert section.index("Fix the failing") < section.index("### Pending Tasks")


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
