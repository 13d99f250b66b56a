from __future__ import annotations

import hashlib
import json
import os
import select
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events import tokens
from events.tokens import (
    arguments_json,
    count_tokens,
    encoding_for_model,
    event_tokens,
    litellm_tokenizer_dir,
    model_max_input_tokens,
    stamp,
    stamped_tokens,
)
from tests.events.builders import assistant, call, result, summary, turn_end, user

ENCODINGS = ("cl100k_base", "o200k_base")
BPE_URL = "https://openaipublic.blob.core.windows.net/encodings/{}.tiktoken"


def test_a_lone_hello_world_user_message_is_six_tokens() -> None:
    assert count_tokens("hello world", "cl100k_base") == 2
    assert event_tokens(user(1, "hello world"), "cl100k_base") == 6


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_assistant_counts_content_and_each_calls_name_and_compact_arguments(encoding: str) -> None:
    args = {"path": "src/a.py", "lines": [1, 2], "note": "é"}
    event = assistant(1, "let me look", [call("c1", "read_file", args), call("c2", "fetch_url", '{"u": 1}')])
    expected = (
        count_tokens("let me look", encoding) + 4
        + count_tokens("read_file", encoding) + count_tokens('{"path":"src/a.py","lines":[1,2],"note":"é"}', encoding)
        + count_tokens("fetch_url", encoding) + count_tokens('{"u": 1}', encoding)
    )
    assert event_tokens(event, encoding) == expected


def test_arguments_object_is_counted_as_compact_json_not_pretty() -> None:
    args = {"a": [1, 2, 3], "b": {"c": "d"}}
    compact = assistant(1, "", [call("c", "x", args)])
    spaced = assistant(1, "", [call("c", "x", json.dumps(args))])
    assert event_tokens(compact, "cl100k_base") < event_tokens(spaced, "cl100k_base")


def test_tool_result_counts_output_and_tool_name() -> None:
    event = result(1, "c1", "file contents here", "read_file")
    enc = "cl100k_base"
    assert event_tokens(event, enc) == count_tokens("file contents here", enc) + count_tokens("read_file", enc) + 4


def test_summary_counts_its_text_and_other_types_count_zero() -> None:
    assert event_tokens(summary([], "the summary", 1), "cl100k_base") == count_tokens("the summary", "cl100k_base") + 4
    assert event_tokens(turn_end(1), "cl100k_base") == 0
    assert event_tokens({"type": "rollback", "throughTurnId": 1}, "cl100k_base") == 0


def test_special_token_text_is_counted_as_ordinary_text() -> None:
    assert count_tokens("a <|endoftext|> b", "cl100k_base") > 3
    assert event_tokens(user(1, "<|endoftext|><|fim_prefix|>"), "o200k_base") > 4


@pytest.mark.parametrize(
    ("model", "encoding"),
    [
        ("gpt-4o", "o200k_base"),
        ("openai/gpt-4o", "o200k_base"),
        ("openrouter/openai/gpt-4o-mini", "o200k_base"),
        ("gpt-4", "cl100k_base"),
        ("claude-3-5-sonnet", "cl100k_base"),
        (None, "cl100k_base"),
        ("", "cl100k_base"),
    ],
)
def test_encoding_for_model_strips_provider_and_falls_back_to_cl100k(model: str | None, encoding: str) -> None:
    assert encoding_for_model(model) == encoding


def test_stamp_replaces_a_producer_stamp_and_is_reused_only_for_its_encoding() -> None:
    forged = {**user(1, "hello world"), "tokenCount": 999, "tokenEncoding": "cl100k_base"}
    stamped = stamp(forged, "cl100k_base")
    assert stamped["tokenCount"] == 6 and stamped["tokenEncoding"] == "cl100k_base"
    assert forged["tokenCount"] == 999  # a copy, the input is untouched
    assert stamped_tokens(forged, "cl100k_base") == 999  # a matching stamp is trusted by readers
    assert stamped_tokens(forged, "o200k_base") == event_tokens(forged, "o200k_base")


def test_stamp_of_an_uncounted_event_carries_no_stamp() -> None:
    stamped = stamp({**turn_end(1), "tokenCount": 5, "tokenEncoding": "x"}, "cl100k_base")
    assert "tokenCount" not in stamped and "tokenEncoding" not in stamped


@pytest.mark.parametrize("name", ENCODINGS)
def test_litellm_ships_the_bpe_files_of_both_encodings(name: str) -> None:
    directory = litellm_tokenizer_dir()
    assert directory is not None
    assert (Path(directory) / hashlib.sha1(BPE_URL.format(name).encode()).hexdigest()).is_file()


def test_token_counting_works_offline_without_importing_litellm(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import os, socket, sys
        def refuse(*args, **kwargs):
            raise OSError("network disabled in this test")
        socket.socket = refuse
        socket.create_connection = refuse
        from events.tokens import count_tokens
        print(count_tokens("hello world", "cl100k_base"), count_tokens("hello world", "o200k_base"))
        print("litellm" in sys.modules)
        print(os.environ["TIKTOKEN_CACHE_DIR"])
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR")}
    env.update(HTTPS_PROXY="http://127.0.0.1:9", HTTP_PROXY="http://127.0.0.1:9", TMPDIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    counts, imported, cache_dir = done.stdout.splitlines()
    assert counts == "2 2"
    assert imported == "False"
    assert cache_dir == litellm_tokenizer_dir()


def test_a_model_whose_encoding_is_not_shipped_is_counted_with_cl100k_offline(tmp_path: Path) -> None:
    """tiktoken maps davinci/ada to r50k_base and gpt2 to gpt2, whose files litellm does not ship:
    every count of such a session raised a ConnectionError offline (the watcher's round failed
    again and again, the session's entries stayed pending, its API routes answered 500)."""
    script = textwrap.dedent(
        """
        import socket
        def refuse(*args, **kwargs):
            raise OSError("network disabled in this test")
        socket.socket.connect = refuse  # (the class kept: ssl subclasses it when imported)
        socket.create_connection = refuse
        from events.config import ContextSettings
        from events.tokens import encoding_for_model
        from events.view import build_view
        for model in ("davinci", "gpt2", "ollama/ada", "text-davinci-003", "gpt-4o"):
            print(model, encoding_for_model(model))
        events = [{"type": "user", "uuid": "u1", "turnId": 1, "content": "hello world"},
                  {"type": "turn_end", "uuid": "e1", "turnId": 1, "model": "davinci"}]
        print(build_view(events, ContextSettings()).prompt_estimate)
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR")}
    env.update(HTTPS_PROXY="http://127.0.0.1:9", HTTP_PROXY="http://127.0.0.1:9", TMPDIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "network disabled" not in done.stderr  # decided by name: no download was even tried
    assert done.stdout.splitlines() == [
        "davinci cl100k_base", "gpt2 cl100k_base", "ollama/ada cl100k_base", "text-davinci-003 p50k_base",
        "gpt-4o o200k_base", str(2 + 4)]  # "hello world" in cl100k_base, plus the message's overhead
    assert "token encoding r50k_base of model davinci is not one litellm ships: counting with cl100k_base" \
        in done.stderr


def test_a_user_chosen_tiktoken_cache_dir_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "/somewhere/else")
    tokens.ensure_offline_cache()
    assert os.environ["TIKTOKEN_CACHE_DIR"] == "/somewhere/else"


def test_model_max_input_tokens_from_litellm_and_none_when_unknown() -> None:
    assert model_max_input_tokens("gpt-4o") == 128_000
    assert model_max_input_tokens("openai/gpt-4o") == 128_000
    assert model_max_input_tokens("no-such-model-xyz") is None
    assert model_max_input_tokens("") is None


@pytest.fixture
def silent_servers(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[socket.socket]]:
    """Ollama's and huggingface.co's addresses pointed at sockets that accept and never answer."""
    listeners = []
    for _ in range(2):
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listeners.append(listener)
    monkeypatch.setenv("OLLAMA_API_BASE", "http://127.0.0.1:%d" % listeners[0].getsockname()[1])
    proxy = "http://127.0.0.1:%d" % listeners[1].getsockname()[1]
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.setenv(name, proxy)
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    model_max_input_tokens.cache_clear()
    yield listeners
    model_max_input_tokens.cache_clear()
    for listener in listeners:
        listener.close()


def test_a_models_window_is_never_asked_of_its_providers_server(silent_servers: list[socket.socket]) -> None:
    """litellm's ``get_model_info`` POSTs to Ollama (a 6 000 s timeout) for a model not in its map
    (and calls huggingface.co for ``huggingface/...``); the watcher works a window out holding its
    shards' leases, and one ``turn_end`` of a local model stalled it."""
    started = time.monotonic()
    for model in ("ollama/my-local-model", "huggingface/org/model"):
        assert model_max_input_tokens(model) is None
    assert time.monotonic() - started < 5
    assert select.select(silent_servers, [], [], 0)[0] == []  # no connection waits on either
    assert model_max_input_tokens("ollama/llama3") == 8192  # in the map: read from it


def test_a_litellm_without_a_catalog_only_lookup_reads_its_model_map(monkeypatch: pytest.MonkeyPatch) -> None:
    litellm = tokens.load_litellm()
    monkeypatch.setattr(litellm.utils, "get_model_info_helper", lambda model, custom_llm_provider=None: {})
    assert tokens._catalog_entry(litellm, "openai/gpt-4o")["max_input_tokens"] == 128_000
    assert tokens._catalog_entry(litellm, "ollama/llama3")["max_input_tokens"] == 8192
    with pytest.raises(KeyError):
        tokens._catalog_entry(litellm, "ollama/my-local-model")


_JSON_SCALARS = st.one_of(st.text(), st.booleans(), st.none(), st.integers(-(2**70), 2**70),
                          st.floats(allow_nan=True, allow_infinity=True))


@given(arguments=st.one_of(
    st.dictionaries(st.text(), _JSON_SCALARS, max_size=6),
    st.dictionaries(st.text(max_size=5), st.lists(_JSON_SCALARS, max_size=3) | st.dictionaries(
        st.text(max_size=3), _JSON_SCALARS, max_size=3), max_size=3),
    st.lists(_JSON_SCALARS, max_size=4),
))
@settings(max_examples=500)
def test_arguments_json_is_the_json_modules_compact_dump(arguments: object) -> None:
    expected = json.dumps(arguments, separators=(",", ":"), ensure_ascii=False)
    assert arguments_json(arguments) == expected


def test_arguments_json_dumps_every_character_as_the_json_module_does() -> None:
    text = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF)
    arguments = {text[:100]: text, "x": text[::-7]}
    assert arguments_json(arguments) == json.dumps(arguments, separators=(",", ":"), ensure_ascii=False)
    lone = {"s": "\ud800"}  # orjson cannot dump a lone surrogate: the json module does
    assert arguments_json(lone) == json.dumps(lone, separators=(",", ":"), ensure_ascii=False)


class _CountingEncoding:
    """A tiktoken encoding that records the texts it was asked to encode."""

    def __init__(self, encoding: object) -> None:
        self.encoding = encoding
        self.texts: list[str] = []

    def encode_ordinary(self, text: str) -> list[int]:
        self.texts.append(text)
        return self.encoding.encode_ordinary(text)  # type: ignore[attr-defined,no-any-return]


@pytest.fixture
def counting(monkeypatch: pytest.MonkeyPatch) -> Iterator[_CountingEncoding]:
    """Every tokenization is recorded; the shown-text cache starts empty."""
    real = tokens.get_encoding("cl100k_base")
    recorder = _CountingEncoding(real)
    monkeypatch.setattr(tokens, "get_encoding", lambda name: recorder)
    tokens.forget_shown_counts()
    yield recorder
    tokens.forget_shown_counts()


@given(text=st.text(max_size=tokens.SHOWN_TEXT_CHARS + 50))
@settings(max_examples=200)
def test_count_shown_tokens_is_count_tokens(text: str) -> None:
    assert tokens.count_shown_tokens(text, "cl100k_base") == count_tokens(text, "cl100k_base")


def test_a_shown_text_is_tokenized_once_and_a_long_one_every_time(counting: _CountingEncoding) -> None:
    shown = "head of the output\n…[4000 characters elided]…\ntail of the output" * 2
    long = "x " * tokens.SHOWN_TEXT_CHARS
    first = [tokens.count_shown_tokens(text, "cl100k_base") for text in (shown, long)]
    equal = "x " * tokens.SHOWN_TEXT_CHARS  # the same text, another string: no cache keeps long texts
    again = [tokens.count_shown_tokens(text, "cl100k_base") for text in (shown, equal)]
    assert counting.texts.count(shown) == 1
    assert counting.texts.count(long) == 2
    assert first == again == [count_tokens(shown, "cl100k_base"), count_tokens(long, "cl100k_base")]


def test_the_very_same_long_string_counted_twice_in_a_row_is_tokenized_once(counting: _CountingEncoding) -> None:
    """A summary is counted against its limit, then again when its line is stamped."""
    summary, other = "word " * 200, "other " * 200
    assert count_tokens(summary, "cl100k_base") == count_tokens(summary, "cl100k_base") > 200
    count_tokens(summary, "o200k_base")  # another encoding: counted
    count_tokens(other, "cl100k_base")
    count_tokens(summary, "cl100k_base")  # not the last one counted: counted again
    assert counting.texts.count(summary) == 3


def test_a_million_blanks_are_counted_not_a_crash_of_the_tokenizer() -> None:
    """tiktoken overflowed its stack on a run of a million spaces (a PanicException, a BaseException
    no handler caught: one producer's event killed the watcher at each try), and was quadratic
    before it: long runs of blanks are counted a piece at a time, in linear time."""
    import time

    from events.tokens import count_tokens

    started = time.monotonic()
    for text in (" " * 1_000_000 + "x", "\t" * 2_000_000, ("x" + " " * 8_000) * 300):
        assert count_tokens(text, "cl100k_base") == count_tokens(text, "cl100k_base") > 0
    assert time.monotonic() - started < 10
    assert count_tokens("hello world", "cl100k_base") == 2  # (ordinary text: as tiktoken counts it)
