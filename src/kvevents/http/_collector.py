"""The index service's Prometheus metrics, read at scrape time: nothing on the hot path.

Every numeric field of :class:`~kvevents.index.prefix.IndexStats` and
:class:`~kvevents.service.core.ServiceStats` becomes a metric on its own, its HELP text the
field's documentation (:func:`kvevents.metrics.field_docs`); a field added to either record
shows up without a change here.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from kvevents.metrics import CollectorGroup, StatsCollector
from kvevents.service.core import IndexService

__all__ = ["ServiceCollector"]


class ServiceCollector:
    """The index's and the service's stats, bytes per block, and blocks per holder."""

    def __init__(self, service: IndexService) -> None:
        self._service = service
        self._stats = CollectorGroup(
            [
                StatsCollector("kvevents_index", lambda: [({}, service.index_stats())]),
                StatsCollector("kvevents_service", lambda: [({}, service.stats())]),
            ]
        )

    def collect(self) -> Iterator[Metric]:
        """Every family, built now."""
        yield from self._stats.collect()
        yield GaugeMetricFamily(
            "kvevents_index_bytes_per_block",
            "Estimated bytes per (holder, block) entry",
            self._service.index_stats().bytes_per_block,
        )
        yield self._tier_blocks()
        yield from self._feed_health()

    def _feed_health(self) -> Iterator[GaugeMetricFamily]:
        """The feed's health as numbers an alert can test (``GET /health`` says it in words)."""
        health = self._service.health()
        yield GaugeMetricFamily(
            "kvevents_service_feed_healthy",
            "1 while the subscriber's I/O thread (or a replica's consume loop) is serving, "
            "degraded or not; 0 when it is stalled or dead (GET /health then answers 503 with "
            "the reason)",
            1.0 if health.state in ("ok", "degraded") else 0.0,
        )
        yield GaugeMetricFamily(
            "kvevents_service_feed_stalled_seconds",
            "Seconds the subscriber's I/O thread has been stuck in its current turn of work "
            "(0 when it is idle or keeping up)",
            health.stalled_for,
        )

    def _tier_blocks(self) -> GaugeMetricFamily:
        family = GaugeMetricFamily(
            "kvevents_index_worker_blocks",
            "Blocks held per worker, rank and tier",
            labels=["worker_id", "rank", "tier"],
        )
        with self._service.lock:
            streams = self._service.index.streams()
        for info in streams:
            for tier, blocks in info.tiers.items():
                family.add_metric([info.worker_id, str(info.rank), tier], blocks)
        return family
