"""Prometheus metrics from kvevents stats records.

Every component reports its losses and counts as a frozen dataclass (``publisher.stats()``,
``subscriber.stats()``, ``index.stats()``). This module turns such records into Prometheus
metric families without copying their fields by hand, so a field added to a stats record shows
up as a metric on its own:

- numeric fields (int, float, bool) become one sample each, named ``<prefix>_<field>``;
- a field is a gauge when its dataclass metadata says ``{"metric": "gauge"}`` or its name says
  it is a level (depth, lag, size, current counts); every other field is a counter;
- non-numeric fields (strings, nested records) are skipped.

``prometheus-client`` is an optional dependency (``pip install kvevents[metrics]``); it is
imported only when a collector or exporter is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

__all__ = ["StatsCollector", "metric_kind", "start_exporter", "stats_samples"]

# Substrings that mark a field as a level rather than a running total.
_GAUGE_HINTS = (
    "depth",
    "lag",
    "size",
    "bytes_per",
    "ring_",
    "active",
    "current",
    "held",
    "streams",
    "workers",
    "blocks",
    "holders",
    "pending",
    "incomplete",
    "state",
    "age",
)
# Fields whose names contain a hint above but that only ever grow.
_COUNTER_OVERRIDES = (
    "_total",
    "blocks_stored",
    "blocks_removed",
    "stored_blocks",
    "removed_blocks",
)

Labels = Mapping[str, str]
Source = Callable[[], Iterable[tuple[Labels, Any]]]


def metric_kind(field: dataclasses.Field[Any]) -> str:
    """``"gauge"`` or ``"counter"`` for one stats field (metadata first, then its name)."""
    declared = field.metadata.get("metric")
    if declared in ("gauge", "counter"):
        return str(declared)
    name = field.name
    if any(hint in name for hint in _COUNTER_OVERRIDES):
        return "counter"
    return "gauge" if any(hint in name for hint in _GAUGE_HINTS) else "counter"


def stats_samples(record: Any) -> Iterator[tuple[str, str, float, str]]:
    """``(field, kind, value, doc)`` for every numeric field of a stats dataclass."""
    if not dataclasses.is_dataclass(record):
        raise TypeError(f"expected a stats dataclass, got {type(record).__name__}")
    for field in dataclasses.fields(record):
        value = getattr(record, field.name)
        if isinstance(value, (bool, int, float)):
            doc = field.metadata.get("doc", "") or field.name.replace("_", " ")
            yield field.name, metric_kind(field), float(value), str(doc)


class StatsCollector:
    """A prometheus-client collector reading stats records from ``source`` at scrape time.

    ``source()`` yields ``(labels, record)`` pairs, e.g. one per stream or per worker; all
    pairs must use the same label names.
    """

    def __init__(self, prefix: str, source: Source) -> None:
        self.prefix = prefix
        self.source = source

    def collect(self) -> Iterator[Any]:
        """Build one metric family per field, one sample per labelled record."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        families: dict[str, Any] = {}
        for labels, record in self.source():
            for name, kind, value, doc in stats_samples(record):
                family = families.get(name)
                if family is None:
                    cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
                    family = cls(f"{self.prefix}_{name}", doc, labels=list(labels))
                    families[name] = family
                family.add_metric(list(labels.values()), value)
        yield from families.values()


def start_exporter(
    collectors: Iterable[StatsCollector], port: int = 0, addr: str = "127.0.0.1"
) -> tuple[Any, int]:
    """Serve ``/metrics`` for ``collectors`` on a background thread; returns (server, port).

    For publishers inside engines that have no HTTP server of their own. Call
    ``server.shutdown()`` to stop it. Port 0 picks a free port.
    """
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=True)
    for collector in collectors:
        registry.register(collector)
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    return server, int(server.server_address[1])
