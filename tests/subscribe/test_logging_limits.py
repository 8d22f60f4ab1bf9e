"""Loss warnings are rate-limited per stream and kind, and still say how many were held back."""

from __future__ import annotations

import logging

import pytest

from kvevents.subscribe import Subscriber
from kvevents.subscribe._streams import StreamSpec, SubscriberOptions
from kvevents.testing.fixtures import heartbeat
from kvevents.testing.peers import Collector, RawPublisher


def test_unrecoverable_holes_warn_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    """Many holes on a stream without replay log one warning per interval, but all are counted."""
    caplog.set_level(logging.WARNING, logger="kvevents.subscribe.subscriber")
    clock = [1000.0]
    options = SubscriberOptions(gap_log_interval=60.0, wall_clock=lambda: clock[0])
    with RawPublisher(replay=False) as raw:
        spec = StreamSpec("w", 0, raw.endpoint)
        with Subscriber([spec], options=options) as sub:
            collector = Collector(sub)
            collector.handshake(raw, spec.key)
            holes = sub.stream_stats()[spec.key].unrecoverable
            clock[0] += 61.0  # a late join may have warned already: start a fresh interval
            caplog.clear()
            for _ in range(3):
                raw.publish(heartbeat(), drop=True)
                raw.publish(heartbeat())
            collector.wait(lambda c: sub.stream_stats()[spec.key].unrecoverable == holes + 3)
            clock[0] += 61.0
            raw.publish(heartbeat(), drop=True)
            raw.publish(heartbeat())
            collector.wait(lambda c: sub.stream_stats()[spec.key].unrecoverable == holes + 4)
    lost = [r.getMessage() for r in caplog.records if "cannot be recovered" in r.getMessage()]
    assert len(lost) == 2
    assert "held back" not in lost[0]
    assert lost[1].endswith("(2 similar warnings held back)")
