"""Prometheus metrics of the HTTP API: request counts and latencies, plus Redis-side gauges.

Invariants: every app has its own ``CollectorRegistry`` (no module-level
metrics, so two apps in one process never share counters); the Redis gauges are
read at scrape time and a scrape never fails because Redis is down
(``compactor_redis_up`` says 0 instead).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import redis
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from compactor.keys import Keys
from compactor.queue import compaction_queue
from events.config import Settings

logger = logging.getLogger(__name__)


class RedisCollector(Collector):
    """Gauges read from Redis on each scrape: queue depth, sessions, streams, dead letters."""

    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        self.client = client
        self.settings = settings
        self.keys = Keys(settings.redis.prefix, settings.redis.shards)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        up = GaugeMetricFamily("compactor_redis_up", "1 when Redis answered this scrape")
        try:
            families = list(self._read())
        except redis.RedisError as e:
            logger.warning("metrics scrape: redis unavailable: %s", e)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from families

    def _read(self) -> Iterator[GaugeMetricFamily]:
        queue = compaction_queue(self.client, self.settings)
        yield GaugeMetricFamily("compactor_queue_jobs", "compaction jobs waiting in the RQ queue",
                                value=queue.count)
        yield GaugeMetricFamily("compactor_failed_jobs", "jobs in the RQ failed-job registry",
                                value=queue.failed_job_registry.count)
        yield GaugeMetricFamily("compactor_sessions", "sessions seen by the watcher",
                                value=self.client.zcard(self.keys.sessions))
        yield GaugeMetricFamily("compactor_dead_letters", "entries in the dead-letter stream",
                                value=self.client.xlen(self.keys.dead))
        streams = GaugeMetricFamily("compactor_stream_entries", "entries kept in each stream shard",
                                    labels=["shard"])
        pipe = self.client.pipeline(transaction=False)
        for stream in self.keys.all_streams():
            pipe.xlen(stream)
        for shard, length in enumerate(pipe.execute()):
            streams.add_metric([str(shard)], length)
        yield streams


class HttpMetrics:
    """ASGI middleware counting requests by method, route template and status."""

    def __init__(self, app: ASGIApp, *, registry: CollectorRegistry) -> None:
        self.app = app
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
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            self.requests.labels(scope["method"], route, str(status)).inc()
            self.latency.labels(scope["method"], route).observe(time.perf_counter() - started)
