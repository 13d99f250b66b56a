"""Every ``compactor`` command through typer's CliRunner (and ``python -m`` once)."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
import typer
from rq.job import Job
from typer.testing import CliRunner

from compactor.cli import app
from compactor.keys import Keys
from compactor.queue import compaction_queue, enqueue_compaction
from compactor.store import SessionStore
from events.config import Settings
from events.log import SessionLog
from compactor.llm_stub import STUB_MODEL, LLMStub
from tests.producer.test_api import CWD, SID, run_jobs, write_session

COMMANDS = ("serve", "watch", "work", "api", "compact", "context", "status", "dead-letters", "demo", "bench",
            "health")


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "codingcode.yaml"
    path.write_text("context:\n  compactionModel: extractive\n")
    return path


def base_args(settings: Settings, config: Path) -> list[str]:
    return ["--config", str(config), "--redis-url", settings.redis.url,
            "--data-dir", str(settings.data_dir)]


def cli_settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"context": settings.context.model_copy(
        update={"compaction_model": "extractive"})})


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_and_takes_config(runner: CliRunner, command: str) -> None:
    result = runner.invoke(app, [command, "--help"])
    assert result.exit_code == 0, result.output
    assert "--config" in result.output


@pytest.mark.parametrize("command", [c for c in COMMANDS if c not in ("bench", "demo")])
def test_every_command_but_bench_and_demo_takes_data_dir(runner: CliRunner, command: str) -> None:
    """OPERATIONS lists ``--data-dir`` for all but those two: ``dead-letters`` had none, so next to
    a ``serve`` on another data dir it could not find that serve's embedded Redis."""
    result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert "--data-dir" in result.output, result.output


@pytest.mark.parametrize("via_env", [False, True])
def test_a_bad_log_level_names_where_it_came_from_and_the_levels(runner: CliRunner, via_env: bool) -> None:
    """``COMPACTION_LOG_LEVEL=LOUD`` was reported as ``invalid --log-level 'LOUD'``, no reason."""
    args, env = (["watch"], {"COMPACTION_LOG_LEVEL": "LOUD"}) if via_env else (["watch", "--log-level", "LOUD"], {})
    result = runner.invoke(app, args, env=env)
    assert result.exit_code == 2
    origin = "COMPACTION_LOG_LEVEL" if via_env else "--log-level"
    assert result.stderr.strip() == (f"compactor: invalid {origin} 'LOUD': must be one of "
                                     "DEBUG, INFO, WARNING, ERROR, CRITICAL")
    # the log format likewise (it was always "--log-format")
    args, env = (["watch"], {"COMPACTION_LOG_FORMAT": "xml"}) if via_env else (["watch", "--log-format", "xml"], {})
    result = runner.invoke(app, args, env=env)
    assert result.exit_code == 2
    origin = "COMPACTION_LOG_FORMAT" if via_env else "--log-format"
    assert result.stderr.strip().startswith(f"compactor: invalid {origin}: "), result.stderr


def test_demo_help_says_it_never_uses_the_configured_data_dir(runner: CliRunner) -> None:
    """It said "a temporary data dir unless configured", but dataDir and COMPACTION_DATA_DIR
    are never used by the demo: only --data-dir."""
    result = runner.invoke(app, ["demo", "--help"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "unless configured" not in text
    assert ("a temporary data dir, removed afterwards, unless --data-dir is given (never dataDir or "
            "COMPACTION_DATA_DIR)") in text


def test_version_is_the_installed_distributions(runner: CliRunner) -> None:
    from importlib.metadata import version

    for flag in ("--version", "-V"):
        result = runner.invoke(app, [flag])
        assert (result.exit_code, result.output) == (0, f"compactor {version('compactor')}\n")


def test_python_dash_m_runs_the_cli() -> None:
    done = subprocess.run([sys.executable, "-m", "compactor", "--help"], check=False, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0
    assert all(command in done.stdout for command in COMMANDS)


# Sends the child a signal as it first imports pydantic (which the command line needs, the entry
# point itself not), then runs the installed console script as pip's wrapper does.
SIGNAL_WHILE_IMPORTING = """
import importlib.abc, os, signal, sys
from importlib.metadata import entry_points

class Stop(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "pydantic":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.{signal})
        return None

sys.meta_path.insert(0, Stop())
(script,) = [e for e in entry_points(group="console_scripts") if e.name == "compactor"]
sys.argv = ["compactor", *{argv!r}]
sys.exit(script.load()())
"""


@pytest.mark.parametrize("signal_name,code", [("SIGINT", 130), ("SIGTERM", 143), ("SIGHUP", 129)])
@pytest.mark.parametrize("argv", [["status", "--json"], ["compact", "s1", "--cwd", "/w", "--json"]])
def test_a_stop_signal_while_the_command_line_loads_exits_as_later_without_a_traceback(
        signal_name: str, code: int, argv: list[str]) -> None:
    """Ctrl-C printed a KeyboardInterrupt traceback of the imports (the first half second of every
    command), and SIGTERM or SIGHUP killed the command there: ``compact`` then printed no
    CompressResult JSON, which SPEC §7 makes its last line always."""
    script = SIGNAL_WHILE_IMPORTING.format(signal=signal_name, argv=argv)
    done = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (code, "")
    if argv[0] == "compact":
        assert json.loads(done.stdout.splitlines()[-1]) == {"didCompress": False, "released": 0, "promptEstimate": 0}
    else:
        assert done.stdout == ""


# Sends the child a signal from the interpreter's teardown (a global's finalizer: the modules are
# torn down after Python gave its signal handlers up), then runs the console script as pip's wrapper does.
SIGNAL_WHILE_EXITING = """
import os, signal, sys
from importlib.metadata import entry_points

class SentLate:
    def __init__(self, kill, pid, signum):
        self.kill, self.pid, self.signum = kill, pid, signum

    def __del__(self):
        self.kill(self.pid, self.signum)

late = SentLate(os.kill, os.getpid(), signal.{signal})
(script,) = [e for e in entry_points(group="console_scripts") if e.name == "compactor"]
sys.argv = ["compactor", *{argv!r}]
sys.exit(script.load()())
"""


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGHUP", "SIGINT"])
@pytest.mark.parametrize(("argv", "code"), [(["--version"], 0),
                                            (["health", "--json", "--redis-url", "redis://127.0.0.1:1"], 1)])
def test_a_stop_signal_while_the_interpreter_exits_leaves_the_commands_exit_code(
        tmp_path: Path, signal_name: str, argv: list[str], code: int) -> None:
    """A process that had stopped cleanly was killed by a stop landing in its teardown, where
    Python has put its handlers back to the default action (``work`` given SIGTERM then SIGHUP 3 ms
    apart: exit 129, 1 run in 10): a supervisor took the clean stop for a crash."""
    script = SIGNAL_WHILE_EXITING.format(signal=signal_name, argv=[*argv, *(
        ["--data-dir", str(tmp_path / "data")] if argv[0] == "health" else [])])
    done = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (code, "")
    assert done.stdout.startswith("compactor " if code == 0 else '{"healthy":false')


@pytest.mark.parametrize("yaml_text,fragment", [
    ("context:\n  microCompactThreshold: 2\n", "context.microCompactThreshold"),
    ("redis:\n  shard: 3\n", "redis.shard"),
    # the RQ queue is named after the prefix: other RQ apps' workers took the jobs, ours theirs
    ("redis:\n  prefix: default\n", "redis.prefix: must not be 'default'"),
    ("context:\n  defaultContextWindow: 99999999999\n", "context.defaultContextWindow: Input should be less"),
    ("- a list\n", "mapping"),
    ("api:\n  port: true\n", "api.port: must be a number, not true/false"),  # lax mode would read 1
    ("context:\n  microCompactMinChars: yes\n", "context.microCompactMinChars: must be a number"),
    ("dataDir: ''\n", "dataDir: must not be empty"),  # Path('') would be the current directory
    ("dataDir: 5\n", "dataDir: must be a path (a string), not int 5"),
    ("context:\n  compactionThreshold: .nan\n", "context.compactionThreshold: Input should be a finite number"),
    # Redis refused the TTL (the breaker's key then never expired: the breaker stayed open for good)
    ("context:\n  failureTtlSeconds: 99999999999999999999\n", "context.failureTtlSeconds: Input should be less"),
    # Redis refused the COUNT of every XREADGROUP, and the watcher retried it forever
    ("watcher:\n  batchSize: 99999999999999999999999\n", "watcher.batchSize: Input should be less than or equal "
                                                         "to 10000"),
    # loaded, then ``watch`` and ``serve`` died on "ValueError: embedded null byte" (or a UnicodeEncodeError)
    ('dataDir: "/tmp/x/a\\0x"\n', "dataDir: must not contain a NUL byte"),
    ('dataDir: "/tmp/x/\\ud800"\n', "dataDir: has '\\ud800' at position 7, which a path cannot "
                                     "hold (surrogates not allowed)"),
    # YAML reads 1e100 as a string: pydantic's "unable to parse string as an integer" puzzled
    ("context:\n  keepRecentTurns: 1e100\n", "context.keepRecentTurns: must be a whole number written in digits, "
                                             "not '1e100'"),
    # loaded, then every LLM call failed ("LLM Provider NOT provided"), or went to a provider for
    # a model named "Extractive" instead of the built-in summarizer
    ("context:\n  compactionModel: ' openai/gpt-4o-mini'\n",
     "context.compactionModel: ' openai/gpt-4o-mini' has spaces around it"),
    ("context:\n  fallbackModel: Extractive\n",
     "context.fallbackModel: 'Extractive': the built-in summarizer is written 'extractive'"),
    ("context:\n  fallbackModel: gpt 4o\n", "context.fallbackModel: 'gpt 4o' holds a space"),
    # loaded, and that tool's outputs were never elided
    ("context:\n  compactableTools: [read_file, ' run_tests']\n",
     "context.compactableTools: item 1: ' run_tests' has spaces around it: write 'run_tests'"),
    ("context:\n  compactableTools: ['']\n", "context.compactableTools: item 0 is empty"),
    ('api:\n  allowedHosts: ["a.example", "b\\ud800"]\n', "api.allowedHosts: item 1: contains a lone surrogate "
                                                          "(\\ud800 at character 1)"),
    # a typo was a bare "unknown key"
    ("context:\n  compactionThreshhold: 0.5\n",
     "context.compactionThreshhold: unknown key (did you mean compactionThreshold?)"),
    ("context:\n  compaction-threshold: 0.5\n",
     "context.compaction-threshold: unknown key (the file spells it compactionThreshold)"),
    # YAML keeps a repeated key's last value: the first section's settings were dropped unsaid
    ("context:\n  maxFailures: 5\nagentKey: 1\ncontext:\n  keepRecentTurns: 2\n",
     "context: given twice in {file} (lines 1 and 4): YAML keeps the last"),
    ("redis:\n  prefix: a\n  shards: 4\n  'prefix': b\n", "redis.prefix: given twice in {file} (lines 2 and 4)"),
])
def test_bad_config_is_one_line_and_exit_2(runner: CliRunner, tmp_path: Path, yaml_text: str,
                                           fragment: str) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml_text)
    for command in (["status"], ["context", SID, "--cwd", CWD], ["health"], ["watch"]):
        result = runner.invoke(app, [*command, "--config", str(bad)])
        assert result.exit_code == 2, (command, result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("compactor: invalid configuration")
        assert str(bad) in lines[0]  # (a codingcode.yaml read from the working directory went unnamed)
        assert fragment.format(file=bad) in lines[0]


def test_a_key_merged_in_by_yaml_and_overridden_is_no_repeated_key(runner: CliRunner, tmp_path: Path) -> None:
    """``<<: *defaults`` then one key overridden is YAML's own idiom (the explicit key wins): the
    check for repeated keys ran on the node tree after PyYAML had spliced the merged pairs into
    it, and refused the file ("context.maxFailures: given twice ... lines 1 and 4")."""
    from events.config import load_settings

    config = tmp_path / "merged.yaml"
    config.write_text("x-defaults: &d {maxFailures: 2, keepRecentTurns: 4}\n"
                      "context:\n  <<: *d\n  maxFailures: 5\n"
                      "redis: {<<: {shards: 4, prefix: shared}, prefix: mine}\n")
    settings = load_settings(config, {})
    assert (settings.context.max_failures, settings.context.keep_recent_turns) == (5, 4)
    assert (settings.redis.shards, settings.redis.prefix) == (4, "mine")
    config.write_text("x-defaults: &d {maxFailures: 2}\ncontext:\n  <<: *d\n  maxFailures: 5\n  maxFailures: 6\n")
    result = runner.invoke(app, ["status", "--config", str(config)])
    assert result.exit_code == 2 and "context.maxFailures: given twice" in result.stderr  # (still refused)


def test_aliases_in_the_config_are_checked_for_repeated_keys_once_each(tmp_path: Path) -> None:
    """The check for repeated keys followed aliases: one to a mapping holding it recursed without
    end (a RecursionError traceback), and a chain of 21 doubled the work at each link (2.8 s)."""
    from events.config import load_settings
    from events.errors import InvalidConfig

    config = tmp_path / "c.yaml"
    config.write_text("context: &c {compactionThreshold: 0.8, extra: {loop: *c}}\n")
    with pytest.raises(InvalidConfig, match=f"^{re.escape(str(config))}: context.extra: "):
        load_settings(config, environ={})
    chain = ["a0: &a0 {x: 1}"] + [f"a{n}: &a{n} {{a: *a{n - 1}, b: *a{n - 1}}}" for n in range(1, 40)]
    config.write_text("\n".join(chain) + "\ncontext: {keepRecentTurns: 2, x: *a39}\n")
    started = time.monotonic()
    with pytest.raises(InvalidConfig, match=f"^{re.escape(str(config))}: context.x: "):
        load_settings(config, environ={})
    assert time.monotonic() - started < 2


def test_a_key_the_agent_repeats_outside_our_sections_is_left_to_it(tmp_path: Path) -> None:
    from events.config import load_settings
    config = tmp_path / "c.yaml"
    config.write_text("model: a\nmodel: b\nagent: {x: 1, x: 2}\ncontext: {keepRecentTurns: 3}\n")
    assert load_settings(config, environ={}).context.keep_recent_turns == 3


def test_every_wrong_value_is_named_in_the_one_line(runner: CliRunner, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("context:\n  compactionThreshold: 1.5\n  keepRecentTurns: -1\nredis:\n  shards: 0\n")
    result = runner.invoke(app, ["status", "--config", str(bad)])
    assert result.exit_code == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"compactor: invalid configuration: {bad}: context.compactionThreshold: ")
    assert "; context.keepRecentTurns: " in line and "; redis.shards: " in line


def test_a_misspelt_section_is_warned_of_and_the_agents_own_keys_are_not(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    from events.config import Settings, load_settings

    config = tmp_path / "c.yaml"
    config.write_text("contxt:\n  keepRecentTurns: 3\nRediss: {}\nmodel: gpt-4o\ntools: [read_file]\n"
                      "apiKey: x\ncontextWindow: 8000\n")
    with caplog.at_level(logging.WARNING, logger="events.config"):
        settings = load_settings(config, environ={})
    assert settings == Settings()  # still ignored: the file is shared with the agent
    assert sorted(r.getMessage() for r in caplog.records) == [
        f"{config}: unknown top-level key 'Rediss' ignored; did you mean 'redis'?",
        f"{config}: unknown top-level key 'contxt' ignored; did you mean 'context'?",
    ]


@pytest.mark.parametrize("key,ours", [("datadir", "dataDir"), ("DataDir", "dataDir"), ("data-dir", "dataDir"),
                                      ("Redis", "redis"), ("CONTEXT", "context")])
def test_one_of_our_top_level_keys_in_another_case_or_with_a_separator_is_refused(
    tmp_path: Path, key: str, ours: str,
) -> None:
    """Only ``data_dir`` was refused: ``datadir: /srv/logs`` was warned of and ignored, and the logs
    went to the default dataDir (each session split in two); ``Redis:`` ran an embedded server
    that no agent published to."""
    from events.config import load_settings
    from events.errors import InvalidConfig

    config = tmp_path / "c.yaml"
    config.write_text(f"{key}: {{}}\n" if ours != "dataDir" else f"{key}: /srv/logs\n")
    with pytest.raises(InvalidConfig, match=f"{key}: unknown key \\(the file spells it {ours}\\)"):
        load_settings(config, environ={})


def test_the_file_takes_its_keys_only_as_spelt_in_camel_case(
    runner: CliRunner, tmp_path: Path,
) -> None:
    """The field names were a second, undocumented spelling: ``data_dir`` alone was used, beside
    ``dataDir`` silently dropped, and ``compaction_model`` beside ``compactionModel`` an error
    on a spelling that worked alone. Then ``data_dir`` was ignored with a warning: a file written
    for the version that read it sent the logs to the default dataDir after an upgrade (each
    session split in two, its history gone from its context)."""
    config = tmp_path / "c.yaml"
    config.write_text(f"data_dir: {tmp_path / 'elsewhere'}\nagentTheme: dark\n")
    result = runner.invoke(app, ["api", "--config", str(config)])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        f"compactor: invalid configuration: {config}: data_dir: unknown key (the file spells it dataDir)"]
    config.write_text("context:\n  compaction_model: x\n  keepRecentTurns: 3\n")
    result = runner.invoke(app, ["api", "--config", str(config)])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        f"compactor: invalid configuration: {config}: context.compaction_model: unknown key (the file spells it "
        "compactionModel)"]
    config.write_text("context:\n  keepRecnetTurns: 3\n")
    result = runner.invoke(app, ["api", "--config", str(config)])
    assert result.stderr.strip().splitlines() == [
        f"compactor: invalid configuration: {config}: context.keepRecnetTurns: unknown key (did you mean keepRecentTurns?)"]


def test_a_value_of_the_wrong_shape_is_named_in_yaml_words(runner: CliRunner, tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    for text, line in (
        ("context:\n  compactableTools: read_file\n",
         "context.compactableTools: must be a list, not the text 'read_file'"),
        ("context: 3\nredis: [a]\n",
         "context: must be a section (keys and values), not a number; redis: must be a section (keys and "
         "values), not a list"),
    ):
        config.write_text(text)
        result = runner.invoke(app, ["api", "--config", str(config)])
        assert result.exit_code == 2, result.output
        assert result.stderr.strip().splitlines() == [f"compactor: invalid configuration: {config}: {line}"]


def test_a_job_timeout_not_above_the_llm_timeout_is_warned_of(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """Valid but self-defeating: the job's timeout fired inside every slow LLM call."""
    from events.config import load_settings

    config = tmp_path / "c.yaml"
    config.write_text("context:\n  llmTimeoutSeconds: 30\nworker:\n  jobTimeoutSeconds: 5\n")
    with caplog.at_level(logging.WARNING, logger="events.config"):
        load_settings(config, environ={})
    [record] = caplog.records
    assert record.getMessage().startswith("worker.jobTimeoutSeconds (5) is not above context.llmTimeoutSeconds (30")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="events.config"):
        (tmp_path / "empty.yaml").write_text("")
        load_settings(tmp_path / "empty.yaml", environ={})  # the defaults: 600 s against 120 s
    assert caplog.records == []
    # an event limit past the body's: valid (stream producers are held to it), but the API's never applies
    config.write_text("limits:\n  maxBodyBytes: 1048576\n")  # the event limit's default is 4 MiB
    with caplog.at_level(logging.WARNING, logger="events.config"):
        load_settings(config, environ={})
    [record] = caplog.records
    assert record.getMessage().startswith("limits.maxEventBytes (4194304) is above limits.maxBodyBytes (1048576)")


@pytest.mark.parametrize("command", ["serve", "watch", "work"])
def test_a_data_dir_that_cannot_be_used_is_one_line_and_exit_2(runner: CliRunner, tmp_path: Path,
                                                               command: str) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    result = runner.invoke(app, [command, "--data-dir", str(a_file / "data"), "--redis-url", "redis://127.0.0.1:1"])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        f"compactor: invalid configuration: dataDir (from --data-dir): {a_file / 'data'} cannot be created: "
        "Not a directory"]
    # where it came from is named, as for any other bad value (it was "dataDir" alone)
    for spelled in (str(a_file), f"{a_file}/", f"{a_file.parent}/./{a_file.name}"):  # (a trailing / was
        # blamed on --data-dir: typer's Path option drops it, and the two no longer compared equal)
        result = runner.invoke(app, [command, "--redis-url", "redis://127.0.0.1:1"], env={"COMPACTION_DATA_DIR": spelled})
        assert result.stderr.strip().splitlines() == [
            f"compactor: invalid configuration: dataDir (from COMPACTION_DATA_DIR): {a_file} is not a directory"]
    config = tmp_path / "c.yaml"
    config.write_text(f"dataDir: {a_file}\n")
    result = runner.invoke(app, [command, "--redis-url", "redis://127.0.0.1:1", "--config", str(config)],
                           env={"COMPACTION_DATA_DIR": ""})
    assert result.stderr.strip().splitlines() == [  # the file named in front, as for its other wrong values
        f"compactor: invalid configuration: {config}: dataDir: {a_file} is not a directory"]
    # with no Redis to name either, the data dir is what is said (it said "redis.url: is empty and no
    # `compactor serve` runs under <a file>")
    result = runner.invoke(app, [command, "--data-dir", str(a_file)], env={"REDIS_URL": "", "COMPACTION_DATA_DIR": ""})
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        f"compactor: invalid configuration: dataDir (from --data-dir): {a_file} is not a directory"]


@pytest.mark.parametrize("command", [["api", "--port", "0"], ["context", "s1", "--cwd", "/p"],
                                     ["compact", "s1", "--cwd", "/p"], ["status"]])
def test_a_reader_on_a_data_dir_that_is_a_file_is_refused_not_told_no_session(
        runner: CliRunner, tmp_path: Path, command: list[str]) -> None:
    """``api`` started on it and answered every session 404 (``context``: "no session"), the
    mistake said as a missing session, where watch, work and serve refused it."""
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    result = runner.invoke(app, [*command, "--data-dir", str(a_file), "--redis-url", "redis://127.0.0.1:1"]
                           if command[0] != "context" else [*command, "--data-dir", str(a_file)])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        f"compactor: invalid configuration: dataDir (from --data-dir): {a_file} is not a directory"]
    missing = runner.invoke(app, ["context", "s1", "--cwd", "/p", "--data-dir", str(tmp_path / "none")])
    assert missing.exit_code == 1 and "no session" in missing.stderr  # (not there yet: no concern of a reader)
    under = runner.invoke(app, ["context", "s1", "--cwd", "/p", "--data-dir", str(a_file / "data")])
    assert under.exit_code == 2 and under.stderr.strip().splitlines() == [
        f"compactor: invalid configuration: dataDir (from --data-dir): {a_file / 'data'}: {a_file}, on its way, "
        "is not a directory"]


def test_a_demo_data_dir_that_cannot_be_used_is_one_line_and_exit_2(runner: CliRunner, tmp_path: Path) -> None:
    """It was a traceback from the embedded Redis's mkdir (NotADirectoryError, or a read-only file system)."""
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    result = runner.invoke(app, ["demo", "--data-dir", str(a_file), "-s", "1", "-t", "1"])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        f"compactor: invalid configuration: --data-dir: {a_file} is not a directory"]


@pytest.mark.parametrize("command", [["context", "s1", "--cwd", "/p"], ["demo"]])
def test_an_empty_data_dir_option_is_refused_not_taken_for_the_current_directory(
    runner: CliRunner, command: list[str],
) -> None:
    result = runner.invoke(app, [*command, "--data-dir", ""])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        "compactor: invalid configuration: dataDir (from --data-dir): must not be empty (it would mean the "
        "current directory: pass . for that)"]


@pytest.mark.parametrize("command", [["status"], ["api"], ["context", "s1", "--cwd", "/p"]])
def test_an_empty_config_option_is_refused_not_read_as_the_current_directory(
    runner: CliRunner, command: list[str],
) -> None:
    """``Path("")`` is ``.``: the error said ``.: cannot be read: Is a directory``."""
    result = runner.invoke(app, [*command, "--config", ""])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        "compactor: invalid configuration: --config: must not be empty (name a codingcode.yaml, or leave the "
        "option out for ./codingcode.yaml)"]


@pytest.mark.parametrize("source", ["file", "COMPACTION_DATA_DIR", "--data-dir"])
def test_a_data_dir_in_an_unknown_users_home_is_one_line_and_exit_2(runner: CliRunner, tmp_path: Path,
                                                                     source: str) -> None:
    """``Path.expanduser`` raised "RuntimeError: Could not determine home directory.": a traceback."""
    config = tmp_path / "c.yaml"
    config.write_text("dataDir: ~nosuchuser/x\n" if source == "file" else "")
    flag = ["--data-dir", "~nosuchuser/x"] if source == "--data-dir" else []
    env = {"COMPACTION_DATA_DIR": "~nosuchuser/x"} if source == "COMPACTION_DATA_DIR" else {}
    key = f"{config}: dataDir" if source == "file" else f"dataDir (from {source})"
    for command in (["status"], ["watch"], ["serve"]):
        result = runner.invoke(app, [*command, "--config", str(config), *flag], env=env)
        assert result.exit_code == 2, (command, result.output)
        assert result.stderr.strip().splitlines() == [
            f"compactor: invalid configuration: {key}: ~nosuchuser/x: cannot expand ~nosuchuser: no such user"]


def test_missing_config_file_is_exit_2(runner: CliRunner, tmp_path: Path) -> None:
    result = runner.invoke(app, ["status", "--config", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 2 and "config file not found" in result.stderr


def test_a_config_path_that_cannot_be_read_is_one_line_and_exit_2(runner: CliRunner, tmp_path: Path) -> None:
    result = runner.invoke(app, ["status", "--json", "--config", str(tmp_path)])  # a directory
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [f"compactor: invalid configuration: {tmp_path}: cannot be read: "
                                                  "Is a directory"]


def test_a_config_file_nested_too_deeply_or_a_broken_link_is_said_and_utf16_is_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """600 nested brackets were a RecursionError traceback; a ./codingcode.yaml linking to a file
    moved away was the defaults, said nowhere; a UTF-16 file (PowerShell 5's ``>``) was "not valid
    YAML: 'utf-8' codec can't decode byte 0xff"."""
    from events.config import load_settings
    from events.errors import InvalidConfig

    deep = tmp_path / "deep.yaml"
    deep.write_text("x: " + "[" * 3000 + "]" * 3000 + "\n")
    with pytest.raises(InvalidConfig, match="is not valid YAML: nested too deeply"):
        load_settings(deep, environ={})
    monkeypatch.chdir(tmp_path)
    (tmp_path / "codingcode.yaml").symlink_to(tmp_path / "moved.yaml")
    with pytest.raises(InvalidConfig, match=r"config file not found: a broken symbolic link to .*moved\.yaml"):
        load_settings(None, environ={})
    wide = tmp_path / "wide.yaml"
    wide.write_bytes("context:\n  keepRecentTurns: 3\n".encode("utf-16"))  # (with its byte order mark)
    assert load_settings(wide, environ={}).context.keep_recent_turns == 3


def test_a_key_or_section_with_no_value_takes_its_default(tmp_path: Path) -> None:
    from events.config import Settings, load_settings

    config = tmp_path / "c.yaml"
    config.write_text("context:\n  # compactionModel: x\nredis:\n  url:\napi: {port: }\n")
    assert load_settings(config, environ={}) == Settings()


def test_an_env_override_does_not_hide_a_wrong_section_in_the_file(tmp_path: Path) -> None:
    from events.config import load_settings
    from events.errors import InvalidConfig

    config = tmp_path / "c.yaml"
    config.write_text("api: 5\n")
    with pytest.raises(InvalidConfig, match=f"^{re.escape(str(config))}: api: "):
        load_settings(config, environ={"COMPACTION_API_PORT": "9000"})


def test_bad_env_override_is_exit_2(runner: CliRunner, tmp_path: Path) -> None:
    result = runner.invoke(app, ["serve", "--config", str(tmp_path / "x.yaml")],
                           env={"COMPACTION_API_PORT": "not-a-port"})
    assert result.exit_code == 2


@pytest.mark.parametrize("url,why", [
    ("http://x", "redis.url{src}: must start with redis://, rediss:// or unix://, not http://"),
    ("REDIS://h", "redis.url{src}: must start with redis://, rediss:// or unix://, not REDIS://"),
    ("redis://h:99999", "redis.url{src}: port 99999 is out of range 1-65535"),
    ("redis://:s3cret@127.0.0.1:notaport/0", "redis.url{src}: port must be a number, not 'notaport'"),
    ("redis://:s3cret#x@127.0.0.1:6379/0", "redis.url{src}: port must be a number; the URL does not parse as one "
                                          "with a password: percent-encode a password's '#', '/', '?', '@' (%23, "
                                          "%2F, %3F, %40)"),
    ("redis://h/db0", "redis.url{src}: the database must be a number, not 'db0'"),
    ("redis://h?db=x", "redis.url{src}: the database must be a number, not 'x'"),
    # a digit to ``isdigit``, not to ``int``: the port was a raw "invalid literal for int()", the
    # database dropped by redis-py (db 0)
    ("redis://h:\u00b2/0", "redis.url{src}: port must be a number, not '\u00b2'"),
    ("redis://h/\u00b2", "redis.url{src}: the database must be a number, not '\u00b2'"),
    ("redis://:s3cret@h/0?socket_timeout=abc", "redis.url{src}: Invalid value for 'socket_timeout' in connection URL"),
    ("redis://h?ssl_cert_reqs=none", "redis.url{src}: the query setting 'ssl_cert_reqs' is not one a redis:// "
                                     "connection takes"),
    ("rediss://h/0?ssl_cert_reqs=bogus", "redis.url{src}: a query setting is refused: Invalid SSL Certificate "
                                         "Requirements Flag: bogus"),
    ("redis://h/0?protocol=9", "redis.url{src}: a query setting is refused: protocol must be either 2 or 3"),
    ("unix://", "redis.url{src}: a unix:// URL needs the socket's absolute path (unix:///path/redis.sock)"),
    ("unix://relative.sock", "redis.url{src}: a unix:// URL needs the socket's absolute path "
                             "(unix:///path/redis.sock)"),
    # loaded, then every command died at its first Redis call with a traceback (a UnicodeError from
    # the resolver; the socket's ValueError), and ``compact`` printed no CompressResult line
    ("redis://a..b:6379", "redis.url{src}: the host 'a..b' is not a host name (an empty label, or one over 63 "
                          "characters)"),
    ("redis://a%2E%2Eb", "redis.url{src}: the host 'a..b' is not a host name (an empty label, or one over 63 "
                         "characters)"),  # (redis-py reads the host percent-decoded)
    ("redis://:s3cret@h/0?socket_timeout=-1", "redis.url{src}: the query setting socket_timeout must be a number "
                                              "of seconds over 0 and at most 86400, not -1.0"),
    ("redis://h?socket_connect_timeout=nan", "redis.url{src}: the query setting socket_connect_timeout must be a "
                                             "number of seconds over 0 and at most 86400, not nan"),
])
@pytest.mark.parametrize("source", ["file", "--redis-url", "REDIS_URL"])
def test_a_bad_redis_url_is_one_line_and_exit_2_naming_where_it_came_from(
    runner: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str, why: str, source: str,
) -> None:
    """redis-py's ValueError was a 47-line traceback (exit 1), and ``work`` replaced its dying
    workers every second forever; the password of a URL is never shown."""
    monkeypatch.delenv("REDIS_URL", raising=False)
    config = tmp_path / "c.yaml"
    config.write_text(f"redis:\n  url: '{url}'\n" if source == "file" else "")
    flag = ["--redis-url", url] if source == "--redis-url" else []
    env = {"REDIS_URL": url} if source == "REDIS_URL" else {}
    expected = (f"compactor: invalid configuration: {config}: " + why.format(src="") if source == "file"
                else "compactor: invalid configuration: " + why.format(src=f" (from {source})"))
    for command in (["status"], ["health"], ["watch"], ["work", "--count", "1"], ["api"], ["demo"]):
        result = runner.invoke(app, [*command, "--config", str(config), "--data-dir", str(tmp_path / "d"), *flag],
                               env=env)
        assert result.exit_code == 2, (command, result.output)
        assert result.stderr.strip().splitlines() == [expected], command
        assert "s3cret" not in result.stderr
    quiet = runner.invoke(app, ["health", "--check", "--config", str(config), *flag], env=env)
    assert (quiet.exit_code, quiet.stdout, quiet.stderr) == (1, "", "")  # a health check never exits 2


@pytest.mark.parametrize("url", ["redis://h", "rediss://user:pw@h:6380/2", "redis://[::1]:6379?db=3",
                                 "unix:///tmp/r.sock?db=0", "redis://h:6379/", "redis://h?socket_timeout=2.5",
                                 "rediss://h?ssl_cert_reqs=none", "redis://[fe80::1%25eth0]:6379",
                                 "redis://m\u00fcnchen.example:6379", "redis://cafe.be", "redis://redis_1:6379",
                                 "redis://" + "%61" * 30 + ".example"])
def test_a_good_redis_url_loads(tmp_path: Path, url: str) -> None:
    from events.config import load_settings

    (tmp_path / "c.yaml").write_text(f"redis: {{url: '{url}'}}\n")
    assert load_settings(tmp_path / "c.yaml", environ={}).redis.url == url


def test_a_character_past_u_ffff_that_a_json_writer_escaped_as_a_pair_loads_as_itself(tmp_path: Path) -> None:
    """A config written by ``json.dumps`` (YAML reads JSON) holds ``"\\ud83d\\ude00"`` for an emoji:
    PyYAML leaves the two halves apart, and the lone-surrogate check refused a valid value."""
    from events.config import load_settings

    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({"api": {"token": "tok-\U0001f600", "allowedHosts": ["h\U0001f600.example"]}}))
    assert "\\ud83d\\ude00" in config.read_text()
    settings = load_settings(config, environ={})
    assert (settings.api.token, settings.api.allowed_hosts) == ("tok-\U0001f600", ["h\U0001f600.example"])


@pytest.mark.parametrize("var,value,why", [
    ("COMPACTION_API_PORT", "abc", "api.port (from COMPACTION_API_PORT): Input should be a valid integer"),
    ("COMPACTION_WORKERS", "0", "worker.count (from COMPACTION_WORKERS): Input should be greater than or equal to 1"),
    ("COMPACTION_DATA_DIR", " ", "dataDir (from COMPACTION_DATA_DIR): must not be empty"),
    # a byte not UTF-8 in a variable, which Python reads as a lone surrogate: loaded, every request
    # sending a token (the right one too) was a 500, and every LLM job of that model failed
    ("COMPACTION_API_TOKEN", "ab\udcff", "api.token (from COMPACTION_API_TOKEN): contains a lone surrogate "
                                         "(\\udcff at character 2)"),
    ("COMPACTION_MODEL", "openai/m\udcff", "context.compactionModel (from COMPACTION_MODEL): contains a lone"),
    ("REDIS_URL", "redis://us\udcffer@h", "redis.url (from REDIS_URL): contains a lone surrogate"),
])
def test_a_bad_environment_variable_is_named(runner: CliRunner, tmp_path: Path, var: str, value: str,
                                             why: str) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(f"api: {{port: 9000}}\nworker: {{count: 3}}\ndataDir: {tmp_path / 'data'}\n")
    # (``serve`` and ``api`` take the variable as their option's value too: typer's usage box said it)
    for command in (["status"], ["serve"], ["api"]):
        result = runner.invoke(app, [*command, "--config", str(config)], env={var: value})
        assert result.exit_code == 2, (command, result.output)
        [line] = result.stderr.strip().splitlines()
        assert line.startswith(f"compactor: invalid configuration: {why}"), (command, line)


def test_a_bad_port_or_worker_count_option_is_one_line_naming_it(runner: CliRunner, tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(f"dataDir: {tmp_path / 'data'}\n")
    for args, why in ((["serve", "--port", "70000"], "api.port (from --port): Input should be less than or equal"),
                      (["api", "--port", "x"], "api.port (from --port): Input should be a valid integer"),
                      (["serve", "--workers", "65"], "worker.count (from --workers): Input should be less than"),
                      (["work", "--count", "0"], "worker.count (from --count): Input should be greater than")):
        result = runner.invoke(app, [*args, "--config", str(config)])
        assert result.exit_code == 2, (args, result.output)
        [line] = result.stderr.strip().splitlines()
        assert line.startswith(f"compactor: invalid configuration: {why}"), (args, line)


def test_work_count_overrides_compaction_workers_and_a_refused_start_creates_no_data_dir(
        runner: CliRunner, tmp_path: Path) -> None:
    """``work --count 1`` was refused for a stale ``COMPACTION_WORKERS=0`` (the flag never reached the
    settings); and ``watch`` / ``work`` refused for want of a Redis had created the data dir first."""
    data = tmp_path / "data"
    result = runner.invoke(app, ["work", "--count", "1", "--burst", "--redis-url", "redis://127.0.0.1:1/0",
                                 "--data-dir", str(data)], env={"COMPACTION_WORKERS": "0"})
    assert result.exit_code == 1 and "Redis unreachable" in result.stderr, result.output
    for command in ("watch", "work"):
        gone = tmp_path / f"never-{command}"
        result = runner.invoke(app, [command, "--redis-url", "", "--data-dir", str(gone)])
        assert result.exit_code == 2 and "no `compactor serve` runs under" in result.stderr, result.output
        assert not gone.exists()


def test_an_empty_environment_variable_leaves_the_files_value(tmp_path: Path) -> None:
    """docker compose sets ``COMPACTION_API_TOKEN=${COMPACTION_API_TOKEN:-}``: empty, it turned the
    file's ``api.token`` off, and the API answered everyone without a word in the logs."""
    from events.config import load_settings

    config = tmp_path / "c.yaml"
    config.write_text("api: {token: filetok}\nredis: {url: 'redis://h:6390'}\n")
    settings = load_settings(config, {"COMPACTION_API_TOKEN": "", "REDIS_URL": "", "COMPACTION_MODEL": ""})
    assert (settings.api.token, settings.redis.url, settings.context.compaction_model) == (
        "filetok", "redis://h:6390", "")
    assert load_settings(config, {"COMPACTION_API_TOKEN": "envtok"}).api.token == "envtok"


@pytest.mark.parametrize("token", [" s3cret", "s3cret\n", "\ts3cret "])
def test_an_api_token_with_whitespace_at_an_end_is_refused_without_showing_it(runner: CliRunner, tmp_path: Path,
                                                                              token: str) -> None:
    """HTTP strips a header value's ends, so no request could carry such a token: every Bearer
    request was a 401. Stripping it would leave the clients sending something else."""
    from events.config import load_settings

    config, empty = tmp_path / "c.yaml", tmp_path / "empty.yaml"
    config.write_text(json.dumps({"api": {"token": token}}))  # (JSON is YAML)
    empty.write_text("")
    for path, env, key in ((config, {}, f"{config}: api.token"),
                           (empty, {"COMPACTION_API_TOKEN": token}, "api.token (from COMPACTION_API_TOKEN)")):
        result = runner.invoke(app, ["api", "--config", str(path)], env=env)
        assert result.exit_code == 2, result.output
        assert result.stderr.strip().splitlines() == [
            f"compactor: invalid configuration: {key}: must not begin or end with whitespace (HTTP strips a "
            "header's ends: no request could carry it)"]
        assert "s3cret" not in result.stderr
    assert load_settings(empty, {"COMPACTION_API_TOKEN": "a b\u00a0"}).api.token == "a b\u00a0"  # sent as is


def test_an_api_token_with_a_line_break_or_a_nul_inside_is_refused(runner: CliRunner, tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    for token in ("s3cret\nmore", "s3cret\rmore", "s3cret\0more"):
        config.write_text(json.dumps({"api": {"token": token}}))
        result = runner.invoke(app, ["api", "--config", str(config)])
        assert result.exit_code == 2, result.output
        assert result.stderr.strip().splitlines() == [
            f"compactor: invalid configuration: {config}: api.token: must not hold a line break or a NUL (no HTTP "
            "header can carry one)"]


@pytest.mark.parametrize("host", ["", " "])
def test_an_empty_api_host_in_the_file_is_refused_not_every_interface(runner: CliRunner, tmp_path: Path,
                                                                      host: str) -> None:
    """``bind("")`` listens on every interface: the file's empty ``api.host`` opened the API to the
    network, where an empty ``COMPACTION_API_HOST`` or ``--host ""`` means the default."""
    from events.config import load_settings

    config, empty = tmp_path / "c.yaml", tmp_path / "empty.yaml"
    config.write_text(json.dumps({"api": {"host": host}}))
    empty.write_text("")
    result = runner.invoke(app, ["api", "--config", str(config)])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        f"compactor: invalid configuration: {config}: api.host: must not be empty (it would listen on every interface): "
        "127.0.0.1 for this machine only (the default: leave it out), 0.0.0.0 for every interface"]
    assert load_settings(empty, {"COMPACTION_API_HOST": ""}).api.host == "127.0.0.1"


def test_demo_reads_its_data_dir_as_data_dir_is_read(runner: CliRunner, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``--data-dir '~nosuchuser/x'`` made a directory named ``~nosuchuser`` where the demo ran."""
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["demo", "--sessions", "1", "--turns", "1", "--data-dir", "~nosuchuser/x"])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        "compactor: invalid configuration: dataDir (from --data-dir): ~nosuchuser/x: cannot expand ~nosuchuser: "
        "no such user"]
    assert list(tmp_path.iterdir()) == []


def test_the_compaction_and_fallback_models_can_come_from_the_environment(tmp_path: Path) -> None:
    """The compose file's template used them; ``docker run -e COMPACTION_MODEL=...`` was ignored."""
    from events.config import load_settings

    (tmp_path / "c.yaml").write_text("")
    settings = load_settings(tmp_path / "c.yaml", {"COMPACTION_MODEL": "openai/gpt-4o-mini",
                                                      "COMPACTION_FALLBACK_MODEL": "extractive"})
    assert (settings.context.compaction_model, settings.context.fallback_model) == (
        "openai/gpt-4o-mini", "extractive")


def test_a_relative_data_dir_is_made_absolute_at_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from events.config import load_settings

    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text("")
    assert load_settings(tmp_path / "c.yaml", {"COMPACTION_DATA_DIR": "d/../data"}).data_dir == tmp_path / "data"


def test_a_data_dir_too_long_for_the_embedded_redis_socket_is_one_line(runner: CliRunner, tmp_path: Path) -> None:
    """valkey refuses a unix socket path over 107 bytes: ``serve`` died with a traceback."""
    from compactor.embedded import EmbeddedRedis
    from compactor.serve import embedded_dir
    from events.config import MAX_SOCKET_PATH_BYTES, load_settings

    long_dir = tmp_path / ("d" * (MAX_SOCKET_PATH_BYTES - len(str(tmp_path))))
    fits = tmp_path / ("d" * (MAX_SOCKET_PATH_BYTES - len(str(tmp_path)) - len("/.redis/redis.sock") - 1))
    (tmp_path / "c.yaml").write_text("")
    settings = load_settings(tmp_path / "c.yaml", {"COMPACTION_DATA_DIR": str(fits)})
    assert len(str(EmbeddedRedis(embedded_dir(settings)).socket)) == MAX_SOCKET_PATH_BYTES  # the same layout
    for command in (["serve"], ["status"]):
        result = runner.invoke(app, [*command, "--data-dir", str(long_dir)], env={"REDIS_URL": ""})
        assert result.exit_code == 2, result.output
        assert result.stderr.strip().splitlines() == [
            f"compactor: invalid configuration: dataDir (from --data-dir): too long for the embedded Redis: its "
            f"socket {long_dir}/.redis/redis.sock would be {len(str(long_dir)) + 18} bytes, and a unix socket's "
            f"path takes at most {MAX_SOCKET_PATH_BYTES} (use a shorter dataDir, or set redis.url)"]
    # ``--redis-url ''`` is the embedded server even when the file names a URL: checked the same
    # (the URL was emptied after the check, and serve failed later on the socket)
    (tmp_path / "url.yaml").write_text("redis: {url: 'redis://127.0.0.1:1/0'}\n")
    emptied = runner.invoke(app, ["status", "--config", str(tmp_path / "url.yaml"), "--redis-url", "",
                                  "--data-dir", str(long_dir)], env={"REDIS_URL": None})
    assert emptied.exit_code == 2 and "dataDir (from --data-dir): too long for the embedded Redis" in emptied.stderr
    assert not long_dir.exists()
    assert load_settings(tmp_path / "c.yaml", {"COMPACTION_DATA_DIR": str(long_dir),
                                                  "REDIS_URL": "redis://h"}).data_dir == long_dir


def test_context_reads_a_log_under_a_data_dir_too_long_for_the_embedded_socket(
        runner: CliRunner, tmp_path: Path) -> None:
    """``context`` reads the log and never Redis: it was refused for the embedded server's socket."""
    from events.config import MAX_SOCKET_PATH_BYTES

    long_dir = tmp_path / ("d" * (MAX_SOCKET_PATH_BYTES - len(str(tmp_path))))
    log = long_dir / "tmp-p" / "sessions" / "s1.jsonl"
    log.parent.mkdir(parents=True)
    log.write_text(json.dumps({"type": "user", "uuid": "u1", "timestamp": "2026-12-03T00:00:00Z", "turnId": 1,
                               "content": "hello world"}) + "\n")
    (tmp_path / "c.yaml").write_text("")
    result = runner.invoke(app, ["context", "s1", "--cwd", "/tmp/p", "--json", "--config", str(tmp_path / "c.yaml"),
                                 "--data-dir", str(long_dir)], env={"REDIS_URL": None})
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["promptEstimate"] == 6


def test_a_bad_value_in_the_file_is_not_blamed_on_an_unrelated_variable(runner: CliRunner, tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("api: {port: abc}\n")
    result = runner.invoke(app, ["status", "--config", str(config)], env={"COMPACTION_API_HOST": "0.0.0.0"})
    assert result.exit_code == 2
    assert result.stderr.startswith(f"compactor: invalid configuration: {config}: api.port: Input should be a valid "
                                    "integer")


@pytest.mark.parametrize("yaml_text,where", [
    ("context: {\n", "line 2 column 1: expected the node content, but found '<stream end>' "
                     "(while parsing a flow node)"),
    ("redis:\n  url: x\n   prefix: y\n", "line 3 column 10: mapping values are not allowed here"),
    ("a: 1\n\tb: 2\n", "line 2 column 1: found character '\\t' that cannot start any token "
                       "(while scanning for the next token)"),
    # the end of the file alone named no quote, nor where it opened
    ("context:\n  compactionModel: \"gpt\n", "line 3 column 1: found unexpected end of stream "
                                            "(while scanning a quoted scalar from line 2 column 20)"),
    ("context: {}\n---\nredis: {}\n", "line 2 column 1: but found another document "
                                     "(expected a single document in the stream from line 1 column 1)"),
])
def test_invalid_yaml_is_one_line_with_its_position(runner: CliRunner, tmp_path: Path, yaml_text: str,
                                                    where: str) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml_text)
    result = runner.invoke(app, ["context", SID, "--cwd", CWD, "--config", str(bad)])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [f"compactor: invalid configuration: {bad}: {where}"]


def test_processes_without_redis_url_and_no_serve_exit_2(runner: CliRunner, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("CODINGCODE_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    for command in ("watch", "work", "api", "status"):
        result = runner.invoke(app, [command, "--data-dir", str(tmp_path / "d")])
        assert result.exit_code == 2, (command, result.output)
        assert "no `compactor serve` runs" in result.stderr


def test_work_with_an_unreachable_redis_exits_1_at_once(tmp_path: Path) -> None:
    """Its worker processes used to die at their first Redis call and be replaced every second,
    a traceback each, forever."""
    process = subprocess.Popen(
        [sys.executable, "-m", "compactor", "work", "--count", "2", "--redis-url", f"unix://{tmp_path}/none.sock",
         "--data-dir", str(tmp_path / "d")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        out, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    assert process.returncode == 1
    [line] = err.strip().splitlines()
    assert line.startswith(f"compactor: Redis unreachable at unix://{tmp_path}/none.sock: "), line


def test_an_option_given_empty_is_not_dropped_as_an_empty_variable_is(
        runner: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--redis-url ''`` (its help: "empty: the embedded server of compactor serve") used the file's
    URL, and ``--host ''`` listened on the default address, where ``api.host: ''`` is refused."""
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("COMPACTION_API_HOST", raising=False)
    config = tmp_path / "c.yaml"
    config.write_text(f"redis: {{url: 'redis://127.0.0.1:1/0'}}\ndataDir: {tmp_path / 'd'}\n")
    embedded = runner.invoke(app, ["status", "--config", str(config), "--redis-url", ""])
    assert embedded.exit_code == 2 and "no `compactor serve` runs" in embedded.stderr, embedded.output
    host = runner.invoke(app, ["api", "--config", str(config), "--host", ""])
    assert host.exit_code == 2
    assert host.stderr.strip() == "compactor: invalid configuration: api.host (from --host): must not be empty"


def test_work_gives_up_on_a_worker_process_that_keeps_dying(settings: Settings,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from worker import runner

    monkeypatch.setattr(runner, "RESPAWN_DELAY_S", 0.0)
    monkeypatch.setattr(runner, "_child", lambda settings, burst: os._exit(3))  # forked: inherited
    with pytest.raises(runner.WorkersFailed, match=rf"worker process exited {runner.MAX_RESPAWNS} times within "
                                                    r"60s \(last exit code 3\); giving up"):
        runner._Supervisor(settings, 2, burst=False).run()


@pytest.mark.parametrize("host,key,reason", [
    ("127.0.0.1", "api.port (from --port)", "Address already in use; choose another with --port or "
                                            "COMPACTION_API_PORT"),
    ("10.255.255.1", "api.host (from --host)", "Cannot assign requested address"),
    ("not a host", "api.host (from --host)", "Name or service not known"),
])
def test_api_on_an_address_it_cannot_listen_on_is_one_line_and_exit_2(
        runner: CliRunner, settings: Settings, config: Path, host: str, key: str, reason: str) -> None:
    """uvicorn logged "[Errno 98] address already in use" and exited 3, a code the README does not list."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = runner.invoke(app, ["api", "--host", host, "--port", str(port), *base_args(settings, config)])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        f"compactor: invalid configuration: {key}: cannot listen on {host}:{port}: {reason}"]


def test_a_port_it_cannot_listen_on_is_named_with_where_it_came_from(
        runner: CliRunner, settings: Settings, config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """README: a wrong value from a variable or its option is named with it; the empty and range
    checks did, the listen check said ``api.port`` whatever set it."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setenv("COMPACTION_API_PORT", str(port))
        from_env = runner.invoke(app, ["api", *base_args(settings, config)])
        monkeypatch.delenv("COMPACTION_API_PORT")
        filed = config.parent / "port.yaml"
        filed.write_text(config.read_text() + f"\napi:\n  port: {port}\n")
        from_file = runner.invoke(app, ["api", *base_args(settings, filed)])
    assert from_env.exit_code == from_file.exit_code == 2, (from_env.output, from_file.output)
    assert "api.port (from COMPACTION_API_PORT): cannot listen on" in from_env.stderr
    assert "invalid configuration: api.port: cannot listen on" in from_file.stderr


def test_a_child_of_serve_restarted_on_a_read_only_data_dir_starts(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker restarted while the data dir was read-only (or full) exited 2 each time, and serve
    gave up and stopped the whole stack, its API too; the processes still running held their
    sessions through it. serve checks the data dir at its start; its children do not again."""
    from compactor.cli.common import usable_data_dir
    from compactor.serve import PARENT_PID_ENV

    def read_only(*args: Any, **kwargs: Any) -> Any:
        raise OSError(30, "Read-only file system")

    (tmp_path / "data").mkdir()
    settings = Settings.model_validate({"dataDir": str(tmp_path / "data")})
    monkeypatch.setattr("tempfile.TemporaryFile", read_only)
    with pytest.raises(typer.Exit):  # serve itself, or watch/work run alone: exit 2 at start
        usable_data_dir(settings)
    monkeypatch.setenv(PARENT_PID_ENV, str(os.getpid()))
    assert usable_data_dir(settings) is settings


def test_a_child_of_serve_does_not_create_its_data_dir_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """serve made the data dir: one gone since (moved, unmounted) was created again, empty, by each
    child restarted, and the data dir put back with ``mv`` went inside it."""
    from compactor.cli.common import usable_data_dir
    from compactor.serve import PARENT_PID_ENV

    settings = Settings.model_validate({"dataDir": str(tmp_path / "data")})
    monkeypatch.setenv(PARENT_PID_ENV, str(os.getpid()))
    with pytest.raises(typer.Exit) as stopped:
        usable_data_dir(settings)
    assert stopped.value.exit_code == 2 and not (tmp_path / "data").exists()
    assert f"{tmp_path / 'data'} is gone (removed, moved or unmounted while the service ran)" in capsys.readouterr().err
    monkeypatch.delenv(PARENT_PID_ENV)
    assert usable_data_dir(settings) is settings and (tmp_path / "data").is_dir()  # (serve's own start makes it)


def test_a_port_freed_within_a_few_seconds_is_waited_for() -> None:
    """The API of a serve killed with SIGKILL holds its port until it sees its parent gone (about
    a second): a serve restarted right after was refused, 'Address already in use', exit 2."""
    from compactor.cli.common import api_socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    threading.Timer(1.0, taken.close).start()
    started = time.monotonic()
    with api_socket("127.0.0.1", port) as sock:
        assert sock.getsockname()[1] == port
    assert 0.9 < time.monotonic() - started < 5


# -- context -----------------------------------------------------------------------------

def hand_written_log(data_dir: Path) -> None:
    path = SessionLog(data_dir, CWD, SID).path
    path.parent.mkdir(parents=True)
    lines = [
        {"type": "session_meta", "uuid": "m", "timestamp": "2025-01-01T00:00:00Z",
         "sessionId": SID, "cwd": CWD},
        {"type": "user", "uuid": "u1", "timestamp": "2025-01-01T00:00:01Z", "turnId": 1,
         "content": "hello world"},
        {"type": "assistant", "uuid": "a1", "timestamp": "2025-01-01T00:00:02Z", "turnId": 1,
         "content": "hi there"},
        {"type": "turn_end", "uuid": "e1", "timestamp": "2025-01-01T00:00:03Z", "turnId": 1,
         "model": "gpt-4"},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_context_json_from_a_hand_written_log_without_redis(runner: CliRunner, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")  # nothing listens: unused
    hand_written_log(tmp_path / "data")
    result = runner.invoke(app, ["context", SID, "--cwd", CWD, "--json",
                                 "--data-dir", str(tmp_path / "data")])
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert body["currentTurnId"] == 2
    assert [m["role"] for m in body["messages"]] == ["user", "assistant"]
    assert body["promptEstimate"] == 6 + 2 + 4


def test_context_rendered_for_humans(runner: CliRunner, tmp_path: Path) -> None:
    hand_written_log(tmp_path / "data")
    result = runner.invoke(app, ["context", SID, "--cwd", CWD, "--data-dir",
                                 str(tmp_path / "data")])
    assert result.exit_code == 0
    assert "promptEstimate 12" in result.stdout and "hello world" in result.stdout


def test_context_full_prints_a_message_of_a_million_lines_under_its_title_in_linear_time(
        runner: CliRunner, tmp_path: Path) -> None:
    """In a panel rich laid out each line of the message: an output of 1 million short lines (a
    2 MB event) took over a minute to print with ``--full``."""
    import time

    hand_written_log(tmp_path / "data")
    path = SessionLog(tmp_path / "data", CWD, SID).path
    path.write_text(path.read_text() + json.dumps(
        {"type": "user", "uuid": "u2", "turnId": 2, "content": "a\n" * 1_000_000 + "[red]the end\x1b[2J"}) + "\n")
    started = time.monotonic()
    result = runner.invoke(app, ["context", SID, "--cwd", CWD, "--full", "--data-dir", str(tmp_path / "data")],
                           env={"COLUMNS": "100"})
    assert time.monotonic() - started < 20  # (in a panel: about a minute)
    assert result.exit_code == 0, result.output
    assert result.stdout.count("a\n") >= 1_000_000 and "[red]the end\\x1b[2J" in result.stdout  # (as sent, escaped)
    assert "user " in result.stdout and "hello world" in result.stdout


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["context", SID, "--cwd", CWD], ["context", SID, "--cwd",
                                  CWD, "--json"], ["health", "--json", "--redis-url", "redis://127.0.0.1:1"]])
def test_output_to_a_closed_pipe_ends_the_command_with_141_silently(tmp_path: Path, args: list[str]) -> None:
    """``compactor context ... | head -1``: typer's and rich's handling of EPIPE exit 1 silently,
    which says Redis was unreachable or the session unknown; a Unix tool stops at SIGPIPE (141)."""
    hand_written_log(tmp_path / "data")
    process = subprocess.Popen([sys.executable, "-m", "compactor", *args, *(
        ["--data-dir", str(tmp_path / "data")] if args[0] in ("context", "health") else [])],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "REDIS_URL": "redis://127.0.0.1:1/0"})
    assert process.stdout is not None
    process.stdout.close()  # (before it writes: its import alone takes longer)
    _, err = process.communicate(timeout=60)
    assert (process.returncode, err) == (141, b"")


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["context", SID, "--cwd", CWD, "--json"],
                                  ["health", "--json", "--redis-url", "redis://127.0.0.1:1"]])
def test_output_to_a_full_disk_is_said_in_one_line_exit_1(tmp_path: Path, args: list[str]) -> None:
    """``status --json > f`` on a full disk (``> /dev/full``): a traceback of typer's and click's frames."""
    hand_written_log(tmp_path / "data")
    with open("/dev/full", "w") as full:
        process = subprocess.run([sys.executable, "-m", "compactor", *args, *(
            ["--data-dir", str(tmp_path / "data")] if args[0] in ("context", "health") else [])],
            stdout=full, stderr=subprocess.PIPE, env={**os.environ, "REDIS_URL": "redis://127.0.0.1:1/0"},
            timeout=60)
    said = process.stderr.decode().strip().splitlines()
    assert (process.returncode, said[-1]) == (1, "compactor: cannot write the output: No space left on device")
    assert "Traceback" not in process.stderr.decode()


def test_only_an_error_writing_the_output_is_said_as_one() -> None:
    """A log's read failing EIO names no file either: it is no output's, and keeps its traceback."""
    from compactor.cli import _in_output

    def read_a_log() -> None:
        raise OSError(errno.EIO, "Input/output error")

    with pytest.raises(OSError) as read:
        read_a_log()
    assert not _in_output(read.value)
    full = open("/dev/full", "w")  # noqa: SIM115
    try:
        with pytest.raises(OSError) as written:
            typer.echo("x", file=full)
    finally:
        with contextlib.suppress(OSError):  # (what it holds buffered fails again)
            full.close()
    assert _in_output(written.value)


@pytest.mark.parametrize("args", [["status"], ["compact", SID, "--cwd", CWD]])
def test_a_command_whose_stderr_reader_is_gone_exits_as_it_would_and_compact_prints_its_json(
        tmp_path: Path, args: list[str]) -> None:
    """typer and rich take an EPIPE on either stream for one on stdout: a closed stderr made a
    command failing on its own (Redis unreachable) exit 141, and ``compact``'s message on stderr
    ended it before its JSON line (SPEC §7)."""
    out = tmp_path / "out"
    with out.open("w") as stdout:
        process = subprocess.Popen(
            [sys.executable, "-m", "compactor", *args, "--redis-url", "redis://127.0.0.1:1/0", "--data-dir",
             str(tmp_path / "data")], stdout=stdout, stderr=subprocess.PIPE)
        assert process.stderr is not None
        process.stderr.close()
        assert process.wait(timeout=60) == 1
    if args[0] == "compact":
        assert json.loads(out.read_text().splitlines()[-1]) == {"didCompress": False, "released": 0,
                                                               "promptEstimate": 0}


def test_json_output_is_ascii_with_every_other_character_escaped(runner: CliRunner, tmp_path: Path) -> None:
    """C1 controls (CSI, U+009B), DEL's neighbours and a right-to-left override reached a terminal
    raw from ``--json`` (the human view escapes them), and a latin-1 stdout failed on a CJK one."""
    hand_written_log(tmp_path / "data")
    path = SessionLog(tmp_path / "data", CWD, SID).path
    text = "csi\x9b31m rlo\u202eabc \u6a21\u578b \U0001f600"
    path.write_text(path.read_text() + json.dumps({"type": "user", "uuid": "u2", "turnId": 2, "content": text}) + "\n")
    result = runner.invoke(app, ["context", SID, "--cwd", CWD, "--json", "--data-dir", str(tmp_path / "data")])
    assert result.exit_code == 0, result.output
    assert result.stdout.isascii() and "\\u009b" in result.stdout and "\\u202e" in result.stdout
    assert json.loads(result.stdout)["messages"][-1]["content"] == text


@pytest.mark.parametrize("tool", ["tool[/]", "[red]evil"])
def test_context_shows_a_tool_name_as_sent_not_as_markup(runner: CliRunner, tmp_path: Path, tool: str) -> None:
    """``tool[/]`` (a name the service accepts) made the panel's title raise rich's MarkupError;
    ``[red]evil`` showed as ``evil``."""
    hand_written_log(tmp_path / "data")
    path = SessionLog(tmp_path / "data", CWD, SID).path
    lines = [json.dumps(line) for line in (
        {"type": "assistant", "uuid": "a2", "turnId": 2, "content": "",
         "toolCalls": [{"id": "c1", "name": tool, "arguments": {}}]},
        {"type": "tool_result", "uuid": "t2", "turnId": 2, "toolCallId": "c1", "toolName": tool, "output": "done"})]
    path.write_text(path.read_text() + "\n".join(lines) + "\n")
    result = runner.invoke(app, ["context", SID, "--cwd", CWD, "--data-dir", str(tmp_path / "data")],
                           env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    assert f"tool ({tool})" in result.stdout


def test_a_columns_of_zero_still_prints(runner: CliRunner, tmp_path: Path, r: redis.Redis, settings: Settings,
                                        config: Path) -> None:
    """``COLUMNS=0`` made rich print nothing, and the command exited 0."""
    hand_written_log(tmp_path / "data")
    context = runner.invoke(app, ["context", SID, "--cwd", CWD, "--data-dir", str(tmp_path / "data")],
                            env={"COLUMNS": "0"})
    assert context.exit_code == 0 and "hello world" in context.stdout
    write_session(r, settings, 2)
    status = runner.invoke(app, ["status", *base_args(settings, config)], env={"COLUMNS": "0"})
    assert status.exit_code == 0 and SID[:4] in status.stdout, status.output


def test_context_of_unknown_session_exits_1_and_bad_id_exits_2(runner: CliRunner,
                                                               tmp_path: Path) -> None:
    unknown = runner.invoke(app, ["context", SID, "--cwd", CWD, "--data-dir", str(tmp_path)])
    assert unknown.exit_code == 1 and "no session" in unknown.stderr
    bad = runner.invoke(app, ["context", "bad.id", "--cwd", CWD, "--data-dir", str(tmp_path)])
    assert bad.exit_code == 2 and "sessionId" in bad.stderr
    relative = runner.invoke(app, ["context", SID, "--cwd", "rel", "--data-dir", str(tmp_path)])
    assert relative.exit_code == 2 and "cwd" in relative.stderr


# -- status ------------------------------------------------------------------------------

def test_status_json_and_table(runner: CliRunner, r: redis.Redis, settings: Settings,
                               config: Path) -> None:
    write_session(r, settings, 2)
    write_session(r, settings, 1, sid="other")
    r.set(Keys().failures("other"), 5)
    result = runner.invoke(app, ["status", "--json", *base_args(settings, config)])
    assert result.exit_code == 0, result.output
    rows = {row["sessionId"]: row for row in json.loads(result.stdout)}
    assert set(rows) == {SID, "other"}
    assert rows["other"]["breakerOpen"] is True and rows[SID]["breakerOpen"] is False
    assert rows[SID]["currentTurnId"] == 3 and rows[SID]["contextWindow"] == 4000
    table = runner.invoke(app, ["status", *base_args(settings, config)], env={"COLUMNS": "200"})
    assert table.exit_code == 0
    [other] = [line for line in table.stdout.splitlines() if line.strip().startswith("other ")]
    assert "5 open" in other and "/4000" in other  # failures, the breaker open, tokens / window
    assert "breaker open" in table.stdout  # the caption says what "open" means


def test_status_under_other_settings_than_the_stacks_stores_nothing(
        runner: CliRunner, r: redis.Redis, settings: Settings, tmp_path: Path) -> None:
    """A state derived under other context settings was rebuilt and stored by ``compactor status``
    under its own: one run without the stack's config rewrote every listed state (and the
    watcher rewrote them back), each rebuild holding the session's writers up on its log's lock."""
    from compactor.store import SessionStore

    write_session(r, settings, 2)
    stored = SessionStore(r, settings).load(SID)
    assert stored is not None
    other = tmp_path / "other.yaml"
    other.write_text(f"context:\n  microCompactKeepChars: {settings.context.micro_compact_keep_chars + 7}\n")
    result = runner.invoke(app, ["status", "--json", *base_args(settings, other)])
    assert result.exit_code == 0, result.output
    [row] = json.loads(result.stdout)
    assert row["sessionId"] == SID and row["currentTurnId"] == 3  # (shown, rebuilt under its own settings)
    after = SessionStore(r, settings).load(SID)
    assert after is not None and after.settings == stored.settings and after.log_size == stored.log_size


def test_status_with_no_session_in_redis_says_whether_the_data_dir_holds_logs(
        runner: CliRunner, r: redis.Redis, settings: Settings, config: Path, tmp_path: Path) -> None:
    """After Redis was emptied or replaced, ``status`` said "no sessions yet" over the logs."""
    empty = runner.invoke(app, ["status", *base_args(settings, config)])
    assert (empty.exit_code, empty.stderr.strip()) == (0, "no sessions yet")
    write_session(r, settings, 2)
    write_session(r, settings, 1, sid="other")
    r.flushdb()
    result = runner.invoke(app, ["status", *base_args(settings, config)], env={"COLUMNS": "400"})
    assert result.exit_code == 0
    assert result.stderr.strip() == (f"no session known to Redis, but {settings.data_dir} holds 2 session logs: "
                                     f"each is listed again at its session's next event or compaction "
                                     f"(idle for 7 days, their state forgotten? or was Redis emptied or "
                                     f"replaced?)")
    write_session(r, settings, 2)
    write_session(r, settings, 1, sid="other")
    elsewhere = tmp_path / "elsewhere"  # (the wrong data dir: Redis knows both, neither has a log there)
    wrong = runner.invoke(app, ["status", "--config", str(config), "--redis-url", settings.redis.url,
                                "--data-dir", str(elsewhere)])
    assert wrong.stderr.strip() == (f"Redis knows 2 session(s), none with a log in {elsewhere}: is it the data "
                                    f"dir they were written to? (compare {elsewhere}/.compactor-id with "
                                    f"compaction:datadir)")
    one = runner.invoke(app, ["status", "--limit", "1", "--config", str(config), "--redis-url", settings.redis.url,
                              "--data-dir", str(elsewhere)])
    assert one.stderr.startswith(f"Redis knows 2 session(s), none of the 1 most recent with a log in {elsewhere}:")


def test_status_table_fits_80_columns_with_a_line_per_session(runner: CliRunner, r: redis.Redis,
                                                              settings: Settings, config: Path) -> None:
    """At 80 columns no header or value breaks over two lines; the last compaction shows its age."""
    write_session(r, settings, 2)
    r.set(Keys().failures(SID), 3)
    settings = cli_settings(settings)
    enqueue_compaction(r, settings, SID, CWD, "llm", forced=True)
    run_jobs(r, settings)
    table = runner.invoke(app, ["status", *base_args(settings, config)], env={"COLUMNS": "80"})
    assert table.exit_code == 0, table.output
    lines = table.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert any(line.split() == ["session", "turn", "context", "tokens", "failures", "job", "last", "compaction"]
               for line in lines)
    [row] = [line for line in lines if line.strip().startswith(SID)]
    cells = row.split()
    assert cells[1] == "3" and cells[3].endswith("/4000") and cells[4:7] == ["3", "open", "llm"]
    assert re.fullmatch(r"\d+s", cells[7]) and cells[8] == "ago"


@pytest.mark.parametrize("session_ids", [["s1", "s2"], ["abcdefgh"]])
def test_a_narrow_status_table_leaves_columns_out_rather_than_crop_one(session_ids: list[str]) -> None:
    """At 60 columns with ids shorter than the session column's minimum (8), the table was fitted
    as if that column could shrink to the ids: it overflowed, and the terminal cut off the job
    column and the caption's end, which said nothing of it."""
    import io

    from rich.console import Console

    from compactor.cli.sessions import status_table
    from producer.api_models import SessionBody

    bodies = [SessionBody(session_id=sid, cwd="/p", prompt_estimate=5000, context_window=8000, current_turn_id=3,
                          micro_threshold=4000, compaction_threshold=7200, failures=0, breaker_open=False)
              for sid in session_ids]

    def rendered(width: int, console_width: int) -> list[str]:
        console = Console(width=console_width, file=io.StringIO(), color_system=None)
        console.print(status_table(bodies, width))
        return [line.rstrip() for line in console.file.getvalue().splitlines()]  # type: ignore[attr-defined]

    for width in range(44, 101, 2):
        lines, uncropped = rendered(width, width), rendered(width, 1_000)
        assert max(len(line) for line in uncropped) <= width, (width, uncropped)
        assert lines == uncropped, width


def test_status_piped_is_not_cropped_and_a_limited_list_says_of_how_many(
        runner: CliRunner, r: redis.Redis, settings: Settings, config: Path) -> None:
    """Piped (``status | cat``, ``> file``) the table took rich's 80-column default: "last compactio",
    cells cut; and ``--limit 2`` of 4 sessions was titled "2 session(s)", read as the total."""
    long_sid = "a-session-id-long-enough-to-be-folded-in-80-columns"
    for n, sid in enumerate((SID, "other", "third", long_sid)):
        write_session(r, settings, n + 1, sid=sid)
        r.zadd(Keys().sessions, {sid: time.time() - 1000 + n})  # the long id is the most recent
    settings = cli_settings(settings)
    enqueue_compaction(r, settings, long_sid, CWD, "llm", forced=True)
    run_jobs(r, settings)
    table = runner.invoke(app, ["status", "--limit", "2", *base_args(settings, config)], env={"COLUMNS": None})
    assert table.exit_code == 0, table.output
    lines = table.stdout.splitlines()
    assert "compactor: 2 of 4 sessions" in lines[0]
    assert any(line.split() == ["session", "turn", "context", "tokens", "failures", "job", "last", "compaction"]
               for line in lines)
    [row] = [line for line in lines if line.strip().startswith(long_sid)]  # the whole id, on one line
    cells = row.split()
    assert cells[-3] == "llm" and re.fullmatch(r"\d+s", cells[-2]) and cells[-1] == "ago"
    everything = runner.invoke(app, ["status", *base_args(settings, config)], env={"COLUMNS": None})
    assert "compactor: 4 session(s)" in everything.stdout.splitlines()[0]
    # fewer rows than the limit: the others have no log, and a larger --limit would not list them
    SessionStore(r, settings).log("other", CWD).path.unlink()
    unlisted = runner.invoke(app, ["status", *base_args(settings, config)], env={"COLUMNS": None})
    assert "compactor: 3 session(s) (1 more without a log)" in unlisted.stdout.splitlines()[0], unlisted.output


def test_status_of_sessions_idle_past_their_state_ttl_says_so(
        runner: CliRunner, r: redis.Redis, settings: Settings, config: Path) -> None:
    """A week with no write at all: the index still held the sessions whose states had expired,
    and ``status`` said none had a log in the data dir ("is it the data dir they were written to?")."""
    from compactor.store import STATE_IDLE_TTL_S

    write_session(r, settings, 2)
    write_session(r, settings, 1, sid="other")
    keys = Keys()
    r.delete(keys.session(SID), keys.uuids(SID))  # its state expired, as its TTL makes it a week after
    r.zadd(keys.sessions, {SID: time.time() - STATE_IDLE_TTL_S - 60})  # its last write
    table = runner.invoke(app, ["status", *base_args(settings, config)], env={"COLUMNS": None})
    assert table.exit_code == 0, table.output
    assert "compactor: 1 session(s)" in table.stdout.splitlines()[0], table.output  # (not "1 more without a log")
    r.delete(keys.session("other"), keys.uuids("other"))
    r.zadd(keys.sessions, {"other": time.time() - STATE_IDLE_TTL_S - 60})
    idle = runner.invoke(app, ["status", *base_args(settings, config)])
    assert idle.exit_code == 0
    assert idle.stderr.strip() == (f"no session known to Redis, but {settings.data_dir} holds 2 session logs: "
                                   f"each is listed again at its session's next event or compaction (idle for "
                                   f"7 days, their state forgotten? or was Redis emptied or replaced?)")


def test_status_with_unreachable_redis_exits_1(runner: CliRunner, tmp_path: Path) -> None:
    result = runner.invoke(app, ["status", "--redis-url", f"unix://{tmp_path}/none.sock",
                                 "--data-dir", str(tmp_path)])
    assert result.exit_code == 1 and "Redis unreachable" in result.stderr


# -- compact -----------------------------------------------------------------------------

def compact_process(settings: Settings, config: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "compactor", "compact", SID, "--cwd", CWD,
         *base_args(settings, config), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def queued_compact_process(r: redis.Redis, settings: Settings, config: Path) -> subprocess.Popen[str]:
    """``compact_process``, returned once its job is queued (or it ended, or 30 s passed)."""
    process = compact_process(settings, config)
    queue = compaction_queue(r, settings)
    deadline = time.monotonic() + 30
    while queue.count == 0 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return process


def test_compact_status_and_context_keep_out_of_the_stacks_shared_metrics(r: redis.Redis, settings: Settings,
                                                                    config: Path, tmp_path: Path) -> None:
    """``docker compose exec api compactor compact`` (PROMETHEUS_MULTIPROC_DIR set, as in every
    container) counted its enqueue into the stack's metrics, and each run left a file there."""
    write_session(r, settings, 3)
    shared = tmp_path / "metrics"
    shared.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(shared), "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    for command in (["compact", SID, "--cwd", CWD, "--timeout", "0.3", *base_args(settings, config)],
                    ["status", *base_args(settings, config)], ["dead-letters", *base_args(settings, config)],
                    ["context", SID, "--cwd", CWD, "--config", str(config), "--data-dir", str(settings.data_dir)]):
        done = subprocess.run([sys.executable, "-m", "compactor", *command],
                              env=env, capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode in (0, 1), done.stderr
    assert compaction_queue(r, settings).count == 1  # (the compact did enqueue)
    assert list(shared.iterdir()) == []


def test_compact_failing_in_a_way_no_one_foresaw_still_prints_the_json_last(
        runner: CliRunner, r: redis.Redis, settings: Settings, config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SPEC §7: the JSON line is the last one whatever ends the command; an exception of no kind
    ``compact`` handles (a ValueError from the Redis client, say) ended it with none."""
    import compactor.queue

    write_session(r, settings, 3)
    estimate = SessionStore(r, settings).load(SID).prompt_estimate  # type: ignore[union-attr]

    def broken(*_args: object, **_kwargs: object) -> str:
        raise ValueError("Timeout value out of range")

    monkeypatch.setattr(compactor.queue, "enqueue_forced_compaction", broken)
    result = runner.invoke(app, ["compact", SID, "--cwd", CWD, *base_args(settings, config)])
    assert result.exit_code == 1 and isinstance(result.exception, ValueError)
    assert json.loads(result.stdout.splitlines()[-1]) == {"didCompress": False, "released": 0,
                                                          "promptEstimate": estimate}


@pytest.mark.parametrize("json_out", [False, True])
def test_compact_prints_compress_result_json_last(r: redis.Redis, settings: Settings,
                                                  config: Path, json_out: bool) -> None:
    """SPEC §7: the CompressResult JSON is the last line; with ``--json`` it is all of stdout."""
    settings = cli_settings(settings)
    write_session(r, settings, 3)
    process = compact_process(settings, config, *(["--json"] if json_out else []))
    queue = compaction_queue(r, settings)
    deadline = time.monotonic() + 30
    while queue.count == 0 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    run_jobs(r, settings)  # the worker, in this process (RQ wants the main thread)
    out, err = process.communicate(timeout=30)
    assert process.returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert set(result) == {"didCompress", "released", "promptEstimate"}
    assert result["didCompress"] is True and result["released"] > 0
    if json_out:
        assert json.loads(out) == result and "released" in err
    else:
        assert "released" in out.splitlines()[0]


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_compact_stopped_while_it_waits_still_prints_the_json_last(
        r: redis.Redis, settings: Settings, config: Path, signum: int, code: int) -> None:
    """SPEC §7: ``compact`` always prints the CompressResult JSON as its last line. Stopped while
    its job waited (``timeout 30 compactor compact ...``, Ctrl-C), it printed nothing."""
    write_session(r, settings, 3)
    estimate = SessionStore(r, settings).load(SID).prompt_estimate  # type: ignore[union-attr]
    process = queued_compact_process(r, settings, config)  # no worker: it waits
    assert process.poll() is None
    time.sleep(0.3)  # (past the enqueue, into the wait)
    process.send_signal(signum)
    out, err = process.communicate(timeout=30)
    assert process.returncode == code, err
    assert json.loads(out.splitlines()[-1]) == {"didCompress": False, "released": 0, "promptEstimate": estimate}
    assert "Traceback" not in err, err
    [job_id] = compaction_queue(r, settings).job_ids  # (it said nothing of the job it had queued)
    assert f"stopped waiting: compaction job {job_id} was queued and runs on; see GET /api/jobs/{job_id}" in err


def test_compact_waits_out_a_redis_restart_while_its_job_is_queued(settings: Settings, config: Path) -> None:
    """A restart of Redis (its data kept) during the wait ended ``compact`` at once: exit 1, "nothing
    compacted" on stdout, while the job it had queued ran once Redis was back and compacted."""
    import tempfile

    from compactor.embedded import EmbeddedRedis

    with tempfile.TemporaryDirectory(prefix="restart-") as directory:
        server = EmbeddedRedis(Path(directory), persist=True).start()
        try:
            own = cli_settings(settings.model_copy(update={"redis": settings.redis.model_copy(
                update={"url": server.url})}))
            client = redis.Redis.from_url(server.url)
            write_session(client, own, 3)
            process = queued_compact_process(client, own, config)
            assert process.poll() is None and compaction_queue(client, own).count == 1
            server.stop()  # (SHUTDOWN: the queue written to its AOF first)
            time.sleep(1.0)  # the command polls a Redis that is gone
            server = EmbeddedRedis(Path(directory), persist=True).start()
            run_jobs(client, own)
            out, err = process.communicate(timeout=60)
        finally:
            server.stop()
    assert process.returncode == 0, err
    assert json.loads(out.splitlines()[-1])["didCompress"] is True


def test_compact_whose_job_redis_lost_says_so_and_prints_the_json_last(
        r: redis.Redis, settings: Settings, config: Path) -> None:
    """Redis lost the job while ``compact`` waited for it (a restart without persistence, FLUSHDB):
    it died with a traceback (the API's 404 for an unknown job) and printed no JSON line. (It
    waits for the job to come back, as a worker running it writes it back, up to its timeout.)"""
    write_session(r, settings, 3)
    estimate = SessionStore(r, settings).load(SID).prompt_estimate  # type: ignore[union-attr]
    process = compact_process(settings, config, "--timeout", "1.5")
    queue = compaction_queue(r, settings)
    deadline = time.monotonic() + 30
    while queue.count == 0 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    [job_id] = queue.job_ids
    r.delete(Job.key_for(job_id))
    out, err = process.communicate(timeout=30)
    assert process.returncode == 1, err
    assert json.loads(out.splitlines()[-1]) == {"didCompress": False, "released": 0, "promptEstimate": estimate}
    assert "Traceback" not in err, err
    assert f"compactor: Redis lost compaction job {job_id} while it was waited for" in err


def test_compact_with_redis_down_at_its_deadline_names_the_job_it_queued(
        runner: CliRunner, r: redis.Redis, settings: Settings, config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """It said "Redis unreachable" alone: the job it had queued, which may still run, went unnamed
    (the API answers 202 with its id then)."""
    from producer import api_jobs

    def down(*args: Any) -> None:
        raise redis.ConnectionError("Error 111 connecting")

    write_session(r, settings, 3)
    monkeypatch.setattr(api_jobs, "wait_for_job", down)
    result = runner.invoke(app, ["compact", SID, "--cwd", CWD, *base_args(settings, config)])
    assert result.exit_code == 1
    [job_id] = compaction_queue(r, settings).job_ids
    assert (f"Redis unreachable: Error 111 connecting; compaction job {job_id} was queued and may still run: "
            f"see GET /api/jobs/{job_id}") in result.stderr
    assert set(json.loads(result.stdout.splitlines()[-1])) == {"didCompress", "released", "promptEstimate"}


def test_compact_stopped_while_it_starts_still_prints_the_json_last(
        runner: CliRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its first imports (RQ's, the API's: up to 0.8 s) ran before the signals were handled: a
    Ctrl-C or SIGTERM then ended the command with no JSON line."""
    from compactor.cli import sessions

    def ctrl_c() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(sessions, "outside_the_stack", ctrl_c)
    result = runner.invoke(app, ["compact", SID, "--cwd", CWD])
    assert json.loads(result.stdout.splitlines()[-1]) == {"didCompress": False, "released": 0, "promptEstimate": 0}


def test_compact_times_out_with_exit_1(runner: CliRunner, r: redis.Redis, settings: Settings,
                                       config: Path) -> None:
    write_session(r, settings, 3)
    result = runner.invoke(app, ["compact", SID, "--cwd", CWD, "--timeout", "0.3",
                                 *base_args(settings, config)])
    assert result.exit_code == 1 and "still queued" in result.stderr


@pytest.mark.parametrize("timeout", ["inf", "1e309", "86401", "nan", "0"])
def test_compact_refuses_a_timeout_that_is_not_up_to_a_day(runner: CliRunner, tmp_path: Path, timeout: str) -> None:
    """``--timeout inf`` was taken ("waiting (up to infs)"); api.jobWaitSeconds, which it
    replaces, is at most a day."""
    result = runner.invoke(app, ["compact", SID, "--cwd", CWD, "--timeout", timeout, "--data-dir", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--timeout'" in result.stderr and "waiting" not in result.output


def test_compact_waiting_behind_a_queued_job_says_still_queued(runner: CliRunner, r: redis.Redis,
                                                                settings: Settings, config: Path) -> None:
    """The second forced compaction waits behind the first (RQ status ``created``): it is queued
    as far as the operator can tell, as OPERATIONS.md names it."""
    write_session(r, settings, 3)
    args = ["compact", SID, "--cwd", CWD, "--timeout", "0.3", *base_args(settings, config)]
    first, second = runner.invoke(app, args), runner.invoke(app, args)
    estimate = SessionStore(r, settings).load(SID).prompt_estimate  # type: ignore[union-attr]
    for result in (first, second):
        assert result.exit_code == 1
        assert re.search(r"compaction job \S+ still queued after 0\.3s; see GET /api/jobs/", result.stderr), result.stderr
        assert json.loads(result.stdout.splitlines()[-1]) == {  # SPEC §7: always the last line
            "didCompress": False, "released": 0, "promptEstimate": estimate}


def test_compact_of_failed_job_names_the_error_without_its_module_path(
        r: redis.Redis, settings: Settings, config: Path) -> None:
    """The failure line said "failed: events.errors.SessionNotFound: no session ..."."""
    write_session(r, settings, 3)
    estimate = SessionStore(r, settings).load(SID).prompt_estimate  # type: ignore[union-attr]
    process = queued_compact_process(r, settings, config)
    SessionLog(settings.data_dir, CWD, SID).path.unlink()  # the job finds no log
    run_jobs(r, settings)
    out, err = process.communicate(timeout=30)
    assert process.returncode == 1
    assert json.loads(out.splitlines()[-1]) == {"didCompress": False, "released": 0, "promptEstimate": estimate}
    [line] = [line for line in err.splitlines() if line.startswith("compactor: ")]
    assert re.fullmatch(rf"compactor: compaction job \S+ failed: no log for session {SID} in {CWD}", line), line


def test_compact_of_failed_job_exits_1_with_the_error(r: redis.Redis, settings: Settings,
                                                      config: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    write_session(r, settings, 3)
    process = queued_compact_process(r, settings, config)
    stubbed = settings.model_copy(update={"context": settings.context.model_copy(
        update={"compaction_model": STUB_MODEL, "llm_timeout_seconds": 5.0})})
    with LLMStub() as stub:
        monkeypatch.setenv("OPENAI_API_BASE", stub.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-stub")
        stub.reply = "no summary block in this reply"
        run_jobs(r, stubbed)
    out, err = process.communicate(timeout=30)
    assert process.returncode == 1
    assert "failed" in err and "summary" in err.lower()
    # SPEC §7: the CompressResult JSON is always the last line (nothing compacted)
    result = json.loads(out.splitlines()[-1])
    assert result["didCompress"] is False and result["released"] == 0 and result["promptEstimate"] > 0


@pytest.mark.parametrize("args", [
    ["s1"],  # no --cwd
    ["s1", "--cwd", "/p", "--config", ""],
    ["s1", "--cwd", "/p", "--data-dir", ""],
    ["s1", "--cwd", "/p", "--timeout", "0"],
    ["s1", "--cwd", "/p", "--timeout", "x"],
], ids=["no-cwd", "empty-config", "empty-data-dir", "timeout-0", "timeout-x"])
def test_compact_refusing_its_arguments_still_prints_the_json_last(args: list[str]) -> None:
    """SPEC §7: always the last line. Arguments refused while they were parsed (click's usage
    errors, an option's own check) ended the command before its body: nothing on stdout."""
    result = CliRunner().invoke(app, ["compact", *args])
    assert result.exit_code == 2, result.output
    assert json.loads(result.stdout.splitlines()[-1]) == {"didCompress": False, "released": 0, "promptEstimate": 0}
    assert "didCompress" not in CliRunner().invoke(app, ["compact", "--help"]).stdout  # (--help: the help alone)


def _run_jobs_with_the_llm_refusing(r: redis.Redis, settings: Settings, monkeypatch: pytest.MonkeyPatch,
                                    **context: Any) -> Settings:
    """Every queued job, run here with ``openai/stub-model`` answering 401 (and ``context``'s
    settings); the settings they ran with."""
    stubbed = settings.model_copy(update={"context": settings.context.model_copy(update={
        "compaction_model": STUB_MODEL, "llm_timeout_seconds": 5.0, **context})})
    with LLMStub() as stub:
        monkeypatch.setenv("OPENAI_API_BASE", stub.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-stub")
        stub.status = 401
        run_jobs(r, stubbed)
    return stubbed


def test_compact_of_failed_job_prints_the_micro_step_it_applied(
        r: redis.Redis, settings: Settings, config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The LLM call failed after the micro step had elided old outputs (SPEC §5 runs it first, and
    the failure leaves it in the log): the last line said ``didCompress: false, released: 0``."""
    write_session(r, settings, 3)
    before = SessionStore(r, settings).load(SID).prompt_estimate  # type: ignore[union-attr]
    process = queued_compact_process(r, settings, config)
    stubbed = _run_jobs_with_the_llm_refusing(r, settings, monkeypatch, compactable_tools=("run_tests",))
    out, err = process.communicate(timeout=30)
    assert process.returncode == 1, err
    assert SessionLog(settings.data_dir, CWD, SID).read()[-1]["type"] == "compact"
    after = SessionStore(r, stubbed).load(SID).prompt_estimate  # type: ignore[union-attr]
    assert after < before
    assert json.loads(out.splitlines()[-1]) == {"didCompress": True, "released": before - after,
                                                "promptEstimate": after}
    assert f"its micro step was applied: released {before - after} tokens" in err
    assert "compactor: compaction job" in err and "failed" in err


def test_compact_answered_by_the_fallback_warns_of_the_llm_failure(
        r: redis.Redis, settings: Settings, config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_session(r, settings, 3)
    process = compact_process(settings, config, "--json")
    queue = compaction_queue(r, settings)
    deadline = time.monotonic() + 30
    while queue.count == 0 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    _run_jobs_with_the_llm_refusing(r, settings, monkeypatch, fallback_model="extractive")
    out, err = process.communicate(timeout=30)
    assert process.returncode == 0, err
    assert json.loads(out)["didCompress"] is True  # stdout stays the CompressResult alone
    assert "the LLM call failed (permanent" in err and "summarized by the fallback extractive" in err


def test_compact_of_unknown_session_exits_1(runner: CliRunner, settings: Settings,
                                            config: Path, r: redis.Redis) -> None:
    result = runner.invoke(app, ["compact", SID, "--cwd", CWD, *base_args(settings, config)])
    assert result.exit_code == 1 and "no session" in result.stderr
    assert compaction_queue(r, settings).count == 0
    # SPEC §7: the CompressResult JSON is always the last line (nothing printed on stdout before)
    assert json.loads(result.stdout.splitlines()[-1]) == {"didCompress": False, "released": 0, "promptEstimate": 0}


def test_compact_under_another_cwd_than_the_sessions_names_it_exit_2(runner: CliRunner, settings: Settings,
                                                                      config: Path, r: redis.Redis) -> None:
    """The API answers 400 naming the cwd the session is bound to; ``compactor compact`` said
    "no session", exit 1, and the operator looked for a lost log."""
    write_session(r, settings, 3)
    result = runner.invoke(app, ["compact", SID, "--cwd", "/elsewhere", *base_args(settings, config)])
    assert result.exit_code == 2, result.output
    assert f"session {SID} is bound to cwd '{CWD}', not '/elsewhere'" in result.stderr
    assert compaction_queue(r, settings).count == 0
    # the session's own estimate, as for another spelling of its cwd (it was 0: the log under /elsewhere's)
    estimate = SessionStore(r, settings).load(SID).prompt_estimate  # type: ignore[union-attr]
    assert estimate > 0
    assert json.loads(result.stdout.splitlines()[-1]) == {"didCompress": False, "released": 0,
                                                          "promptEstimate": estimate}


def test_compact_of_unknown_session_with_no_redis_to_ask_is_still_no_session(runner: CliRunner,
                                                                                tmp_path: Path) -> None:
    """The embedded default, no serve running: asking Redis for the cwd the session is bound to
    made a missing log a configuration error (exit 2, "redis.url: is empty ...")."""
    result = runner.invoke(app, ["compact", SID, "--cwd", CWD, "--data-dir", str(tmp_path)], env={"REDIS_URL": ""})
    assert result.exit_code == 1, result.output
    assert "no session" in result.stderr and "redis.url" not in result.stderr


def test_compact_that_cannot_queue_a_job_still_ends_with_a_compress_result(
        runner: CliRunner, settings: Settings, config: Path, r: redis.Redis, tmp_path: Path) -> None:
    """SPEC §7: ``compact`` always prints the CompressResult JSON as its last line: a bad session
    id, Redis unreachable or a bad config printed nothing on stdout. The estimate is the log's when
    Redis cannot say it."""
    write_session(r, settings, 3)
    estimate = SessionStore(r, settings).load(SID).prompt_estimate  # type: ignore[union-attr]
    down = runner.invoke(app, ["compact", SID, "--cwd", CWD, "--config", str(config), "--data-dir",
                               str(settings.data_dir), "--redis-url", f"unix://{tmp_path}/none.sock"])
    bad_id = runner.invoke(app, ["compact", "bad..id", "--cwd", CWD, *base_args(settings, config)])
    bad_config = tmp_path / "bad.yaml"
    bad_config.write_text("context: {keepRecentTurns: -1}\n")
    unconfigured = runner.invoke(app, ["compact", SID, "--cwd", CWD, "--config", str(bad_config)])
    assert (down.exit_code, bad_id.exit_code, unconfigured.exit_code) == (1, 2, 2)
    assert "Redis unreachable" in down.stderr and "sessionId" in bad_id.stderr and "keepRecentTurns" in unconfigured.stderr
    assert [json.loads(result.stdout.splitlines()[-1])["promptEstimate"] for result in (down, bad_id, unconfigured)] \
        == [estimate, 0, 0]
    assert estimate > 0 and all(json.loads(result.stdout.splitlines()[-1])["didCompress"] is False
                                for result in (down, bad_id, unconfigured))


# -- health ------------------------------------------------------------------------------

def test_health_check_exit_codes(runner: CliRunner, settings: Settings, config: Path,
                                 tmp_path: Path) -> None:
    ok = runner.invoke(app, ["health", "--check", *base_args(settings, config)])
    assert ok.exit_code == 0 and ok.stdout == ""
    down = runner.invoke(app, ["health", "--check", "--redis-url",
                               f"unix://{tmp_path}/none.sock"])
    assert down.exit_code == 1
    report = runner.invoke(app, ["health", "--json", "--workers", "--watcher",
                                 *base_args(settings, config)])
    assert report.exit_code == 1
    body = json.loads(report.stdout)
    assert body["healthy"] is False and body["checks"]["redis"] == "ok"
    assert body["checks"]["workers"].startswith("error")


def test_health_check_without_a_redis_to_use_is_unhealthy_and_silent(
    runner: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No redis.url and no ``compactor serve`` under the data dir yet (a container starting):
    exit 1 like any failed check (Docker reserves 2), nothing printed."""
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("CODINGCODE_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)  # no ./codingcode.yaml
    empty = ["--data-dir", str(tmp_path / "empty")]
    quiet = runner.invoke(app, ["health", "--check", *empty])
    assert (quiet.exit_code, quiet.stdout, quiet.stderr) == (1, "", "")
    report = runner.invoke(app, ["health", "--json", *empty])
    assert report.exit_code == 1
    assert json.loads(report.stdout)["checks"]["redis"].startswith("error: invalid configuration: redis.url")
    bad = tmp_path / "bad.yaml"
    bad.write_text("context: {compactionThreshold: 7}\n")
    broken = runner.invoke(app, ["health", "--check", "--config", str(bad), *empty])
    assert (broken.exit_code, broken.stdout, broken.stderr) == (1, "", "")
    reported = runner.invoke(app, ["health", "--check", "--json", "--config", str(bad), *empty])
    assert reported.exit_code == 1  # (--json: the report says why, where it printed nothing)
    assert json.loads(reported.stdout) == {"healthy": False, "checks": {
        "config": f"error: invalid configuration: {bad}: context.compactionThreshold: Input should be less than or "
                  "equal to 1"}}


def test_health_of_the_configs_api_on_port_0_says_to_give_its_url(runner: CliRunner, tmp_path: Path) -> None:
    """It checked port 0 and said "Connection refused": port 0 is one the API chose at its start."""
    config = tmp_path / "c.yaml"
    config.write_text("api: {port: 0}\n")
    result = runner.invoke(app, ["health", "--json", "--api", "config", "--config", str(config),
                                 "--redis-url", "redis://127.0.0.1:1"])
    assert result.exit_code == 1
    assert json.loads(result.stdout)["checks"]["api"] == (
        "error: api.port is 0 (a free port the API chose at its start): give --api URL")


@pytest.mark.parametrize(("args", "said"), [
    (["--api", "http://127.0.0.1:99999"], "Port out of range"),  # it was a refused connection: unhealthy
    (["--api", "127.0.0.1:8080"], "is not an http(s) URL of the API"),
    (["--this-host"], "only with --workers"),  # it was ignored
])
def test_health_refuses_a_wrong_command_line_as_such(runner: CliRunner, args: list[str], said: str) -> None:
    result = runner.invoke(app, ["health", *args, "--redis-url", "redis://127.0.0.1:1"])
    assert result.exit_code == 2, result.output
    assert said in " ".join(result.output.replace("│", " ").split())
    # a health check never exits 2 (Docker reserves it): unhealthy, silently
    checked = runner.invoke(app, ["health", "--check", *args, "--redis-url", "redis://127.0.0.1:1"])
    assert (checked.exit_code, checked.output) == (1, "")
    reported = runner.invoke(app, ["health", "--check", "--json", *args, "--redis-url", "redis://127.0.0.1:1"])
    assert reported.exit_code == 1
    [(name, error)] = json.loads(reported.stdout)["checks"].items()
    assert name == "options" and said in error


@pytest.mark.parametrize("args,said", [
    (["--bogus"], "No such option: --bogus"),
    (["--config", ""], "invalid configuration: --config: must not be empty"),
    (["--data-dir", ""], "invalid configuration: dataDir (from --data-dir): must not be empty"),
])
def test_health_check_takes_a_command_line_click_refuses_for_unhealthy(runner: CliRunner, args: list[str],
                                                                         said: str) -> None:
    """Refused while the command line was parsed (an unknown option, an empty ``--config``), ``health
    --check`` exited 2, which Docker reserves, with a message; ``--json`` printed no report."""
    plain = runner.invoke(app, ["health", *args, "--redis-url", "redis://127.0.0.1:1"])
    assert plain.exit_code == 2 and said in " ".join(plain.output.replace("│", " ").split())
    checked = runner.invoke(app, ["health", "--check", *args, "--redis-url", "redis://127.0.0.1:1"])
    assert (checked.exit_code, checked.stdout, checked.stderr) == (1, "", "")
    reported = runner.invoke(app, ["health", *args, "--check", "--json", "--redis-url", "redis://127.0.0.1:1"])
    assert (reported.exit_code, reported.stderr) == (1, "")
    report = json.loads(reported.stdout)
    assert report["healthy"] is False and list(report["checks"]) == ["options"]
    assert report["checks"]["options"].startswith(f"error: {said}")
    assert runner.invoke(app, ["health", "--check", "--help"]).exit_code == 0


def test_a_redis_refusing_the_login_is_said_to_refuse_not_to_be_unreachable(
        runner: CliRunner, settings: Settings, config: Path) -> None:
    """redis-py's AuthenticationError is a ConnectionError: a wrong password read "Redis unreachable"."""
    parts = urlsplit(settings.redis.url)  # (the test server's unix socket)
    url = f"unix://{parts.path}?{parts.query}&username=nobody&password=wrong"
    result = runner.invoke(app, ["status", "--config", str(config), "--redis-url", url])
    assert result.exit_code == 1, result.output
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("compactor: Redis refused at unix://"), line
    assert "invalid username-password pair" in line, line


def test_health_checks_a_live_api(runner: CliRunner, settings: Settings, config: Path,
                                  r: redis.Redis) -> None:
    import uvicorn

    from producer.api import create_app

    token = "sëcret-tok"  # a non-ASCII token: httpx refused the header, every check failed (the images' too)
    secured = settings.model_copy(update={"api": settings.api.model_copy(update={"token": token})})
    server = uvicorn.Server(uvicorn.Config(create_app(secured, redis=r), host="127.0.0.1",
                                           port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        result = runner.invoke(app, ["health", "--check", "--api", f"http://127.0.0.1:{port}",
                                     *base_args(settings, config)], env={"COMPACTION_API_TOKEN": token})
        assert result.exit_code == 0, result.output
        wrong = runner.invoke(app, ["health", "--check", "--api", "http://127.0.0.1:9",
                                    *base_args(settings, config)])
        assert wrong.exit_code == 1
        # /healthz given was asked for /healthz/healthz (a 404); a query was read as the status page's
        for given in (f"http://127.0.0.1:{port}/healthz", f"http://127.0.0.1:{port}/?x=1"):
            result = runner.invoke(app, ["health", "--json", "--api", given, *base_args(settings, config)],
                                   env={"COMPACTION_API_TOKEN": token})
            assert result.exit_code == 0 and json.loads(result.stdout)["checks"]["api"] == "ok", result.output
        unhealthy = runner.invoke(app, ["health", "--json", "--api", f"http://127.0.0.1:{port}/elsewhere/",
                                        *base_args(settings, config)])  # (no such route: said with where it asked)
        assert json.loads(unhealthy.stdout)["checks"]["api"] == \
            f"error: HTTP 401 from http://127.0.0.1:{port}/elsewhere/healthz"
        refused = runner.invoke(app, ["health", "--json", "--api", "http://127.0.0.1:9",
                                      *base_args(settings, config)])
        assert json.loads(refused.stdout)["checks"]["api"].startswith("error: http://127.0.0.1:9/healthz: ")
    finally:
        server.should_exit = True
        thread.join(10)


# -- bench -------------------------------------------------------------------------------

def test_bench_view_quick_json(runner: CliRunner) -> None:
    result = runner.invoke(app, ["bench", "view", "--quick", "--json"])
    assert result.exit_code == 0, result.output
    body: dict[str, Any] = json.loads(result.stdout)
    assert {"view_s", "baseline_s", "ratio"} <= set(body) and body["view_s"] > 0
    assert body["ratio"] == pytest.approx(body["view_s"] / body["baseline_s"], rel=0.01)
    assert type(body["events"]) is int and type(body["bytes"]) is int  # counts (the table printed 1.995e+06)


def test_bench_rejects_unknown_scenario(runner: CliRunner) -> None:
    assert runner.invoke(app, ["bench", "nope"]).exit_code == 2


def test_bench_prints_a_table_without_json(runner: CliRunner, tmp_path: Path) -> None:
    """A Redis URL and a data dir the benchmarks never use refused them (exit 2)."""
    unused = {"REDIS_URL": "http://x", "COMPACTION_DATA_DIR": str(tmp_path / ("d" * 120))}
    result = runner.invoke(app, ["bench", "view", "--quick"], env={"COLUMNS": "120", **unused})
    assert result.exit_code == 0
    assert "compactor bench" in result.stdout and "ratio" in result.stdout


def test_the_api_socket_gives_its_connections_tcp_nodelay() -> None:
    """asyncio sets TCP_NODELAY on accepted connections only when the listening socket's protocol
    is IPPROTO_TCP; created with protocol 0, every response on a kept-alive connection waited ~40 ms
    (headers and body two sends, the body held by Nagle until the client's delayed ACK)."""
    import asyncio

    from compactor.cli.common import api_socket

    async def accepted_nodelay() -> int:
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                sock = transport.get_extra_info("socket")
                seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        sock = api_socket("127.0.0.1", 0)
        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        port = sock.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):
            value = await asyncio.wait_for(seen, 5)
        server.close()
        return value

    assert asyncio.run(accepted_nodelay()) != 0


@pytest.mark.parametrize(("error", "one_line"), [
    (redis.ResponseError("MISCONF Errors writing to the AOF file: No space left on device"), True),
    (redis.exceptions.NoPermissionError("this user has no permissions to run the 'xadd' command"), True),
    (redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"), False),
])
def test_a_redis_refusal_is_one_line_a_redis_bug_a_traceback(capsys: pytest.CaptureFixture[str],
                                                             error: Exception, one_line: bool) -> None:
    """A full disk under the demo's Redis (MISCONF) ended ``demo`` on a 79-line traceback."""
    import typer

    from compactor.cli.common import user_errors

    if not one_line:
        with pytest.raises(redis.ResponseError), user_errors():
            raise error
        return
    with pytest.raises(typer.Exit) as exited, user_errors():
        raise error
    assert exited.value.exit_code == 1
    assert capsys.readouterr().err == f"compactor: Redis refused: {error}\n"


def test_dead_letters_lists_the_refused_entries_newest_first_with_their_reasons(
        runner: CliRunner, r: redis.Redis, settings: Settings, config: Path) -> None:
    """Operators read {p}:dead with redis-cli XRANGE: no command showed why an entry was refused."""
    from producer.watcher import Watcher
    from tests.producer.conftest import drain

    keys = Keys()
    r.xadd(keys.stream_for("s1"), {"session": "s1", "cwd": CWD, "event": b'{"type": "user"}'})
    r.xadd(keys.stream_for("s2"), {"session": "s2", "cwd": "relative", "event": b'{"type": "user", "turnId": 1}'})
    r.xadd(keys.stream_for("s1"), {"session": "s1", "cwd": CWD, "event": b"\xff not json"})
    drain(Watcher(r, settings, name="w"), r, settings)
    args = ["--config", str(config), "--redis-url", settings.redis.url]
    result = runner.invoke(app, ["dead-letters", "--json", *args])
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert body["total"] == 3 and body["complete"] is True
    assert sorted((d["session"], d["reason"], d["event"]) for d in body["letters"]) == [
        ("s1", "invalid UTF-8 in field 'event' at byte 0", "\ufffd not json"),
        ("s1", "turnId: Field required (and content too)", '{"type": "user"}'),
        ("s2", "cwd: must be an absolute path", '{"type": "user", "turnId": 1}')]
    assert [d["letterId"] for d in body["letters"]] == sorted((d["letterId"] for d in body["letters"]), reverse=True)
    only = json.loads(runner.invoke(app, ["dead-letters", "--json", "--session", "s2", *args]).stdout)
    assert [d["session"] for d in only["letters"]] == ["s2"] and "cwd" in only["letters"][0]["reason"]
    table = runner.invoke(app, ["dead-letters", "--limit", "2", *args], env={"COLUMNS": "200"})
    assert table.exit_code == 0, table.output
    rows = [line for line in table.stdout.splitlines() if " ago " in line]
    assert len(rows) == 2 and "2 of 3 dead letter(s)" in table.stdout
    of_s2 = runner.invoke(app, ["dead-letters", "--session", "s2", *args], env={"COLUMNS": "200"})
    assert "1 dead letter(s) of session s2 (3 in all)" in of_s2.stdout  # (was "1 of 3": read as s2's 3)
    none = runner.invoke(app, ["dead-letters", "--session", "s9", *args])
    assert none.exit_code == 0 and "no dead letters of session s9" in none.output
    for odd in ("agent[/]1", "[bold]s-43"):  # (a malformed id, what the filter is for: a traceback, another id)
        none = runner.invoke(app, ["dead-letters", "--session", odd, *args])
        assert none.exit_code == 0 and none.stderr.strip() == f"no dead letters of session {odd}", none.output
    r.xadd(keys.stream_for("s1"), {"session": "s1\nforged", "cwd": CWD, "event": b'{"type": "user"}'})
    drain(Watcher(r, settings, name="w2"), r, settings)
    table = runner.invoke(app, ["dead-letters", "--limit", "1", *args], env={"COLUMNS": "200"})
    rows = [line for line in table.stdout.splitlines() if " ago " in line]  # one row: its line break shown
    assert len(rows) == 1 and "s1\\nforged" in rows[0], table.stdout


def test_an_agents_escape_sequences_are_shown_not_sent_to_the_terminal(
        runner: CliRunner, r: redis.Redis, settings: Settings, config: Path, tmp_path: Path) -> None:
    """A tool's output (or a refused entry's session field) holding ``ESC ]0;title ESC \\ ESC [2J``
    set the operator's window title and cleared the screen under ``context`` and ``dead-letters``."""
    from producer.watcher import Watcher
    from tests.producer.conftest import drain

    attack = "\x1b]0;pwned\x1b\\\x1b[2J\x9b0m"
    hand_written_log(tmp_path / "data")
    path = SessionLog(tmp_path / "data", CWD, SID).path
    path.write_text(path.read_text() + json.dumps(
        {"type": "user", "uuid": "u2", "turnId": 2, "content": f"look: {attack} done"}) + "\n")
    context = runner.invoke(app, ["context", SID, "--cwd", CWD, "--data-dir", str(tmp_path / "data")])
    r.xadd(Keys().stream_for("s1"), {"session": f"x{attack}y", "cwd": CWD, "event": b'{"type": "user"}'})
    drain(Watcher(r, settings, name="w"), r, settings)
    letters = runner.invoke(app, ["dead-letters", "--config", str(config), "--redis-url", settings.redis.url],
                            env={"COLUMNS": "300"})
    for result in (context, letters):
        assert result.exit_code == 0, result.output
        assert not any(c in result.stdout for c in "\x1b\x9b")
        assert "\\x1b]0;pwned\\x1b\\\\x1b[2J\\x9b0m" in result.stdout.replace("\n", "")


def test_status_names_a_held_back_session_it_has_no_row_for(runner: CliRunner, r: redis.Redis, settings: Settings,
                                                            config: Path) -> None:
    """A session whose log cannot be read (not a regular file) has no state to show: the status
    table left it out, and only the held-back count said anything was wrong."""
    from compactor.held import HOLD

    write_session(r, settings, 1)
    keys = Keys(settings.redis.prefix, settings.redis.shards)
    r.set(keys.lease(keys.shard_of("broken")), "w:1")
    r.register_script(HOLD)(keys=[keys.held], args=["broken", 90, 150, "[Errno 21] Is a directory", "w:1",
                                                    keys.shard_of("broken")])
    result = runner.invoke(app, ["status", *base_args(settings, config)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    [line] = [line for line in result.stdout.splitlines() if "broken" in line]
    assert line.startswith("held back, not in the table: broken since 1m") and "Is a directory" in line
    assert any(row.strip().startswith(SID) for row in result.stdout.splitlines())
    # an error quoting an agent's path with control characters reaches no terminal as they are
    r.register_script(HOLD)(keys=[keys.held], args=["broken", 90, 150, "/w/\x1b]0;pwned\x07x: [Errno 5] EIO", "w:1",
                                                    keys.shard_of("broken")])
    result = runner.invoke(app, ["status", *base_args(settings, config)], env={"COLUMNS": "200"})
    [line] = [line for line in result.stdout.splitlines() if "broken" in line]
    assert "\x1b" not in line and "\\x1b]0;pwned\\x07" in line, line
