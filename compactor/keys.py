"""Every Redis key the service uses, under the configurable prefix (default ``compaction``).

Layout (``{p}`` is ``redis.prefix``; fixed by SPEC §6 where marked):

    {p}:events:{n}              stream shard n = crc32(utf8(sessionId)) % shards   (SPEC)
    {p}:dead                    dead-letter stream of rejected entries              (SPEC)
    {p}:failures:{sessionId}    LLM failure counter, TTL failureTtlSeconds          (SPEC)
    {p}:session:{sessionId}     hash: derived per-session state (see events.state)
    {p}:sessions                zset: sessionId -> last activity (unix seconds)
    {p}:uuids:{sessionId}       set: the uuids in the session's log (rejects duplicates)
                                (these three forget a session idle for STATE_IDLE_TTL_S, 7 days:
                                its next event or job rebuilds them from its log)
    {p}:lease:{n}               string: watcher id owning shard n (PX lease)
    {p}:fence:{n}               counter: fencing token of shard n, bumped per new lease
    {p}:watchers                zset: live watcher id -> last heartbeat (server ms)
    {p}:datadir                 string: the id of the data dir the sessions are written to
                                (``{dataDir}/.compactor-id``): a watcher or worker on another refuses
                                to start (compactor.datadir)
    {p}:datadir:marks           hash: the running watchers' marks in the data dir (a copy has none)
    {p}:shards                  string: the redis.shards of the watchers (each heartbeat writes it;
                                a watcher with another count is refused while one of these lives)
    {p}:job:{sessionId}         string: id of the one compaction job queued/running
    {p}:retrigger:{sessionId}   string: a trigger that arrived while a job was pending
    {p}:claims                  zset: sessionId -> when its claim/trigger needs a look (unix s);
                                the worker janitor frees claims whose job never came or died
    {p}:janitor                 string: lock held by the one worker janitor running now
    {p}:replaced:{jobId}        string: set (NX, 1 day) by the one process replacing an abandoned
                                forced job: RQ's maintenance and the janitor found it at once
    {p}:health                  string: written by each health check (Redis must take writes)
    {p}:orphans                 string: lock held by the watcher dead-lettering the entries of
                                streams past redis.shards (producer.watcher.orphans)
    {p}:held                    hash: sessionId -> why and since when a watcher holds it back
                                (its log cannot be written: compactor.held)
    {p}:sent:{sessionId}        zset: uuid -> when the HTTP API published it (last 10 minutes):
                                a retry sent before the first copy is applied is not published again
    {p}:cwd:{sessionId}         string: the cwd a session's first published batch was sent with
                                (10 minutes: while an entry of it waits, the API refuses another cwd)
    {p}:lettered:{n}            hash: id -> digest of the entry, of shard n's entries dead-lettered
                                ahead of their ack (a run's refused entries, right before its
                                append): their letter is not written again by a retry, a takeover,
                                a restart or the sweep of streams past redis.shards; a field goes
                                with its entry's ack (the key: 30 days after its last letter)
    {p}:claimed:{n}             set: ids of shard n's entries claimed from another consumer of the
                                group (a hand-run reader's, an older deployment's) and not acked
                                yet: applied out of order once later entries of their session were,
                                they are dead-lettered, by this owner or the next (an id goes with
                                its entry's ack; the key: 30 days after its last claim)
    {p}:failing                 zset: sessionId -> when its failure counter expires (unix s): the
                                sessions with LLM failures counted, read by the breaker gauges
                                (a SCAN of {p}:failures:* walked the whole keyspace per scrape)
    {p}:failing:indexed         string: set once the counters of an earlier version (none in
                                {p}:failing) were added to it, by the first breaker count
    {p}:unread-deleted:{n}      string: the highest id of shard n's entries found deleted amid
                                unread ones (a producer's XDEL), once dead-lettered: not lettered
                                twice (a trim's loss is lettered once by the group's counter);
                                followed by " unsettled" until the group has read across it

docs/OPERATIONS.md "Redis keys" lists them for operators, with their lifetimes and the
state hash's fields.

Consumer group on every shard: ``{p}-watchers``, with one consumer per shard,
``shard-{n}``, read only by the watcher holding the shard's lease (stable
across restarts and takeovers: the shard's backlog is that consumer's PEL).
RQ queue: ``{p}``; RQ's own keys keep RQ's ``rq:`` prefix (override with
``RQ_KEY_PREFIX``).
Redis holds only derived or in-flight state: the logs are the source of truth.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    """Key builders for one prefix."""

    prefix: str = "compaction"
    shards: int = 8

    def shard_of(self, session_id: str) -> int:
        """The stream shard a session's events go to."""
        return zlib.crc32(session_id.encode("utf-8")) % self.shards

    def stream(self, shard: int) -> str:
        return f"{self.prefix}:events:{shard}"

    def stream_for(self, session_id: str) -> str:
        return self.stream(self.shard_of(session_id))

    def all_streams(self) -> list[str]:
        return [self.stream(n) for n in range(self.shards)]

    @property
    def dead(self) -> str:
        return f"{self.prefix}:dead"

    def failures(self, session_id: str) -> str:
        return f"{self.prefix}:failures:{session_id}"

    def session(self, session_id: str) -> str:
        return f"{self.prefix}:session:{session_id}"

    def uuids(self, session_id: str) -> str:
        return f"{self.prefix}:uuids:{session_id}"

    @property
    def sessions(self) -> str:
        return f"{self.prefix}:sessions"

    @property
    def held(self) -> str:
        return f"{self.prefix}:held"

    def sent(self, session_id: str) -> str:
        return f"{self.prefix}:sent:{session_id}"

    def bound(self, session_id: str) -> str:
        """The cwd a session's first published batch was sent with (``SET NX``, 10 minutes)."""
        return f"{self.prefix}:cwd:{session_id}"

    def lease(self, shard: int) -> str:
        return f"{self.prefix}:lease:{shard}"

    def lettered(self, shard: int) -> str:
        return f"{self.prefix}:lettered:{shard}"

    def claimed(self, shard: int) -> str:
        return f"{self.prefix}:claimed:{shard}"

    def unread_deleted(self, shard: int) -> str:
        return f"{self.prefix}:unread-deleted:{shard}"

    @property
    def failing(self) -> str:
        return f"{self.prefix}:failing"

    @property
    def failing_indexed(self) -> str:
        return f"{self.prefix}:failing:indexed"

    def fence(self, shard: int) -> str:
        return f"{self.prefix}:fence:{shard}"

    @property
    def watchers(self) -> str:
        return f"{self.prefix}:watchers"

    @property
    def data_dir(self) -> str:
        return f"{self.prefix}:datadir"

    @property
    def data_dir_marks(self) -> str:
        """The running watchers' marks in the data dir (``compactor.datadir``: a copy has none of them)."""
        return f"{self.prefix}:datadir:marks"

    @property
    def shard_count(self) -> str:
        return f"{self.prefix}:shards"

    def job(self, session_id: str) -> str:
        return f"{self.prefix}:job:{session_id}"

    def retrigger(self, session_id: str) -> str:
        return f"{self.prefix}:retrigger:{session_id}"

    @property
    def claims(self) -> str:
        return f"{self.prefix}:claims"

    @property
    def janitor(self) -> str:
        return f"{self.prefix}:janitor"

    def replaced(self, job_id: str) -> str:
        return f"{self.prefix}:replaced:{job_id}"

    @property
    def health(self) -> str:
        return f"{self.prefix}:health"

    @property
    def orphans(self) -> str:
        return f"{self.prefix}:orphans"

    @property
    def group(self) -> str:
        return f"{self.prefix}-watchers"

    def consumer(self, shard: int) -> str:
        return f"shard-{shard}"

    @property
    def queue(self) -> str:
        return self.prefix
