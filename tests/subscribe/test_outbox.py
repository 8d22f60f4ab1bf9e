"""The hand-off between the subscriber's I/O thread and its consumers."""

from __future__ import annotations

import threading

from kvevents.subscribe._outbox import Outbox
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


def test_a_burst_larger_than_the_box_wakes_an_event_loop_consumer() -> None:
    """A listener-woken (asyncio-style) consumer is woken while the producer waits for room."""
    box: Outbox[int] = Outbox(maxsize=2)
    woken = threading.Event()
    box.listener = woken.set
    producer = threading.Thread(target=lambda: box.put_many(list(range(6))), daemon=True)
    producer.start()
    got: list[int] = []
    try:
        while len(got) < 6:
            assert woken.wait(5.0), "the consumer was never woken: the burst would deadlock"
            woken.clear()
            while (item := box.get(0))[0]:
                got.append(item[1])  # type: ignore[arg-type]
    finally:
        box.close()  # releases a producer stuck on a full box
        producer.join(5.0)
    assert got == list(range(6))
