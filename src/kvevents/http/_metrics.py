"""``GET /metrics``: a server's Prometheus registry and its exposition.

:func:`metrics_registry` holds what every HTTP server of the package exports (the process's CPU,
memory, file descriptors and garbage collector, as every Prometheus-native service does; the
HTTP refusals, ``kvevents_http_*``) next to the collectors it is given; :func:`metrics_route`
serves it in the text format, rendered on a worker thread.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.registry import Collector
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvevents.http._limits import HttpCounters
from kvevents.metrics import StatsCollector

__all__ = ["QUERY_BUCKETS", "metrics_registry", "metrics_route", "query_histogram"]

#: Buckets of the /query latency histogram, in seconds: a query is tens of microseconds in
#: process and a fraction of a millisecond for 8k tokens; the top buckets catch lock waits.
QUERY_BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.5,
    1.0,
)
_TEXT_FORMAT = "text/plain; version=0.0.4"


def metrics_registry(
    counters: HttpCounters, collectors: Iterable[Collector] = ()
) -> CollectorRegistry:
    """A registry of the process's metrics, ``counters`` as ``kvevents_http_*``, and
    ``collectors``."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    GCCollector(registry=registry)
    registry.register(StatsCollector("kvevents_http", lambda: [({}, counters.stats())]))
    for collector in collectors:
        registry.register(collector)
    return registry


def query_histogram(registry: CollectorRegistry) -> Histogram:
    """``kvevents_query_duration_seconds`` in ``registry``."""
    return Histogram(
        "kvevents_query_duration_seconds",
        "Time to answer a POST /query, from its body read to its answer encoded (the "
        "index walk and the routing decision; not the network)",
        buckets=QUERY_BUCKETS,
        registry=registry,
    )


def metrics_route(registry: CollectorRegistry) -> Route:
    """``GET /metrics``: ``registry`` in Prometheus's text format."""

    async def metrics(request: Request) -> Response:
        text = await run_in_threadpool(generate_latest, registry)
        return Response(text, media_type=_TEXT_FORMAT)

    return Route("/metrics", metrics, methods=["GET"])
