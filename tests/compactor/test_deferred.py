"""Commands sent now, replies read later, against a real Redis: order, errors, no stale reply."""

from __future__ import annotations

import pytest
import redis

from compactor.deferred import Deferred

# A reply that comes tens of milliseconds after the command (a busy script; a script's
# TIME is frozen): still unread when the next command is sent.
SLOW = ("EVAL", "local x = 0 for i = 1, 5000000 do x = x + i end return 'late'", 0)


def test_the_commands_run_when_sent_and_their_replies_come_in_order(r: redis.Redis) -> None:
    sent = Deferred(r, [("SET", "a", "1"), ("INCR", "a"), ("GET", "a")])
    assert sent.replies() == [b"OK", 2, b"2"]
    assert not sent.pending
    assert r.get("a") == b"2"


def test_a_pipeline_is_sent_as_queued_and_its_connection_goes_back_to_the_pool(r: redis.Redis) -> None:
    pipe = r.pipeline(transaction=False)
    pipe.hset("h", mapping={"x": "1", "y": "2"})
    pipe.eval("return redis.call('HGET', KEYS[1], ARGV[1])", 1, "h", "y")
    sent = Deferred.pipeline(r, pipe)
    assert sent.replies() == [2, b"2"]
    pool = r.connection_pool
    assert len(pool._in_use_connections) == 0  # type: ignore[attr-defined]


def test_an_error_reply_raises_and_no_later_command_reads_a_stale_reply(r: redis.Redis) -> None:
    r.set("s", "text")
    sent = Deferred(r, [("INCR", "s"), SLOW])
    with pytest.raises(redis.ResponseError):
        sent.replies()  # the first reply is an error: the second is never read on that connection
    assert len(r.connection_pool._in_use_connections) == 0  # type: ignore[attr-defined]  # given back
    for _ in range(3):  # every connection of the pool answers its own commands
        assert r.set("b", "2") is True
        assert r.get("b") == b"2"


def test_a_discarded_send_leaves_no_reply_behind(r: redis.Redis) -> None:
    sent = Deferred(r, [SLOW])
    sent.discard()
    assert not sent.pending
    with pytest.raises(RuntimeError):
        sent.replies()
    for _ in range(3):
        assert r.set("d", "4") is True
        assert r.get("d") == b"4"


def test_a_single_connection_client_has_no_side_channel(redis_url: str) -> None:
    single = redis.Redis.from_url(redis_url, single_connection_client=True)
    try:
        assert not Deferred.supported(single)
        assert Deferred.supported(redis.Redis.from_url(redis_url))
    finally:
        single.close()
