"""The replay side of a publisher (WIRE.md section 3): a bounded ring and a ROUTER server.

:class:`ReplayRing` is pure: the encoded batches a rank published, bounded by a batch count
(``buffer_steps``) and a byte budget, searchable by sequence number.

:class:`ReplayServer` answers DEALER requests on a ROUTER socket owned by the publisher's
service thread. Replies are sent non-blocking with ``ROUTER_MANDATORY`` and resumed later when a
client's pipe is full, a few messages per client per round, so one large or slow replay never
starves another client, the live path, or the capture draining. Nothing is dropped silently: a
client that vanishes mid-reply is counted in ``clients_lost``.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from kvevents.errors import DecodeError
from kvevents.wire import parse_replay_request, replay_end_frames

__all__ = ["ReplayRing", "ReplayServer", "RingEntry"]

_END = replay_end_frames()
# Messages sent to one client before moving to the next: small enough that a 10,000-batch
# replay yields to others (and to capture draining) every few hundred microseconds.
_CHUNK = 32


@dataclass(frozen=True)
class RingEntry:
    """One buffered batch: its sequence number, its 8-byte sequence frame and its payload."""

    seq: int
    seq_frame: bytes
    payload: bytes


class ReplayRing:
    """The last ``max_batches`` published batches, at most ``max_bytes`` of payload in all.

    Sequence numbers ascend but need not be dense: batches lost before they were sent (queue
    full, encode error) are never buffered. A batch larger than the whole budget is not kept.
    """

    def __init__(self, max_batches: int, max_bytes: int) -> None:
        if max_batches < 1 or max_bytes < 1:
            raise ValueError("a replay ring needs max_batches >= 1 and max_bytes >= 1")
        self.max_batches = max_batches
        self.max_bytes = max_bytes
        self._entries: list[RingEntry] = []
        self._head = 0
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries) - self._head

    @property
    def nbytes(self) -> int:
        """Payload bytes currently held."""
        return self._bytes

    @property
    def oldest_seq(self) -> int | None:
        """The sequence number of the oldest buffered batch, None when empty."""
        return self._entries[self._head].seq if len(self) else None

    def append(self, seq: int, seq_frame: bytes, payload: bytes) -> None:
        """Buffer a published batch, evicting the oldest ones beyond either bound."""
        if self._entries and seq <= self._entries[-1].seq:
            raise ValueError(f"seq {seq} does not follow {self._entries[-1].seq}")
        self._entries.append(RingEntry(seq, seq_frame, payload))
        self._bytes += len(payload)
        while len(self) > self.max_batches or (self._bytes > self.max_bytes and len(self)):
            self._bytes -= len(self._entries[self._head].payload)
            self._head += 1
        if self._head > 1024 and self._head * 2 > len(self._entries):
            # Compact now and then: amortised O(1) eviction with O(1) indexing.
            del self._entries[: self._head]
            self._head = 0

    def tail(self, start_seq: int) -> list[RingEntry]:
        """A snapshot of every buffered batch with ``seq >= start_seq``, oldest first."""
        lo = bisect.bisect_left(self._entries, start_seq, lo=self._head, key=_seq_of)
        return self._entries[lo:]


def _seq_of(entry: RingEntry) -> int:
    return entry.seq


@dataclass
class _Session:
    identity: bytes
    start_seq: int | None  # None: the request was malformed, answer the end marker only
    entries: list[RingEntry] = field(default_factory=list)
    position: int = 0
    started: bool = False


@dataclass
class ReplayCounters:
    """What the server did; read by ``Publisher.stats()`` (single writer: the service thread)."""

    requests: int = 0
    batches_served: int = 0
    rejected: int = 0
    malformed: int = 0
    clients_lost: int = 0


class ReplayServer:
    """Serves replay requests on a bound ROUTER socket; used only by the thread that owns it.

    ``before_snapshot`` is called before a reply's snapshot is taken: the publisher drains its
    capture pipe there, so a reply holds every batch a subscriber may already have seen live.
    """

    def __init__(
        self,
        socket: zmq.Socket[bytes],
        ring: ReplayRing,
        topic: bytes,
        *,
        max_active: int,
        max_waiting: int,
        before_snapshot: Callable[[], None] = lambda: None,
    ) -> None:
        self._socket = socket
        self._ring = ring
        self._topic = topic
        self._max_active = max_active
        self._max_waiting = max_waiting
        self._before_snapshot = before_snapshot
        self._active: list[_Session] = []
        self._waiting: deque[_Session] = deque()
        self.counters = ReplayCounters()

    @property
    def busy(self) -> bool:
        """True while some reply is still being sent."""
        return bool(self._active)

    @property
    def active(self) -> int:
        """Replies in progress."""
        return len(self._active)

    def accept_requests(self) -> None:
        """Read every pending request (non-blocking) and queue or reject it."""
        while True:
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self.counters.requests += 1
            self._queue(_session_for(frames, self.counters))
        self._activate()

    def _queue(self, session: _Session) -> None:
        if len(self._waiting) >= self._max_waiting:
            self.counters.rejected += 1
            # Beyond the wait queue the client gets the end marker at once (never silence);
            # its first replayed sequence then differs from what it asked: a visible gap.
            self._send_now(session.identity, _END)
            return
        self._waiting.append(session)

    def _activate(self) -> None:
        busy_ids = {s.identity for s in self._active}
        kept: deque[_Session] = deque()
        while self._waiting and len(self._active) < self._max_active:
            session = self._waiting.popleft()
            if session.identity in busy_ids:
                kept.append(session)  # one reply at a time per client, in request order
                continue
            self._start(session)
            busy_ids.add(session.identity)
        kept.extend(self._waiting)
        self._waiting = kept

    def _start(self, session: _Session) -> None:
        if session.start_seq is not None:
            self._before_snapshot()
            session.entries = self._ring.tail(session.start_seq)
        session.started = True
        self._active.append(session)

    def pump(self) -> bool:
        """Send one round (a few messages per reply); True if any message went out."""
        progressed = False
        for session in list(self._active):
            sent, done = self._send_chunk(session)
            progressed = progressed or sent > 0
            if done:
                self._active.remove(session)
        if progressed or not self._active:
            self._activate()
        return progressed

    def _send_chunk(self, session: _Session) -> tuple[int, bool]:
        sent = 0
        entries = session.entries
        while sent < _CHUNK:
            if session.position < len(entries):
                entry = entries[session.position]
                frames = [session.identity, b"", self._topic, entry.seq_frame, entry.payload]
            else:
                frames = [session.identity, *_END]
            outcome = self._try_send(frames)
            if outcome == "blocked":
                return sent, False
            if outcome == "lost":
                return sent, True
            sent += 1
            if session.position >= len(entries):
                return sent, True
            session.position += 1
            self.counters.batches_served += 1
        return sent, False

    def _try_send(self, frames: list[bytes]) -> str:
        try:
            self._socket.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            return "blocked"
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self.counters.clients_lost += 1
            return "lost"
        return "sent"

    def _send_now(self, identity: bytes, frames: list[bytes]) -> None:
        if self._try_send([identity, *frames]) == "blocked":
            self.counters.clients_lost += 1


def _session_for(frames: list[bytes], counters: ReplayCounters) -> _Session:
    identity = frames[0]
    try:
        start: int | None = parse_replay_request(frames[1:])
    except DecodeError:
        counters.malformed += 1
        start = None
    return _Session(identity=identity, start_seq=start)
