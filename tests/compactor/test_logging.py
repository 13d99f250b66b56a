"""JSON-lines logging: the formatter, the CLI setup, and the fields jobs and dead letters carry."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from compactor.cli.common import LOG_FORMAT_ENV, setup_logging
from compactor.logging import JsonFormatter, make_formatter
from compactor.queue import enqueue_compaction
from events.config import ENV_OVERRIDES, Settings
from producer.watcher.batch import BatchOutcome
from tests.worker.conftest import CWD, run_burst, write_session

JOB_FIELDS = {"session_id", "job_id", "kind", "outcome", "duration_ms"}


def record(msg: str = "hello %s", args: tuple[object, ...] = ("world",), **extra: object,
           ) -> logging.LogRecord:
    rec = logging.LogRecord("compactor.test", logging.INFO, __file__, 1, msg, args, None)
    rec.__dict__.update(extra)
    return rec


def test_json_line_has_message_level_logger_and_extra_fields() -> None:
    line = JsonFormatter().format(record(session_id="s1", duration_ms=12.5, job_id=None))
    data = json.loads(line)
    assert data["msg"] == "hello world" and data["level"] == "INFO"
    assert data["logger"] == "compactor.test" and data["ts"].endswith("Z")
    assert data["session_id"] == "s1" and data["duration_ms"] == 12.5 and data["job_id"] is None
    assert "args" not in data and "levelno" not in data


def test_json_record_stays_one_line_with_newlines_exceptions_and_odd_values() -> None:
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        rec = record("multi\nline", (), payload=object())
        rec.exc_info = sys.exc_info()
    line = JsonFormatter().format(rec)
    assert "\n" not in line
    data = json.loads(line)
    assert "ValueError: boom" in data["exc"] and data["payload"].startswith("<object")


def test_uvicorns_coloured_copy_of_the_message_is_not_a_field() -> None:
    """uvicorn passes ``extra={"color_message": ...}`` (the message with terminal colour codes)."""
    data = json.loads(JsonFormatter().format(record(
        "Started server process [%d]", (7,), color_message="Started server process [\x1b[36m%d\x1b[0m]")))
    assert data["msg"] == "Started server process [7]" and "color_message" not in data


def test_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="text, json"):
        make_formatter("xml")


@pytest.fixture
def root_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    monkeypatch.delenv(LOG_FORMAT_ENV, raising=False)
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_setup_logging_json_from_the_environment(root_logging: None, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(LOG_FORMAT_ENV, "JSON")
    setup_logging("INFO")
    logging.getLogger("compactor.x").info("job done", extra={"outcome": "compressed"})
    err = capsys.readouterr().err.strip().splitlines()
    assert json.loads(err[-1])["outcome"] == "compressed"


def test_setup_logging_text_by_default(root_logging: None,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging("INFO")
    logging.getLogger("compactor.x").info("plain", extra={"outcome": "compressed"})
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.endswith("INFO compactor.x plain")
    assert os.environ[LOG_FORMAT_ENV] == "text"  # handed to child processes


def test_every_job_logs_session_job_kind_outcome_and_duration(
        settings: Settings, r: redis.Redis, caplog: pytest.LogCaptureFixture) -> None:
    write_session(r, settings, "logged", 3, window=4000)
    job_id = enqueue_compaction(r, settings, "logged", CWD, "micro")
    caplog.set_level(logging.INFO, logger="worker.jobs")
    run_burst(r, settings)
    [rec] = [rec for rec in caplog.records if rec.name == "worker.jobs"]
    fields = {k: getattr(rec, k) for k in JOB_FIELDS}
    assert fields["session_id"] == "logged" and fields["job_id"] == job_id
    assert fields["kind"] == "micro" and fields["outcome"] == "compressed"
    assert fields["duration_ms"] >= 0
    assert json.loads(JsonFormatter().format(rec))["outcome"] == "compressed"


def test_every_enqueue_logs_session_job_kind_and_outcome(
        settings: Settings, r: redis.Redis, caplog: pytest.LogCaptureFixture) -> None:
    """OPERATIONS: enqueues carry ``session_id`` / ``job_id`` / ``kind`` / ``outcome`` (the
    enqueue line had no outcome; a forced job's waiting line no kind)."""
    write_session(r, settings, "queued", 3, window=4000)
    caplog.set_level(logging.INFO, logger="compactor.queue")
    job_id = enqueue_compaction(r, settings, "queued", CWD, "micro")
    forced = enqueue_compaction(r, settings, "queued", CWD, "llm", forced=True)
    lines = [json.loads(JsonFormatter().format(rec)) for rec in caplog.records if rec.name == "compactor.queue"]
    assert [(line["session_id"], line["job_id"], line["kind"], line["outcome"]) for line in lines] == [
        ("queued", job_id, "micro", "enqueued"), ("queued", forced, "llm", "waiting")]


def test_every_dead_letter_logs_session_kind_outcome_and_reason(
        caplog: pytest.LogCaptureFixture) -> None:
    outcome = BatchOutcome("compaction:events:3")
    caplog.set_level(logging.WARNING, logger="producer.watcher.batch")
    outcome.reject("1-0", "turnId: goes backwards: 1 < currentTurnId 3",
                   [b"session", b"s-9", b"cwd", b"/x", b"event", b"{}"])
    data = json.loads(JsonFormatter().format(caplog.records[-1]))
    assert data["session_id"] == "s-9" and data["outcome"] == "dead_lettered"
    assert data["kind"] == "turn_order" and data["entry_id"] == "1-0"
    assert {"job_id", "duration_ms", "reason", "stream"} <= set(data)


def test_a_dead_letters_text_line_names_its_session(caplog: pytest.LogCaptureFixture) -> None:
    """README: every dead-lettered entry logs its session and reason; the text line had no session
    (only the JSON one did). A bad id is quoted: it may hold a line break."""
    outcome = BatchOutcome("compaction:events:3")
    caplog.set_level(logging.WARNING, logger="producer.watcher.batch")
    outcome.reject("1-0", "turnId: goes backwards", [b"session", b"s-9", b"cwd", b"/x", b"event", b"{}"])
    outcome.reject("2-0", "sessionId: must match", [b"session", b"bad\nid", b"cwd", b"/x", b"event", b"{}"])
    outcome.reject("3-0", "missing field 'session'", [b"cwd", b"/x", b"event", b"{}"])
    assert [rec.getMessage() for rec in caplog.records[-3:]] == [
        "dead-lettered session=s-9 stream=compaction:events:3 id=1-0 reason=turnId: goes backwards",
        "dead-lettered session='bad\\nid' stream=compaction:events:3 id=2-0 reason=sessionId: must match",
        "dead-lettered session=- stream=compaction:events:3 id=3-0 reason=missing field 'session'"]


def test_a_process_refused_at_its_start_says_so_as_a_json_record_under_json_logs(tmp_path: Path) -> None:
    """``compactor serve --log-format json 2>&1 | jq``: a child refused at its start (Redis
    unreachable, another data dir, another shard count) wrote ``compactor: ...`` as plain text,
    and jq stopped at that line."""
    env = {k: v for k, v in os.environ.items() if k not in ENV_OVERRIDES and k != "CODINGCODE_CONFIG"}
    env.update(LITELLM_LOCAL_MODEL_COST_MAP="True")
    done = subprocess.run([sys.executable, "-m", "compactor", "watch", "--log-format", "json",
                           "--redis-url", "redis://127.0.0.1:1/0", "--data-dir", str(tmp_path / "d")],
                          env=env, capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path)
    assert done.returncode == 1
    records = [json.loads(line) for line in done.stderr.splitlines()]
    assert [(r["level"], r["msg"].split(":")[0]) for r in records][-1] == ("ERROR", "Redis unreachable at redis")
