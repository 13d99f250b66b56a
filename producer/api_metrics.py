"""Prometheus metrics of the HTTP API: its own requests, the processes' counters, Redis gauges.

What ``/metrics`` serves (``scrape_registry``):

- ``ProcessMetrics``: the counters and histograms of ``compactor.metrics`` and
  the HTTP middleware. With ``PROMETHEUS_MULTIPROC_DIR`` set (``compactor
  serve``), aggregated over every process writing there (watcher, workers, API);
  unset, this process's own values.
- Gauges read from Redis on each scrape: ``RedisCollector`` (queue, sessions,
  dead letters, sessions held back, stream lengths), ``StreamLagCollector`` (per shard: entries not
  yet applied, pending, age of the oldest), ``BreakerCollector`` (sessions whose
  LLM breaker is open now; a bounded SCAN).

Invariants: every app has its own ``CollectorRegistry`` for its HTTP metrics
(two apps in one process never share them); a scrape never fails because Redis
is down (``compactor_redis_up`` says 0 and the Redis gauges are left out); the
Redis work per scrape is bounded (``MAX_BREAKER_KEYS``; no entry's payload is read but the oldest's); a scrape
waits for a Redis that does not answer once, not once per collector: when
``RedisCollector`` (registered first, so collected first) finds Redis down, the
other Redis collectors skip that scrape (``RedisGate``). Against a Redis that
accepts connections but never answers, a scrape then takes one socket timeout
(5 s in the API), inside Prometheus's default 10 s scrape timeout, where three
would not be. Concurrent scrapes share the gate: while Redis flaps, a scrape may
leave gauges out because of another's failure; each scrape's first collector resets it.
"""

from __future__ import annotations

import glob
import logging
import math
import os
import struct
import time
from collections.abc import Iterator, Sequence
from typing import Any

import redis
from prometheus_client import CollectorRegistry, Counter, Histogram, Metric
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from starlette.routing import BaseRoute, Match, Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from compactor import metrics as process_metrics
from compactor.held import held_sessions
from compactor.keys import Keys
from rq.utils import as_text
from compactor.shards import server_ms
from compactor.queue import compaction_queue
from compactor.store import known_sessions
from events.config import Settings

logger = logging.getLogger(__name__)

MAX_BREAKER_KEYS = 10_000  # failure counters examined per scrape, at most
SCAN_BATCH = 1_000
UNMATCHED = "unmatched"  # the route label of a request no route answered


class RedisGate:
    """Whether Redis answered the current scrape: set by ``RedisCollector``, read by the
    Redis collectors registered after it."""

    __slots__ = ("up",)

    def __init__(self) -> None:
        self.up = True


class RedisCollector(Collector):
    """Gauges read from Redis on each scrape: queue depth, sessions, streams, dead letters."""

    def __init__(self, client: redis.Redis, settings: Settings, gate: RedisGate | None = None) -> None:
        self.client = client
        self.settings = settings
        self.keys = Keys(settings.redis.prefix, settings.redis.shards)
        self.gate = gate or RedisGate()

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("compactor_redis_up", "1 when Redis answered this scrape")
        try:
            families = list(self._read())
        except redis.RedisError as e:
            logger.warning("metrics scrape: redis unavailable: %s", e)
            self.gate.up = False
            up.add_metric([], 0)
            yield up
            return
        self.gate.up = True
        up.add_metric([], 1)
        yield up
        yield from families

    def _read(self) -> Iterator[Metric]:
        queue = compaction_queue(self.client, self.settings)
        yield GaugeMetricFamily("compactor_queue_jobs", "compaction jobs waiting in the RQ queue",
                                value=queue.count)
        yield GaugeMetricFamily("compactor_failed_jobs", "jobs in the RQ failed-job registry",
                                value=queue.failed_job_registry.count)
        yield GaugeMetricFamily("compactor_sessions", "sessions seen by the watcher",
                                value=known_sessions(self.client, self.keys))
        yield GaugeMetricFamily("compactor_dead_letters", "entries in the dead-letter stream",
                                value=self.client.xlen(self.keys.dead))
        yield GaugeMetricFamily("compactor_sessions_held_back",
                                "sessions a watcher holds back: their log cannot be written or read "
                                "(a full disk, a corrupt line...)",
                                value=len(held_sessions(self.client, self.keys)))
        streams = GaugeMetricFamily("compactor_stream_entries", "entries kept in each stream shard",
                                    labels=["shard"])
        pipe = self.client.pipeline(transaction=False)
        for stream in self.keys.all_streams():
            pipe.xlen(stream)
        for shard, length in enumerate(pipe.execute()):
            streams.add_metric([str(shard)], length)
        yield streams


class StreamLagCollector(Collector):
    """Per shard, from XINFO GROUPS / XPENDING: entries not yet applied and how old they are.

    ``backlog`` = undelivered (the group's lag) + pending (delivered, not acked);
    an entry is applied to its log before it is acked, so the backlog is what the
    watcher still has to apply. A shard whose group does not exist yet counts
    every entry as undelivered.
    """

    def __init__(self, client: redis.Redis, settings: Settings, gate: RedisGate | None = None) -> None:
        self.client = client
        self.keys = Keys(settings.redis.prefix, settings.redis.shards)
        self.gate = gate or RedisGate()

    def collect(self) -> Iterator[Metric]:
        if not self.gate.up:  # RedisCollector found Redis down in this scrape: no second wait
            return
        backlog = GaugeMetricFamily(
            "compactor_stream_backlog_entries",
            "entries the watcher has not applied yet (undelivered + pending)", labels=["shard"])
        pending = GaugeMetricFamily(
            "compactor_stream_pending_entries", "entries delivered to the watcher, not yet acked",
            labels=["shard"])
        oldest = GaugeMetricFamily(
            "compactor_stream_oldest_unapplied_seconds",
            "age of the oldest entry not applied yet (0 when none)", labels=["shard"])
        try:
            now_ms = server_ms(self.client)
            rows = [(n, *self.shard_lag(n, now_ms)) for n in range(self.keys.shards)]
        except redis.RedisError as e:
            logger.warning("metrics scrape: stream lag unavailable: %s", e)
            return
        for n, total, in_flight, age_s in rows:
            backlog.add_metric([str(n)], total)
            pending.add_metric([str(n)], in_flight)
            oldest.add_metric([str(n)], age_s)
        yield from (backlog, pending, oldest)

    def shard_lag(self, shard: int, now_ms: int) -> tuple[int, int, float]:
        """``(backlog, pending, oldest age in seconds)`` of one shard."""
        stream = self.keys.stream(shard)
        if not self.client.exists(stream):
            return 0, 0, 0.0
        group = self._group(stream)
        if group is None:
            first = self.client.xrange(stream, "-", "+", count=1)
            return int(self.client.xlen(stream)), 0, _age_s(first[0][0], now_ms) if first else 0.0
        in_flight = _int(group.get("pending"))
        after = b"(" + _bytes(group.get("last-delivered-id") or b"0-0")
        lag = group.get("lag")
        # Redis cannot tell the lag (an entry deleted amid unread ones; Redis < 7): every entry kept but
        # the pending ones, an upper bound (the watcher trims what it acked every ~10 s). Counting them
        # with XRANGE moved up to 100 000 whole entries per shard on each scrape, in a backlog.
        undelivered = _int(lag) if lag is not None else max(0, int(self.client.xlen(stream)) - in_flight)
        oldest_id = None
        if in_flight:
            oldest_id = self.client.xpending(stream, self.keys.group).get("min")
        elif undelivered:
            first = self.client.xrange(stream, after, "+", count=1)
            oldest_id = first[0][0] if first else None
        age = _age_s(oldest_id, now_ms) if oldest_id else 0.0
        return undelivered + in_flight, in_flight, age

    def _group(self, stream: str) -> dict[str, Any] | None:
        for group in self.client.xinfo_groups(stream):
            if _bytes(group.get("name") or b"") == self.keys.group.encode():
                return dict(group)
        return None


class BreakerCollector(Collector):
    """Sessions whose LLM breaker is open now: failure counters at ``maxFailures`` or more.

    The counters of the sessions in ``{p}:failing``, ``MAX_BREAKER_KEYS`` at most per scrape;
    ``compactor_breaker_scan_truncated`` says 1 when the bound cut it short.
    """

    def __init__(self, client: redis.Redis, settings: Settings, gate: RedisGate | None = None) -> None:
        self.client = client
        keys = Keys(settings.redis.prefix, settings.redis.shards)
        self.prefix, self.failing, self.indexed = keys.failures(""), keys.failing, keys.failing_indexed
        self.max_failures = settings.context.max_failures
        self.gate = gate or RedisGate()

    def collect(self) -> Iterator[Metric]:
        if not self.gate.up:  # RedisCollector found Redis down in this scrape: no second wait
            return
        try:
            open_now, failing, truncated = self.count()
        except redis.RedisError as e:
            logger.warning("metrics scrape: breakers unavailable: %s", e)
            return
        yield GaugeMetricFamily("compactor_breakers_open",
                                "sessions whose LLM breaker is open (failures >= maxFailures)",
                                value=open_now)
        yield GaugeMetricFamily("compactor_sessions_failing",
                                "sessions with at least one LLM failure counted (24 h TTL)",
                                value=failing)
        yield GaugeMetricFamily("compactor_breaker_scan_truncated",
                                f"1 when more than {MAX_BREAKER_KEYS} failure counters exist",
                                value=int(truncated))

    def count(self) -> tuple[int, int, bool]:
        """``(open breakers, sessions with failures, whether the count was cut short)``: the
        sessions of ``{p}:failing`` (the workers add each failing session there with its counter's
        expiry; a SCAN of the counters walked every key of the Redis per scrape: 1 s at 1.5 M keys),
        their counters read; the expired ones pruned first."""
        seconds, _ = self.client.time()
        if not self.client.exists(self.indexed):
            self._index_earlier_counters(int(seconds))
        pipe = self.client.pipeline(transaction=False)
        pipe.zremrangebyscore(self.failing, "-inf", f"({int(seconds)}")
        pipe.zrange(self.failing, 0, MAX_BREAKER_KEYS - 1)
        pipe.zcard(self.failing)
        _, sessions, total = pipe.execute()
        keys = [self.prefix + as_text(session) for session in sessions]
        raw = [v for i in range(0, len(keys), SCAN_BATCH) for v in self.client.mget(keys[i:i + SCAN_BATCH])]
        gone = [session for session, value in zip(sessions, raw) if value is None]
        if gone:  # (deleted by hand, or expired before its score: out of the index, the one kept for good too;
            # each checked again in the script: a failure counted since the MGET indexed it anew)
            self.client.eval(_PRUNE_GONE, 1, self.failing, self.prefix, *gone)
        values = [_int(v) for v in raw]
        return (sum(v >= self.max_failures for v in values), sum(v > 0 for v in values),
                int(total) - len(gone) > MAX_BREAKER_KEYS)


    def _index_earlier_counters(self, now: int) -> None:
        """Once per Redis (``{p}:failing:indexed``, claimed for ``INDEXING_CLAIM_S`` first, so that the
        API processes' first scrapes do not all scan): the failure counters an earlier version wrote,
        which it did not index, into ``{p}:failing`` (a session whose breaker was open counted no new
        failure to be indexed by, and read 0 in the gauges for up to a day). One SCAN, indexed batch
        by batch; a counter with no TTL (set by hand) is kept in the index until it is deleted."""
        if not self.client.set(self.indexed, "indexing", nx=True, ex=INDEXING_CLAIM_S):
            return
        indexed = 0
        batch: list[bytes] = []
        for key in self.client.scan_iter(match=_glob_escape(self.prefix) + "*", count=SCAN_BATCH):
            batch.append(key)
            if len(batch) >= SCAN_BATCH:
                indexed += self._index(batch, now)
                batch = []
        indexed += self._index(batch, now) if batch else 0
        self.client.set(self.indexed, "1")
        if indexed:
            logger.info("failure counters of an earlier version indexed: %d", indexed)

    def _index(self, keys: list[bytes], now: int) -> int:
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.ttl(key)
        scores = {as_text(key)[len(self.prefix):]: (now + int(ttl)) if int(ttl) >= 0 else math.inf
                  for key, ttl in zip(keys, pipe.execute()) if int(ttl) != -2}  # (-1: no TTL; -2: gone)
        if scores:
            self.client.zadd(self.failing, scores)
        return len(scores)


# KEYS: the failing index; ARGV: the counters' key prefix, then sessions. Each whose counter is gone
# leaves the index.
_PRUNE_GONE = """
for i = 2, #ARGV do
  if redis.call('EXISTS', ARGV[1] .. ARGV[i]) == 0 then redis.call('ZREM', KEYS[1], ARGV[i]) end
end
return 0
"""
INDEXING_CLAIM_S = 300  # an API process indexing earlier counters holds the marker this long at most


def _glob_escape(text: str) -> str:
    """``text`` with SCAN's glob characters escaped (a prefix may hold them)."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


class ProcessMetrics(Collector):
    """The process-side counters and histograms, across processes in multi-process mode."""

    def __init__(self, http_registry: CollectorRegistry) -> None:
        self.http_registry = http_registry
        self.directory = process_metrics.multiprocess_dir()
        self.multiprocess = (MultiProcessCollector(None)  # type: ignore[no-untyped-call]
                             if self.directory else None)
        self.unreadable: set[str] = set()  # (said once each)

    def collect(self) -> Iterator[Metric]:
        if self.multiprocess is not None:  # the HTTP metrics are in the shared files too
            files = [path for path in glob.glob(os.path.join(str(self.directory), "*.db")) if self._readable(path)]
            yield from self.multiprocess.merge(files, accumulate=True)  # type: ignore[no-untyped-call]
            return
        yield from process_metrics.REGISTRY.collect()
        yield from self.http_registry.collect()

    def _readable(self, path: str) -> bool:
        """Whether a process's file of values reads whole: one left empty or cut (a process killed
        as it created it) made every scrape, and the overview, a 500."""
        try:
            list(MmapedDict.read_all_values_from_file(path))  # type: ignore[no-untyped-call]
            return True
        except FileNotFoundError:
            return False  # (removed since: its process's stack ended)
        except (OSError, RuntimeError, struct.error, UnicodeDecodeError) as e:
            if path not in self.unreadable:
                self.unreadable.add(path)
                logger.warning("metrics file %s left out of the scrapes: %s", path, e)
            return False

    def totals(self) -> dict[str, float]:
        """Each counter's value summed over its labels, by family name (no ``_total``)."""
        sums: dict[str, float] = {}
        for family in self.collect():
            if family.type != "counter":
                continue
            sums[family.name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
        return sums


def scrape_registry(process: ProcessMetrics, client: redis.Redis,
                    settings: Settings) -> CollectorRegistry:
    """What ``/metrics`` serves: the process metrics and the Redis gauges (``RedisCollector``
    first: the others skip a scrape it found Redis down in)."""
    registry = CollectorRegistry()
    gate = RedisGate()
    for collector in (process, RedisCollector(client, settings, gate),
                      StreamLagCollector(client, settings, gate), BreakerCollector(client, settings, gate)):
        registry.register(collector)
    return registry


def _age_s(entry_id: bytes | str | None, now_ms: int) -> float:
    ms = int(_bytes(entry_id).partition(b"-")[0])
    return max(0.0, (now_ms - ms) / 1000)


def _bytes(value: object) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def _int(value: object) -> int:
    try:
        return int(value)  # type: ignore[call-overload,no-any-return]
    except (TypeError, ValueError):
        return 0


class HttpMetrics:
    """ASGI middleware counting requests by method, route template and status."""

    def __init__(self, app: ASGIApp, *, registry: CollectorRegistry, routes: Sequence[BaseRoute] = ()) -> None:
        self.app = app
        self.routes = routes  # the app's routes, in routing order: to label a request refused before routing
        self.requests = Counter("compactor_http_requests", "HTTP requests",
                                ["method", "route", "status"], registry=registry)
        self.latency = Histogram("compactor_http_request_seconds", "HTTP request latency",
                                 ["method", "route"], registry=registry)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        started = time.perf_counter()

        async def tracked_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        finally:
            route = route_label(scope, self.routes)
            method = scope["method"] if scope["method"] in HTTP_METHODS else "other"
            self.requests.labels(method, route, str(status)).inc()
            self.latency.labels(method, route).observe(time.perf_counter() - started)


# The ``method`` label's values: a request's method is whatever the client sent (the server takes
# any token), and each new one made series of its own, without the token (a 401 counts too).
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})  # else "other"


def route_label(scope: Scope, routes: Sequence[BaseRoute] = ()) -> str:
    """The template of the route that answered (``unmatched`` when none did).

    A mount's requests (the status page's ``/static`` files) all count under the
    mount's template, ``/static/{path}``, never their own paths: the label set
    stays bounded. FastAPI leaves ``scope["route"]`` unset for a mount; its
    ``endpoint`` (the mounted app) names it. A request refused before routing
    (``RequestGuard``'s 401 and 413) counts under the first of ``routes`` whose path
    it is: FastAPI did not route it.
    """
    route = scope.get("route") or _mount_of(scope) or _route_for(scope, routes)
    if isinstance(route, Mount):
        return route.path_format
    return getattr(route, "path", None) or UNMATCHED


def _route_for(scope: Scope, routes: Sequence[BaseRoute]) -> BaseRoute | None:
    """The first of ``routes`` that matches the request in full, else the first that matches
    its path for another method (it would have answered 405)."""
    partial = None
    for route in routes:
        match = route.matches(dict(scope))[0]  # (a copy: FastAPI's routes note things in the scope)
        if match is Match.FULL:
            return route
        if match is Match.PARTIAL and partial is None:
            partial = route
    return partial


def _mount_of(scope: Scope) -> Mount | None:
    endpoint = scope.get("endpoint")
    if endpoint is None:
        return None
    routes = getattr(scope.get("app"), "routes", ())
    return next((r for r in routes if isinstance(r, Mount) and r.app is endpoint), None)
