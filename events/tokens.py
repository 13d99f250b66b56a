"""Offline token counting and the per-line token stamp (SPEC §4.5).

Invariants:
- Counting never touches the network: before tiktoken loads its first encoding,
  ``TIKTOKEN_CACHE_DIR`` (when unset) points at the BPE files litellm ships in
  ``litellm/litellm_core_utils/tokenizers/`` (found without importing litellm,
  which costs seconds). ``cl100k_base``, ``o200k_base`` and ``p50k_base`` are there; a
  model whose encoding is not (``r50k_base``, ``gpt2``) is counted with ``cl100k_base``,
  as a model tiktoken does not know.
- Special-token text such as ``<|endoftext|>`` is counted as ordinary text;
  counting never raises on user content.
- ``event_tokens`` is the one definition of an event's contribution to
  promptEstimate; ``stamp`` stores exactly that number on the line
  (``tokenCount``) with the encoding it was computed with (``tokenEncoding``),
  and ``stamped_tokens`` reuses it only when the encodings match.
- litellm is imported lazily, once (``events.litellm_setup``), and only for
  ``model_max_input_tokens``.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import logging
import os
import re
from functools import lru_cache
from typing import Any, Mapping

import orjson
import tiktoken

from events.litellm_setup import load_litellm

logger = logging.getLogger(__name__)

DEFAULT_ENCODING = "cl100k_base"
MESSAGE_OVERHEAD_TOKENS = 4  # per counted item, SPEC §4.5
TOKEN_COUNT_FIELD = "tokenCount"
TOKEN_ENCODING_FIELD = "tokenEncoding"
COUNTED_TYPES = frozenset({"user", "assistant", "tool_result", "summary"})
_LITELLM_TOKENIZER_DIR = ("litellm_core_utils", "tokenizers")
# json.dumps(separators=(",", ":"), ensure_ascii=False), built once (dumps builds one per call).
_COMPACT_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def litellm_tokenizer_dir() -> str | None:
    """The directory of litellm's bundled tiktoken files, found without importing litellm."""
    try:
        spec = importlib.util.find_spec("litellm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = os.path.join(location, *_LITELLM_TOKENIZER_DIR)
        if os.path.isdir(candidate):
            return candidate
    return None


def ensure_offline_cache() -> None:
    """Point tiktoken at litellm's bundled files unless the user chose a cache dir."""
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        return
    directory = litellm_tokenizer_dir()
    if directory is None:
        logger.warning("litellm's tokenizer files not found; tiktoken may need the network")
        return
    os.environ["TIKTOKEN_CACHE_DIR"] = directory


@lru_cache(maxsize=None)
def get_encoding(name: str) -> tiktoken.Encoding:
    """The tiktoken ``Encoding`` called ``name``, loaded once (offline)."""
    ensure_offline_cache()
    return tiktoken.get_encoding(name)


@lru_cache(maxsize=1024)
def encoding_for_model(model: str | None) -> str:
    """tiktoken's encoding name for ``model`` (provider prefixes stripped); cl100k_base if unknown."""
    if not model:
        return DEFAULT_ENCODING
    candidates = [model]
    if "/" in model:
        candidates.append(model.rsplit("/", 1)[-1])
    for candidate in candidates:
        try:
            name = tiktoken.encoding_name_for_model(candidate)
        except KeyError:
            continue
        return name if _loads_offline(name, model) else DEFAULT_ENCODING
    return DEFAULT_ENCODING


SHIPPED_ENCODINGS = frozenset({"cl100k_base", "o200k_base", "o200k_harmony", "p50k_base", "p50k_edit"})


def _loads_offline(name: str, model: str) -> bool:
    """Whether the encoding ``name`` is one whose file litellm ships (``o200k_harmony`` and
    ``p50k_edit`` read those of ``o200k_base`` and ``p50k_base``); ``r50k_base`` (davinci, ada,
    ...) and ``gpt2`` are not, and tiktoken would download them: offline every count of such a
    session raised (its watcher round failed again and again). Decided by name, not by trying:
    a host with the network would then count such a session otherwise than one without."""
    if name in SHIPPED_ENCODINGS:
        return True
    _warn_unshipped(name, model)
    return False


@lru_cache(maxsize=64)
def _warn_unshipped(name: str, model: str) -> None:
    logger.warning("token encoding %s of model %s is not one litellm ships: counting with %s", name, model,
                   DEFAULT_ENCODING)


def count_tokens(text: str, encoding: str) -> int:
    """Tokens of ``text`` in ``encoding``; special-token text counts as ordinary text."""
    if not text:
        return 0
    if len(text) <= SHORT_TEXT_CHARS:
        return _count_short(text, encoding)
    global _last_count
    last = _last_count  # (one read of one tuple: threads may count at once)
    if last[0] is text and last[1] == encoding:  # the very same string, counted again (a summary: checked
        return last[2]  # against its limit, then stamped as it is appended)
    count = _encoded_length(get_encoding(encoding), text)
    _last_count = (text, encoding, count)
    return count


# tiktoken's encoder overflows its stack on one run of blanks this long or a little longer (a
# PanicException, a BaseException: no handler caught it, and a producer's event of a million spaces
# killed the watcher at each try) and is quadratic on it before: such a run is counted a piece at a
# time, each piece of at most this many characters (a different count than whole, but the same
# everywhere the service counts)
LONG_BLANKS_CHARS = 8192
_LONG_BLANKS = re.compile(rf"((?<!\s)\s{{{LONG_BLANKS_CHARS},}})")  # (from a run's start only: linear)


def _encoded_length(encoder: Any, text: str) -> int:
    if _LONG_BLANKS.search(text) is None:
        return len(encoder.encode_ordinary(text))
    total = 0
    for index, part in enumerate(_LONG_BLANKS.split(text)):
        if index % 2:  # (a run of blanks)
            total += sum(len(encoder.encode_ordinary(part[i:i + LONG_BLANKS_CHARS]))
                         for i in range(0, len(part), LONG_BLANKS_CHARS))
        elif part:
            total += len(encoder.encode_ordinary(part))
    return total


_last_count: tuple[str | None, str, int] = (None, "", 0)  # the last long text counted (by identity), ...


SHORT_TEXT_CHARS = 64  # tool names, small arguments: the same few strings again and again


@lru_cache(maxsize=4096)
def _count_short(text: str, encoding: str) -> int:
    return _encoded_length(get_encoding(encoding), text)


SHOWN_TEXT_CHARS = 512  # an elided output as shown (``microCompactKeepChars`` up to ~230) is cached
SHOWN_CACHE_ENTRIES = 8_192  # the text is the key: ~650 bytes each at the default keep (~5 MB), ~11 MB at most


def count_shown_tokens(text: str, encoding: str) -> int:
    """``count_tokens`` of an elided tool output as shown (head, marker, tail), cached.

    A rebuild's view, the API's and an LLM job's kept lines count the same
    compacted outputs again and again, while only the newest compact adds new
    ones: a process counts each once. The cache is an LRU keyed by the text
    itself, so a count is never another text's; a longer text is counted every time.
    """
    if len(text) <= SHOWN_TEXT_CHARS:
        return _count_shown(text, encoding)
    return count_tokens(text, encoding)


@lru_cache(maxsize=SHOWN_CACHE_ENTRIES)
def _count_shown(text: str, encoding: str) -> int:
    return count_tokens(text, encoding)


def forget_shown_counts() -> None:
    """Empty ``count_shown_tokens``'s cache and ``count_tokens``'s last count (a process that never
    counted them: benchmarks, tests)."""
    global _last_count
    _count_shown.cache_clear()
    _last_count = (None, "", 0)


def arguments_json(arguments: Any) -> str:
    """Tool-call arguments as compact JSON: a string is kept as it is, anything else is dumped.

    The text is ``json.dumps(separators=(",", ":"), ensure_ascii=False)``'s. A
    flat object of string keys and string / bool / null / integer values (the
    usual arguments) is dumped by orjson, whose output is then the same
    character for character (it escapes exactly the same characters); anything
    else (floats, nesting, a 65-bit integer) goes to the json module.
    """
    if isinstance(arguments, str):
        return arguments
    if arguments is None:
        return ""
    if type(arguments) is dict:
        for key, value in arguments.items():
            if type(key) is not str or type(value) not in _FLAT_JSON_TYPES:
                break
        else:
            try:
                return orjson.dumps(arguments).decode()
            except (TypeError, orjson.JSONEncodeError):  # an integer beyond 64 bits, a lone surrogate
                pass
    return _COMPACT_JSON.encode(arguments)


_FLAT_JSON_TYPES = frozenset({str, bool, int, type(None)})  # ``type(v) is`` these: no subclasses


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _tool_call_tokens(calls: Any, encoding: str) -> int:
    if not isinstance(calls, list):
        return 0
    total = 0
    for call in calls:
        if isinstance(call, dict):
            total += count_tokens(_text(call.get("name")), encoding)
            total += count_tokens(arguments_json(call.get("arguments", "")), encoding)
    return total


def event_tokens(event: dict[str, Any], encoding: str) -> int:
    """An event's SPEC §4.5 contribution (tool output not elided); 0 for uncounted types."""
    kind = event.get("type")
    if kind == "user":
        return count_tokens(_text(event.get("content")), encoding) + MESSAGE_OVERHEAD_TOKENS
    if kind == "assistant":
        content = count_tokens(_text(event.get("content")), encoding)
        calls = _tool_call_tokens(event.get("toolCalls"), encoding)
        return content + calls + MESSAGE_OVERHEAD_TOKENS
    if kind == "tool_result":
        return tool_result_tokens(_text(event.get("output")), _text(event.get("toolName")), encoding)
    if kind == "summary":
        return count_tokens(_text(event.get("summaryText")), encoding) + MESSAGE_OVERHEAD_TOKENS
    return 0


def tool_result_tokens(output: str, tool_name: str, encoding: str) -> int:
    """A tool result's contribution given the output as shown."""
    return count_tokens(output, encoding) + count_tokens(tool_name, encoding) + MESSAGE_OVERHEAD_TOKENS


def stamp(event: dict[str, Any], encoding: str) -> dict[str, Any]:
    """A copy of ``event`` carrying its own token stamp; a stamp sent by a producer is replaced."""
    stamped = dict(event)
    stamped.pop(TOKEN_COUNT_FIELD, None)
    stamped.pop(TOKEN_ENCODING_FIELD, None)
    if event.get("type") in COUNTED_TYPES:
        stamped[TOKEN_COUNT_FIELD] = event_tokens(event, encoding)
        stamped[TOKEN_ENCODING_FIELD] = encoding
    return stamped


def stamped_tokens(event: dict[str, Any], encoding: str) -> int:
    """The stamp when it was computed with ``encoding``, else a fresh ``event_tokens``."""
    count = event.get(TOKEN_COUNT_FIELD)
    if type(count) is int and event.get(TOKEN_ENCODING_FIELD) == encoding:
        return count
    return event_tokens(event, encoding)


@lru_cache(maxsize=256)
def model_max_input_tokens(model: str) -> int | None:
    """litellm's max input tokens for ``model``; None when unknown (never raises).

    Looked up in litellm's own catalog (the model map shipped with it) only: ``get_model_info``
    asks some providers' servers (an ``ollama/...`` model not in the map: a POST to
    ``$OLLAMA_API_BASE/api/show`` with a 6 000 s timeout; ``huggingface/...``: huggingface.co),
    and the watcher works the window out while it holds its shards' leases. One ``turn_end`` of a
    local model stalled every shard of the watcher, and the window depended on whether that
    server answered in each process."""
    if not model:
        return None
    try:
        info = _catalog_entry(load_litellm(), model)
        value = info.get("max_input_tokens")
    except Exception:  # litellm raises plain Exception (or ModelNotMappedError) for unknown models
        logger.debug("no model info for %r", model, exc_info=True)  # (%r: a producer's name, line breaks and all)
        return None
    return value if isinstance(value, int) and value > 0 else None


def _catalog_entry(litellm: Any, model: str) -> Mapping[str, Any]:
    """``model``'s entry in litellm's catalog, resolved as ``get_model_info`` resolves names, but
    never from a provider's server; KeyError (or litellm's error) when it has none."""
    helper = getattr(litellm.utils, "get_model_info_helper", None)
    if helper is not None and "catalog_only" in inspect.signature(helper).parameters:
        info: Mapping[str, Any] = helper(model=model, catalog_only=True)
        return info
    # (a litellm without ``catalog_only``: the map itself, by the name and by the name without its provider)
    for key in dict.fromkeys((model, model.split("/", 1)[-1])):
        entry = litellm.model_cost.get(key)
        if isinstance(entry, Mapping):
            return entry
    raise KeyError(model)
