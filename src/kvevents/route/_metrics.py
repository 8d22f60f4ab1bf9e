"""The proxy's counters and its Prometheus registry (``GET /metrics``).

Totals are typed fields (:class:`ProxyCounts`, :class:`~kvevents.route.EngineCounts`)
turned into metrics by :class:`kvevents.metrics.StatsCollector`; the requests by route,
engine and status and the time to first token are prometheus-client families.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    ProcessCollector,
)
from prometheus_client.registry import Collector

from kvevents.http import HttpCounters
from kvevents.metrics import StatsCollector
from kvevents.route._engines import EnginePool

__all__ = ["TTFT_BUCKETS", "ProxyCounts", "ProxyMetrics", "ProxyStats"]

#: Buckets of the time to first token, in seconds: a millisecond in front of a stand-in
#: engine, tens of milliseconds to seconds on a real one, minutes behind a long queue.
TTFT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


@dataclass
class ProxyCounts:
    """What the proxy did with its clients' requests."""

    planned: int = 0  #: chat and completion requests handed to the planner
    passed_through: int = 0  #: other /v1/* and /tokenize, /detokenize requests forwarded
    retries: int = 0  #: attempts made on another engine after a retryable failure
    client_disconnects: int = 0  #: requests whose client went away before their answer ended
    unknown_models: int = 0  #: requests refused with 404 (a model no engine serves)
    no_engine: int = 0  #: requests answered 503 (no healthy engine for them)
    upstream_failures: int = 0  #: requests answered 502 or 504 after their engines failed
    truncated: int = 0  #: answers cut off after they began (engine lost, silent, too large)
    continued: int = 0  #: streams whose engine was lost mid-answer, finished by another
    planner_errors: int = 0  #: plans that raised (then routed to any healthy engine)


@dataclass(frozen=True)
class ProxyStats:
    """The proxy now: ``in_flight`` requests and a copy of its ``counts``."""

    GAUGES: ClassVar[frozenset[str]] = frozenset({"in_flight"})

    in_flight: int  #: requests being answered
    counts: ProxyCounts


class ProxyMetrics:
    """The registry behind ``GET /metrics`` and the families the proxy updates."""

    def __init__(
        self,
        pool: EnginePool,
        stats: Callable[[], ProxyStats],
        http: HttpCounters,
        collectors: Sequence[Collector] = (),
    ) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.requests = Counter(
            "kvevents_route_requests",
            "OpenAI API requests answered, by route, engine (empty: none) and status",
            ["route", "engine", "status"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "kvevents_route_ttft_seconds",
            "Seconds from a streamed request's arrival to its first body byte from the engine",
            ["engine"],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )

        self._counted: dict[tuple[str, str, int], Counter] = {}

        # Stats records of several types, read field by field.
        def totals() -> Iterator[tuple[dict[str, str], Any]]:
            record = stats()
            yield {}, record
            yield {}, record.counts

        # Stats records of several types, read field by field.
        def engines() -> Iterator[tuple[dict[str, str], Any]]:
            for engine in pool.engines:
                record = engine.stats()
                yield {"engine": engine.id}, record
                yield {"engine": engine.id}, record.counts

        self.registry.register(StatsCollector("kvevents_route", totals))
        self.registry.register(StatsCollector("kvevents_route_engine", engines))
        self.registry.register(StatsCollector("kvevents_http", lambda: [({}, http.stats())]))
        for collector in collectors:
            self.registry.register(collector)

    def count_request(self, route: str, engine: str, status: int) -> None:
        """One more request answered by route, engine and status (its series kept at hand:
        prometheus-client's labels() takes a lock each time)."""
        key = (route, engine, status)
        child = self._counted.get(key)
        if child is None:
            child = self._counted[key] = self.requests.labels(route, engine, str(status))
        child.inc()


def snapshot(counts: ProxyCounts, in_flight: int) -> ProxyStats:
    return ProxyStats(in_flight, dataclasses.replace(counts))
