"""Redis commands sent now whose replies are read later, to overlap a round trip with work.

A job sends its state read before it reads the log, and its last writes before
it frees its memory, logs and counts: the wait for Redis (on an idle server a
few hundred microseconds, most of it the server's wake-up) then runs beside
that work instead of after it. redis-py's ``Pipeline.execute`` sends and reads
in one call, so this holds a pooled connection between the two.

Invariant: a connection whose replies were not all read is disconnected before
it goes back to the pool (``discard``, or any error while reading), so no later
command can read a stale reply.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis


class Deferred:
    """Commands sent on a connection of ``client``'s pool; ``replies()`` reads their replies.

    ``supported(client)`` first: a single-connection client has no side channel.
    The replies are the raw ones (no response callbacks: ``HGETALL`` may be a
    flat list); an error reply raises ``redis.ResponseError`` from ``replies``.
    """

    __slots__ = ("_client", "_connection", "_count")

    def __init__(self, client: redis.Redis, commands: Sequence[Sequence[Any]]) -> None:
        connection = client.connection_pool.get_connection()
        try:
            connection.send_packed_command(connection.pack_commands(commands))  # type: ignore[no-untyped-call]
        except BaseException:
            _drop(client, connection)
            raise
        self._client = client
        self._connection: Any = connection
        self._count = len(commands)

    @staticmethod
    def supported(client: redis.Redis) -> bool:
        return getattr(client, "connection", None) is None

    @classmethod
    def pipeline(cls, client: redis.Redis, pipeline: redis.client.Pipeline) -> Deferred:
        """The commands queued on ``pipeline`` (``client``'s; not executed), sent now."""
        return cls(client, [args for args, _options in pipeline.command_stack])

    def replies(self) -> list[Any]:
        """The replies, in order (once); the connection goes back to the pool."""
        connection, self._connection = self._connection, None
        if connection is None:
            raise RuntimeError("the replies were read or discarded already")
        try:
            replies = [connection.read_response() for _ in range(self._count)]
        except BaseException:
            _drop(self._client, connection)
            raise
        self._client.connection_pool.release(connection)
        return replies

    def discard(self) -> None:
        """Give the connection back unread (disconnected); the commands may or may not have run."""
        connection, self._connection = self._connection, None
        if connection is not None:
            _drop(self._client, connection)

    @property
    def pending(self) -> bool:
        return self._connection is not None


def _drop(client: redis.Redis, connection: Any) -> None:
    """Give back a connection whose replies may be unread: disconnected first."""
    connection.disconnect()
    client.connection_pool.release(connection)
