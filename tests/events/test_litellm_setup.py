"""events.litellm_setup: the level litellm's loggers get (the import itself: tests/worker/test_summarize.py)."""

from __future__ import annotations

import logging

import pytest

from events.litellm_setup import DEFAULT_LITELLM_LEVEL, litellm_level


@pytest.mark.parametrize(("value", "level"), [
    (None, DEFAULT_LITELLM_LEVEL),
    ("", DEFAULT_LITELLM_LEVEL),
    ("DEBUG", logging.DEBUG),
    (" info ", logging.INFO),
    ("error", logging.ERROR),
    ("30", 30),
    ("loud", DEFAULT_LITELLM_LEVEL),
    ("\u00b2", DEFAULT_LITELLM_LEVEL),  # a digit to ``isdigit``, not to ``int``: a ValueError at import
])
def test_litellm_log_names_a_level_or_the_default_applies(value: str | None, level: int) -> None:
    assert litellm_level(value) == level
