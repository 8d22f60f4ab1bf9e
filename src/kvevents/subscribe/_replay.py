"""The replay client: asks publishers' ROUTER sockets for missed batches (WIRE.md section 3).

It is driven by the thread that owns it (the subscriber's I/O thread): :meth:`request` and
:meth:`cancel` start and stop replays, :meth:`handle` reads a readable DEALER socket, and
:meth:`tick` runs timeouts and backoff; :meth:`timeout` says when the next tick is due. Each
returns :class:`ReplayBatch` and :class:`ReplayEnd` events for the caller's cursors.

Checks and recoveries:

- 3-frame (vLLM up to 0.25, older SGLang) and 4-frame replies are both read;
- a first sequence later than asked is counted as trimmed and passed on (the cursor reports
  the skipped range unrecoverable);
- a discontinuity inside a reply (ROUTER silently drops what does not fit the pipe) or no
  message for ``idle_timeout`` resumes from the next sequence on a fresh socket, after an
  exponential backoff, up to ``max_attempts`` requests; past that the reply is taken as is;
- ``total_timeout`` bounds a replay from first request to end marker;
- at most ``max_concurrent`` replays run at once; more wait in arrival order.

Every attempt uses its own DEALER, so a late answer to an abandoned attempt can never be
mistaken for the current one.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TypeAlias

import zmq

from kvevents.errors import DecodeError
from kvevents.ratelimit import RateLimitedWarning
from kvevents.security import CurveClient, apply_client
from kvevents.subscribe._streams import ReplayOptions
from kvevents.wire import parse_replay_reply, replay_request_frames

__all__ = [
    "ReplayBatch",
    "ReplayClient",
    "ReplayClientCounters",
    "ReplayEnd",
    "ReplayEvent",
    "ReplayOptions",
]

log = logging.getLogger("kvevents.subscribe.subscriber")

# Messages read from one socket per handle() call, so one long replay cannot starve others.
_READ_BURST = 512


@dataclass(frozen=True, slots=True)
class ReplayBatch:
    """One replayed batch for the stream ``key``, from the request numbered ``ticket``."""

    key: Hashable
    seq: int
    payload: bytes
    ticket: int = 0


@dataclass(frozen=True, slots=True)
class ReplayEnd:
    """The replay for ``key`` is over: ``ok`` after the end marker, else ``reason`` says why."""

    key: Hashable
    ok: bool
    reason: str = "end marker"
    ticket: int = 0


ReplayEvent: TypeAlias = ReplayBatch | ReplayEnd


@dataclass
class ReplayClientCounters:
    """What the client did (``SubscriberStats.replay_*``): requests sent, resumes, timeouts
    (idle or total), trimmed replies (the server's ring had moved on), malformed reply
    messages, replays completed and failed. Written by the owning thread only."""

    requests: int = 0
    resumes: int = 0
    timeouts: int = 0
    trimmed: int = 0
    malformed: int = 0
    completed: int = 0
    failed: int = 0


@dataclass
class _Replay:
    key: Hashable
    endpoint: str
    next_seq: int
    created: float
    ticket: int
    attempts: int = 0
    socket: zmq.Socket[bytes] | None = None
    first: bool = True
    last_activity: float = 0.0
    retry_at: float | None = None
    curve: CurveClient | None = None


class ReplayClient:
    """Replays for many streams over DEALER sockets registered on the owner's ``poller``."""

    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        poller: zmq.Poller,
        *,
        options: ReplayOptions | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_message_size: int = -1,
    ) -> None:
        self._context = context
        # ZeroMQ's MAXMSGSIZE of every DEALER (-1: no limit): a reply frame over it drops
        # the connection, which the idle timeout then handles like a silent server.
        self._max_message_size = max_message_size
        self._poller = poller
        self.options = options or ReplayOptions()
        self._clock = clock
        self._replays: dict[Hashable, _Replay] = {}
        self._active: set[Hashable] = set()
        self._waiting: deque[Hashable] = deque()
        self._by_socket: dict[zmq.Socket[bytes], _Replay] = {}
        self.counters = ReplayClientCounters()
        # Replays that ended outside tick() or handle() (a socket could not be opened).
        self._ended: list[ReplayEvent] = []
        self._tickets = 0
        # Keyed by kind and endpoint: a misbehaving server must not flood the log.
        self._warn = RateLimitedWarning(log, interval=10.0, clock=clock)

    # ------------------------------------------------------------------ commands

    def request(
        self, key: Hashable, endpoint: str, start: int, *, curve: CurveClient | None = None
    ) -> int:
        """Replay ``seq >= start`` for ``key``, replacing any replay it already has.

        Returns the request's ticket; every event of this replay carries it, so events of a
        replaced replay still in the caller's hands can be told apart. ``curve``: the server
        is a CURVE server (``docs/security.md``).
        """
        self.cancel(key)
        self._tickets += 1
        self._replays[key] = _Replay(
            key, endpoint, start, self._clock(), self._tickets, curve=curve
        )
        self._waiting.append(key)
        self._admit()
        return self._tickets

    def cancel(self, key: Hashable) -> None:
        """Stop the replay for ``key`` (if any) and close its socket."""
        replay = self._replays.pop(key, None)
        if replay is None:
            return
        self._close_socket(replay)
        if key in self._active:
            self._active.discard(key)
        else:
            self._waiting.remove(key)
        self._admit()

    def close(self) -> None:
        """Cancel every replay."""
        for key in list(self._replays):
            self.cancel(key)

    def active(self, key: Hashable) -> bool:
        """True while ``key`` has a replay running or waiting for a slot."""
        return key in self._replays

    def owns_any(self) -> bool:
        """True while at least one DEALER socket is open."""
        return bool(self._by_socket)

    # ------------------------------------------------------------------ driving

    def handle(self, sock: zmq.Socket[bytes]) -> list[ReplayEvent]:
        """Read what ``sock`` (reported readable by the poller) holds."""
        events: list[ReplayEvent] = []
        replay = self._by_socket.get(sock)
        for _ in range(_READ_BURST):
            if replay is None or replay.socket is not sock:
                break
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            except zmq.ZMQError as exc:  # the socket broke: a fresh one, like a silent server
                self._resume(replay, f"receive failed: {exc}", events)
                break
            replay.last_activity = self._clock()
            self._on_frames(replay, frames, events)
        return events

    def tick(self) -> list[ReplayEvent]:
        """Run due timeouts, resumes and retries."""
        events: list[ReplayEvent] = []
        now = self._clock()
        for key in list(self._active):
            replay = self._replays[key]
            if now - replay.created >= self.options.total_timeout:
                self.counters.timeouts += 1
                self._finish(replay, False, "total timeout", events)
            elif replay.retry_at is not None:
                if now >= replay.retry_at:
                    self._attempt(replay)
            elif now - replay.last_activity >= self.options.idle_timeout:
                self.counters.timeouts += 1
                self._resume(replay, "idle timeout", events)
        # Replays that ended where no list was at hand (a socket could not be opened).
        ended, self._ended = self._ended, []
        return ended + events

    def timeout(self) -> float | None:
        """Seconds until :meth:`tick` has something to do; None when nothing is running."""
        due: list[float] = []
        for key in self._active:
            replay = self._replays[key]
            due.append(replay.created + self.options.total_timeout)
            if replay.retry_at is not None:
                due.append(replay.retry_at)
            else:
                due.append(replay.last_activity + self.options.idle_timeout)
        if not due:
            return None
        return max(0.0, min(due) - self._clock())

    # ------------------------------------------------------------------ internals

    def _admit(self) -> None:
        while self._waiting and len(self._active) < self.options.max_concurrent:
            key = self._waiting.popleft()
            self._active.add(key)
            self._attempt(self._replays[key])

    def _attempt(self, replay: _Replay) -> None:
        self._close_socket(replay)
        replay.attempts += 1
        try:
            sock = self._open(replay)
        except (zmq.ZMQError, ValueError) as exc:
            # Out of sockets or descriptors, or a refused endpoint: this replay's problem
            # only; retried after a backoff like a silent server, then given up.
            self._resume(replay, f"cannot open a replay socket: {exc}", self._ended)
            return
        self.counters.requests += 1
        replay.socket = sock
        replay.first = True
        replay.retry_at = None
        replay.last_activity = self._clock()
        self._by_socket[sock] = replay
        self._poller.register(sock, zmq.POLLIN)

    def _open(self, replay: _Replay) -> zmq.Socket[bytes]:
        sock = self._context.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)  # the server sends the whole reply at once
            sock.setsockopt(zmq.MAXMSGSIZE, self._max_message_size)
            apply_client(sock, replay.curve)
            sock.connect(replay.endpoint)
            sock.send_multipart(replay_request_frames(replay.next_seq), zmq.NOBLOCK)
        except BaseException:
            sock.close(linger=0)
            raise
        return sock

    def _close_socket(self, replay: _Replay) -> None:
        sock = replay.socket
        if sock is None:
            return
        replay.socket = None
        self._by_socket.pop(sock, None)
        self._poller.unregister(sock)
        sock.close(linger=0)

    def _on_frames(self, replay: _Replay, frames: list[bytes], events: list[ReplayEvent]) -> None:
        try:
            msg = parse_replay_reply(frames)
        except DecodeError as exc:
            self.counters.malformed += 1
            self._warn(f"malformed {replay.endpoint}", "replay from %s: %s", replay.endpoint, exc)
            return
        if msg.is_end:
            self._finish(replay, True, "end marker", events)
            return
        expected = replay.next_seq
        if msg.seq < expected:
            return
        if msg.seq > expected:
            if replay.first:
                self.counters.trimmed += 1
                self._warn(
                    f"trimmed {replay.endpoint}",
                    "replay from %s started at seq %d, asked %d: the ring moved on",
                    replay.endpoint,
                    msg.seq,
                    expected,
                )
            elif replay.attempts < self.options.max_attempts:
                self._resume(replay, f"reply skipped from {expected} to {msg.seq}", events)
                return
        replay.first = False
        replay.next_seq = msg.seq + 1
        events.append(ReplayBatch(replay.key, msg.seq, msg.payload, replay.ticket))

    def _resume(self, replay: _Replay, reason: str, events: list[ReplayEvent]) -> None:
        self._close_socket(replay)
        if replay.attempts >= self.options.max_attempts:
            self._finish(replay, False, reason, events)
            return
        self.counters.resumes += 1
        exponent = replay.attempts - 1
        delay = min(self.options.backoff_max, self.options.backoff_initial * 2**exponent)
        replay.retry_at = self._clock() + delay
        log.info(
            "replay from %s: %s; resuming from seq %d in %.2fs",
            replay.endpoint,
            reason,
            replay.next_seq,
            delay,
        )

    def _finish(self, replay: _Replay, ok: bool, reason: str, events: list[ReplayEvent]) -> None:
        if ok:
            self.counters.completed += 1
        else:
            self.counters.failed += 1
            self._warn(
                f"failed {replay.endpoint}",
                "replay from %s failed at seq %d: %s",
                replay.endpoint,
                replay.next_seq,
                reason,
            )
        events.append(ReplayEnd(replay.key, ok, reason, replay.ticket))
        self.cancel(replay.key)
