"""Prometheus metrics from kvevents stats records.

Every component reports its losses and counts as a frozen dataclass (``publisher.stats()``,
``subscriber.stats()``, ``index.stats()``). This module turns such records into Prometheus
metric families without copying their fields by hand, so a field added to a stats record shows
up as a metric on its own:

- numeric fields (int, float, bool) become one sample each, named ``<prefix>_<field>``;
- a field is a gauge when its metadata says ``{"metric": "gauge"}`` or the record class lists
  it in its ``GAUGES`` class attribute (levels: depth, lag, sizes); every other number only
  grows and is a counter;
- non-numeric fields (strings, nested records, None) are skipped, and so is a field that is
  also a label (``rank`` of a per-stream record is a label, not a sample);
- a metric's HELP text is the field's own documentation (:func:`field_docs`): its ``doc``
  metadata, its ``#:`` comment, or the ````name``: text`` sentence of the record's docstring.

:func:`publisher_collector` and :func:`subscriber_collector` build the collectors for our own
components; :func:`start_exporter` serves any collectors over HTTP for processes (engines)
that have no HTTP server of their own.

``prometheus-client`` is an optional dependency (``pip install kvevents[metrics]``); it is
imported only when a collector or exporter is built.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from kvevents._types import Document

__all__ = [
    "CollectorGroup",
    "StatsCollector",
    "field_docs",
    "metric_kind",
    "publisher_collector",
    "start_exporter",
    "stats_samples",
    "subscriber_collector",
]

if TYPE_CHECKING:
    from _typeshed import DataclassInstance as StatsRecord  # any stats record (a dataclass)

Labels = Mapping[str, str]
Source = Callable[[], Iterable[tuple[Labels, "StatsRecord"]]]


def metric_kind(record: StatsRecord, field: dataclasses.Field[Any]) -> str:  # a field of any type
    """``"gauge"`` or ``"counter"`` for one field of a stats record.

    Declared, never guessed: the field's metadata (``{"metric": "gauge"}``) first, then the
    record class's ``GAUGES`` set of level fields; every other number is a counter.
    """
    declared = field.metadata.get("metric")
    if declared in ("gauge", "counter"):
        return str(declared)
    return "gauge" if field.name in getattr(record, "GAUGES", ()) else "counter"


# ``name: type = default  #: doc`` on the field's line, or ``#: doc`` on the line above it.
_TRAILING = re.compile(r"^\s+(\w+)\s*:[^#]*#:\s*(.+)$")
_LEADING = re.compile(r"^\s+#:\s*(.+)$")
_FIELD = re.compile(r"^\s+(\w+)\s*:")
# ````name``: text`` in a docstring, up to the end of its sentence or clause.
_PROSE = re.compile(r"``(\w+)``:\s*(.+?)[.;](?=\s|$)", re.DOTALL)


def _source_docs(cls: type) -> dict[str, str]:
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):  # no source (frozen, built in C): names only
        return {}
    docs: dict[str, str] = {}
    above: str | None = None
    for line in lines:
        trailing, leading, field = _TRAILING.match(line), _LEADING.match(line), _FIELD.match(line)
        if trailing:
            docs[trailing.group(1)] = trailing.group(2).strip()
        elif field and above is not None:
            docs[field.group(1)] = above
        above = leading.group(1).strip() if leading else None
    return docs


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's documentation in a stats record class and its bases: a ``#:`` comment
    (same line or the line above) first, else its ````name``: text`` in a class docstring."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        for name, text in _PROSE.findall(klass.__doc__ or ""):
            docs[name] = " ".join(text.split())
        docs.update(_source_docs(klass) if dataclasses.is_dataclass(klass) else {})
    return docs


def stats_samples(record: StatsRecord) -> Iterator[tuple[str, str, float, str]]:
    """``(field, kind, value, doc)`` for every numeric field of a stats dataclass; ``doc`` is
    the field's ``doc`` metadata, else its documentation (:func:`field_docs`), else its name."""
    if not dataclasses.is_dataclass(record):
        raise TypeError(f"expected a stats dataclass, got {type(record).__name__}")
    cls: type = type(record)
    docs = field_docs(cls)
    for field in dataclasses.fields(record):
        value = getattr(record, field.name)
        if isinstance(value, (bool, int, float)):
            doc = field.metadata.get("doc") or docs.get(field.name) or field.name.replace("_", " ")
            yield field.name, metric_kind(record, field), float(value), str(doc)


class StatsCollector:
    """A prometheus-client collector reading stats records from ``source`` at scrape time.

    ``source()`` yields ``(labels, record)`` pairs, e.g. one per stream or per worker; all
    pairs must use the same label names. ``docs`` gives HELP texts by field name (default:
    the field's ``doc`` metadata, else its name).
    """

    def __init__(self, prefix: str, source: Source, docs: Mapping[str, str] | None = None) -> None:
        self.prefix = prefix
        self.source = source
        self.docs = docs or {}

    def collect(self) -> Iterator[Any]:  # prometheus_client's metric families (untyped)
        """Build one metric family per field, one sample per labelled record."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        families: Document = {}
        for labels, record in self.source():
            for name, kind, value, doc in stats_samples(record):
                if name in labels:
                    continue
                family = families.get(name)
                if family is None:
                    cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
                    help_text = self.docs.get(name, doc)
                    family = cls(f"{self.prefix}_{name}", help_text, labels=list(labels))
                    families[name] = family
                family.add_metric(list(labels.values()), value)
        yield from families.values()


class CollectorGroup:
    """Several collectors registered as one (e.g. a subscriber's totals and its streams)."""

    def __init__(self, collectors: Iterable[StatsCollector]) -> None:
        self.collectors = list(collectors)

    def collect(self) -> Iterator[Any]:  # prometheus_client's metric families (untyped)
        """Every family of every member collector."""
        for collector in self.collectors:
            yield from collector.collect()


# Duck-typed: a publisher, or an iterable of them (anything with stats() and rank).
def publisher_collector(publishers: Any, prefix: str = "kvevents_publisher") -> StatsCollector:
    """Metrics of one publisher or a sequence of them (one per rank), labelled ``rank``.

    ``publishers`` is anything with ``stats()`` and ``rank`` (``create_publisher`` results),
    or an iterable of such; it is read at every scrape, so counters are always current.
    """
    members = [publishers] if hasattr(publishers, "stats") else list(publishers)
    if not members:
        raise ValueError("publisher_collector needs at least one publisher")

    def source() -> Iterator[tuple[Labels, StatsRecord]]:
        for publisher in members:
            yield {"rank": str(publisher.rank)}, publisher.stats()

    return StatsCollector(prefix, source)


# Duck-typed: anything with stats() and stream_stats(), as Subscriber and the relay have.
def subscriber_collector(subscriber: Any, prefix: str = "kvevents_subscriber") -> CollectorGroup:
    """Metrics of a subscriber: totals as ``<prefix>_*`` and per stream as
    ``<prefix>_stream_*`` labelled ``worker_id`` and ``rank`` (the one worker label of every
    kvevents metric, as in the HTTP API).

    Streams added or removed later appear or vanish at the next scrape.
    """

    def totals() -> Iterator[tuple[Labels, StatsRecord]]:
        yield {}, subscriber.stats()

    def streams() -> Iterator[tuple[Labels, StatsRecord]]:
        for (worker, rank), stats in sorted(subscriber.stream_stats().items()):
            yield {"worker_id": worker, "rank": str(rank)}, stats

    return CollectorGroup(
        [StatsCollector(prefix, totals), StatsCollector(f"{prefix}_stream", streams)]
    )


def start_exporter(
    collectors: Iterable[StatsCollector | CollectorGroup], port: int = 0, addr: str = "127.0.0.1"
) -> tuple[Any, int]:  # prometheus_client's server (untyped), the port
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
