"""Collectors for our own publisher and subscriber, and the exporter serving them."""

from __future__ import annotations

import dataclasses
import time
import urllib.request
from typing import Any

import pytest

from kvevents.metrics import publisher_collector, start_exporter, subscriber_collector
from kvevents.subscribe import StreamStats, SubscriberStats
from kvevents.testing.fixtures import heartbeat
from kvevents.testing.publisher import started_publisher
from kvevents.testing.sockets import Deadline


def _samples(collector: Any) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in collector.collect():
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def _stream(worker: str, rank: int, delivered: int) -> StreamStats:
    return StreamStats(
        worker_id=worker,
        rank=rank,
        state="live",
        received=delivered,
        delivered=delivered,
        gaps=1,
        replays=1,
        events=delivered,
        last_seq=delivered - 1,
        lag_seconds=None,
    )


class FakeSubscriber:
    def stats(self) -> SubscriberStats:
        return SubscriberStats(
            streams=2,
            incomplete=0,
            received=7,
            delivered=7,
            gaps=2,
            replays=2,
            events=7,
            queued=0,
            sink_errors=0,
            max_lag=None,
        )

    def stream_stats(self) -> dict[tuple[str, int], StreamStats]:
        return {("b", 1): _stream("b", 1, 4), ("a", 0): _stream("a", 0, 3)}


def test_subscriber_collector_labels_streams_by_worker_and_rank() -> None:
    """Per-stream samples carry worker and rank labels; totals carry none; labels are not samples."""
    samples = _samples(subscriber_collector(FakeSubscriber()))
    delivered = samples["kvevents_subscriber_stream_delivered_total"]
    assert delivered == [
        ({"worker_id": "a", "rank": "0"}, 3.0),
        ({"worker_id": "b", "rank": "1"}, 4.0),
    ]
    assert samples["kvevents_subscriber_delivered_total"] == [({}, 7.0)]
    assert samples["kvevents_subscriber_streams"] == [({}, 2.0)]
    assert samples["kvevents_subscriber_stream_last_seq"][0] == (
        {"worker_id": "a", "rank": "0"},
        2.0,
    )
    assert not any("stream_rank" in name for name in samples)
    assert "kvevents_subscriber_max_lag" not in samples  # None: no sample rather than a fake 0


def test_publisher_collector_reads_live_stats_per_rank() -> None:
    """A real publisher's counters are read at scrape time, labelled by rank."""
    with started_publisher() as pub:
        collector = publisher_collector(pub)
        before = _samples(collector)["kvevents_publisher_enqueued_total"]
        pub.publish(heartbeat())
        after = _samples(collector)["kvevents_publisher_enqueued_total"]
    assert before == [({"rank": "0"}, 0.0)] and after == [({"rank": "0"}, 1.0)]


def test_publisher_collector_needs_a_publisher() -> None:
    """An empty publisher list is a mistake, reported at once."""
    with pytest.raises(ValueError, match="at least one publisher"):
        publisher_collector([])


def test_exporter_serves_publishers_of_every_rank() -> None:
    """start_exporter with publisher_collector serves one sample per rank over HTTP."""

    @dataclasses.dataclass
    class Fake:
        rank: int

        def stats(self) -> Any:
            from kvevents.publish import PublisherStats

            return PublisherStats(enqueued=10 + self.rank, next_seq=10 + self.rank)

    server, port = start_exporter([publisher_collector([Fake(0), Fake(1)])])
    try:
        deadline = Deadline(10)
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    text = r.read().decode()
                break
            except OSError:
                assert not deadline.expired
                time.sleep(0.01)
    finally:
        server.shutdown()
        server.server_close()
    assert 'kvevents_publisher_enqueued_total{rank="1"} 11.0' in text
    assert 'kvevents_publisher_next_seq{rank="0"} 10.0' in text
    assert "# TYPE kvevents_publisher_next_seq gauge" in text
