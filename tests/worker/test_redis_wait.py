"""``worker.redis_wait``: what a worker logs and how long it waits while Redis does not serve it."""

from __future__ import annotations

import logging

import pytest
import redis

from compactor.redis_errors import is_transient
from worker.redis_wait import WAIT_MAX_S, RedisWait


def test_an_outage_is_logged_once_and_waited_out_with_a_growing_capped_wait(
    caplog: pytest.LogCaptureFixture,
) -> None:
    wait = RedisWait("w1")
    refused = redis.ResponseError("MISCONF Errors writing to the AOF file: No space left on device")
    with caplog.at_level(logging.INFO, logger="worker.redis_wait"):
        for _ in range(6):
            wait.failed("waiting for a job", refused)
        waits = [wait.next_wait() for _ in range(6)]
        wait.served()
        wait.served()
    assert waits == [1.0, 2.0, 4.0, 8.0, WAIT_MAX_S, WAIT_MAX_S]
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.INFO]
    assert "MISCONF" in caplog.records[0].getMessage() and "w1" in caplog.records[0].getMessage()
    assert "again after" in caplog.records[1].getMessage()
    assert not wait.waiting and wait.next_wait() == 1.0  # the next outage starts over


@pytest.mark.parametrize(("error", "transient"), [
    (redis.ResponseError("MISCONF Errors writing to the AOF file"), True),
    (redis.ResponseError("NOREPLICAS Not enough good replicas to write."), True),
    (redis.ReadOnlyError("You can't write against a read only replica."), True),
    (redis.ConnectionError("Connection refused"), True),
    (redis.TimeoutError("Timeout reading from socket"), True),
    (redis.ResponseError("Command # 1 (EVALSHA ...) of pipeline caused error: MISCONF Errors"), True),
    (redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"), False),
    (redis.ResponseError("ERR Error running script (call to f_0): user_script:1: oops"), False),
])
def test_refusals_and_dropped_connections_pass_by_themselves_other_errors_are_bugs(
    error: redis.RedisError, transient: bool,
) -> None:
    assert is_transient(error) is transient
