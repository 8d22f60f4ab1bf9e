"""Fault injection between real publishers and a real subscriber: a lossy relay.

A :class:`DropRule` decides, from a seed and a stream's sequence numbers alone, which live
messages are lost, so a run with drops is reproducible. A :class:`LossyRelay` puts the rule on
the network: one background thread owns a SUB socket per upstream publisher and a PUB socket
per stream bound on an ephemeral loopback port, and forwards every live message except the
ones the rule drops. Subscribers connect to the relay for live messages and straight to the
publisher for replays, exactly like a consumer behind a lossy network: what is dropped stays
in the publisher's replay ring and comes back through a replay.

Only the relay imports ``zmq``; the rule is pure and tested without sockets.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

import xxhash
import zmq

from kvevents._libzmq import Context, Socket
from kvevents.events import StreamKey
from kvevents.wire import unpack_seq

__all__ = ["DropRule", "LossyRelay", "RelayStats"]


@dataclass
class DropRule:
    """Drop a seeded, deterministic fraction ``rate`` of each stream's live messages.

    Disarmed, it drops nothing (handshake probes must pass). :meth:`arm` records, per stream,
    the first sequence number the rule applies to, and decisions depend only on the seed, the
    stream and the distance from that number: runs with the same seed drop the same batches.
    """

    rate: float = 0.0
    seed: int = 0
    _base: dict[StreamKey, int] = field(default_factory=dict, repr=False)
    _armed: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate < 1.0:
            raise ValueError(f"drop rate must be in [0, 1), got {self.rate}")

    def arm(self, next_seqs: dict[StreamKey, int]) -> None:
        """Apply from now on; ``next_seqs`` is each stream's next sequence number."""
        self._base = dict(next_seqs)
        self._armed = True

    def drops(self, key: StreamKey, seq: int) -> bool:
        """Whether live message ``seq`` of stream ``key`` is lost."""
        if not self._armed or self.rate <= 0.0:
            return False
        base = self._base.get(key)
        if base is None or seq < base:
            return False
        name = f"{self.seed}/{key[0]}/{key[1]}/{seq - base}".encode()
        return xxhash.xxh64_intdigest(name) < self.rate * 2**64


@dataclass(frozen=True)
class RelayStats:
    """Live messages the relay forwarded and dropped, over every stream."""

    forwarded: int
    dropped: int


class LossyRelay:
    """Forwards live messages from publishers to subscribers, dropping what the rule says.

    ``upstreams`` maps a stream key to its publisher's bound live endpoint. After
    :meth:`start`, :attr:`endpoints` maps each key to the relay's own bound endpoint.
    """

    def __init__(self, upstreams: dict[StreamKey, str], rule: DropRule) -> None:
        self.rule = rule
        self.endpoints: dict[StreamKey, str] = {}
        self._upstreams = dict(upstreams)
        self._context: Context = zmq.Context.instance()
        self._stop_endpoint = f"inproc://kvevents-relay-stop-{id(self)}"
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._failure: list[BaseException] = []
        self._forwarded = 0
        self._dropped = 0

    def start(self, timeout: float = 10.0) -> None:
        """Bind and connect in the relay thread; re-raise its failure here."""
        self._thread = threading.Thread(target=self._run, name="kvevents-relay", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"lossy relay not ready after {timeout}s")
        if self._failure:
            raise self._failure[0]

    def close(self) -> None:
        """Stop the thread; its sockets close with linger 0."""
        if self._thread is None:
            return
        stop = self._context.socket(zmq.PAIR)
        stop.linger = 0
        try:
            stop.connect(self._stop_endpoint)
            stop.send(b"")
        finally:
            stop.close()
        self._thread.join()
        self._thread = None

    def stats(self) -> RelayStats:
        return RelayStats(self._forwarded, self._dropped)

    def _run(self) -> None:
        sockets: list[Socket] = []
        try:
            stop = self._context.socket(zmq.PAIR)
            sockets.append(stop)
            stop.bind(self._stop_endpoint)
            routes = self._open(sockets)
        except BaseException as exc:
            self._failure.append(exc)
            self._ready.set()
            _close_all(sockets)
            return
        self._ready.set()
        try:
            self._forward(stop, routes)
        finally:
            _close_all(sockets)

    def _open(self, sockets: list[Socket]) -> dict[Socket, tuple[StreamKey, Socket]]:
        routes = {}
        for key, upstream in self._upstreams.items():
            sub = self._context.socket(zmq.SUB)
            pub = self._context.socket(zmq.PUB)
            sockets += [sub, pub]
            for sock in (sub, pub):
                sock.linger = 0
                sock.rcvhwm = sock.sndhwm = 0  # a relay that dropped on its own would lie
            sub.subscribe(b"")
            sub.connect(upstream)
            pub.bind("tcp://127.0.0.1:0")
            self.endpoints[key] = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            routes[sub] = (key, pub)
        return routes

    def _forward(
        self,
        stop: Socket,
        routes: dict[Socket, tuple[StreamKey, Socket]],
    ) -> None:
        poller = zmq.Poller()
        poller.register(stop, zmq.POLLIN)
        for sub in routes:
            poller.register(sub, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if stop in ready:
                return
            for sub in ready:
                key, pub = routes[sub]
                self._pass(sub, key, pub)

    def _pass(self, sub: Socket, key: StreamKey, pub: Socket) -> None:
        while True:
            try:
                frames = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if (
                len(frames) == 3
                and len(frames[1]) == 8
                and self.rule.drops(key, unpack_seq(frames[1]))
            ):
                self._dropped += 1
                continue
            pub.send_multipart(frames)
            self._forwarded += 1


def _close_all(sockets: Iterable[Socket]) -> None:
    for sock in sockets:
        sock.close(linger=0)
