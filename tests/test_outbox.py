"""The hand-off between the subscriber's I/O thread and its consumers."""

from __future__ import annotations

import threading

from kvevents._subscriber_loop import Outbox
from kvevents.testing.sockets import wait_for


def test_put_many_keeps_order_and_wakes_once() -> None:
    """A burst arrives whole and in order, with one listener call for the lot."""
    box: Outbox[int] = Outbox(maxsize=100)
    calls = []
    box.listener = lambda: calls.append(1)
    assert box.put_many([1, 2, 3])
    assert box.put_many([4])
    assert [box.get(0)[1] for _ in range(4)] == [1, 2, 3, 4]
    assert calls == [1]  # the second burst found the box non-empty


def test_put_many_waits_for_room_and_loses_nothing() -> None:
    """A burst larger than the box blocks until the consumer makes room, then completes."""
    box: Outbox[int] = Outbox(maxsize=2)
    done = threading.Event()

    def produce() -> None:
        box.put_many(list(range(10)))
        done.set()

    producer = threading.Thread(target=produce)
    producer.start()
    got = []
    while len(got) < 10:
        ok, item = box.get(5.0)
        assert ok, "the producer never made progress"
        got.append(item)
    assert done.wait(5.0)
    producer.join(5.0)
    assert got == list(range(10))


def test_put_many_after_close_is_refused() -> None:
    """Closing wakes a blocked producer, which reports that its items were not taken."""
    box: Outbox[int] = Outbox(maxsize=1)
    result: list[bool] = []
    producer = threading.Thread(target=lambda: result.append(box.put_many([1, 2, 3])))
    producer.start()
    wait_for(lambda: len(box) == 1, timeout=5.0, what="the first item")  # then it blocks
    box.close()
    producer.join(5.0)
    assert result == [False]
    assert box.get(0) == (True, 1)  # what went in before the close is still drained
