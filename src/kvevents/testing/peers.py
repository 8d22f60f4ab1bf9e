"""Fault injection for subscribers: a scriptable raw publisher and a collecting consumer.

:class:`RawPublisher` speaks the exact wire contract (WIRE.md sections 2 and 3) with plain
pyzmq: a PUB socket, plus an optional ROUTER replay server on its own thread. The test decides
every sequence number and every fault: drop chosen live messages (they stay in the replay
ring, like a batch lost on the network), send duplicates, restart the counter at 0, answer
replays in 3 frames, forget the oldest batches (a trimmed ring), never answer, or answer
slowly. The PUB socket belongs to the thread that created the publisher.

Engine-shaped payloads to feed it are in :mod:`kvevents.testing.fixtures`.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import zmq

from kvevents.events import KVEventBatch, StreamKey
from kvevents.subscribe import Delivery, StreamReset, StreamStatus
from kvevents.testing.fixtures import heartbeat
from kvevents.testing.sockets import unique_inproc
from kvevents.wire import (
    decode_batch,
    encode_batch,
    live_frames,
    pack_seq,
    parse_replay_request,
    replay_end_frames,
)

if TYPE_CHECKING:
    from kvevents.subscribe import Subscriber

__all__ = ["Collector", "RawPublisher", "ReplayBehaviour"]


@dataclass
class ReplayBehaviour:
    """How the replay server answers; change the fields at any time.

    ``answer``: False never answers (requests are still recorded). ``reply_frames``: 4, or 3
    like vLLM up to 0.25. ``delay``: seconds slept before each replayed message. ``end``:
    False omits the end marker.
    """

    answer: bool = True
    reply_frames: int = 4
    delay: float = 0.0
    end: bool = True


@dataclass
class _Ring:
    capacity: int
    items: OrderedDict[int, bytes] = field(default_factory=OrderedDict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, seq: int, payload: bytes) -> None:
        with self.lock:
            self.items[seq] = payload
            while len(self.items) > self.capacity:
                self.items.popitem(last=False)

    def since(self, start: int) -> list[tuple[int, bytes]]:
        with self.lock:
            return [(s, p) for s, p in self.items.items() if s >= start]

    def forget_before(self, seq: int) -> None:
        with self.lock:
            for old in [s for s in self.items if s < seq]:
                del self.items[old]

    def clear(self) -> None:
        with self.lock:
            self.items.clear()


class RawPublisher:
    """A publisher the test scripts message by message; see the module docstring.

    ``published`` records ``(seq, payload)`` of every batch of the current incarnation in
    order (dropped ones included), which is what a subscriber should end up delivering.
    """

    def __init__(
        self,
        *,
        topic: str = "",
        replay: bool = True,
        ring_size: int = 10_000,
        host: str = "127.0.0.1",
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        self.topic = topic.encode()
        self.behaviour = ReplayBehaviour()
        self.requests: list[int] = []
        self.published: list[tuple[int, bytes]] = []
        self._ctx = context or zmq.Context.instance()
        self._ring = _Ring(ring_size)
        self._next = 0
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 0)
        self._pub.bind(f"tcp://{host}:0")
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopper: zmq.Socket[bytes] | None = None
        if replay:
            self._start_replay(host)

    # ------------------------------------------------------------------ live side

    @property
    def next_seq(self) -> int:
        """The sequence the next :meth:`publish` uses."""
        return self._next

    def publish(self, batch: KVEventBatch | bytes, *, drop: bool = False) -> int:
        """Publish the next batch (``drop``: keep it for replay but never send it live)."""
        payload = batch if isinstance(batch, bytes) else encode_batch(batch)
        seq = self._next
        self._next += 1
        self._ring.add(seq, payload)
        self.published.append((seq, payload))
        if not drop:
            self._pub.send_multipart(live_frames(self.topic, seq, payload))
        return seq

    def send_raw(self, frames: list[bytes]) -> None:
        """Send arbitrary frames on the PUB socket (malformed messages, end markers...)."""
        self._pub.send_multipart(frames)

    def duplicate(self, seq: int) -> None:
        """Send an already published batch live again."""
        payload = dict(self.published)[seq]
        self._pub.send_multipart(live_frames(self.topic, seq, payload))

    def restart(self) -> None:
        """Behave like a fresh process on the same endpoints: seq back to 0, ring empty."""
        self._next = 0
        self._ring.clear()
        self.published = []

    def forget_before(self, seq: int) -> None:
        """Trim the replay ring: batches below ``seq`` can no longer be replayed."""
        self._ring.forget_before(seq)

    def close(self) -> None:
        """Stop the replay thread and close both sockets."""
        self._stop.set()
        if self._thread is not None and self._stopper is not None:
            self._stopper.send(b"")
            self._thread.join(timeout=5)
            self._stopper.close(linger=0)
        self._pub.close(linger=0)

    def __enter__(self) -> RawPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ replay side

    def _start_replay(self, host: str) -> None:
        ready: list[str] = []
        started = threading.Event()
        control = unique_inproc("raw-replay-stop")
        self._stopper = self._ctx.socket(zmq.PAIR)
        self._stopper.setsockopt(zmq.LINGER, 0)
        self._stopper.bind(control)
        self._thread = threading.Thread(
            target=self._serve, args=(host, control, ready, started), name="raw-replay", daemon=True
        )
        self._thread.start()
        if not started.wait(10) or not ready:
            raise RuntimeError("raw replay server did not start")
        self.replay_endpoint = ready[0]

    def _serve(self, host: str, control: str, ready: list[str], started: threading.Event) -> None:
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.SNDHWM, 0)  # a whole reply must fit (WIRE.md section 3)
        router.bind(f"tcp://{host}:0")
        stop = self._ctx.socket(zmq.PAIR)
        stop.setsockopt(zmq.LINGER, 0)
        stop.connect(control)
        ready.append(router.getsockopt_string(zmq.LAST_ENDPOINT))
        started.set()
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(stop, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if router in dict(poller.poll()):
                    identity, *rest = router.recv_multipart()
                    self._answer(router, identity, rest)
        finally:
            router.close(linger=0)
            stop.close(linger=0)

    def _answer(self, router: zmq.Socket[bytes], identity: bytes, rest: list[bytes]) -> None:
        start = parse_replay_request(rest)
        self.requests.append(start)
        how = self.behaviour
        if not how.answer:
            return
        for seq, payload in self._ring.since(start):
            if how.delay:
                time.sleep(how.delay)
            if self._stop.is_set():
                return
            head = [identity, b""] if how.reply_frames == 3 else [identity, b"", self.topic]
            router.send_multipart([*head, pack_seq(seq), payload])
        if how.end:
            router.send_multipart([identity, *replay_end_frames()])


# ---------------------------------------------------------------------- consuming side


class Collector:
    """Drains a subscriber the way a consumer would, for assertions after quiescence.

    Per stream it keeps ``(seq, batch)`` in delivery order and drops them on a
    :class:`~kvevents.subscribe.StreamReset`, exactly as an index must; ``resets`` and
    ``statuses`` keep what was reported.
    """

    def __init__(self, subscriber: Subscriber) -> None:
        self.subscriber = subscriber
        self.delivered: dict[StreamKey, list[tuple[int, KVEventBatch]]] = {}
        self.resets: list[StreamReset] = []
        self.statuses: list[StreamStatus] = []

    def pump(self, timeout: float = 0.01) -> int:
        """Take every waiting item (waiting up to ``timeout`` for the first); how many."""
        count = 0
        item = self.subscriber.get(timeout)
        while item is not None:
            count += 1
            self._take(item)
            item = self.subscriber.get_nowait()
        return count

    def _take(self, item: Delivery | StreamReset | StreamStatus) -> None:
        if isinstance(item, Delivery):
            self.delivered.setdefault(item.stream.key, []).append((item.seq, item.batch))
        elif isinstance(item, StreamReset):
            self.resets.append(item)
            self.delivered.pop(item.stream.key, None)
        else:
            self.statuses.append(item)

    def seqs(self, key: StreamKey) -> list[int]:
        """Delivered sequence numbers of one stream since its last reset."""
        return [seq for seq, _ in self.delivered.get(key, [])]

    def wait(
        self, predicate: Callable[[Collector], object], timeout: float = 10.0, what: str = ""
    ) -> None:
        """Pump until ``predicate(self)`` holds; TimeoutError naming ``what`` otherwise."""
        deadline = time.monotonic() + timeout
        while not predicate(self):
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout}s waiting for {what or predicate}")
            self.pump()

    def handshake(self, publisher: RawPublisher, key: StreamKey, timeout: float = 10.0) -> None:
        """Publish heartbeats until ``key`` delivered one: the SUB is connected (slow joiner)."""
        deadline = time.monotonic() + timeout
        while not self.delivered.get(key):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no delivery from {key} after {timeout}s of probes")
            publisher.publish(heartbeat())
            self.pump(0.02)

    def caught_up(self, publisher: RawPublisher, key: StreamKey) -> bool:
        """True when ``key`` delivered up to the publisher's last sequence."""
        return self.seqs(key)[-1:] == [publisher.next_seq - 1]

    def matches(self, publisher: RawPublisher, key: StreamKey) -> bool:
        """True when the stream delivered exactly what ``publisher`` published, in order."""
        got = self.delivered.get(key, [])
        want = [(seq, decode_batch(payload).batch) for seq, payload in publisher.published]
        return got == want
