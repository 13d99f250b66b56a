"""Importing litellm: once per process, offline, quiet, logging through the process's handlers.

Every import of litellm goes through ``load_litellm`` (the model map in
``events.tokens``, the summarizer in ``worker.summarize``).

Invariants, once it returned:
- litellm is imported once per process (a lock), with its bundled model cost
  map (``LITELLM_LOCAL_MODEL_COST_MAP``: no download), no debug banner, no
  telemetry, its import-time warnings not raised, and the warnings litellm
  itself silences for its process silenced (``catch_warnings`` undoes the
  filters an import installs: a worker printed 13 pydantic warnings on its
  first call).
- litellm's loggers (``LITELLM_LOGGERS``) have no handler of their own. At
  import litellm gives each a stream handler in its own format that writes
  records below WARNING to *stdout*: in a worker at INFO every LLM call printed
  two multi-line records there, and the same two again through the process's
  handlers (``compactor.logging``). Now each record is written once, by the
  process's handlers, in its format (one JSON line under ``--log-format json``).
  The import's own records below WARNING (~13 at DEBUG, logged before its
  handlers can be taken off, to stdout) are not written.
  The loggers' own filters stay (litellm redacts secrets there); the mark its
  redaction leaves on a record is taken off after them.
- Those loggers pass WARNING and above, or the level ``LITELLM_LOG`` names
  (litellm's documented switch, e.g. ``LITELLM_LOG=DEBUG``); the process's
  own level still applies on top, through its handlers.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from types import ModuleType

LITELLM_LOGGERS = ("LiteLLM", "LiteLLM Router", "LiteLLM Proxy")
# The warnings litellm silences for its process when imported (its ``apply_process_defaults``):
# pydantic's, about litellm's own types, raised later, on its first calls.
LITELLM_IGNORED_WARNINGS = (
    r".*conflict with protected namespace.*",
    r".*Accessing the.*attribute on the instance is deprecated.*",
    r".*`ReadOnly` qualifier.*",
)
DEFAULT_LITELLM_LEVEL = logging.WARNING  # one line per job is ours to write; litellm's INFO is per call
LEVEL_ENV = "LITELLM_LOG"

_litellm: ModuleType | None = None
_lock = threading.Lock()


def load_litellm() -> ModuleType:
    """The litellm module, imported on the first call (seconds), then the same module."""
    global _litellm
    with _lock:
        if _litellm is None:
            os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
            levels = {name: logging.getLogger(name).level for name in LITELLM_LOGGERS}
            for name in LITELLM_LOGGERS:  # its import's chatter (below WARNING: to stdout) is not written
                logging.getLogger(name).setLevel(logging.WARNING)
            try:
                with warnings.catch_warnings():  # litellm's import-time warnings are not ours to raise
                    warnings.simplefilter("ignore")
                    import litellm
            except BaseException:
                for name, level in levels.items():
                    logging.getLogger(name).setLevel(level)
                raise
            for message in LITELLM_IGNORED_WARNINGS:  # litellm's own, undone by catch_warnings' exit
                warnings.filterwarnings("ignore", message=message)

            litellm.suppress_debug_info = True  # no "Provider List" banner for unknown models
            litellm.telemetry = False
            adopt_litellm_loggers()
            _litellm = litellm
    return _litellm


def adopt_litellm_loggers() -> None:
    """Remove the handlers litellm gave its loggers and set their level (module docstring)."""
    level = litellm_level(os.environ.get(LEVEL_ENV))
    for name in LITELLM_LOGGERS:
        log = logging.getLogger(name)
        for handler in list(log.handlers):
            log.removeHandler(handler)
        log.removeFilter(_drop_redaction_mark)
        log.addFilter(_drop_redaction_mark)  # after litellm's own: it runs on what they left
        log.setLevel(level)


REDACTION_MARK = "litellm_redacted"  # set on a record by litellm's redaction filter (its loggers' own)


def _drop_redaction_mark(record: logging.LogRecord) -> bool:
    """Take the mark litellm's redaction filter left off the record: it is no field of the
    record's (``compactor.logging`` writes a record's extra attributes as JSON fields)."""
    record.__dict__.pop(REDACTION_MARK, None)
    return True


def litellm_level(value: str | None) -> int:
    """The level ``LITELLM_LOG`` names (``DEBUG``, ``info``, ``30``), else ``DEFAULT_LITELLM_LEVEL``."""
    if not value or not value.strip():
        return DEFAULT_LITELLM_LEVEL
    text = value.strip().upper()
    if text.isascii() and text.isdigit():
        return int(text)
    level = logging.getLevelName(text)
    return level if isinstance(level, int) else DEFAULT_LITELLM_LEVEL
