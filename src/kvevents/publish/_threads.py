"""The two threads behind a ZeroMQ publisher, each owning its sockets.

The forwarder runs ``zmq.proxy_steerable`` in C with the GIL released: it moves every queued
message from the inproc frontend to the PUB socket, copying each part to the capture pipe
*before* the PUB socket. Delivery therefore never waits for a Python thread to get the GIL,
however busy the engine thread is.

The service thread is plain Python: it drains the capture pipe (counting what was published
and filling the replay ring), serves replay requests and sends heartbeats. It may lag behind
the live stream; nothing live depends on it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import zmq

from kvevents._libzmq import Context, Socket
from kvevents.errors import BindError, PublisherError
from kvevents.publish._replay import ReplayLimits, ReplayRing, ReplayServer
from kvevents.security import CurveServer, HandshakeWatch, apply_server, monitor
from kvevents.wire import parse_endpoint

__all__ = ["Forwarder", "Ready", "Service", "bind"]

# A replay client blocked on a full pipe is retried after this long (ROUTER's POLLOUT fires
# for any writable peer, so it cannot tell us when *this* client has room).
_BLOCKED_RETRY_MS = 1
# Messages queued per replay client. Resumable non-blocking sends (ROUTER_MANDATORY) do the
# flow control, so the pipe need not hold a whole reply; each queued message is a copy of a
# buffered payload, so a deep pipe per slow client would multiply the ring's memory.
_REPLAY_SNDHWM = 1000
# The largest frame a replay client may send (a request is at most two frames of 8 bytes; with
# CURVE the handshake's frames are a few hundred bytes). A bigger one closes the connection in
# libzmq before any memory is spent on it, so nobody can make the server buffer a huge frame.
_REPLAY_MAXMSGSIZE = 4096
# How often the capture pipe is drained into the ring and the counters when nothing else
# wakes the thread (a replay request drains it first anyway).
_DRAIN_INTERVAL_MS = 10
# Capture messages drained per turn, so a burst never delays a replay request for long.
_DRAIN_LIMIT = 4096


class Ready:
    """A start-up handshake: the thread reports its bound endpoint or the error it hit."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.endpoint: str | None = None
        self.error: BaseException | None = None

    def succeed(self, endpoint: str | None) -> None:
        self.endpoint = endpoint
        self._event.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._event.set()

    def wait(self, timeout: float, what: str) -> str | None:
        """The endpoint, or re-raise the thread's error in the caller."""
        if not self._event.wait(timeout):
            raise PublisherError(f"{what} did not start within {timeout}s")
        if self.error is not None:
            raise self.error
        return self.endpoint


def bind(socket: Socket, endpoint: str, *, rank: int, role: str) -> str:
    """Bind (never connect), with the IPv6 option for ``[addr]`` hosts; the bound endpoint."""
    if parse_endpoint(endpoint).is_ipv6:
        socket.setsockopt(zmq.IPV6, 1)
    try:
        socket.bind(endpoint)
    except zmq.ZMQError as exc:
        text = zmq.strerror(exc.errno) if exc.errno is not None else str(exc)
        reason = text[:1].lower() + text[1:]
        raise BindError(
            f"cannot bind {endpoint} for rank {rank} ({role}): {reason}",
            endpoint=endpoint,
            rank=rank,
            role=role,
        ) from exc
    return socket.getsockopt_string(zmq.LAST_ENDPOINT)


class Forwarder(threading.Thread):
    """Owns the frontend, the PUB socket, the capture sender and the proxy's control socket.

    The proxy returns when the publisher sends ``TERMINATE`` on the control socket; the PUB
    socket then closes with ``close_linger_ms`` (set by :meth:`prepare_stop`) as its linger.
    """

    def __init__(
        self,
        context: Context,
        *,
        endpoints: dict[str, str],
        endpoint: str,
        rank: int,
        hwm: int,
        curve: CurveServer | None = None,
    ) -> None:
        super().__init__(name=f"kvevents-forwarder-r{rank}", daemon=True)
        self._curve = curve
        self._context = context
        self._endpoints = endpoints
        self._endpoint = endpoint
        self._rank = rank
        self._hwm = hwm
        self.ready = Ready()
        self.close_linger_ms = 0

    def prepare_stop(self, linger_ms: int) -> None:
        """Called before ``TERMINATE``: the PUB socket's linger when the proxy returns."""
        self.close_linger_ms = linger_ms

    def run(self) -> None:
        sockets: list[Socket] = []
        try:
            frontend, pub, capture, control = self._open(sockets)
        except BaseException as exc:
            for socket in sockets:
                socket.close(0)
            self.ready.fail(exc)
            return
        self.ready.succeed(pub.getsockopt_string(zmq.LAST_ENDPOINT))
        try:
            self._forward(frontend, pub, capture, control)
        finally:
            pub.setsockopt(zmq.LINGER, self.close_linger_ms)
            for socket in sockets:
                socket.close()

    def _open(self, sockets: list[Socket]) -> tuple[Socket, ...]:
        frontend = self._socket(sockets, zmq.PULL)
        # The queue's capacity is the sender's SNDHWM plus this RCVHWM (inproc adds them).
        frontend.setsockopt(zmq.RCVHWM, 1)
        frontend.bind(self._endpoints["frontend"])
        pub = self._socket(sockets, zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, self._hwm)
        if self._curve is not None:
            apply_server(pub, self._curve)
            monitor(pub, self._endpoints["monitor-publish"])
        bind(pub, self._endpoint, rank=self._rank, role="publish")
        capture = self._socket(sockets, zmq.PUSH)
        # Unbounded: the proxy blocks on a full capture pipe, and that would stall live delivery.
        capture.setsockopt(zmq.SNDHWM, 0)
        capture.connect(self._endpoints["capture"])
        control = self._socket(sockets, zmq.PAIR)
        control.bind(self._endpoints["control"])
        return frontend, pub, capture, control

    def _socket(self, sockets: list[Socket], kind: int) -> Socket:
        socket: Socket = self._context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        sockets.append(socket)
        return socket

    def _forward(self, *sockets: Socket) -> None:
        """Run the proxy until ``TERMINATE`` (a subclass may re-enter it)."""
        frontend, pub, capture, control = sockets
        zmq.proxy_steerable(frontend, pub, capture, control)


class Service(threading.Thread):
    """Owns the capture receiver, the replay ROUTER and a wake-up socket.

    ``heartbeat`` publishes an empty batch through the ordinary publish path;
    ``last_activity`` returns the monotonic time of the last publish.
    """

    def __init__(
        self,
        context: Context,
        *,
        endpoints: dict[str, str],
        replay_endpoint: str | None,
        rank: int,
        topic: bytes,
        ring: ReplayRing | None,
        limits: ReplayLimits,
        heartbeat_interval: float | None,
        heartbeat: Callable[[], None],
        last_activity: Callable[[], float],
        curve: CurveServer | None = None,
    ) -> None:
        super().__init__(name=f"kvevents-service-r{rank}", daemon=True)
        self._curve = curve
        # Refused handshakes are counted only with CURVE: the plain path stays untouched.
        self.handshakes = HandshakeWatch(rank) if curve is not None else None
        self._context = context
        self._endpoints = endpoints
        self._replay_endpoint = replay_endpoint
        self._rank = rank
        self._topic = topic
        self.ring = ring
        self._limits = limits
        self._heartbeat_interval = heartbeat_interval
        self._heartbeat = heartbeat
        self._last_activity = last_activity
        self.ready = Ready()
        self.server: ReplayServer | None = None
        self.published = 0
        self.bytes_sent = 0
        self._flushed = threading.Condition()
        self._capture: Socket | None = None

    def wait_published(self, target: int, timeout: float) -> bool:
        """Wait until ``target`` batches went through the proxy; False on timeout."""
        with self._flushed:
            return self._flushed.wait_for(lambda: self.published >= target, timeout)

    def run(self) -> None:
        sockets: list[Socket] = []
        try:
            capture, wake, router = self._open(sockets)
        except BaseException as exc:
            for socket in sockets:
                socket.close(0)
            self.ready.fail(exc)
            return
        self.ready.succeed(router.getsockopt_string(zmq.LAST_ENDPOINT) if router else None)
        try:
            self._loop(capture, wake, router)
        finally:
            self._drain(limit=None)
            if self.handshakes is not None:
                self.handshakes.close()
            for socket in sockets:
                socket.close(0)

    def _open(self, sockets: list[Socket]) -> tuple[Socket, Socket, Socket | None]:
        capture = self._socket(sockets, zmq.PULL)
        capture.setsockopt(zmq.RCVHWM, 0)
        capture.bind(self._endpoints["capture"])
        self._capture = capture
        wake = self._socket(sockets, zmq.PAIR)
        wake.bind(self._endpoints["wake"])
        if self.handshakes is not None:
            self.handshakes.attach(self._context, self._endpoints["monitor-publish"], "publish")
        if self._replay_endpoint is None or self.ring is None:
            return capture, wake, None
        router = self._socket(sockets, zmq.ROUTER)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.SNDHWM, _REPLAY_SNDHWM)
        router.setsockopt(zmq.MAXMSGSIZE, _REPLAY_MAXMSGSIZE)
        if self.handshakes is not None:
            apply_server(router, self._curve)
            monitor(router, self._endpoints["monitor-replay"])
            self.handshakes.attach(self._context, self._endpoints["monitor-replay"], "replay")
        bind(router, self._replay_endpoint, rank=self._rank, role="replay")
        self.server = ReplayServer(
            router, self.ring, self._topic, self._limits, before_snapshot=self._drain_all
        )
        return capture, wake, router

    def _socket(self, sockets: list[Socket], kind: int) -> Socket:
        socket: Socket = self._context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        sockets.append(socket)
        return socket

    def _loop(self, capture: Socket, wake: Socket, router: Socket | None) -> None:
        poller = zmq.Poller()
        # The capture pipe is drained on a timer, not per message: each wake-up would make this
        # thread compete with the engine's thread for the GIL, a thousand times a second.
        poller.register(wake, zmq.POLLIN)
        if router is not None:
            poller.register(router, zmq.POLLIN)
        for sock in self.handshakes.sockets if self.handshakes is not None else ():
            poller.register(sock, zmq.POLLIN)
        progressed = False
        while True:
            ready = dict(poller.poll(self._timeout_ms(progressed)))
            self._drain()
            if wake in ready and wake.recv() == b"stop":
                return
            self._count_handshakes(ready)
            if self.server is not None:
                # A flood is read a bite at a time, with a drain of the capture pipe (the ring)
                # before each bite; the router stays readable, so the next poll does not wait.
                if router in ready:
                    self.server.accept_requests()
                progressed = self.server.pump() if self.server.busy else False
            self._maybe_heartbeat()

    def _count_handshakes(self, ready: dict[Socket, int]) -> None:
        if self.handshakes is not None:
            for sock in self.handshakes.sockets:
                if sock in ready:
                    self.handshakes.handle(sock)

    def _timeout_ms(self, progressed: bool) -> int:
        if self.server is not None and self.server.busy:
            return 0 if progressed else _BLOCKED_RETRY_MS
        if self._heartbeat_interval is None:
            return _DRAIN_INTERVAL_MS
        due = self._last_activity() + self._heartbeat_interval - time.monotonic()
        return min(_DRAIN_INTERVAL_MS, max(0, int(due * 1000) + 1))

    def _maybe_heartbeat(self) -> None:
        interval = self._heartbeat_interval
        if interval is not None and time.monotonic() - self._last_activity() >= interval:
            self._heartbeat()

    def _drain_all(self) -> None:
        # Before a replay snapshot: every batch a subscriber may have seen live is in the
        # capture pipe already (the proxy copies each part there before the PUB socket).
        self._drain(limit=None)

    def _drain(self, limit: int | None = _DRAIN_LIMIT) -> None:
        capture = self._capture
        if capture is None:
            return
        drained = 0
        while limit is None or drained < limit:
            try:
                topic, seq_frame, payload = capture.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            drained += 1
            self.bytes_sent += len(topic) + len(seq_frame) + len(payload)
            if self.ring is not None:
                self.ring.append(int.from_bytes(seq_frame, "big"), seq_frame, payload)
        if drained:
            with self._flushed:
                self.published += drained
                self._flushed.notify_all()
