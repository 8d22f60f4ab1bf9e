"""Stats records become Prometheus metrics without hand-copied fields."""

from __future__ import annotations

import dataclasses
import urllib.request
from typing import ClassVar

import pytest

from kvevents.metrics import StatsCollector, metric_kind, start_exporter, stats_samples


@dataclasses.dataclass(frozen=True)
class FakeStats:
    GAUGES: ClassVar[frozenset[str]] = frozenset({"queue_depth", "lag_seconds"})

    published: int = 3
    dropped_queue_full: int = 1
    queue_depth: int = 7
    lag_seconds: float = 0.25
    explicit: int = dataclasses.field(
        default=2, metadata={"metric": "gauge", "doc": "an explicit gauge"}
    )
    name: str = "not numeric"


def test_kinds_are_declared_not_guessed() -> None:
    """Fields in GAUGES and fields with gauge metadata are gauges; everything else counts up."""
    kinds = {f.name: metric_kind(FakeStats(), f) for f in dataclasses.fields(FakeStats)}
    assert kinds["published"] == "counter"
    assert kinds["dropped_queue_full"] == "counter"
    assert kinds["queue_depth"] == "gauge"
    assert kinds["lag_seconds"] == "gauge"
    assert kinds["explicit"] == "gauge"


def test_samples_skip_non_numeric_fields() -> None:
    """Only numeric fields become samples."""
    names = [name for name, *_ in stats_samples(FakeStats())]
    assert names == ["published", "dropped_queue_full", "queue_depth", "lag_seconds", "explicit"]


def test_non_dataclass_is_rejected() -> None:
    """Passing something that is not a stats record is a TypeError, not silence."""
    with pytest.raises(TypeError, match="stats dataclass"):
        list(stats_samples({"published": 1}))


def test_exporter_serves_labelled_samples() -> None:
    """The exporter serves every field with its labels over HTTP."""
    records = [({"rank": "0"}, FakeStats()), ({"rank": "1"}, FakeStats(published=9))]
    server, port = start_exporter([StatsCollector("kvevents_publisher", lambda: records)])
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    assert 'kvevents_publisher_published_total{rank="1"} 9.0' in text
    assert 'kvevents_publisher_queue_depth{rank="0"} 7.0' in text
    assert "# TYPE kvevents_publisher_queue_depth gauge" in text
    assert "# HELP kvevents_publisher_explicit an explicit gauge" in text


def test_every_stats_record_declares_only_real_fields_as_gauges() -> None:
    """A GAUGES entry that names no field is a typo that would silently export a counter."""
    from kvevents.index import IndexStats
    from kvevents.publish import PublisherStats
    from kvevents.subscribe import StreamStats, SubscriberStats

    for record in (PublisherStats, StreamStats, SubscriberStats, IndexStats):
        names = {f.name for f in dataclasses.fields(record)}
        assert names >= record.GAUGES, (record.__name__, record.GAUGES - names)
