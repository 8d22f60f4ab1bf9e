"""Publisher fixtures: a started publisher on ephemeral ports, readiness handshakes, replay.

Everything here is deterministic: endpoints are bound at port 0 and read back, and a
subscriber is known to be connected only once it has received a probe (an empty batch), never
after a sleep. ``python -m kvevents.testing.publisher ENDPOINT COUNT`` runs an out-of-process
subscriber (see :func:`main`).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import select
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import IO, Any, Literal

import msgspec
import zmq

from kvevents._libzmq import Context, Socket
from kvevents._types import Document
from kvevents.config import KVEventsConfig
from kvevents.errors import PublisherError
from kvevents.events import KVEventBatch
from kvevents.publish import Forwarder, PublisherOptions, ZmqPublisher
from kvevents.testing.sockets import Deadline
from kvevents.wire import ReplayMessage, parse_live, parse_replay_reply, replay_request_frames

__all__ = [
    "PausablePublisher",
    "connect_subscriber",
    "connectable",
    "local_config",
    "paused_forwarding",
    "probe_until",
    "read_replay",
    "replay_dealer",
    "request_replay",
    "spawn_subscriber",
    "started_publisher",
    "wait_subscribed",
]


# The test fixture forwards any config keyword.
def local_config(**overrides: Any) -> KVEventsConfig:
    """An enabled config bound on ephemeral loopback ports, replay on; fields overridable."""
    fields: Document = {
        "enable_kv_cache_events": True,
        "endpoint": "tcp://127.0.0.1:0",
        "replay_endpoint": "tcp://127.0.0.1:0",
    }
    fields.update(overrides)
    return KVEventsConfig(**fields)


@contextlib.contextmanager
def started_publisher(
    config: KVEventsConfig | None = None,
    rank: int = 0,
    *,
    world_size: int | None = None,
    options: PublisherOptions | None = None,
    pausable: bool = False,
) -> Iterator[ZmqPublisher]:
    """A started :class:`ZmqPublisher` (default: :func:`local_config`), shut down afterwards.

    ``pausable``: a :class:`PausablePublisher`, for :func:`paused_forwarding`.
    """
    kind = PausablePublisher if pausable else ZmqPublisher
    publisher = kind(config or local_config(), rank, world_size=world_size, options=options)
    publisher.start()
    try:
        yield publisher
    finally:
        publisher.shutdown(timeout=1.0)


def connectable(endpoint: str) -> str:
    """The endpoint a client connects to for a bound one (wildcard hosts become loopback)."""
    for wildcard, loopback in (
        ("tcp://0.0.0.0:", "tcp://127.0.0.1:"),
        ("tcp://[::]:", "tcp://[::1]:"),
    ):
        if endpoint.startswith(wildcard):
            return loopback + endpoint[len(wildcard) :]
    return endpoint


def connect_subscriber(
    context: Context, endpoint: str, topic: bytes = b"", *, rcvhwm: int | None = None
) -> Socket:
    """A SUB socket (linger 0) connected to ``endpoint`` and subscribed to ``topic``."""
    socket: Socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.LINGER, 0)
    if rcvhwm is not None:
        socket.setsockopt(zmq.RCVHWM, rcvhwm)
    if connectable(endpoint).startswith("tcp://["):
        socket.setsockopt(zmq.IPV6, 1)
    socket.setsockopt(zmq.SUBSCRIBE, topic)
    socket.connect(connectable(endpoint))
    return socket


def _probe(publisher: ZmqPublisher) -> int:
    return publisher.publish(KVEventBatch(ts=time.time(), events=[]))


def wait_subscribed(publisher: ZmqPublisher, socket: Socket, timeout: float = 10.0) -> int:
    """Publish probes (empty batches) until ``socket`` receives one; return the last probe's seq.

    Every probe in flight is drained from ``socket``, so the next message it receives is the
    next batch published, with seq ``returned + 1``.
    """
    deadline = Deadline(timeout)
    last = _probe(publisher)
    while not socket.poll(5):
        if deadline.expired:
            raise TimeoutError(f"no probe reached the subscriber within {timeout}s")
        last = _probe(publisher)
    while True:
        if not socket.poll(int(deadline.remaining() * 1000) + 1):
            raise TimeoutError(f"probe seq {last} did not reach the subscriber")
        if parse_live(socket.recv_multipart()).seq >= last:
            return last


def probe_until(publisher: ZmqPublisher, stream: IO[str], timeout: float = 20.0) -> str:
    """Publish probes until ``stream`` (a child's stdout) yields a line; return that line."""
    deadline = Deadline(timeout)
    while not deadline.expired:
        _probe(publisher)
        ready, _, _ = select.select([stream], [], [], 0.005)
        if ready:
            return stream.readline().strip()
    raise TimeoutError(f"the subscriber did not report ready within {timeout}s")


_Command = Literal["run", "pause", "stop"]


class _PausableForwarder(Forwarder):
    """A forwarder whose proxy can be left and re-entered: the queue then fills.

    libzmq's own PAUSE command does not stop forwarding in 4.3.5, so pausing means leaving the
    proxy (``TERMINATE``) with ``command`` set to ``"pause"``, and waiting for :meth:`resume`.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # the test fixture forwards any keyword
        super().__init__(*args, **kwargs)
        self.command: _Command = "stop"
        self.paused = threading.Event()
        self._resume = threading.Event()

    def resume(self, command: _Command = "run") -> None:
        self.command = command
        self._resume.set()

    def prepare_stop(self, linger_ms: int) -> None:
        super().prepare_stop(linger_ms)
        self.resume("stop")

    def _forward(self, *sockets: Socket) -> None:
        while True:
            super()._forward(*sockets)
            if self.command != "pause":
                return
            self._resume.clear()
            if self._stopping():  # asked to stop while the proxy was returning
                return
            self.paused.set()
            self._resume.wait()
            self.paused.clear()
            if self._stopping():
                return

    def _stopping(self) -> bool:
        # Another thread sets the command: a call, so no narrowing from the check above sticks.
        return self.command == "stop"


class PausablePublisher(ZmqPublisher):
    """A :class:`ZmqPublisher` whose forwarding tests can pause (see :func:`paused_forwarding`)."""

    def _new_forwarder(self, context: Context, names: dict[str, str]) -> Forwarder:
        return _PausableForwarder(
            context,
            endpoints=names,
            endpoint=self.endpoints.publish,
            rank=self.rank,
            hwm=self.config.hwm,
            curve=self.options.curve,
        )

    def pause_forwarding(self, timeout: float = 10.0) -> None:
        """Stop moving batches to the PUB socket until :meth:`resume_forwarding`."""
        forwarder = self._pausable()
        if forwarder is None or self._state != "started":
            raise PublisherError(f"publisher for rank {self.rank} is not running")
        forwarder.command = "pause"
        self._send_control(b"TERMINATE")
        if not forwarder.paused.wait(timeout):
            raise PublisherError(f"forwarder of rank {self.rank} did not pause within {timeout}s")
        # libzmq tells the queue's sender of the forwarder's reads lazily (at most every ms
        # or so): until it does, a send can be refused although there is room, and a later
        # one accepted. Reading EVENTS makes the sender take that news now, so that the queue
        # refuses exactly when it is full from here on.
        with self._lock:
            if self._push is not None:
                self._push.getsockopt(zmq.EVENTS)

    def resume_forwarding(self) -> None:
        """Move batches again."""
        forwarder = self._pausable()
        if forwarder is not None:
            forwarder.resume("run")

    def _pausable(self) -> _PausableForwarder | None:
        """The running forwarder (made by :meth:`_new_forwarder`: always pausable)."""
        forwarder = self._forwarder
        assert forwarder is None or isinstance(forwarder, _PausableForwarder)
        return forwarder


@contextlib.contextmanager
def paused_forwarding(publisher: ZmqPublisher) -> Iterator[None]:
    """Hold every accepted batch in the queue (so it fills) until the block exits.

    ``publisher`` must be a :class:`PausablePublisher` (``started_publisher(pausable=True)``).
    """
    if not isinstance(publisher, PausablePublisher):
        raise TypeError(
            "paused_forwarding needs a PausablePublisher (started_publisher(pausable=True))"
        )
    publisher.pause_forwarding()
    try:
        yield
    finally:
        publisher.resume_forwarding()


def replay_dealer(
    context: Context,
    endpoint: str,
    *,
    rcvhwm: int | None = None,
    rcvbuf: int | None = None,
    source: str | None = None,
) -> Socket:
    """A DEALER (linger 0) connected to a replay ``endpoint``.

    ``source``: the local address to connect from (tcp only), e.g. ``127.0.0.2``, so that the
    server sees another peer; ``rcvbuf`` shrinks the kernel's receive buffer, so a client that
    does not read really holds the server's sends back.
    """
    dealer: Socket = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    if rcvhwm is not None:
        dealer.setsockopt(zmq.RCVHWM, rcvhwm)
    if rcvbuf is not None:
        dealer.setsockopt(zmq.RCVBUF, rcvbuf)
    target = connectable(endpoint)
    if target.startswith("tcp://["):
        dealer.setsockopt(zmq.IPV6, 1)
    if source is not None:
        if not target.startswith("tcp://"):
            raise ValueError(f"a source address needs a tcp endpoint, got {endpoint}")
        target = f"tcp://{source}:0;{target[len('tcp://') :]}"
    dealer.connect(target)
    return dealer


def request_replay(
    context: Context,
    endpoint: str,
    start_seq: int,
    *,
    timeout: float = 10.0,
    rcvhwm: int | None = None,
    pause: float = 0.0,
    request: list[bytes] | None = None,
    source: str | None = None,
) -> list[ReplayMessage]:
    """Ask a replay server for ``start_seq`` onwards; every reply message, end marker last.

    ``pause`` sleeps between receives (a slow client); ``request`` overrides the frames sent;
    ``source`` is the local address to connect from (see :func:`replay_dealer`).
    """
    dealer = replay_dealer(context, endpoint, rcvhwm=rcvhwm, source=source)
    try:
        dealer.send_multipart(request if request is not None else replay_request_frames(start_seq))
        return read_replay(dealer, timeout=timeout, pause=pause)
    finally:
        dealer.close(0)


def read_replay(
    dealer: Socket, *, timeout: float = 10.0, pause: float = 0.0
) -> list[ReplayMessage]:
    """Read one whole reply from a DEALER that sent a request: every message, end marker last."""
    deadline = Deadline(timeout)
    replies: list[ReplayMessage] = []
    while True:
        if not dealer.poll(int(deadline.remaining() * 1000) + 1):
            raise TimeoutError(f"replay reply incomplete after {len(replies)} messages")
        replies.append(parse_replay_reply(dealer.recv_multipart()))
        if replies[-1].is_end:
            return replies
        if pause:
            time.sleep(pause)


def spawn_subscriber(
    endpoint: str, count: int, *, idle_timeout: float = 10.0, fast: bool = False
) -> subprocess.Popen[str]:
    """Start ``python -m kvevents.testing.publisher`` reading ``count`` non-empty batches."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvevents.testing.publisher",
            connectable(endpoint),
            str(count),
            "--idle-timeout",
            str(idle_timeout),
            *(["--fast"] if fast else []),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )


_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def main(argv: list[str] | None = None) -> int:
    """Out-of-process subscriber: print ``ready`` at the first message, then a JSON summary.

    Empty batches (probes, heartbeats) are ignored; for the ``COUNT`` non-empty batches it
    reports how many arrived, whether their sequence numbers were dense, and the latency from
    each batch's ``ts`` to its arrival (microseconds, p50 and p99).
    """
    parser = argparse.ArgumentParser(prog="python -m kvevents.testing.publisher")
    parser.add_argument("endpoint")
    parser.add_argument("count", type=int)
    parser.add_argument("--idle-timeout", type=float, default=10.0)
    parser.add_argument(
        "--fast",
        action="store_true",
        help="skip decoding: payloads over 20 bytes count, no latency",
    )
    args = parser.parse_args(argv)
    context: Context = zmq.Context()
    socket = connect_subscriber(context, args.endpoint, rcvhwm=0)
    summary = _collect(socket, args.count, args.idle_timeout, args.fast)
    print(json.dumps(summary), flush=True)
    socket.close(0)
    context.term()
    return 0


def _collect(socket: Socket, count: int, idle_timeout: float, fast: bool = False) -> Document:
    seqs: list[int] = []
    latencies: list[float] = []
    announced = False
    first_at = last_at = 0.0
    while len(seqs) < count and socket.poll(int(idle_timeout * 1000)):
        _topic, seq_frame, payload = socket.recv_multipart()
        now = time.time()
        if not announced:
            print("ready", flush=True)
            announced = True
        if fast:
            if len(payload) <= 20:  # an empty batch (probe or heartbeat) is about 12 bytes
                continue
        else:
            batch = _decoder.decode(payload)
            if not batch.events:
                continue
            latencies.append((now - batch.ts) * 1e6)
        first_at = first_at or now
        last_at = now
        seqs.append(int.from_bytes(seq_frame, "big"))
    dense = all(b == a + 1 for a, b in itertools.pairwise(seqs))
    ordered = sorted(latencies)
    return {
        "received": len(seqs),
        "elapsed_s": last_at - first_at,
        "dense": dense,
        "first": seqs[0] if seqs else None,
        "last": seqs[-1] if seqs else None,
        "latency_p50_us": statistics.median(ordered) if ordered else None,
        "latency_p99_us": ordered[int(0.99 * (len(ordered) - 1))] if ordered else None,
    }


if __name__ == "__main__":
    raise SystemExit(main())
