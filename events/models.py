"""Wire models for the events of a session log (SPEC §3).

Invariants:
- The wire names are camelCase; Python attributes are snake_case with aliases.
- Unknown extra fields are kept as they are (``extra="allow"``) and written back.
- Models are frozen; validation is strict (no "1" -> 1 coercion), so a wrong
  type is an error naming the field rather than a silent conversion.
- ``EVENT_ADAPTER`` is the one ``TypeAdapter`` for the discriminated union.
- A timestamp (``timestamp``, ``createdAt``) is exactly ``YYYY-MM-DDTHH:MM:SS``, an optional
  fraction of 1-9 digits, then ``Z`` or ``+00:00`` (docs/STREAM_PROTOCOL.md), and kept as sent.
- The rules beyond one event's schema (a value the log cannot hold as sent, a batch's uuid
  and turn order) are in ``events.checks``.

The service reads logs as plain dicts for speed (see ``events.log``); these
models are the gate every event passes before it is written.
"""

from __future__ import annotations

import copy
import functools
import re
import typing
import uuid as uuidlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Annotated, Any, Literal, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetPydanticSchema,
    TypeAdapter,
    ValidationError,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic.fields import FieldInfo
from pydantic_core import CoreSchema, PydanticCustomError

from events.errors import InvalidEvent

SESSION_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")
MAX_TURN_ID = 1_000_000_000  # far above any real session; rejects absurd ids
# far above any model's window: one larger (2**64 - 1 was accepted) can never trigger a compaction,
# and its thresholds came out of a float rounded in the session's API answer
MAX_CONTEXT_WINDOW = 1_000_000_000
MAX_CWD_CHARS = 4096
# SPEC §3's "ISO-8601 UTC" as docs/STREAM_PROTOCOL.md spells it (the date and time are checked too)
UTC_TIMESTAMP_RE = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]{1,9})?(?:Z|\+00:00)")
TIMESTAMP_RULE = ("must be an ISO-8601 UTC date and time: YYYY-MM-DDTHH:MM:SS, an optional fraction, "
                  "then Z or +00:00 (2024-01-01T12:00:00.000Z)")
SURROGATE_RE = re.compile("[\ud800-\udfff]")  # never valid Unicode text: UTF-8 cannot encode one
# what the log's JSON encoder (orjson) writes: a signed or unsigned 64-bit integer
MIN_JSON_INT, MAX_JSON_INT = -(2**63), 2**64 - 1

EVENT_TYPES = (
    "session_meta", "user", "assistant", "tool_result",
    "turn_end", "rollback", "compact", "summary",
)
TURN_SCOPED_TYPES = frozenset({"user", "assistant", "tool_result", "turn_end"})
CONTEXT_TYPES = frozenset({"user", "assistant", "tool_result"})

TurnId = Annotated[int, Field(ge=1, le=MAX_TURN_ID)]


class _Wire(BaseModel):
    model_config = ConfigDict(
        frozen=True,
        extra="allow",
        strict=True,
        populate_by_name=True,
        alias_generator=to_camel,
        serialize_by_alias=True,
    )


def _utc_timestamp(value: str | None) -> str | None:
    if value is not None and not _is_utc_timestamp(value):
        if UTC_TIMESTAMP_RE.fullmatch(value) is not None:  # (the rule's form: "must be YYYY-MM-DD..." puzzled)
            raise ValueError(f"{value[:19]} is no date and time that exists (a 30 February, an hour 24, a "
                             "second 60)")
        raise ValueError(TIMESTAMP_RULE)
    return value


UtcTimestamp = Annotated[str | None, AfterValidator(_utc_timestamp)]


def _clean_uuid(value: str | None) -> str | None:
    """A uuid is the event's identity: ``" a\n"`` and ``"a"`` were two events, so a client that
    trims on a retry had its event applied twice; and a line break or control character in it
    went on into summaries' ``replaces`` and dead-letter reasons."""
    if value is None:
        return value
    control = next((c for c in value if ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0), None)
    if control is not None:
        raise ValueError(f"holds the control character {control!r} at character {value.index(control)}")
    if value != value.strip():
        raise ValueError("starts or ends with whitespace")
    return value


class _Event(_Wire):
    uuid: Annotated[str | None, AfterValidator(_clean_uuid)] = Field(default=None, min_length=1, max_length=128)
    timestamp: UtcTimestamp = None


def _is_utc_timestamp(value: str) -> bool:
    """SPEC §3: a full date and time in UTC, in the one form ``UTC_TIMESTAMP_RE`` spells; kept as sent."""
    if UTC_TIMESTAMP_RE.fullmatch(value) is None:
        return False
    try:
        datetime.fromisoformat(value[:19])  # the date and time exist: not 2024-02-30, 24:00:00, :60
    except ValueError:
        return False
    return True


class SessionMeta(_Event):
    type: Literal["session_meta"]
    session_id: str | None = None
    cwd: str | None = None
    created_at: UtcTimestamp = None
    model: str | None = None
    parent_session_id: str | None = None


class UserEvent(_Event):
    type: Literal["user"]
    turn_id: TurnId
    content: str


def _one_error(message: str) -> GetPydanticSchema:
    """A union that fails with ``message`` alone, not one error per member (``dict[str,any]: ...``)."""
    def schema(source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        union = dict(handler(source), custom_error_type="union_type", custom_error_message=message)
        return typing.cast(CoreSchema, union)

    return GetPydanticSchema(schema)


class ToolCall(_Wire):
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: Annotated[dict[str, Any] | str, _one_error("must be an object or a string (its JSON text, kept as sent)")] = ""


class Usage(_Wire):
    prompt: int = Field(ge=0)
    completion: int = Field(ge=0)
    total: int = Field(ge=0)


class AssistantEvent(_Event):
    type: Literal["assistant"]
    turn_id: TurnId
    content: str | None = ""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    usage: Usage | None = None

    @model_validator(mode="after")
    def _distinct_call_ids(self) -> AssistantEvent:
        """Two calls of one message under one id: a result answers one of them only (the other's
        dropped from the context view, still counted), and an OpenAI-style API refuses the pair."""
        seen: dict[str, int] = {}
        for index, call in enumerate(self.tool_calls):
            if call.id in seen:
                raise PydanticCustomError("call_id", "duplicates toolCalls[{first}].id ('{id}'): each call of a "
                                          "message needs an id of its own", {"first": seen[call.id], "id": call.id,
                                                                             "wire_field": f"toolCalls[{index}].id"})
            seen[call.id] = index
        return self


class ToolResultEvent(_Event):
    type: Literal["tool_result"]
    turn_id: TurnId
    tool_call_id: str = Field(min_length=1)
    tool_name: str = Field(min_length=1)
    output: str


class TurnEndEvent(_Event):
    type: Literal["turn_end"]
    turn_id: TurnId
    model: str = Field(min_length=1)
    context_window: int | None = Field(default=None, ge=1, le=MAX_CONTEXT_WINDOW)


class RollbackEvent(_Event):
    type: Literal["rollback"]
    through_turn_id: TurnId
    reason: str  # SPEC §3 lists it without a "?": a rollback says why


class CompactEvent(_Event):
    type: Literal["compact"]
    start_turn_id: TurnId
    end_turn_id: TurnId

    @model_validator(mode="after")
    def _a_range(self) -> CompactEvent:
        if self.end_turn_id < self.start_turn_id:  # SPEC §4: turns startTurnId..endTurnId
            raise PydanticCustomError("turn_range", "must be at least startTurnId ({start})",
                                      {"start": self.start_turn_id, "wire_field": "endTurnId"})
        return self


class SummaryEvent(_Event):
    type: Literal["summary"]
    replaces: list[str]
    summary_text: str
    last_summarized_turn_id: TurnId


Event = Annotated[
    Union[
        SessionMeta, UserEvent, AssistantEvent, ToolResultEvent,
        TurnEndEvent, RollbackEvent, CompactEvent, SummaryEvent,
    ],
    Field(discriminator="type"),
]
EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)


# a finished LLM job's result carries this key too when its fallback summarizer answered for a
# failed LLM call: {kind, error, model, fallback} (``worker.compaction.LlmFailure``)
LLM_ERROR_FIELD = "llmError"
MICRO_STEP_FIELD = "microStep"  # a failed LLM job's meta: the CompressResult of the micro step it applied
REQUEUED_AS_FIELD = "requeuedAs"  # an abandoned forced job's meta: the forced job queued in its place
REQUEUED_FROM_FIELD = "requeuedFrom"  # ... and that job's: the one it replaces (it is not queued again itself)


class CompressResult(_Wire):
    """What a compaction returns (SPEC §1): tokens freed and the estimate after."""

    model_config = ConfigDict(frozen=True, extra="forbid", alias_generator=to_camel,
                              populate_by_name=True, serialize_by_alias=True)
    did_compress: bool
    released: int
    prompt_estimate: int


def validate_session_id(session_id: object) -> str:
    """Return ``session_id`` if it matches SPEC §3's pattern, else raise InvalidEvent."""
    if not isinstance(session_id, str) or not SESSION_ID_RE.fullmatch(session_id):
        raise InvalidEvent(
            "sessionId",
            "must match ^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$ (letters, digits, _ and -; at most 128)",
        )
    return session_id


def validate_cwd(cwd: object, *, new: bool = False) -> str:
    """Return ``cwd`` if it is an absolute path of valid text with no NUL byte, else raise
    InvalidEvent; ``new`` (a cwd coming in with events: the stream's, the Publisher's): no control
    character at all either (a session logged before that rule stays readable)."""
    if cwd is None:
        raise InvalidEvent("cwd", "is required: an absolute path")
    if not isinstance(cwd, str):
        raise InvalidEvent("cwd", "must be a string: an absolute path")
    if not cwd:
        raise InvalidEvent("cwd", "must not be empty: it must be an absolute path")
    if "\x00" in cwd:
        raise InvalidEvent("cwd", "must not contain a NUL byte")
    control = next((c for c in cwd if ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0), None) if new else None
    if control is not None:  # (a line break or an escape in the project's directory name reached every
        # log line naming a path raw: one record over three lines, colours on the operator's terminal)
        raise InvalidEvent("cwd", f"must not contain a control character ({control!r} at character "
                                  f"{cwd.index(control)})")
    if (problem := text_problem(cwd)) is not None:  # a CLI argument of undecodable bytes, a JSON escape
        raise InvalidEvent("cwd", problem)
    if len(cwd) > MAX_CWD_CHARS:
        raise InvalidEvent("cwd", f"is longer than {MAX_CWD_CHARS} characters")
    if not (cwd.startswith("/") or cwd.startswith("\\") or re.match(r"^[A-Za-z]:[\\/]", cwd)):
        raise InvalidEvent("cwd", "must be an absolute path")
    return cwd


def _first_error(error: ValidationError) -> InvalidEvent:
    details = error.errors(include_url=False)
    detail = details[0]
    loc: list[str | int] = _without_tag(detail["loc"])
    ctx = detail.get("ctx") or {}
    if "wire_field" in ctx:  # a model validator names the field it refused
        loc.append(ctx["wire_field"])
    message = str(ctx["error"]) if detail["type"] == "value_error" else detail["msg"]  # no "Value error, "
    if detail["type"] == "missing":  # the others missing beside it, named at once (a tool_result written
        # from scratch took a round trip per field: toolName, then output)
        others = (_without_tag(d["loc"]) for d in details[1:] if d["type"] == "missing")
        beside = [json_path(other) for other in others if other[:-1] == loc[:-1]]
        if beside:
            message += f" (and {', '.join(beside)} too)"
    return InvalidEvent(json_path(loc) or "event", message)


def _without_tag(loc: Sequence[str | int]) -> list[str | int]:
    """An error's location without the type tag the discriminated union puts first."""
    return list(loc[1:] if loc and loc[0] in EVENT_TYPES else loc)


def json_path(parts: Sequence[str | int]) -> str:
    """``["toolCalls", 0, "name"]`` -> ``toolCalls[0].name``, the form error messages use."""
    path = ""
    for part in parts:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def text_problem(text: str) -> str | None:
    """Why ``text`` cannot be written as UTF-8 (a lone surrogate), else None."""
    if text.isascii():
        return None
    found = SURROGATE_RE.search(text)
    if found is None:
        return None
    return (f"contains a lone surrogate ({escaped(found.group())} at character {found.start()}): "
            "it is not valid Unicode")


def escaped(text: str) -> str:
    """``text`` with its surrogates as ``\\udxxx`` (an error message must be valid text itself)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def parse_event(data: object) -> Event:
    """Validate one event (a dict already decoded from JSON); raise InvalidEvent naming the field."""
    if not isinstance(data, dict):
        raise InvalidEvent("event", "must be a JSON object")
    if data.get("type") not in EVENT_TYPES:
        raise InvalidEvent("type", f"must be one of {', '.join(EVENT_TYPES)}")
    try:
        return EVENT_ADAPTER.validate_python(data)
    except ValidationError as e:
        raise _first_error(e) from e


def now_iso() -> str:
    """The current time as ISO-8601 UTC with milliseconds and a ``Z``."""
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def iso_time(seconds: float) -> str:
    """``seconds`` since the epoch as ``now_iso`` writes a time."""
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def with_identity(event: Event, *, uuid: str | None = None, timestamp: str | None = None) -> Event:
    """Fill a missing ``uuid`` / ``timestamp`` (kept when the producer sent them)."""
    updates: dict[str, str] = {}
    if event.uuid is None:
        updates["uuid"] = uuid or str(uuidlib.uuid4())
    if event.timestamp is None:
        updates["timestamp"] = timestamp or now_iso()
    return event.model_copy(update=updates) if updates else event


def to_wire(event: Event) -> dict[str, Any]:
    """The event as the camelCase dict written to the log: every field it was sent with, extra
    ones included, as sent (an explicit ``null`` too: SPEC §3 keeps unknown fields as they are),
    plus the defaults that are not None (an optional field nobody sent is left out)."""
    wire = event.model_dump(by_alias=True)
    sent = event.model_fields_set
    for name, alias in _none_defaults(type(event)):
        if name not in sent:
            del wire[alias]
    return wire


def wire_of(data: dict[str, Any], event: Event) -> dict[str, Any]:
    """``to_wire(event)`` for ``event = parse_event(data)``, made from ``data`` itself.

    The watcher's hot path: a model dump costs as much as the validation. Validation
    is strict and the validators return values as sent, so the dump differs from
    ``data`` only by the defaults that are not None (filled in here, nested tool
    calls too) and by names: a ``data`` that sends a field by its Python name
    (``turn_id``) takes ``to_wire``. Key order may differ; the content is the same
    (pinned by a property test against ``to_wire``). ``data`` becomes the result.
    """
    shape = _shape(type(event))
    if shape is None or not shape.python_names.isdisjoint(data):
        return to_wire(event)
    _fill_defaults(data, shape)
    return data


@dataclass(frozen=True)
class _Shape:
    """What a model's dump adds to the dict it validated: ``defaults`` (wire name, factory) of
    the fields whose default is not None, ``nested`` (wire name, shape, is a list) of the
    sub-models that add some; ``python_names`` the field names that differ from the wire ones."""

    python_names: frozenset[str]
    defaults: tuple[tuple[str, Callable[[], Any]], ...]
    nested: tuple[tuple[str, _Shape, bool], ...]


def _fill_defaults(data: dict[str, Any], shape: _Shape) -> None:
    for alias, make in shape.defaults:
        if alias not in data:
            data[alias] = make()
    for alias, sub, many in shape.nested:
        value = data.get(alias)
        for item in (value if many and type(value) is list else [value]):
            if type(item) is dict:
                _fill_defaults(item, sub)


@functools.cache
def _shape(model: type[BaseModel]) -> _Shape | None:
    """The model's ``_Shape``; None when a field holds sub-models in a way ``_fill_defaults``
    does not follow (a dict of models, a union of several), so ``to_wire`` is used."""
    names, defaults, nested = set(), [], []
    for name, info in model.model_fields.items():
        alias = info.serialization_alias or info.alias or name
        if alias != name:
            names.add(name)
        if not info.is_required():
            make = _default_maker(info)
            if make is None:
                return None
            if make() is not None:
                defaults.append((alias, make))
        found = _sub_model(info.annotation)
        if found is False:
            return None
        if found is not None:
            sub = _shape(found[0])
            if sub is None or sub.python_names:  # a nested dict's keys are not checked
                return None
            if sub.defaults or sub.nested:
                nested.append((alias, sub, found[1]))
    return _Shape(frozenset(names), tuple(defaults), tuple(nested))


def _default_maker(info: FieldInfo) -> Callable[[], Any] | None:
    """A function returning the field's default as validation would (a mutable default
    copied, a factory called); None for a factory that takes the validated data."""
    factory = info.default_factory
    if factory is None:
        default = info.default
        if isinstance(default, (str, int, float, bool, bytes, tuple, frozenset, type(None))):
            return lambda: default
        return functools.partial(copy.deepcopy, default)
    if info.default_factory_takes_validated_data:
        return None
    return factory  # type: ignore[return-value]


def _sub_model(annotation: Any) -> tuple[type[BaseModel], bool] | None | Literal[False]:
    """``(model, is_list)`` for ``M``, ``M | None`` and ``list[M]``; None without sub-models;
    False for a shape ``_fill_defaults`` does not follow."""
    def is_model(value: Any) -> bool:
        return isinstance(value, type) and issubclass(value, BaseModel)

    if is_model(annotation):
        return annotation, False
    args = typing.get_args(annotation)
    models = [a for a in args if is_model(a)]
    if not models:
        return False if any(typing.get_args(a) and _sub_model(a) is not None for a in args) else None
    if typing.get_origin(annotation) is list and len(args) == 1:
        return models[0], True
    if len(models) == 1 and all(a is type(None) or is_model(a) for a in args):
        return models[0], False
    return False


@functools.cache
def _none_defaults(model: type[BaseModel]) -> tuple[tuple[str, str], ...]:
    """``(name, wire name)`` of the model's fields whose default is None."""
    return tuple((name, info.serialization_alias or info.alias or name)
                 for name, info in model.model_fields.items() if info.default is None)
