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
``COMPACTION_WORKERS``. A wrong value is an ``InvalidConfig`` naming the key at
start-up.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import logging
import os
from pathlib import Path
from typing import Any, Mapping

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic.alias_generators import to_camel

from events.errors import InvalidConfig

logger = logging.getLogger(__name__)

DEFAULT_CONFIG_FILE = "codingcode.yaml"
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
}


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


class ContextSettings(_Section):
    compaction_model: str = ""  # empty: the session's own model
    fallback_model: str = ""  # used when the LLM breaker is open; "extractive" needs no LLM
    micro_compact_threshold: float = Field(0.25, gt=0, le=1)
    micro_compact_min_chars: int = Field(120, ge=1)
    compaction_threshold: float = Field(0.9, gt=0, le=1)
    keep_recent_turns: int = Field(1, ge=0)
    max_failures: int = Field(3, ge=1)
    failure_ttl_seconds: int = Field(86_400, ge=1)
    compactable_tools: tuple[str, ...] = DEFAULT_COMPACTABLE_TOOLS
    micro_compact_keep_chars: int = Field(40, ge=0)  # head and tail kept of an elided output
    default_context_window: int = Field(128_000, ge=1)
    llm_timeout_seconds: float = Field(120.0, gt=0)
    summary_reserve_tokens: int = Field(25_000, ge=0)  # SPEC §5: window must hold prompt + this

    @model_validator(mode="after")
    def _thresholds_ordered(self) -> ContextSettings:
        if self.micro_compact_threshold > self.compaction_threshold:
            raise ValueError("microCompactThreshold must not exceed compactionThreshold")
        return self

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


@functools.lru_cache(maxsize=64)
def _lower_names(names: tuple[str, ...]) -> frozenset[str]:
    return frozenset(name.lower() for name in names)


@functools.lru_cache(maxsize=64)
def _fingerprint(min_chars: int, keep_chars: int, default_window: int, tools: frozenset[str]) -> str:
    digest = hashlib.sha256("\0".join(sorted(tools)).encode()).hexdigest()[:12]
    return f"{min_chars}/{keep_chars}/{default_window}/{digest}"


class LimitSettings(_Section):
    max_event_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024)


class RedisSettings(_Section):
    url: str = ""  # empty: an embedded server started under dataDir
    prefix: str = Field("compaction", pattern=r"^[A-Za-z0-9_.-]+$")
    shards: int = Field(8, ge=1, le=1024)


class ApiSettings(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    token: str = ""  # set: Bearer auth required on every route but /healthz
    job_wait_seconds: float = Field(300.0, gt=0)  # a forced compaction waits this long, then 202


class LogSettings(_Section):
    fsync: bool = False  # fsync after every append: durable across power loss, slower


class WatcherSettings(_Section):
    batch_size: int = Field(256, ge=1)
    block_ms: int = Field(1000, ge=1)
    lease_ms: int = Field(10_000, ge=1000)
    claim_idle_ms: int = Field(30_000, ge=1000)


class WorkerSettings(_Section):
    count: int = Field(2, ge=1, le=64)
    job_timeout_seconds: int = Field(600, ge=1)


class Settings(_Section):
    """The whole configuration, with SPEC §8's defaults."""

    model_config = ConfigDict(
        frozen=True, extra="ignore", alias_generator=to_camel, populate_by_name=True
    )
    context: ContextSettings = ContextSettings()
    limits: LimitSettings = LimitSettings()
    redis: RedisSettings = RedisSettings()
    data_dir: Path = Path("~/.codingcode/project")
    api: ApiSettings = ApiSettings()
    log: LogSettings = LogSettings()
    watcher: WatcherSettings = WatcherSettings()
    worker: WorkerSettings = WorkerSettings()

    @field_validator("data_dir", mode="before")
    @classmethod
    def _data_dir_not_empty(cls, value: Any) -> Any:
        if isinstance(value, str) and not value.strip():  # Path("") would be the current directory
            raise ValueError("must not be empty (leave it out for ~/.codingcode/project)")
        return value

    @model_validator(mode="after")
    def _expand_data_dir(self) -> Settings:
        object.__setattr__(self, "data_dir", self.data_dir.expanduser())
        return self


def config_path(explicit: str | os.PathLike[str] | None) -> tuple[Path, bool]:
    """The config file to read and whether it was asked for explicitly."""
    if explicit:
        return Path(explicit), True
    env = os.environ.get("CODINGCODE_CONFIG")
    if env:
        return Path(env), True
    return Path(DEFAULT_CONFIG_FILE), False


def _read_yaml(path: Path, required: bool) -> dict[str, Any]:
    if not path.exists():
        if required:
            raise InvalidConfig(str(path), "config file not found")
        return {}
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise InvalidConfig(str(path), f"is not valid YAML: {e}") from e
    except OSError as e:  # a directory, no permission, ...
        raise InvalidConfig(str(path), f"cannot be read: {e.strerror or e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise InvalidConfig(str(path), "must be a mapping at the top level")
    return data


def _apply_env(data: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    for var, path in ENV_OVERRIDES.items():
        if var not in environ:
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
    return data


def _as_invalid(error: ValidationError) -> InvalidConfig:
    """The first wrong key as the error's field, every other one after its reason (``; key: reason``)."""
    wrong = [(".".join(str(p) for p in detail["loc"]) or "config", detail["msg"].removeprefix("Value error, "))
             for detail in error.errors(include_url=False)]
    (field, reason), others = wrong[0], wrong[1:]
    return InvalidConfig(field, reason + "".join(f"; {key}: {why}" for key, why in others))


MISSPELT_CUTOFF = 0.75  # difflib's ratio from which an unknown top-level key reads as one of our sections


def misspelt_sections(data: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(key, section)`` for each unknown top-level key that reads like a section of ours."""
    ours = {field.alias or name: name for name, field in Settings.model_fields.items()}
    known = set(ours) | set(ours.values())
    by_lower = {name.lower(): name for name in ours}
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
) -> Settings:
    """Build the settings from the config file and the environment; raise InvalidConfig."""
    file, required = config_path(path)
    data = _read_yaml(file, required)
    for key, section in misspelt_sections(data):
        logger.warning("%s: unknown top-level key %r ignored; did you mean %r?", file, key, section)
    data = _apply_env(data, os.environ if environ is None else environ)
    try:
        # Environment values are strings; lax mode converts "8081" to 8081 for them.
        return Settings.model_validate(data)
    except ValidationError as e:
        raise _as_invalid(e) from e
