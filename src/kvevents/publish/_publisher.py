"""The engine-side publisher (WIRE.md sections 2, 3, 5 and 6).

``create_publisher(config, rank)`` returns a :class:`NullPublisher` when events are off, else a
:class:`ZmqPublisher` for that attention-DP rank. See ``docs/publisher.md``.

How a batch travels: ``publish()`` encodes it on the caller's thread (msgspec, microseconds),
allocates its sequence number and hands the three frames, non-blocking, to an inproc queue. A
forwarder thread running ``zmq.proxy_steerable`` in C, without the GIL, moves them to the PUB
socket, so delivery does not wait for any Python thread however busy the engine keeps the GIL.
The proxy copies every message to a capture pipe that a Python service thread drains into the
replay ring and the counters; that thread also serves replays and sends heartbeats.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Literal

import msgspec
import zmq

from kvevents._libzmq import Context, Send3, Socket
from kvevents.config import KVEventsConfig, RankEndpoints, check_layout, rank_endpoints
from kvevents.errors import DecodeError, LayoutError, PublisherClosed, PublisherError
from kvevents.events import Event, KVEventBatch
from kvevents.publish._carry import RemovalCarry
from kvevents.publish._records import PublisherOptions, PublisherStats, ShutdownReport
from kvevents.publish._replay import ReplayRing
from kvevents.publish._send import release_payloads, send3_for
from kvevents.publish._threads import Forwarder, Service
from kvevents.ratelimit import RateLimitedWarning
from kvevents.security import start_authenticator
from kvevents.wire import decode_batch, encode_batch, pack_seq

if TYPE_CHECKING:
    from zmq.auth.thread import ThreadAuthenticator

__all__ = [
    "NullPublisher",
    "Publisher",
    "PublisherOptions",
    "PublisherStats",
    "ShutdownReport",
    "ZmqPublisher",
    "create_publisher",
]

logger = logging.getLogger("kvevents.publish.publisher")
_names = itertools.count()
_JOIN_TIMEOUT = 10.0

#: A publisher's life: ``start()`` goes from new to started, ``shutdown()`` to closed (final).
PublisherState = Literal["new", "started", "closed"]


#: Why a batch was dropped before it reached the queue (each a ``dropped_*`` counter).
DropCause = Literal["queue_full", "encode_error", "send_error"]


@dataclasses.dataclass(slots=True)
class _SendCounts:
    """The caller side's running counters (each documented on :class:`PublisherStats`), under
    the publisher's lock: mutable fields, so that a counter's name is checked by mypy."""

    enqueued: int = 0
    dropped_queue_full: int = 0
    dropped_encode_error: int = 0
    dropped_send_error: int = 0


class Publisher(abc.ABC):
    """What an engine needs: ``start``, ``publish``, ``stats``, ``shutdown``; a context manager."""

    rank: int
    endpoint: str | None = None
    replay_endpoint: str | None = None

    @abc.abstractmethod
    def start(self) -> None:
        """Bind the sockets (idempotent)."""

    @abc.abstractmethod
    def publish(self, batch: KVEventBatch) -> int | None:
        """Queue a batch without blocking; its sequence number (None for the null publisher)."""

    @abc.abstractmethod
    def stats(self) -> PublisherStats:
        """A snapshot of the counters."""

    @abc.abstractmethod
    def shutdown(self, timeout: float | None = None) -> ShutdownReport:
        """Publish what is queued, flush within the linger, close (idempotent)."""

    def __enter__(self) -> Publisher:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()


class NullPublisher(Publisher):
    """Discards every batch: what ``create_publisher`` returns when events are off."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank

    def start(self) -> None:
        """Nothing to bind."""

    def publish(self, batch: KVEventBatch) -> None:
        """Discard the batch."""
        return None

    def stats(self) -> PublisherStats:
        """All zeros."""
        return PublisherStats()

    def shutdown(self, timeout: float | None = None) -> ShutdownReport:
        """Nothing to flush."""
        return ShutdownReport(0, 0, True, 0.0, PublisherStats())


def create_publisher(
    config: KVEventsConfig,
    rank: int = 0,
    *,
    world_size: int | None = None,
    options: PublisherOptions | None = None,
) -> Publisher:
    """The publisher ``config`` asks for, for attention-DP rank ``rank`` of ``world_size``.

    Checks the whole endpoint layout (every rank fails the same way) but creates no socket:
    call ``start()`` or use it as a context manager. Without ``world_size`` (engines whose
    factories pass only a rank) the layout is checked for ranks ``0..rank``, all that is known.
    """
    if not config.publishing:
        return NullPublisher(rank)
    return ZmqPublisher(config, rank, world_size=world_size, options=options)


class ZmqPublisher(Publisher):
    """Publishes one rank's batches on a PUB socket, with a replay ROUTER when configured."""

    def __init__(
        self,
        config: KVEventsConfig,
        rank: int = 0,
        *,
        world_size: int | None = None,
        options: PublisherOptions | None = None,
    ) -> None:
        _check_rank(config, rank, world_size)
        check_layout(config, rank + 1 if world_size is None else world_size)
        self.config = config
        self.rank = rank
        self.endpoints: RankEndpoints = rank_endpoints(config, rank)
        self.options = options or PublisherOptions()
        self._topic = config.topic.encode()
        self._lock = threading.Lock()  # guards the queue socket, seq and caller-side counters
        self._state_lock = threading.Lock()
        self._control_lock = threading.Lock()
        self._state: PublisherState = "new"
        self._accepting = True
        self._report: ShutdownReport | None = None
        self._counts = _SendCounts()
        self._carried_events = 0
        self._heartbeats = 0
        self._next_seq = 0
        self._last_activity = time.monotonic()
        self._carry = RemovalCarry()
        self._warn = RateLimitedWarning(logger)
        self._context: Context | None = None
        self._push: Socket | None = None
        self._send3: Send3 | None = None
        self._control: Socket | None = None
        self._wake: Socket | None = None
        self._forwarder: Forwarder | None = None
        self._service: Service | None = None
        self._authenticator: ThreadAuthenticator | None = None

    def __repr__(self) -> str:
        return f"<ZmqPublisher rank={self.rank} {self.endpoint or self.endpoints.publish} {self._state}>"

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Bind the PUB (and replay) sockets in their threads; re-raise a ``BindError`` here."""
        with self._state_lock:
            if self._state == "started":
                return
            if self._state == "closed":
                raise PublisherClosed(f"publisher for rank {self.rank} was shut down")
            try:
                self._open()
            except BaseException:
                self._teardown(linger_ms=0)
                self.endpoint = self.replay_endpoint = None
                raise
            self._state = "started"

    def _open(self) -> None:
        context: Context = zmq.Context()
        self._context = context
        base = f"inproc://kvevents-pub-{os.getpid()}-{next(_names)}"
        roles = ("frontend", "capture", "control", "wake", "monitor-publish", "monitor-replay")
        names = {role: f"{base}-{role}" for role in roles}
        # The ZAP handler must answer before the first CURVE socket binds.
        self._authenticator = start_authenticator(context, self.options.curve)
        self._control = self._caller_socket(zmq.PAIR, names["control"])
        self._wake = self._caller_socket(zmq.PAIR, names["wake"])
        self._service = self._new_service(context, names)
        self._service.start()
        self.replay_endpoint = self._service.ready.wait(
            self.options.start_timeout, "replay service"
        )
        self._forwarder = self._new_forwarder(context, names)
        self._forwarder.start()
        self.endpoint = self._forwarder.ready.wait(self.options.start_timeout, "forwarder")
        push = self._caller_socket(zmq.PUSH, None)
        # With the frontend's RCVHWM of 1, exactly max_queue_size batches can wait.
        push.setsockopt(zmq.SNDHWM, max(1, self.config.max_queue_size - 1))
        push.connect(names["frontend"])
        self._push = push
        self._send3 = send3_for(push)

    def _caller_socket(self, kind: int, connect: str | None) -> Socket:
        assert self._context is not None
        socket: Socket = self._context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        if connect is not None:
            socket.connect(connect)
        return socket

    def _new_forwarder(self, context: Context, names: dict[str, str]) -> Forwarder:
        return Forwarder(
            context,
            endpoints=names,
            endpoint=self.endpoints.publish,
            rank=self.rank,
            hwm=self.config.hwm,
            curve=self.options.curve,
        )

    def _new_service(self, context: Context, names: dict[str, str]) -> Service:
        ring = None
        if self.endpoints.replay is not None:
            ring = ReplayRing(self.config.buffer_steps, self.options.replay_buffer_bytes)
        return Service(
            context,
            endpoints=names,
            replay_endpoint=self.endpoints.replay,
            rank=self.rank,
            topic=self._topic,
            ring=ring,
            limits=self.options.replay_limits(),
            heartbeat_interval=self.options.heartbeat_interval,
            heartbeat=self._send_heartbeat,
            last_activity=lambda: self._last_activity,
            curve=self.options.curve,
        )

    def shutdown(self, timeout: float | None = None) -> ShutdownReport:
        """Stop accepting, publish what is queued within ``timeout`` (default: the linger).

        Later ``publish()`` calls raise :class:`PublisherClosed`. Never raises because the
        queue is full; what could not be delivered is in the report.
        """
        with self._state_lock:
            if self._report is not None:
                return self._report
            began = time.monotonic()
            if self._state == "new":
                self._state = "closed"
                self._report = ShutdownReport(0, 0, True, 0.0, self.stats())
                return self._report
            self._report = self._close(began, self.options.linger if timeout is None else timeout)
            self._state = "closed"
            return self._report

    def _close(self, began: float, budget: float) -> ShutdownReport:
        assert self._service is not None
        with self._lock:
            self._accepting = False
            accepted = self._counts.enqueued
        self._service.wait_published(accepted, budget)
        with self._lock:
            if self._carry and self._send3 is not None:
                # Removals carried from dropped batches must not die with the publisher.
                heartbeat = KVEventBatch(ts=time.time(), events=[], data_parallel_rank=self.rank)
                self._publish_locked(self._send3, heartbeat)
            accepted = self._counts.enqueued
            push, self._push, self._send3 = self._push, None, None
        self._service.wait_published(accepted, max(0.0, began + budget - time.monotonic()))
        linger_ms = max(0, int((began + budget - time.monotonic()) * 1000))
        published = self._service.published
        flush_started = time.monotonic()
        self._teardown(linger_ms, push)
        flush_time = time.monotonic() - flush_started
        stats = self.stats()
        if stats.dropped or accepted > published:
            logger.warning(
                "publisher rank %d shut down: %d batches dropped, %d undelivered",
                self.rank,
                stats.dropped,
                accepted - published,
            )
        return ShutdownReport(
            published=published,
            undelivered=accepted - published,
            flush_complete=linger_ms == 0 or flush_time < linger_ms / 1000 * 0.9,
            duration=time.monotonic() - began,
            stats=stats,
        )

    def _teardown(self, linger_ms: int, push: Socket | None = None) -> None:
        if push is not None:
            push.close(0)
        forwarder, service = self._forwarder, self._service
        if forwarder is not None and forwarder.is_alive():
            forwarder.prepare_stop(linger_ms)
            self._send_control(b"TERMINATE")
            forwarder.join(_JOIN_TIMEOUT)
        if service is not None and service.is_alive() and self._wake is not None:
            with contextlib.suppress(zmq.Again):
                self._wake.send(b"stop", zmq.NOBLOCK)
            service.join(_JOIN_TIMEOUT)
        for socket in (self._push, self._control, self._wake):
            if socket is not None:
                socket.close(0)
        self._push = self._control = self._wake = None
        if self._authenticator is not None:
            self._authenticator.stop()  # its sockets would keep term() waiting
            self._authenticator = None
        if self._context is not None:
            self._context.term()  # waits for the PUB socket's linger: the final flush
            self._context = None
            release_payloads()  # libzmq has let go of every payload this context held

    def _send_control(self, command: bytes) -> None:
        with self._control_lock:
            control = self._control
            if control is None:
                return
            while control.poll(0):
                control.recv()  # libzmq 4.3 answers each command; nobody needs the answers
            with contextlib.suppress(zmq.Again):
                # Non-blocking: a PAIR whose peer has already closed would block forever.
                control.send(command, zmq.NOBLOCK)

    # ------------------------------------------------------------------ publishing

    def publish(self, batch: KVEventBatch) -> int:
        """Queue ``batch`` without blocking; return its sequence number.

        A batch without ``data_parallel_rank`` gets this publisher's rank. When the queue is
        full the batch is dropped and counted (its sequence number becomes a gap) and its
        removals and clears are carried into the next accepted batch. Raises
        :class:`PublisherClosed` after ``shutdown()``, :class:`PublisherError` before ``start()``.
        """
        if batch.data_parallel_rank is None:
            batch = msgspec.structs.replace(batch, data_parallel_rank=self.rank)
        with self._lock:
            send3 = self._send3
            if send3 is None or not self._accepting:
                raise self._not_accepting()
            return self._publish_locked(send3, batch)

    def publish_encoded(self, payload: bytes) -> int:
        """Queue a batch already encoded as the wire's payload; return its sequence number.

        For engines that encode their own batch struct (vLLM's plugin): no Python object is
        built per event, so a batch allocates one ``bytes``, as the engine's own publisher
        does. The payload is sent as given (its ``data_parallel_rank`` is the caller's
        business); it is decoded only when removals carried from a dropped batch must go in
        front of its events, or when it is dropped itself. Same errors as :meth:`publish`.
        """
        with self._lock:
            send3 = self._send3
            if send3 is None or not self._accepting:
                raise self._not_accepting()
            batch = _decoded(payload) if self._carry else None
            if batch is not None:
                return self._publish_locked(send3, batch)
            seq = self._next_seq
            self._next_seq = seq + 1
            self._last_activity = time.monotonic()
            self._send_locked(send3, seq, payload, lambda: _events_of(payload))
            return seq

    def _publish_locked(self, send3: Send3, batch: KVEventBatch) -> int:
        seq = self._next_seq
        self._next_seq = seq + 1
        self._last_activity = time.monotonic()
        carried = self._carry.take() if self._carry else None
        if carried:
            batch = msgspec.structs.replace(batch, events=[*carried, *batch.events])
        try:
            payload = encode_batch(batch)
        except (msgspec.EncodeError, TypeError, ValueError, OverflowError) as exc:
            self._drop("encode_error", seq, carried or (), str(exc))
            return seq
        if self._send_locked(send3, seq, payload, lambda: batch.events) and carried:
            self._carried_events += len(carried)
        return seq

    def _send_locked(
        self, send3: Send3, seq: int, payload: bytes, events: Callable[[], Sequence[Event]]
    ) -> bool:
        """Send one batch; on failure count the drop and carry its removals (``events()``)."""
        try:
            send3(self._topic, pack_seq(seq), payload)
        except zmq.Again:
            self._drop("queue_full", seq, events(), "queue full")
            return False
        except zmq.ZMQError as exc:
            self._drop("send_error", seq, events(), str(exc))
            return False
        self._counts.enqueued += 1
        return True

    def _drop(self, cause: DropCause, seq: int, carry: Iterable[Event], reason: str) -> None:
        if cause == "queue_full":
            self._counts.dropped_queue_full += 1
        elif cause == "encode_error":
            self._counts.dropped_encode_error += 1
        else:
            self._counts.dropped_send_error += 1
        self._carry.absorb(carry)
        self._warn(
            cause,
            "publisher rank %d dropped batch seq %d (%s); removals and clears carried forward",
            self.rank,
            seq,
            reason,
        )

    def _not_accepting(self) -> PublisherError:
        if self._state == "new":
            return PublisherError(f"publisher for rank {self.rank} is not started")
        return PublisherClosed(f"publisher for rank {self.rank} is shut down")

    def _send_heartbeat(self) -> None:
        try:
            self.publish(KVEventBatch(ts=time.time(), events=[]))
        except PublisherError:
            return
        self._heartbeats += 1

    # ------------------------------------------------------------------ introspection

    def stats(self) -> PublisherStats:
        """A snapshot of the counters (safe from any thread)."""
        service = self._service
        server = service.server if service is not None else None
        ring = service.ring if service is not None else None
        replay = server.counters if server is not None else None
        published = service.published if service is not None else 0
        return PublisherStats(
            **dataclasses.asdict(self._counts),
            published=published,
            carried_events=self._carried_events,
            pending_carry=len(self._carry),
            replay_requests=replay.requests if replay else 0,
            replay_batches_served=replay.batches_served if replay else 0,
            replay_malformed=replay.malformed if replay else 0,
            replay_rejected=replay.rejected if replay else 0,
            replay_rate_limited=replay.rate_limited if replay else 0,
            replay_timed_out=replay.timed_out if replay else 0,
            replay_clients_lost=replay.clients_lost if replay else 0,
            replay_active=server.active if server is not None else 0,
            replay_waiting=server.waiting if server is not None else 0,
            replay_peers=server.peers_tracked if server is not None else 0,
            queue_depth=max(0, self._counts.enqueued - published),
            bytes_sent=service.bytes_sent if service is not None else 0,
            heartbeats=self._heartbeats,
            ring_batches=len(ring) if ring is not None else 0,
            ring_bytes=ring.nbytes if ring is not None else 0,
            next_seq=self._next_seq,
            **_handshake_counts(service),
        )


def _decoded(payload: bytes) -> KVEventBatch | None:
    try:
        return decode_batch(payload).batch
    except DecodeError:
        return None  # sent as given: the subscribers' tolerant decoder counts what it cannot read


def _events_of(payload: bytes) -> Sequence[Event]:
    batch = _decoded(payload)
    return batch.events if batch is not None else ()


def _check_rank(config: KVEventsConfig, rank: int, world_size: int | None) -> None:
    if rank < 0 or (world_size is not None and rank >= world_size):
        where = "negative" if rank < 0 else f"outside world size {world_size}"
        raise LayoutError(
            f"rank {rank} is {where}", endpoint=config.endpoint, rank=rank, rule="rank"
        )


def _handshake_counts(service: Service | None) -> dict[str, int]:
    watch = service.handshakes if service is not None else None
    if watch is None:
        return {}
    return {"auth_rejected": watch.auth_rejected, "handshake_failed": watch.handshake_failed}
