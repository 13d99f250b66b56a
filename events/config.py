"""Configuration: ``codingcode.yaml`` plus environment overrides (SPEC §8).

Where the file is found: ``--config PATH``, else ``$CODINGCODE_CONFIG``, else
``./codingcode.yaml``; a missing default file means all defaults, a missing
explicitly named file is an error. Every key is optional. Unknown top-level keys
are ignored (the file is shared with the Coding Code agent), but one that reads
like a misspelt section of ours (``contxt``, ``Redis``) is logged as a warning
naming the section; unknown keys inside the sections this service owns are
errors, so a typo never goes unnoticed. A file with several wrong values names
them all in one error.

Environment variables override the file: ``REDIS_URL``, ``COMPACTION_DATA_DIR``,
``COMPACTION_API_TOKEN``, ``COMPACTION_API_PORT``, ``COMPACTION_API_HOST``,
``COMPACTION_WORKERS``, ``COMPACTION_MODEL``, ``COMPACTION_FALLBACK_MODEL``. A wrong value is an ``InvalidConfig`` naming the key at
start-up, and the variable when the value came from one (``api.port (from
COMPACTION_API_PORT): ...``). ``redis.url`` is checked here as redis-py will read
it (scheme, port, database), so no process starts on a URL its client refuses.
A file that is not YAML is named with the line and column of the problem.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import hashlib
import ipaddress
import logging
import math
import os
import re
import string
from fractions import Fraction
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import parse_qs, unquote, urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic.alias_generators import to_camel
from pydantic_core import ErrorDetails
from redis import ConnectionPool, RedisError

from events.errors import InvalidConfig
from events.models import MAX_CONTEXT_WINDOW, SURROGATE_RE, text_problem

logger = logging.getLogger(__name__)

DAY_S = 86_400
WEEK_S = 7 * DAY_S
TEN_YEARS_S = 3_650 * DAY_S
DEFAULT_CONFIG_FILE = "codingcode.yaml"
DEFAULT_DATA_DIR = "~/.codingcode/project"
DEFAULT_COMPACTABLE_TOOLS = (
    "read_file", "execute_command", "search_code", "search_files",
    "web_search", "fetch_url", "write_file", "edit_file",
)
ENV_OVERRIDES: dict[str, tuple[str, ...]] = {
    "REDIS_URL": ("redis", "url"),
    "COMPACTION_DATA_DIR": ("dataDir",),
    "COMPACTION_API_TOKEN": ("api", "token"),
    "COMPACTION_API_PORT": ("api", "port"),
    "COMPACTION_API_HOST": ("api", "host"),
    "COMPACTION_WORKERS": ("worker", "count"),
    "COMPACTION_MODEL": ("context", "compactionModel"),
    "COMPACTION_FALLBACK_MODEL": ("context", "fallbackModel"),
}
# The embedded Redis's socket under ``dataDir`` (``compactor.serve.embedded_dir`` + ``EmbeddedRedis.socket``)
# and the most bytes a unix socket's path may have (``sun_path`` holds 108, with its NUL).
EMBEDDED_SOCKET = ".redis/redis.sock"
MAX_SOCKET_PATH_BYTES = 107


class _Section(BaseModel):
    model_config = ConfigDict(
        frozen=True, extra="forbid", alias_generator=to_camel, populate_by_name=True
    )

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """A key with no value (``url:``, a section whose keys are all commented out) takes its default."""
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        """Lax mode reads ``true`` as 1: a YAML boolean where a number belongs is a mistake."""
        if isinstance(value, bool) and info.field_name is not None \
                and cls.model_fields[info.field_name].annotation in (int, float):
            raise ValueError("must be a number, not true/false")
        return value

    @field_validator("*", mode="before")
    @classmethod
    def _surrogate_pairs_joined(cls, value: Any) -> Any:
        """A character past U+FFFF that YAML holds as an escaped pair (``"\\ud83d\\ude00"``, as a
        JSON writer escapes it: PyYAML leaves the two halves apart) is that character."""
        if isinstance(value, str):
            return _joined(value)
        if isinstance(value, list):
            return [_joined(item) if isinstance(item, str) else item for item in value]
        return value

    @field_validator("*")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        """A string (or a list's) with a lone surrogate (``"\\ud800"`` in YAML; a byte not UTF-8 in an
        environment variable, which Python reads as one) is refused at load: taken, it failed where it
        was used, a token's every request a 500, a model's every job a transient failure."""
        if isinstance(value, str) and (problem := text_problem(value)) is not None:
            raise ValueError(problem)
        for index, item in enumerate(value if isinstance(value, (list, tuple)) else ()):
            if isinstance(item, str) and (problem := text_problem(item)) is not None:
                raise ValueError(f"item {index}: {problem}")
        return value


def _joined(text: str) -> str:
    """``text`` with each pair of surrogates that spells one character written as that character
    (a lone surrogate kept, for ``_valid_unicode`` to refuse: a path's undecodable byte too)."""
    if text.isascii() or SURROGATE_RE.search(text) is None:
        return text
    return re.sub("[\ud800-\udbff][\udc00-\udfff]",
                  lambda pair: pair.group().encode("utf-16", "surrogatepass").decode("utf-16"), text)


EXTRACTIVE = "extractive"  # the built-in summarizer's model name (``worker.extractive``)


class ContextSettings(_Section):
    compaction_model: str = ""  # empty: the session's own model
    fallback_model: str = ""  # after a failed LLM call; "extractive" (no LLM) also while the breaker is open
    micro_compact_threshold: float = Field(0.25, gt=0, le=1, allow_inf_nan=False)
    micro_compact_min_chars: int = Field(120, ge=1)
    compaction_threshold: float = Field(0.9, gt=0, le=1, allow_inf_nan=False)
    keep_recent_turns: int = Field(1, ge=0)
    max_failures: int = Field(3, ge=1)
    failure_ttl_seconds: int = Field(86_400, ge=1, le=TEN_YEARS_S)  # (Redis's EXPIRE refuses past ~2^53)
    compactable_tools: tuple[str, ...] = DEFAULT_COMPACTABLE_TOOLS
    micro_compact_keep_chars: int = Field(40, ge=0)  # head and tail kept of an elided output
    default_context_window: int = Field(128_000, ge=1, le=MAX_CONTEXT_WINDOW)
    llm_timeout_seconds: float = Field(120.0, gt=0, le=DAY_S, allow_inf_nan=False)
    summary_reserve_tokens: int = Field(25_000, ge=0)  # SPEC §5: window must hold prompt + this

    @field_validator("compaction_model", "fallback_model")
    @classmethod
    def _a_model_name(cls, name: str) -> str:
        """A name litellm would refuse on every call (or, for ``Extractive``, send to a provider
        instead of the built-in summarizer) is refused at load, not on the first job."""
        if name != name.strip():
            raise ValueError(f"{name!r} has spaces around it: write {name.strip()!r}")
        if any(c.isspace() for c in name):
            raise ValueError(f"{name!r} holds a space: a model name has none")
        if name.lower() == EXTRACTIVE and name != EXTRACTIVE:
            raise ValueError(f"{name!r}: the built-in summarizer is written {EXTRACTIVE!r}")
        return name

    @field_validator("compactable_tools")
    @classmethod
    def _tool_names(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        """A name no tool can have (empty, or with spaces around it: ``" read_file"``) matched no
        output, silently: the outputs of that tool were never elided."""
        for index, name in enumerate(names):
            if not name.strip():
                raise ValueError(f"item {index} is empty: a tool name it would match has none")
            if name != name.strip():
                raise ValueError(f"item {index}: {name!r} has spaces around it: write {name.strip()!r}")
        return names

    @model_validator(mode="after")
    def _thresholds_ordered(self) -> ContextSettings:
        if self.micro_compact_threshold > self.compaction_threshold:
            raise ValueError("microCompactThreshold must not exceed compactionThreshold")
        return self

    @property
    def fallback_past_breaker(self) -> bool:
        """Whether an automatic LLM job runs while the session's LLM breaker is open: only with
        a fallback that calls no LLM (``extractive``). A fallback that is a model is an LLM call
        too, and SPEC §5 enqueues no automatic LLM job while the breaker is open; its failures
        were counted nowhere, so a failing one was called at every turn for 24 h."""
        return self.fallback_model == EXTRACTIVE

    def micro_limit(self, window: int) -> int:
        """The most tokens a session of ``window`` holds without passing ``microCompactThreshold``
        (SPEC §5: micro when E > threshold × W), exactly (``threshold_tokens``)."""
        return threshold_tokens(self.micro_compact_threshold, window)

    def compaction_limit(self, window: int) -> int:
        """The most tokens a session of ``window`` holds without passing ``compactionThreshold``."""
        return threshold_tokens(self.compaction_threshold, window)

    def is_compactable(self, tool_name: str) -> bool:
        """Whether outputs of ``tool_name`` may be elided (case-insensitive)."""
        return tool_name.lower() in self._compactable_lower

    @property
    def state_fingerprint(self) -> str:
        """The settings a session's derived state depends on, as a short string: its
        estimate (what is elided, how much of it is kept), its candidates and its window
        when the model has none. A state stored under other settings is rebuilt."""
        return _fingerprint(self.micro_compact_min_chars, self.micro_compact_keep_chars,
                            self.default_context_window, self._compactable_lower)

    @property
    def _compactable_lower(self) -> frozenset[str]:
        # (keyed by the value, not kept on the instance: ``model_copy(update=...)`` copies an instance's extras)
        return _lower_names(self.compactable_tools)


@functools.lru_cache(maxsize=1024)
def threshold_tokens(threshold: float, window: int) -> int:
    """``floor(threshold × window)`` with the threshold as written: a whole estimate E is over
    ``threshold × window`` exactly when E is over this. The float product is 62.99… for 0.7 × 90,
    so an estimate of 63, equal to the threshold, passed it (SPEC §5's comparisons are strict)."""
    return math.floor(Fraction(repr(threshold)) * window)


@functools.lru_cache(maxsize=64)
def _lower_names(names: tuple[str, ...]) -> frozenset[str]:
    return frozenset(name.lower() for name in names)


# How a state is derived from a log and its settings: bumped when that changes (an elided
# output's shown text, say), so that states stored by an earlier version are rebuilt once.
# 2: an output too short for both halves keeps all it can of them (the marker's count sized exactly).
# 3: a run of 8 192 blanks or more is counted a piece at a time (3982402, 2026-12-05: one token fewer
# for some; the states a version before it stored kept their estimates, off by that, until a job).
# tests/events/test_state.py digests what a derivation computes: a change to it fails there until
# this is bumped.
STATE_DERIVATION = 3


@functools.lru_cache(maxsize=64)
def _fingerprint(min_chars: int, keep_chars: int, default_window: int, tools: frozenset[str]) -> str:
    digest = hashlib.sha256("\0".join(sorted(tools)).encode()).hexdigest()[:12]
    return f"{STATE_DERIVATION}/{min_chars}/{keep_chars}/{default_window}/{digest}"


class LimitSettings(_Section):
    max_event_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024)


REDIS_URL_SCHEMES = ("redis://", "rediss://", "unix://")  # what redis-py's from_url accepts


MAX_SHARDS = 1_024  # (the orphan sweep looks past the configured count up to this: producer.watcher.orphans)


class RedisSettings(_Section):
    url: str = ""  # empty: an embedded server started under dataDir
    prefix: str = Field("compaction", pattern=r"^[A-Za-z0-9_.-]+$")
    shards: int = Field(8, ge=1, le=MAX_SHARDS)

    @field_validator("url")
    @classmethod
    def _a_redis_url(cls, url: str) -> str:
        if url:
            _check_redis_url(url)
        return url

    @field_validator("prefix")
    @classmethod
    def _not_rqs_default_queue(cls, prefix: str) -> str:
        # the RQ queue is named after the prefix: ``default`` is the queue of every RQ app that
        # names none, so their workers took the compaction jobs and ours theirs (and ran their code)
        if prefix == "default":
            raise ValueError("must not be 'default': the RQ queue is named after the prefix, and 'default' is "
                             "the queue of any RQ application on the same Redis that names none")
        return prefix


def _check_redis_url(url: str) -> None:
    """ValueError, in words and without the URL's password, when redis-py would refuse ``url``
    (or silently use database 0 for a wrong one)."""
    if not url.startswith(REDIS_URL_SCHEMES):
        scheme = url.partition("://")[0] if "://" in url else ""
        raise ValueError("must start with redis://, rediss:// or unix://"
                         + (f", not {scheme}://" if scheme and scheme.isalnum() else ""))
    try:
        parts = urlsplit(url)
    except ValueError as e:  # "Invalid IPv6 URL"
        raise ValueError(f"is not a URL: {e}") from e
    if parts.scheme == "unix":
        if not parts.path.startswith("/") or parts.netloc:
            raise ValueError("a unix:// URL needs the socket's absolute path (unix:///path/redis.sock)")
    else:
        # (a password holding '#' ends the netloc there: its head was read, and shown, as the port)
        cut = "@" not in parts.netloc and ("@" in url or "#" in url)
        _check_port(parts.netloc.rpartition("@")[2].rpartition("]")[2].partition(":")[2], cut)
        _check_host(unquote(parts.hostname or ""))  # (as redis-py reads it: a%2E%2Eb is a..b)
    in_query = parse_qs(parts.query).get("db", [])
    in_path = [] if parts.scheme == "unix" else [unquote(parts.path).strip("/")]  # redis://host/2
    for db in in_query or in_path:  # as redis-py: ?db= wins over the path
        if db and not (db.isascii() and db.isdigit()):  # ("²" is a digit to isdigit, not to int)
            raise ValueError(f"the database must be a number, not {db!r}")
    try:  # the query's other settings (socket_timeout=, ...), as redis-py reads them; nothing connects
        connection = ConnectionPool.from_url(url).make_connection()
    except ValueError as e:  # "Invalid value for 'socket_timeout' in connection URL."
        raise ValueError(str(e).rstrip(".")) from None
    except TypeError as e:  # "...__init__() got an unexpected keyword argument 'ssl_cert_reqs'"
        name = str(e).rpartition(" ")[2]
        raise ValueError(f"the query setting {name} is not one a {parts.scheme}:// connection takes") from None
    except RedisError as e:  # "Invalid SSL Certificate Requirements Flag", "protocol must be either 2 or 3"
        raise ValueError(f"a query setting is refused: {e}") from None
    for name in ("socket_timeout", "socket_connect_timeout"):  # (read as any float: the socket refused
        # -1, nan or inf at the first command, a traceback from every command)
        seconds = getattr(connection, name, None)
        if seconds is not None and not (math.isfinite(seconds) and 0 < seconds <= DAY_S):
            raise ValueError(f"the query setting {name} must be a number of seconds over 0 and at most "
                             f"{DAY_S}, not {seconds}")


def _check_host(host: str) -> None:
    """ValueError when ``host`` (of a URL) is no IP address and no name a resolver is asked for: an
    empty label (``a..b``) or one over 63 characters failed at the first command, with a traceback."""
    if not host:
        return
    with contextlib.suppress(ValueError):
        ipaddress.ip_address(host.partition("%")[0])  # (an IPv6 one may name its interface: fe80::1%eth0)
        return
    try:
        host.encode("idna")
    except UnicodeError:
        raise ValueError(f"the host {host!r} is not a host name (an empty label, or one over 63 characters)") \
            from None


def _check_port(port: str, cut: bool) -> None:
    if not port:
        return  # redis-py's default, 6379
    if not (port.isascii() and port.isdigit()):
        if cut:
            raise ValueError("port must be a number; the URL does not parse as one with a password: "
                             "percent-encode a password's '#', '/', '?', '@' (%23, %2F, %3F, %40)")
        raise ValueError(f"port must be a number, not {port!r}")
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"port {port} is out of range 1-65535")


class ApiSettings(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    token: str = ""  # set: Bearer auth required on every route but /healthz
    # with no token: the Host names answered besides IP addresses and localhost ("*": any)
    allowed_hosts: list[str] = []
    job_wait_seconds: float = Field(300.0, gt=0, le=DAY_S, allow_inf_nan=False)  # a forced compaction waits this long, then 202

    @field_validator("host")
    @classmethod
    def _an_address(cls, host: str) -> str:
        # bind("") listens on every interface: an empty value in the file, where an empty
        # COMPACTION_API_HOST or --host "" means the default, opened the API to the network
        if not host.strip():
            raise ValueError("must not be empty (it would listen on every interface): 127.0.0.1 for this "
                             "machine only (the default: leave it out), 0.0.0.0 for every interface")
        return host

    @field_validator("allowed_hosts")
    @classmethod
    def _host_names(cls, names: list[str]) -> list[str]:
        for name in names:
            if not name or name != name.strip() or any(c in name for c in "/:@ \t"):
                raise ValueError(f"{name!r} is not a host name (a name as a Host header carries it, no port)")
        return [name.lower().rstrip(".") for name in names]  # (as a request's Host is read: api_errors)

    @field_validator("token")
    @classmethod
    def _no_whitespace_at_the_ends(cls, token: str) -> str:
        # HTTP servers (and the API's Bearer check) strip a header value's ends, so a request never
        # matches such a token; refused, not stripped: its clients would go on sending it as written.
        # (The message never shows the token.)
        if token != token.strip(string.whitespace):
            raise ValueError("must not begin or end with whitespace (HTTP strips a header's ends: no request "
                             "could carry it)")
        if any(c in token for c in "\r\n\0"):
            raise ValueError("must not hold a line break or a NUL (no HTTP header can carry one)")
        return token


class LogSettings(_Section):
    fsync: bool = False  # fsync after every append: durable across power loss, slower


# Entries read per shard per round (XREADGROUP COUNT): the read of all a watcher's shards is one
# script, during which Redis serves no one else, and the round is held in memory until acked.
MAX_BATCH_SIZE = 10_000


class WatcherSettings(_Section):
    batch_size: int = Field(256, ge=1, le=MAX_BATCH_SIZE)
    block_ms: int = Field(1000, ge=1, le=DAY_S * 1000)
    lease_ms: int = Field(10_000, ge=1000, le=DAY_S * 1000)
    claim_idle_ms: int = Field(30_000, ge=1000, le=DAY_S * 1000)


class WorkerSettings(_Section):
    count: int = Field(2, ge=1, le=64)
    job_timeout_seconds: int = Field(600, ge=1, le=WEEK_S)


class Settings(_Section):
    """The whole configuration, with SPEC §8's defaults."""

    model_config = ConfigDict(
        frozen=True, extra="ignore", alias_generator=to_camel, populate_by_name=True
    )
    context: ContextSettings = ContextSettings()
    limits: LimitSettings = LimitSettings()
    redis: RedisSettings = RedisSettings()
    data_dir: Path = Field(Path(DEFAULT_DATA_DIR), validate_default=True)  # (the default is expanded too)
    api: ApiSettings = ApiSettings()
    log: LogSettings = LogSettings()
    watcher: WatcherSettings = WatcherSettings()
    worker: WorkerSettings = WorkerSettings()

    @field_validator("data_dir", mode="before")
    @classmethod
    def _data_dir_a_path(cls, value: Any) -> Any:
        if isinstance(value, str) and not value.strip():  # Path("") would be the current directory
            raise ValueError(f"must not be empty (leave it out for {DEFAULT_DATA_DIR})")
        if not isinstance(value, (str, os.PathLike)):  # (pydantic's: "Input is not a valid path for <class ...>")
            raise ValueError(f"must be a path (a string), not {type(value).__name__} {value!r}")
        _check_path_bytes(os.fspath(value))
        return value

    @field_validator("data_dir")
    @classmethod
    def _expand_data_dir(cls, data_dir: Path) -> Path:
        # absolute: ``serve`` and its children, and the commands that find its socket, agree on it
        # whatever their working directory (a relative one made the embedded Redis fail to start)
        try:
            expanded = data_dir.expanduser()
        except RuntimeError:  # "Could not determine home directory."
            head = data_dir.parts[0]
            why = "HOME is not set and this user has no home directory" if head == "~" else "no such user"
            raise ValueError(f"{data_dir}: cannot expand {head}: {why}") from None
        return Path(os.path.abspath(expanded))


def _check_path_bytes(path: str) -> None:
    """ValueError when no file system path can be ``path`` (the OS calls fail on it at run time)."""
    if "\0" in path:
        raise ValueError("must not contain a NUL byte (no path can)")
    try:
        os.fsencode(path)
    except UnicodeEncodeError as e:  # a lone surrogate ("\ud800" in YAML)
        raise ValueError(f"has {path[e.start]!r} at position {e.start}, which a path cannot hold "
                         f"({e.reason})") from None


def config_path(explicit: str | os.PathLike[str] | None) -> tuple[Path, bool]:
    """The config file to read and whether it was asked for explicitly."""
    if explicit:
        return Path(explicit), True
    env = os.environ.get("CODINGCODE_CONFIG")
    if env:
        return Path(env), True
    return Path(DEFAULT_CONFIG_FILE), False


def file_with_key(explicit: str | os.PathLike[str] | None, key: str) -> Path | None:
    """The config file (``config_path``) when it sets top-level ``key``, else None (none, or it
    cannot be read now): what an error about the key's value names in front."""
    file, required = config_path(explicit)
    try:
        return file if key in _read_yaml(file, required) else None
    except InvalidConfig:
        return None


def _yaml_text(data: bytes) -> str:
    """A YAML file's text: UTF-8, or UTF-16 with its byte order mark, as YAML allows (PowerShell 5's
    ``>`` writes UTF-16LE: it was "not valid YAML: 'utf-8' codec can't decode byte 0xff")."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        return data.decode("utf-16")
    return data.decode("utf-8-sig" if data.startswith(b"\xef\xbb\xbf") else "utf-8")


def _read_yaml(path: Path, required: bool) -> dict[str, Any]:
    if not path.exists():
        if path.is_symlink():  # (a ./codingcode.yaml linking to a file moved away: the defaults, said nowhere)
            raise InvalidConfig(str(path), f"config file not found: a broken symbolic link to {os.readlink(path)}")
        if required:
            raise InvalidConfig(str(path), "config file not found")
        return {}
    try:
        loader = yaml.SafeLoader(_yaml_text(path.read_bytes()))  # (``safe_load``, keeping its node tree)
        try:
            node = loader.get_single_node()
            # (before constructing, which splices a merge key's ``<<: *defaults`` pairs into the node
            # tree: a key merged in and then overridden, as YAML means it, read as given twice)
            repeated = _repeated_key(node, (), set())
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        raise InvalidConfig(str(path), _yaml_problem(e)) from e
    except UnicodeDecodeError as e:
        raise InvalidConfig(str(path), f"is not valid YAML: {e}") from e
    except RecursionError as e:  # (a traceback, from a file the service would otherwise ignore most of)
        raise InvalidConfig(str(path), "is not valid YAML: nested too deeply") from e
    except OSError as e:  # a directory, no permission, ...
        raise InvalidConfig(str(path), f"cannot be read: {e.strerror or e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise InvalidConfig(str(path), "must be a mapping at the top level")
    if repeated is not None:
        key, first, again = repeated
        raise InvalidConfig(key, f"given twice in {path} (lines {first} and {again}): YAML keeps the last, so one "
                                 "would be dropped; merge them")
    return data


def _repeated_key(node: yaml.Node | None, path: tuple[str, ...],
                  visited: set[int]) -> tuple[str, int, int] | None:
    """A key of ours a mapping of the file gives twice: its dotted path and both lines. PyYAML
    keeps the last silently, so a second ``context:`` section (the file is shared with the agent,
    which keeps its own keys there) dropped the first's settings. At the top level only our
    sections count: the agent's keys are its own business. Each mapping is looked at once
    (``visited``): an alias to one that holds it recursed without end, and a chain of aliases
    doubled the work at each link."""
    if not isinstance(node, yaml.MappingNode) or id(node) in visited:
        return None
    visited.add(id(node))
    seen: dict[str, int] = {}
    for key, value in node.value:
        if not isinstance(key, yaml.ScalarNode) or key.tag != "tag:yaml.org,2002:str":
            continue
        if not path and key.value not in _top_level_keys():
            continue
        line = key.start_mark.line + 1
        if key.value in seen:
            return ".".join((*path, key.value)), seen[key.value], line
        seen[key.value] = line
        found = _repeated_key(value, (*path, key.value), visited)
        if found is not None:
            return found
    return None


def _yaml_problem(error: yaml.YAMLError) -> str:
    """PyYAML's several-line message as one: ``line 2 column 1: expected the node content, ...``,
    its context after it when it gives one (``line 3 column 1: found unexpected end of stream
    (while scanning a quoted scalar from line 2 column 18)``: the end of the file alone named no
    quote)."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None)
    if mark is None or not problem:
        return "is not valid YAML: " + " ".join(str(error).split())
    text = f"line {mark.line + 1} column {mark.column + 1}: " + " ".join(problem.split())
    context, where = getattr(error, "context", None), getattr(error, "context_mark", None)
    if context:
        text += f" ({' '.join(context.split())}"
        if where is not None and (where.line, where.column) != (mark.line, mark.column):
            text += f" from line {where.line + 1} column {where.column + 1}"
        text += ")"
    return text


def _apply_env(data: dict[str, Any], environ: Mapping[str, str],
               origins: Mapping[str, str] | None = None) -> dict[tuple[str, ...], str]:
    """Put the environment's overrides into ``data``; the key path each variable set.

    A variable set empty (``${COMPACTION_API_TOKEN:-}`` in compose) is unset: the file's value
    stands (an empty token had silently turned the file's token off). One given empty by a
    command-line option (``origins``: ``--redis-url ''``, "empty: the embedded server") is empty."""
    applied = {}
    for var, path in ENV_OVERRIDES.items():
        if var not in environ or (not environ[var] and var not in (origins or {})):
            continue
        node = data
        for key in path[:-1]:
            child = node.get(key)
            if child is not None and not isinstance(child, dict):
                break  # the file's section is wrong (``api: 5``): left for validation to name
            node[key] = child = dict(child) if isinstance(child, dict) else {}
            node = child
        else:
            node[path[-1]] = environ[var]
            applied[path] = var
    return applied


def _sources(applied: Mapping[tuple[str, ...], str], origins: Mapping[str, str] | None) -> dict[tuple[str, ...], str]:
    """Key path -> the variable (or, per ``origins``, the option) that set it."""
    return {path: (origins or {}).get(var, var) for path, var in applied.items()}


def _as_invalid(error: ValidationError, sources: Mapping[tuple[str, ...], str], file: Path | None) -> InvalidConfig:
    """The first wrong key as the error's field, every other one after its reason (``; key: reason``);
    a key whose value came from ``sources`` (key path -> variable or option) says so; the others
    came from the config ``file``, named in front (``c.yaml: context.x: ...``) and listed first (a
    ``codingcode.yaml`` read from the working directory, unnamed, was not looked for)."""
    wrong = []
    for detail in error.errors(include_url=False):
        loc = tuple(str(p) for p in detail["loc"])
        key = ".".join(loc) or "config"
        source = next((name for path, name in sources.items() if loc[:len(path)] == path), None)
        wrong.append((source is not None, f"{key} (from {source})" if source else key, _reason(detail)))
    wrong.sort(key=lambda item: item[0])  # (stable: the file's first, each side in pydantic's order)
    (from_env, field, reason), others = wrong[0], wrong[1:]
    return InvalidConfig(_in_file(field, file if not from_env else None),
                         reason + "".join(f"; {key}: {why}" for _, key, why in others))


def _in_file(key: str, file: Path | None) -> str:
    """``key`` preceded by the config file it is wrong in (the file's own errors read the same)."""
    return f"{file}: {key}" if file is not None else key


def _reason(detail: ErrorDetails) -> str:
    """Why one value is wrong: pydantic's words, but for a whole number in another notation (YAML
    reads ``1e100`` as a string, which pydantic was "unable to parse ... as an integer")."""
    value = detail["input"]
    if detail["type"] == "int_parsing" and isinstance(value, str) and _is_a_number(value):
        return f"must be a whole number written in digits, not {value!r}"
    if detail["type"] in ("tuple_type", "list_type"):  # (YAML words, not Python's)
        return f"must be a list, not {_yaml_kind(value)}"
    if detail["type"] in ("model_type", "dict_type"):
        return f"must be a section (keys and values), not {_yaml_kind(value)}"
    if detail["type"] == "extra_forbidden":
        key = str(detail["loc"][-1]) if detail["loc"] else ""
        known = {_folded(name): name for name in _all_keys()}
        spelt = known.get(_folded(key))  # (CompactionThreshold, compaction-threshold: only one was said)
        if spelt is not None and spelt != key:
            return f"unknown key (the file spells it {spelt})"
        close = difflib.get_close_matches(key, sorted(known.values()), n=1, cutoff=MISSPELT_CUTOFF)
        return "unknown key" + (f" (did you mean {close[0]}?)" if close else "")
    return detail["msg"].removeprefix("Value error, ")


def _yaml_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return f"the text {value!r}"
    return "a list" if isinstance(value, list) else "a section" if isinstance(value, dict) else type(value).__name__


@functools.cache
def _all_keys() -> frozenset[str]:
    """Every key of every section, as the file spells it (camelCase)."""
    models: list[type[BaseModel]] = [Settings]
    keys: set[str] = set()
    while models:
        for name, field in models.pop().model_fields.items():
            keys.add(field.alias or name)
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                models.append(field.annotation)
    return frozenset(keys)


@functools.cache
def _top_level_keys() -> frozenset[str]:
    """The file's top-level keys (sections and ``dataDir``)."""
    return frozenset(field.alias or name for name, field in Settings.model_fields.items())


def _is_a_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


MISSPELT_CUTOFF = 0.75  # difflib's ratio from which an unknown top-level key reads as one of our sections


def _folded(key: str) -> str:
    """A key less its case, ``_`` and ``-``: ``data_dir``, ``DataDir`` and ``data-dir`` are ``datadir``."""
    return key.lower().replace("_", "").replace("-", "")


def misspelt_sections(data: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(key, section)`` for each unknown top-level key that reads like a section of ours."""
    known = _top_level_keys()  # (``data_dir`` is not ours: the file spells it ``dataDir``)
    by_lower = {name.lower(): name for name in known}
    found = []
    for key in data:
        if not isinstance(key, str) or key in known:
            continue
        match = difflib.get_close_matches(key.lower(), by_lower, n=1, cutoff=MISSPELT_CUTOFF)
        if match:
            found.append((key, by_lower[match[0]]))
    return found


def load_settings(
    path: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
    origins: Mapping[str, str] | None = None,
    *,
    redis: bool = True,
) -> Settings:
    """Build the settings from the config file and the environment; raise InvalidConfig.

    A wrong value set by an environment variable is reported with the variable's name, or
    with its entry in ``origins`` (``{"REDIS_URL": "--redis-url"}`` for a command-line value
    passed through the environment). A caller that never uses Redis (``redis=False``: reading a
    log) is not refused a dataDir too long for the embedded server's socket.
    """
    file, required = config_path(path)
    data = _read_yaml(file, required)
    ours = {_folded(name): name for name in _top_level_keys()}
    for key in data:  # (other unknown top-level keys are the agent's own: left alone)
        if isinstance(key, str) and key not in ours.values() and _folded(key) in ours:
            # the logs went elsewhere with only a warning (``data_dir`` was read until 2026-11-30; ``datadir``,
            # ``DataDir``, ``data-dir`` were until 2026-12-05, and ``Redis:`` ran an embedded server)
            raise InvalidConfig(_in_file(key, file), f"unknown key (the file spells it {ours[_folded(key)]})")
    for key, section in misspelt_sections(data):
        logger.warning("%s: unknown top-level key %r ignored; did you mean %r?", file, key, section)
    applied = _apply_env(data, os.environ if environ is None else environ, origins)
    try:
        # Environment values are strings; lax mode converts "8081" to 8081 for them.
        # only the file's spelling (camelCase): the field names' would be a second one, and the
        # two together in one section are one dropped value or a clash
        settings = Settings.model_validate(data, by_alias=True, by_name=False)
    except ValidationError as e:
        raise _as_invalid(e, _sources(applied, origins), file if file.exists() else None) from e
    socket = settings.data_dir / EMBEDDED_SOCKET
    if redis and not settings.redis.url and len(os.fsencode(socket)) > MAX_SOCKET_PATH_BYTES:
        source = _sources(applied, origins).get(("dataDir",))
        raise InvalidConfig(f"dataDir (from {source})" if source else
                            _in_file("dataDir", file if "dataDir" in data else None),
                            f"too long for the embedded Redis: its socket {socket} would be {len(os.fsencode(socket))} "
                            f"bytes, and a unix socket's path takes at most {MAX_SOCKET_PATH_BYTES} (use a shorter "
                            "dataDir, or set redis.url)")
    if settings.limits.max_event_bytes > settings.limits.max_body_bytes:
        logger.warning("limits.maxEventBytes (%s) is above limits.maxBodyBytes (%s): the HTTP API refuses a body "
                       "before one of its events reaches the event limit (producers writing to the streams are "
                       "held to maxEventBytes)", settings.limits.max_event_bytes, settings.limits.max_body_bytes)
    if settings.worker.job_timeout_seconds <= settings.context.llm_timeout_seconds:
        logger.warning("worker.jobTimeoutSeconds (%s) is not above context.llmTimeoutSeconds (%s): a slow LLM "
                       "call will end as a job timeout, not an LLM timeout", settings.worker.job_timeout_seconds,
                       settings.context.llm_timeout_seconds)
    return settings
