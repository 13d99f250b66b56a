"""Log formatting for every ``compactor`` process: plain text lines or JSON lines.

``--log-format json`` (env ``COMPACTION_LOG_FORMAT``) writes one JSON object
per record: ``ts`` (ISO-8601 UTC, milliseconds), ``level``, ``logger``,
``msg`` (the formatted message), every ``extra=`` field the call passed (e.g.
``session_id``, ``job_id``, ``kind``, ``outcome``, ``duration_ms``), and
``exc`` with the traceback when there is one.

Invariants: a record always yields exactly one line (newlines inside values
are escaped by JSON); a value JSON cannot encode is written as its ``repr``;
the text format ignores the extra fields (the message already says them).
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
FORMATS = ("text", "json")
# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "taskName",
    "color_message"}  # uvicorn's message again, with terminal colour codes: not a field


def record_extras(record: logging.LogRecord) -> dict[str, Any]:
    """The fields a log call passed with ``extra=``."""
    return {k: v for k, v in vars(record).items()
            if k not in _STANDARD_ATTRS and not k.startswith("_")}


class JsonFormatter(logging.Formatter):
    """One JSON object per record, with the record's ``extra=`` fields at the top level."""

    def format(self, record: logging.LogRecord) -> str:
        moment = datetime.fromtimestamp(record.created, tz=UTC)
        data: dict[str, Any] = {
            "ts": moment.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record_extras(record).items():
            data.setdefault(key, value)
        if record.exc_info:
            data["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            data["exc"] = record.exc_text
        return json.dumps(data, ensure_ascii=False, default=repr, separators=(",", ":"))


def make_formatter(fmt: str) -> logging.Formatter:
    """The formatter for ``text`` or ``json``; ValueError for anything else."""
    name = fmt.strip().lower()
    if name == "json":
        return JsonFormatter()
    if name == "text":
        return logging.Formatter(TEXT_FORMAT)
    raise ValueError(f"log format must be one of {', '.join(FORMATS)}, not {fmt!r}")


def configure(level: int, fmt: str = "text") -> None:
    """Send the root logger's records to stderr in ``fmt`` at ``level`` (replaces handlers)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(make_formatter(fmt))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)


def json_configured() -> bool:
    """Whether the root logger writes JSON lines (``configure(..., "json")``): then a line meant
    for the operator goes out as a record, so stderr stays one JSON object per line."""
    return any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers)
